"""/v1/completions with echo + logprobs (and vLLM's prompt_logprobs) on a real replica, no Ray: the prompt
tokens' logprobs against transformers' log_softmax on the same ids, for text and token-id prompts, n > 1,
several prompts, streaming, max_tokens 0, and the prefix cache."""
import pytest
import torch

from affinity_serve.app.config import AppConfig
from affinity_serve.app.errors import APIError
from affinity_serve.engine import EngineConfig
from tests.unit.app.conftest import LocalHandle

TEXT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
async def served(checkpoints):
    """(ingress, checkpoint path) over one real replica of the tiny llama."""
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica

    path = checkpoints["llama"]
    rep = LLMReplica(EngineConfig(model=path, cache={"num_blocks": 128, "block_size": 4}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": {"model": path}}))
    yield ing, path
    await rep.engine.shutdown()


def _reference(hf_reference, path, ids):
    """log_softmax over transformers' logits: row p scores token p + 1."""
    return torch.log_softmax(hf_reference.logits(path, ids), dim=-1)        # [len(ids), vocab]


def _expected_top(ing, row, token_id, k):
    """What a `top_logprobs` entry must be: the token itself first, then the top k (OpenAI, vLLM)."""
    top = row.topk(k)
    return {ing.serving.token_str(token_id): float(row[token_id]),
            **{ing.serving.token_str(t): float(v) for t, v in zip(top.indices.tolist(), top.values.tolist())}}


def _check_logprobs(ing, ref, ids, lp, k):
    """`lp` covers `ids` (prompt then generated) and matches transformers on every token after the first."""
    assert lp["tokens"] == [ing.serving.token_str(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        want = _expected_top(ing, ref[p - 1], ids[p], k)
        assert list(lp["top_logprobs"][p]) == list(want)
        assert list(lp["top_logprobs"][p].values()) == pytest.approx(list(want.values()), abs=1e-4)
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(ids))]   # from the prompt into the output


@pytest.mark.parametrize("prompt_kind", ["text", "token_ids"])
async def test_echo_logprobs_match_transformers(served, hf_reference, prompt_kind):
    ing, path = served
    tok = ing.serving.tokenizer
    if prompt_kind == "text":
        prompt, ids, echoed = TEXT, tok.encode(TEXT), TEXT
    else:               # a token-id prompt echoes its decoded text, special tokens kept (as vLLM)
        ids = [tok.bos_token_id] + tok.encode(TEXT)
        prompt, echoed = ids, "<s>" + TEXT
    out = await ing.completions({"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, **GREEDY})
    choice = out["choices"][0]
    generated = hf_reference(path, ids, 3)
    all_ids = ids + generated
    assert choice["text"] == echoed + tok.decode(generated)
    assert "".join(choice["logprobs"]["tokens"][:len(ids)]) == echoed
    _check_logprobs(ing, _reference(hf_reference, path, all_ids), all_ids, choice["logprobs"], 2)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 3
    assert "prompt_logprobs" not in choice           # vLLM's field only when asked for


async def test_every_choice_of_every_prompt_carries_its_own_prompt_logprobs(served, hf_reference):
    """n = 2 over two prompts: the engine scores each prompt once; all its choices carry the result."""
    ing, path = served
    tok = ing.serving.tokenizer
    prompts = [tok.encode(TEXT), tok.encode("To be, or not to be, that is the question.")]
    out = await ing.completions({"prompt": prompts, "n": 2, "max_tokens": 2, "echo": True, "logprobs": 1,
                                 "temperature": 1.0, "seed": 7})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, choice in enumerate(out["choices"]):
        ids = prompts[i // 2]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 2
        prompt_part = {k: v[:len(ids)] for k, v in lp.items()}
        _check_logprobs(ing, _reference(hf_reference, path, ids), ids, prompt_part, 1)
    best = await ing.completions({"prompt": prompts[1], "n": 1, "best_of": 3, "max_tokens": 2, "echo": True,
                                  "logprobs": 1, "temperature": 1.0, "seed": 3})
    assert best["choices"][0]["logprobs"]["token_logprobs"][:len(prompts[1])] == pytest.approx(
        out["choices"][2]["logprobs"]["token_logprobs"][:len(prompts[1])], abs=1e-5)


async def test_streamed_echo_logprobs_are_the_non_streamed_ones_in_pieces(served):
    """Each choice's first chunk carries the prompt and its logprobs; offsets run on across chunks."""
    ing, _ = served
    body = {"prompt": TEXT, "n": 2, "max_tokens": 4, "echo": True, "logprobs": 2, **GREEDY}
    whole = await ing.completions(body)
    chunks = [c async for c in ing.completions_stream({**body, "stream": True})]
    num_prompt_tokens = len(ing.serving.tokenizer.encode(TEXT))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith(TEXT) and len(mine[0]["logprobs"]["tokens"]) > num_prompt_tokens
        assert mine[0]["logprobs"]["token_logprobs"][0] is None
        assert "".join(c["text"] for c in mine) == whole["choices"][index]["text"]
        want = whole["choices"][index]["logprobs"]
        got = {key: [v for c in mine for v in c["logprobs"][key]] for key in want}
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
        assert [list(top or {}) for top in got["top_logprobs"]] == [list(top or {}) for top in want["top_logprobs"]]


async def test_max_tokens_0_with_echo_is_the_scored_prompt_alone(served, hf_reference):
    ing, path = served
    ids = ing.serving.tokenizer.encode(TEXT)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = await ing.completions(body)
    choice = out["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    _check_logprobs(ing, _reference(hf_reference, path, ids), ids, choice["logprobs"], 1)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["total_tokens"] == len(ids)
    chunks = [c async for c in ing.completions_stream({**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == TEXT
    assert [t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": ids, "max_tokens": 0})
    assert (e.value.status_code, e.value.param) == (400, "max_tokens")


async def test_vllm_prompt_logprobs_field(served, hf_reference):
    ing, path = served
    ids = ing.serving.tokenizer.encode(TEXT)
    out = await ing.completions({"prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 2, "n": 2, **GREEDY})
    ref = _reference(hf_reference, path, ids)
    for choice in out["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None and choice["logprobs"] is None
        for p in range(1, len(ids)):
            row, top = ref[p - 1], ref[p - 1].topk(2)
            want_ids = [ids[p]] + [t for t in top.indices.tolist() if t != ids[p]]
            assert list(plp[p]) == want_ids
            assert plp[p][ids[p]]["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-4)
            assert plp[p][ids[p]]["rank"] == int((row > row[ids[p]]).sum()) + 1
            assert plp[p][ids[p]]["decoded_token"] == ing.serving.token_str(ids[p])
            assert [plp[p][t]["rank"] for t in top.indices.tolist()] == [1, 2]
    with pytest.raises(APIError) as e:          # as vLLM: not streamed
        await anext(ing.completions_stream({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}))
    assert (e.value.status_code, e.value.param) == (400, "prompt_logprobs")


async def test_scored_prompts_skip_the_prefix_cache_but_leave_it_warm(served):
    ing, _ = served
    body = {"prompt": TEXT + " Knowledge is power.", "max_tokens": 2, **GREEDY}
    await ing.completions(body)
    scored = await ing.completions({**body, "echo": True, "logprobs": 0})
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0      # needs every position's logits
    assert scored["choices"][0]["logprobs"]["token_logprobs"][0] is None
    again = await ing.completions(body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
