"""What OpenAI's and vLLM's clients send and expect, found by trying the API as a user would: nullable optional
fields, vLLM's top_k -1/0, min_tokens above max_tokens, stream_options without stream, error params that name
the field (not a pydantic union branch), out-of-vocabulary logit_bias, `tool_choice: required` over tools whose
parameters use `$ref`, and one entry per call index in a streamed tool-call delta."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import ChatCompletionRequest, CompletionRequest
from affinity_serve.app.tool_calls import ToolCallMode, ToolCallStream, tool_call_grammar
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.llm_engine import LLMEngine
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.types import EngineRequest
from tests.unit.app.test_hostile_inputs import FakeReplica, http_request, ingress

MESSAGES = [{"role": "user", "content": "x"}]


async def _post(ing, kind: RequestKind, body: dict):
    r = await asyncio.wait_for(ing._http(kind, http_request(json.dumps(body).encode())), 5)
    return r.status_code, (json.loads(r.body) if hasattr(r, "body") else None)


@pytest.mark.parametrize("kind,body", [
    (RequestKind.COMPLETION, {"prompt": "hi", "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
                              "presence_penalty": None, "frequency_penalty": None, "stream": None, "echo": None,
                              "logprobs": None, "top_k": None, "seed": None, "stop": None}),
    (RequestKind.CHAT, {"messages": MESSAGES, "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
                        "presence_penalty": None, "frequency_penalty": None, "stream": None, "logprobs": None,
                        "top_logprobs": None, "tools": None, "tool_choice": None, "store": True}),
])
async def test_null_optional_fields_mean_their_defaults(checkpoints, kind, body):
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    status, out = await _post(ing, kind, body)
    assert status == 200, out
    p = replica.generated[0].sampling_params
    assert (p.temperature, p.top_p, p.n, p.presence_penalty, p.frequency_penalty) == (1.0, 1.0, 1, 0.0, 0.0)
    assert (p.stop, p.seed, p.top_k, p.logprobs) == ([], None, None, None)
    assert "echo" not in body or "hi" not in out["choices"][0]["text"]          # echo: null is no echo


def test_top_k_minus_one_and_zero_turn_top_k_off_and_below_is_a_400():
    for k in (-1, 0):
        req = CompletionRequest.model_validate({"prompt": "hi", "top_k": k})
        assert req.top_k is None and req.sampling_params(4, None, 1).top_k is None
    assert CompletionRequest.model_validate({"prompt": "hi", "top_k": 3}).sampling_params(4, None, 1).top_k == 3
    from affinity_serve.app.errors import APIError
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate({"prompt": "hi", "top_k": -2})
    assert e.value.param == "top_k" and "-1 or 0" in str(e.value)


async def test_min_tokens_above_max_tokens_is_a_400_naming_both(checkpoints):
    ing, handle = ingress(checkpoints)
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    assert status == 400 and out["error"]["param"] == "min_tokens", out
    assert "min_tokens (5)" in out["error"]["message"] and "max_tokens (2)" in out["error"]["message"]
    assert "generate" not in [name for name, _ in handle.calls]
    status, _ = await _post(ing, RequestKind.COMPLETION, {"prompt": "hi", "max_tokens": 2, "min_tokens": 2})
    assert status == 200


async def test_stream_options_without_stream_is_a_400(checkpoints):
    ing, _ = ingress(checkpoints)
    status, out = await _post(ing, RequestKind.CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                                      "stream_options": {"include_usage": True}})
    assert status == 400 and out["error"]["param"] == "stream_options", out


@pytest.mark.parametrize("kind,body,param,says", [
    (RequestKind.COMPLETION, {"prompt": 5}, "prompt", ["a string", "a list of token ids"]),
    (RequestKind.COMPLETION, {"prompt": "hi", "stop": 5}, "stop", ["a string", "a list of strings"]),
    (RequestKind.COMPLETION, {"prompt": "hi", "stop": [1, 2]}, "stop.0", ["valid string"]),
    (RequestKind.COMPLETION, {"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias.5", ["valid number"]),
    (RequestKind.CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     ["a string", "a list of content parts"]),
    (RequestKind.CHAT, {"messages": MESSAGES, "tools": [{"function": {"name": "f"}}], "tool_choice": "always"},
     "tool_choice", ["'none', 'auto' or 'required'", "an object"]),
    (RequestKind.CHAT, {"messages": MESSAGES, "tools": [{"function": {"name": "f"}}],
                        "tool_choice": {"type": "function"}}, "tool_choice.function", ["Field required"]),
])
async def test_a_400_names_the_field_and_the_shapes_it_takes(checkpoints, kind, body, param, says):
    ing, _ = ingress(checkpoints)
    status, out = await _post(ing, kind, body)
    err = out["error"]
    assert status == 400 and err["param"] == param, err
    assert all(s in err["message"] for s in says), err
    assert "[" not in err["param"] and "literal" not in err["message"]


def test_an_out_of_vocabulary_logit_bias_key_is_refused_by_the_engine(checkpoints):
    eng = LLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 16, "block_size": 4}))
    vocab = eng.limits.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(EngineRequest("a", [5, 6], SamplingParams(max_tokens=2, logit_bias={vocab: 5.0})))
    assert e.value.param == "logit_bias" and str(vocab) in str(e.value)
    assert not eng.has_unfinished_requests()
    eng.add_request(EngineRequest("b", [5, 6], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 5.0})))
    assert eng.has_unfinished_requests()


ADDRESS = {"type": "object", "$defs": {"Addr": {"type": "object", "properties": {"zip": {"type": "string"}},
                                                "required": ["zip"], "additionalProperties": False}},
           "properties": {"addr": {"$ref": "#/$defs/Addr"}}, "required": ["addr"], "additionalProperties": False}
NODE = {"type": "object", "properties": {"kid": {"$ref": "#/definitions/Node"}}, "additionalProperties": False}
TREE = {"type": "object", "definitions": {"Node": NODE},
        "properties": {"root": {"$ref": "#/definitions/Node"}, "again": {"$ref": "#"}}, "required": ["root"]}


def test_required_tool_choice_keeps_the_references_of_each_functions_parameters():
    req = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "tool_choice": "required",
        "tools": [{"function": {"name": "ship", "parameters": ADDRESS}},
                  {"function": {"name": "walk", "parameters": TREE}}, {"function": {"name": "ping"}}]})
    spec, mode = tool_call_grammar(req)
    spec.check()                                         # xgrammar builds it (it refused the nested $ref before)
    schema = json.loads(spec.json)
    ok = [[{"name": "ship", "arguments": {"addr": {"zip": "1"}}}],
          [{"name": "walk", "arguments": {"root": {"kid": {"kid": {}}}, "again": {"root": {}}}}],
          [{"name": "ping", "arguments": {}}, {"name": "ship", "arguments": {"addr": {"zip": "2"}}}]]
    bad = [[{"name": "ship", "arguments": {"addr": {"zap": "1"}}}],
           [{"name": "walk", "arguments": {"root": {"kid": {"x": 1}}}}],
           [{"name": "walk", "arguments": {"root": {}, "again": {}}}]]
    for inst in ok:
        jsonschema.validate(inst, schema)
    for inst in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(inst, schema)


def test_a_streamed_named_call_sends_one_entry_per_index_in_each_delta():
    stream = ToolCallStream(ToolCallMode("f"))
    text = '{"city": "Paris", "days": 3}'
    deltas = [stream.feed(piece) for piece in ("{", '"city": "Pa', 'ris", "days"', ": 3}")]
    for d in deltas:
        assert len({e["index"] for e in d}) == len(d), d
    assert deltas[0][0]["function"]["name"] == "f" and deltas[0][0]["id"].startswith("call_")
    assert "".join(e["function"]["arguments"] for d in deltas for e in d) == text


# Qwen3's switch, as its template reads it
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _chat(body: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(checkpoints):
    from affinity_serve.app.prompts import chat_prompt_ids
    from affinity_serve.engine import load_tokenizer
    tok = load_tokenizer(checkpoints["llama"])
    tok.chat_template = THINK_TEMPLATE
    plain = tok.decode(chat_prompt_ids(_chat({}), tok))
    off = tok.decode(chat_prompt_ids(_chat({"chat_template_kwargs": {"enable_thinking": False}}), tok))
    on = tok.decode(chat_prompt_ids(_chat({"chat_template_kwargs": {"enable_thinking": True}}), tok))
    assert "<think>" not in plain and plain == on and off.endswith("<think>\n\n</think>\n\n")
    for bad in ({"tokenize": False}, {"add_generation_prompt": False}, {"not a name": 1}, {"conversations": 1},
                {"sanitize_control_tokens": False}):
        with pytest.raises(InvalidRequestError) as e:
            chat_prompt_ids(_chat({"chat_template_kwargs": bad}), tok)
        assert e.value.param == "chat_template_kwargs"
    # a template that refuses the request (its raise_exception, or a variable of the wrong type) is a 400
    tok.chat_template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('start with a system turn') }}" \
                        "{% endif %}{{ messages[0]['content'] }}{{ limit + 1 }}"
    with pytest.raises(InvalidRequestError, match="start with a system turn") as e:
        chat_prompt_ids(_chat({}), tok)
    assert e.value.param == "messages"
    system = {"messages": [{"role": "system", "content": "s"}], "chat_template_kwargs": {"limit": "x"}}
    with pytest.raises(InvalidRequestError) as e:
        chat_prompt_ids(ChatCompletionRequest.model_validate(system), tok)
    assert e.value.param == "chat_template_kwargs"


async def test_continue_final_message_leaves_the_assistant_turn_open(checkpoints):
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    turns = [{"role": "user", "content": "Say a word"}, {"role": "assistant", "content": "The word is"}]
    status, out = await _post(ing, RequestKind.CHAT, {"messages": turns, "max_tokens": 2,
                                                      "continue_final_message": True})
    assert status == 200, out
    from affinity_serve.engine import load_tokenizer
    tok = load_tokenizer(checkpoints["llama"])
    prompt = tok.decode(replica.generated[0].prompt_token_ids)
    assert prompt.rstrip().endswith("The word is") and prompt.count("assistant") == 1
    for body, param in (({"messages": turns, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message")):
        status, out = await _post(ing, RequestKind.CHAT, {**body, "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == param, out
    assert len(replica.generated) == 1


async def test_the_models_routes_are_counted_as_http_responses_and_the_card_has_a_creation_time(checkpoints):
    import time
    t0 = int(time.time())
    ing, _ = ingress(checkpoints)
    seen = []
    ing.metrics.record_http = lambda route, status: seen.append((route, status))
    get = http_request(b"", path="/v1/models", method="GET")
    r = await ing.http_models(get)
    assert r.status_code == 200 and t0 <= json.loads(r.body)["data"][0]["created"] <= time.time()
    model_id = ing.model_name
    assert (await ing.http_model(model_id, http_request(b"", path=f"/v1/models/{model_id}", method="GET"))
            ).status_code == 200
    assert (await ing.http_model("other", http_request(b"", path="/v1/models/other", method="GET"))
            ).status_code == 404
    assert seen == [("/v1/models", 200), ("/v1/models/{model_id}", 200), ("/v1/models/{model_id}", 404)]


async def test_a_batch_prompt_that_does_not_fit_is_named_by_its_index(checkpoints):
    ing, handle = ingress(checkpoints)                        # max_model_len 64
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": [[1, 2], [3] * 70, [4]], "max_tokens": 2})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert out["error"]["message"].startswith("prompt 1 of 3: ")
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": [3] * 70, "max_tokens": 2})
    assert status == 400 and not out["error"]["message"].startswith("prompt ")
    assert "generate" not in [name for name, _ in handle.calls]


# ---------------------------------------------------------------- the handle API, as docs/api.md promises it
async def _drain(agen):
    return [c async for c in agen]


async def test_the_streaming_handle_methods_apply_the_stream_checks_and_the_others_refuse_stream(checkpoints):
    from affinity_serve.app.errors import APIError
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    for body, param in (({"prompt": "hi", "max_tokens": 3, "n": 2, "best_of": 3}, "best_of"),
                        ({"prompt": "hi", "max_tokens": 3, "prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(APIError) as e:
            await _drain(ing.completions_stream(body))
        assert e.value.status_code == 400 and e.value.param == param
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "max_tokens": 2, "stream": True})
    assert e.value.param == "stream" and "completions_stream" in e.value.message
    assert replica.generated == []
    chunks = await _drain(ing.chat_stream(ChatCompletionRequest(messages=MESSAGES, max_tokens=2)))
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_a_handle_request_that_is_not_a_dict_or_a_request_is_a_400(checkpoints):
    from affinity_serve.app.errors import APIError
    ing, _ = ingress(checkpoints)
    for call in (lambda: ing.completions("hello"), lambda: ing.chat(None), lambda: ing.tokenize(["x"])):
        with pytest.raises(APIError) as e:
            await call()
        assert e.value.status_code == 400 and "or a dict of its fields" in e.value.message


def test_a_typed_request_built_with_a_bad_value_raises_the_http_apis_error():
    from affinity_serve.app.errors import APIError
    for kwargs, param in ((dict(prompt="x", max_tokens=-1), "max_tokens"), (dict(prompt="x", temperature="hot"),
                                                                           "temperature"), (dict(), "prompt")):
        with pytest.raises(APIError) as e:
            CompletionRequest(**kwargs)
        assert e.value.status_code == 400 and e.value.param == param


def test_the_proxys_limits_variable_is_checked_key_by_key(monkeypatch):
    from affinity_serve.app.http import HTTP_LIMITS_ENV, parse_http_limits, proxy_middlewares
    assert parse_http_limits('{"max_body_bytes": 15, "body_read_timeout_s": 2.5}') == {
        "max_body_bytes": 15, "body_read_timeout_s": 2.5}
    for text, says in (('{"max_body_byte": 15}', "did you mean 'max_body_bytes'"),
                       ('{"max_connections": -1}', "'max_connections' must be a positive integer"),
                       ('{"max_connections": 1.5}', "'max_connections' must be a positive integer"),
                       ('{"body_read_timeout_s": 0}', "'body_read_timeout_s' must be a positive number"),
                       ('{"retry_after_s": true}', "'retry_after_s' must be a positive integer"),
                       ('[1]', "must be a JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError) as e:
            parse_http_limits(text)
        assert says in str(e.value) and HTTP_LIMITS_ENV in str(e.value)
    monkeypatch.setenv(HTTP_LIMITS_ENV, '{"max_request_body_bytes": 15}')
    with pytest.raises(ValueError, match="unknown limit 'max_request_body_bytes'"):
        proxy_middlewares()


async def test_a_boolean_where_an_integer_goes_is_a_400_not_one(checkpoints):
    ing, _ = ingress(checkpoints)
    for kind, body, param in ((RequestKind.COMPLETION, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
                              (RequestKind.COMPLETION, {"prompt": "hi", "logprobs": True}, "logprobs"),
                              (RequestKind.CHAT, {"messages": MESSAGES, "n": False}, "n"),
                              (RequestKind.CHAT, {"messages": MESSAGES, "temperature": True}, "temperature"),
                              (RequestKind.COMPLETION, {"prompt": [True, False]}, "prompt"),
                              (RequestKind.COMPLETION, {"prompt": [[5, True]]}, "prompt"),
                              (RequestKind.COMPLETION, {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids")):
        status, out = await _post(ing, kind, body)
        assert status == 400 and out["error"]["param"] == param, out
    status, out = await _post(ing, RequestKind.CHAT, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                                      "echo": None})
    assert status == 400 and out["error"]["code"] == "unsupported_field"        # chat has no echo
    status, _ = await _post(ing, RequestKind.CHAT, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True})
    assert status == 200                                                        # chat's logprobs is a boolean


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(checkpoints):
    ing, _ = ingress(checkpoints, FakeReplica(n_tokens=3))
    for continuous in (True, False):
        body = {"prompt": "hi", "max_tokens": 3, "n": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
        r = await asyncio.wait_for(ing._http(RequestKind.COMPLETION, http_request(json.dumps(body).encode())), 5)
        events = [e async for e in r.body_iterator]
        chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
        *choices, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        if continuous:
            done = [c["usage"]["completion_tokens"] for c in choices]
            assert done == sorted(done) and done[-1] == 6 and len(set(done)) > 1
            assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in choices)
        else:
            assert all(c.get("usage") is None for c in choices)


async def test_a_typed_request_with_stream_options_streams_through_the_handle(checkpoints):
    ing, _ = ingress(checkpoints)
    req = ChatCompletionRequest(messages=MESSAGES, max_tokens=2, stream_options={"include_usage": True})
    chunks = await _drain(ing.chat_stream(req))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


class SiblingHitReplica(FakeReplica):
    """Sequence 0 of each prompt computed it (no hit); the later siblings hit the blocks it computed."""

    async def generate(self, req):
        from affinity_serve.app.protocol import ReplicaChunk
        self.generated.append(req)
        for i in range(req.sampling_params.n):
            for t in range(self.n_tokens):
                yield ReplicaChunk("", i, "ab"[t % 2], [10 + t], "length" if t == self.n_tokens - 1 else None,
                                   num_prompt_tokens=len(req.prompt_token_ids),
                                   num_cached_tokens=0 if i == 0 else 4, replica_id="r1")


async def test_cached_tokens_of_n_sequences_are_the_prompts_not_a_later_siblings(checkpoints):
    ing, _ = ingress(checkpoints, SiblingHitReplica())
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2, "n": 3})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, out["usage"]


async def test_continuous_usage_is_on_the_chat_role_chunks_too_and_min_tokens_names_an_unsent_max(checkpoints):
    ing, _ = ingress(checkpoints, FakeReplica(n_tokens=2))
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = await asyncio.wait_for(ing._http(RequestKind.CHAT, http_request(json.dumps(body).encode())), 5)
    chunks = [json.loads(e[len("data: "):]) for e in [e async for e in r.body_iterator] if e.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert all(c["usage"] is not None for c in chunks) and chunks[0]["usage"]["completion_tokens"] == 0
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": "hi", "min_tokens": 40})
    assert status == 400 and "max_tokens (not sent: 16)" in out["error"]["message"], out


def test_the_reserved_template_names_hold_the_fixed_list_and_transformers_own(monkeypatch):
    import inspect

    from affinity_serve.engine import tokenizer as t
    t._reserved_template_names.cache_clear()
    names = t._reserved_template_names()
    assert t._TEMPLATE_RESERVED <= names and "conversations" in names and "sanitize_control_tokens" in names

    def no_signature(fn):
        raise ValueError("no signature")
    monkeypatch.setattr(inspect, "signature", no_signature)
    t._reserved_template_names.cache_clear()
    try:
        assert t._reserved_template_names() == t._TEMPLATE_RESERVED    # falls back to the fixed list
    finally:
        monkeypatch.undo()
        t._reserved_template_names.cache_clear()


async def test_routing_decisions_refuses_what_is_not_a_count(checkpoints):
    """A handle caller's typo got a raw TypeError traceback (or, for -1, silently nothing)."""
    from affinity_serve.app.errors import APIError
    ing, _ = ingress(checkpoints)
    for bad in ("x", -1, 2.5, True):
        with pytest.raises(APIError) as e:
            await ing.routing_decisions(bad)
        assert e.value.status_code == 400 and e.value.param == "n"
