"""OpenAI response bodies from plain values: no Ray, no tokenizer, no model."""
import openai.types as oai
import openai.types.chat as oai_chat

from affinity_serve.app import openai_format as fmt
from affinity_serve.engine.types import Logprobs

META = fmt.ResponseMeta("cmpl-1", 1700000000, "tiny")
LPS = [Logprobs(1, -0.5, 1, [1, 2], [-0.5, -1.5]), Logprobs(22, -0.25, 1, [22], [-0.25])]


def token_str(tid: int) -> str:
    return {1: "a", 2: "b", 22: "cd"}[tid]


def test_usage_and_fingerprint():
    assert fmt.usage(10, 5, 4) == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
    assert fmt.fingerprint(["r2", "r1"]) == "replica:r1,r2"
    assert fmt.token_id_str(42) == "token_id:42"


def test_completion_logprobs_offsets_follow_the_token_strings():
    lp = fmt.completion_logprobs(LPS, token_str, 2, text_offset=3)
    assert lp == {"tokens": ["a", "cd"], "token_logprobs": [-0.5, -0.25],
                  "top_logprobs": [{"a": -0.5, "b": -1.5}, {"cd": -0.25}], "text_offset": [3, 4]}


def test_top_logprobs_hold_the_token_itself_and_num_top_alternatives():
    """As OpenAI and vLLM: up to num_top + 1 entries, the token first; 0 -> the token alone."""
    sampled = Logprobs(2, -1.5, 2, [1, 22], [-0.5, -1.0])
    assert fmt.completion_logprobs([sampled], token_str, 2)["top_logprobs"] == [{"b": -1.5, "a": -0.5, "cd": -1.0}]
    assert fmt.completion_logprobs([sampled], token_str, 1)["top_logprobs"] == [{"b": -1.5, "a": -0.5}]
    assert fmt.completion_logprobs([sampled], token_str, 0)["top_logprobs"] == [{"b": -1.5}]


def test_echoed_prompt_comes_first_with_nulls_for_its_first_token_and_offsets_run_on():
    echo = fmt.EchoedPrompt("bacd", [2, 1, 22], [None, Logprobs(1, -0.7, 1, [1], [-0.7]),
                                                  Logprobs(22, -2.0, 3, [1], [-0.1])])
    lp = fmt.completion_logprobs(LPS, token_str, 1, echo=echo)
    assert lp == {"tokens": ["b", "a", "cd", "a", "cd"], "token_logprobs": [None, -0.7, -2.0, -0.5, -0.25],
                  "top_logprobs": [None, {"a": -0.7}, {"cd": -2.0, "a": -0.1}, {"a": -0.5}, {"cd": -0.25}],
                  "text_offset": [0, 1, 2, 4, 5]}
    body = fmt.completion_response(META, [fmt.Choice("acd", "length", LPS, echo)], fmt.usage(3, 2, 0), "r",
                                   token_str, 1)
    assert body["choices"][0]["text"] == "bacdacd" and body["choices"][0]["logprobs"] == lp


def test_vllm_prompt_logprobs_format():
    lps = [None, Logprobs(22, -2.0, 3, [1, 2], [-0.1, -0.3])]
    assert fmt.vllm_prompt_logprobs([2, 22], lps, token_str, 1) == [
        None, {22: {"logprob": -2.0, "rank": 3, "decoded_token": "cd"},
               1: {"logprob": -0.1, "rank": 1, "decoded_token": "a"}}]
    body = fmt.completion_response(META, [fmt.Choice("x", "length", None, prompt_logprobs=[None])],
                                   fmt.usage(1, 1, 0), "r", token_str)
    assert body["choices"][0]["prompt_logprobs"] == [None]
    plain = fmt.completion_response(META, [fmt.Choice("x", "length", None)], fmt.usage(1, 1, 0), "r", token_str)
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_logprobs_carry_bytes():
    lp = fmt.chat_logprobs(LPS[1:], token_str)
    assert lp == {"content": [{"token": "cd", "logprob": -0.25, "bytes": [99, 100],
                               "top_logprobs": [{"token": "cd", "logprob": -0.25, "bytes": [99, 100]}]}]}


def test_completion_response_validates_with_the_openai_client_types():
    choices = [fmt.Choice("acd", "length", LPS), fmt.Choice("xyz", "stop", None)]
    body = fmt.completion_response(META, choices, fmt.usage(3, 4, 0), "replica:r1", token_str)
    parsed = oai.Completion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1] and parsed.choices[1].logprobs is None
    assert parsed.choices[0].logprobs.tokens == ["a", "cd"] and parsed.system_fingerprint == "replica:r1"


def test_chat_response_validates_with_the_openai_client_types():
    body = fmt.chat_response(META, [fmt.Choice("hello", "stop", LPS)], fmt.usage(3, 2, 1), "replica:r1", token_str)
    parsed = oai_chat.ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hello" and parsed.choices[0].message.role == "assistant"
    assert [c.token for c in parsed.choices[0].logprobs.content] == ["a", "cd"]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1


def test_stream_chunks():
    role = oai_chat.ChatCompletionChunk.model_validate(fmt.chat_role_chunk(META, 1))
    assert role.choices[0].delta.role == "assistant" and role.choices[0].index == 1
    chunk = fmt.chat_chunk(META, 0, "he", None, None, "replica:r1", with_usage=True)
    assert chunk["usage"] is None and chunk["choices"][0]["delta"] == {"content": "he"}
    oai_chat.ChatCompletionChunk.model_validate(chunk)
    last = fmt.chat_chunk(META, 0, "", "stop", None, "replica:r1", with_usage=False)
    assert last["choices"][0]["delta"] == {} and "usage" not in last
    c = fmt.completion_chunk(META, 2, "x", "length", {"tokens": []}, "replica:r1", with_usage=False)
    assert c["object"] == "text_completion" and c["choices"][0] == {
        "index": 2, "text": "x", "finish_reason": "length", "logprobs": {"tokens": []}, "stop_reason": None}
    u = fmt.usage_chunk(META, "chat.completion.chunk", fmt.usage(1, 2, 0))
    assert u["choices"] == [] and oai_chat.ChatCompletionChunk.model_validate(u).usage.total_tokens == 3


def test_return_token_ids_fields_where_vllm_puts_them_and_read_by_the_openai_types():
    """Completions: both on each choice (streamed: prompt ids on a choice's first chunk). Chat: prompt ids on
    the body (streamed: the role chunks), generated ids on each choice. Absent unless given."""
    c = fmt.completion_response(META, [fmt.Choice("x", "length", None, token_ids=[22], prompt_token_ids=[1, 2])],
                                fmt.usage(2, 1, 0), "r", token_str)
    parsed = oai.Completion.model_validate(c).choices[0]
    assert parsed.model_extra == {"token_ids": [22], "prompt_token_ids": [1, 2], "stop_reason": None}
    chat = fmt.chat_response(META, [fmt.Choice("x", "stop", None, token_ids=[22])], fmt.usage(2, 1, 0), "r",
                             token_str, prompt_token_ids=[1, 2])
    parsed = oai_chat.ChatCompletion.model_validate(chat)
    assert parsed.model_extra == {"prompt_token_ids": [1, 2]}
    assert parsed.choices[0].model_extra == {"token_ids": [22], "stop_reason": None}
    chunk = fmt.completion_chunk(META, 0, "", None, None, "r", False, token_ids=[22], prompt_token_ids=[1, 2])
    assert (chunk["choices"][0]["token_ids"], chunk["choices"][0]["prompt_token_ids"]) == ([22], [1, 2])
    assert fmt.chat_chunk(META, 0, "x", None, None, "r", False, token_ids=[5])["choices"][0]["token_ids"] == [5]
    assert fmt.chat_role_chunk(META, 0, [1, 2])["prompt_token_ids"] == [1, 2]
    plain = [fmt.completion_chunk(META, 0, "x", None, None, "r", False)["choices"][0],
             fmt.chat_chunk(META, 0, "x", None, None, "r", False)["choices"][0], fmt.chat_role_chunk(META, 0),
             fmt.chat_response(META, [fmt.Choice("x", "stop", None)], fmt.usage(1, 1, 0), "r", token_str)]
    assert not any({"token_ids", "prompt_token_ids"} & set(d) for d in plain)


def test_stop_reason_is_on_each_finished_choice_as_vllm_returns_it():
    """The stop string or stop token id that ended a choice (None: EOS, the grammar, or a length cap); streamed,
    on the chunk that finishes the choice only."""
    for reason in ("###", 128009, None):
        c = fmt.completion_response(META, [fmt.Choice("x", "stop", None, stop_reason=reason)], fmt.usage(2, 1, 0),
                                    "r", token_str)
        assert oai.Completion.model_validate(c).choices[0].model_extra["stop_reason"] == reason
        chat = fmt.chat_response(META, [fmt.Choice("x", "stop", None, stop_reason=reason)], fmt.usage(2, 1, 0), "r",
                                 token_str)
        assert oai_chat.ChatCompletion.model_validate(chat).choices[0].model_extra["stop_reason"] == reason
        last = fmt.chat_chunk(META, 0, "", "stop", None, "r", with_usage=False, stop_reason=reason)
        assert oai_chat.ChatCompletionChunk.model_validate(last).choices[0].model_extra["stop_reason"] == reason
        last = fmt.completion_chunk(META, 0, "", "stop", None, "r", with_usage=False, stop_reason=reason)
        assert last["choices"][0]["stop_reason"] == reason
    assert "stop_reason" not in fmt.chat_chunk(META, 0, "he", None, None, "r", with_usage=False)["choices"][0]
    assert "stop_reason" not in fmt.completion_chunk(META, 0, "he", None, None, "r", with_usage=False)["choices"][0]


def test_logprob_bytes_are_each_tokens_own_so_a_split_character_can_be_rebuilt(tmp_path):
    """A byte token decodes to U+FFFD; its `bytes` must be its own byte (OpenAI: clients join them to rebuild
    characters split over tokens), not U+FFFD's three."""
    from transformers import AutoTokenizer

    from affinity_serve.engine.demo import write_demo_model
    tok = AutoTokenizer.from_pretrained(str(write_demo_model(tmp_path / "m")))
    table = {b: ch for ch, b in fmt._byte_level_chars().items()}

    def text(tid):
        return tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    ids = [tok.convert_tokens_to_ids(table[b]) for b in "中é".encode()]     # one byte token each
    assert all("\ufffd" in text(t) for t in ids)
    got = b"".join(fmt.token_bytes(tok, t, text(t)) for t in ids)
    assert got.decode("utf-8") == "中é"
    lps = fmt.chat_logprobs([Logprobs(ids[0], -0.5, 1, [ids[0]], [-0.5])], text,
                            lambda t: fmt.token_bytes(tok, t, text(t)))
    assert lps["content"][0]["bytes"] == list("中".encode()[:1])
    plain = tok.encode(" hello", add_special_tokens=False)[0]          # whole characters: their text's bytes
    assert fmt.token_bytes(tok, plain, text(plain)) == text(plain).encode()

    class SentencePiece:                   # byte fallback tokens are spelled <0xNN>
        def convert_ids_to_tokens(self, tid):
            return "<0xE4>"
    assert fmt.token_bytes(SentencePiece(), 7, "\ufffd") == b"\xe4"
