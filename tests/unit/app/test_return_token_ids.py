"""vLLM's `return_token_ids` on a real replica, no Ray: the generated ids are the engine's own (streamed or
not, with or without a tokenizer), each choice carries its prompt's ids, and nothing is added unasked."""
import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.engine import SamplingParams
from affinity_serve.engine import EngineConfig
from tests.unit.app.conftest import LocalHandle

PROMPT = [1, 415, 293, 606, 285, 114]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(params=[False, True], ids=["tokenizer", "token_ids_only"])
async def served(request, checkpoints):
    """(ingress, replica) over one real replica of the tiny llama, with a tokenizer or in token-ids-only mode."""
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica

    engine = {"model": checkpoints["llama"], "skip_tokenizer_init": request.param}
    rep = LLMReplica(EngineConfig.model_validate({**engine, "cache": {"num_blocks": 128, "block_size": 4}}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": engine}))
    yield ing, rep
    await rep.engine.shutdown()


async def _engine_greedy_ids(rep, prompt: list[int], max_tokens: int) -> list[int]:
    """What the engine itself generates greedily for `prompt`, straight from the replica."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [t async for c in rep.generate(GenerateRequest("reference", prompt, params)) for t in c.token_ids]


async def test_completion_token_ids_are_the_engines_greedy_ids(served):
    ing, rep = served
    expected = await _engine_greedy_ids(rep, PROMPT, 6)
    assert len(expected) == 6
    body = {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, **GREEDY}
    choice = (await ing.completions(body))["choices"][0]
    assert choice["token_ids"] == expected and choice["prompt_token_ids"] == PROMPT

    chunks = [c["choices"][0] async for c in ing.completions_stream({**body, "stream": True})]
    assert [t for c in chunks for t in c["token_ids"]] == expected   # every token, even with no text yet
    assert chunks[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in chunks[1:])
    if ing.serving.tokenizer is not None:
        assert choice["text"] == ing.serving.tokenizer.decode(expected)


async def test_each_choice_of_each_prompt_carries_its_prompt_and_its_own_ids(served):
    ing, _ = served
    prompts = [PROMPT, PROMPT[:3] + [7, 8]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "return_token_ids": True}
    out = await ing.completions(body)
    assert [c["prompt_token_ids"] for c in out["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(len(c["token_ids"]) == 4 for c in out["choices"])
    chunks = [c["choices"][0] async for c in ing.completions_stream({**body, "stream": True})]
    for i in range(4):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompts[i // 2] and len([t for c in mine for t in c["token_ids"]]) == 4
    best = await ing.completions({"prompt": PROMPT, "best_of": 3, "max_tokens": 4, "temperature": 1.0,
                                  "ignore_eos": True, "return_token_ids": True})
    assert len(best["choices"]) == 1 and len(best["choices"][0]["token_ids"]) == 4
    assert best["usage"]["completion_tokens"] == 12                   # all best_of sequences, as OpenAI bills


async def test_echo_keeps_the_prompt_out_of_token_ids_and_nothing_is_added_unasked(served):
    ing, rep = served
    expected = await _engine_greedy_ids(rep, PROMPT, 2)
    out = await ing.completions({"prompt": PROMPT, "max_tokens": 2, "echo": True, "return_token_ids": True, **GREEDY})
    assert out["choices"][0]["token_ids"] == expected and out["choices"][0]["prompt_token_ids"] == PROMPT
    out = await ing.completions({"prompt": PROMPT, "max_tokens": 0, "echo": True, "return_token_ids": True})
    assert out["choices"][0]["token_ids"] == [] and out["choices"][0]["prompt_token_ids"] == PROMPT
    out = await ing.completions({"prompt": PROMPT, "max_tokens": 2})
    assert not {"token_ids", "prompt_token_ids"} & set(out["choices"][0])
    chunks = [c async for c in ing.completions_stream({"prompt": PROMPT, "max_tokens": 2, "stream": True})]
    assert not any({"token_ids", "prompt_token_ids"} & set(c["choices"][0]) for c in chunks)


async def test_chat_returns_the_templated_prompt_ids_on_the_body_and_ids_per_choice(checkpoints):
    """As vLLM: chat's `prompt_token_ids` is the body's (streamed: on the role chunks), `token_ids` each choice's."""
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.engine import apply_chat_template

    engine = {"model": checkpoints["llama"]}
    rep = LLMReplica(EngineConfig.model_validate({**engine, "cache": {"num_blocks": 128, "block_size": 4}}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": engine}))
    messages = [{"role": "user", "content": "Say something."}]
    prompt = apply_chat_template(ing.serving.tokenizer, messages)
    expected = await _engine_greedy_ids(rep, prompt, 5)
    body = {"messages": messages, "max_tokens": 5, "return_token_ids": True, **GREEDY}
    out = await ing.chat(body)
    assert out["prompt_token_ids"] == prompt and out["choices"][0]["token_ids"] == expected
    chunks = [c async for c in ing.chat_stream({**body, "stream": True})]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == expected
    assert "prompt_token_ids" not in await ing.chat({"messages": messages, "max_tokens": 2})
    await rep.engine.shutdown()
