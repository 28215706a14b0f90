"""Issue 27.3: response_format, vLLM's structured_outputs/guided_* and tools through the official `openai` client
(strict response validation), against the ingress and a real replica in this process (an httpx transport hands
each request to the ingress's own HTTP path). The model is the tiny random one: every valid output is the
grammar's doing."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from affinity_serve.app.config import AppConfig  # noqa: E402
from affinity_serve.app.prompts import RequestKind  # noqa: E402
from affinity_serve.engine import EngineConfig  # noqa: E402
from tests.unit.app.conftest import LocalHandle  # noqa: E402
from tests.unit.app.test_hostile_inputs import http_request  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "d", "parameters": TIME}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def app(checkpoints):
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica
    path = checkpoints["llama"]
    rep = LLMReplica(EngineConfig(model=path, cache={"num_blocks": 256, "block_size": 4}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": {"model": path}}))

    async def handler(request: httpx.Request) -> httpx.Response:
        kind = RequestKind.CHAT if request.url.path.endswith("/chat/completions") else RequestKind.COMPLETION
        r = await ing._http(kind, http_request(request.content, request.url.path))
        if hasattr(r, "body_iterator"):
            body = "".join([e if isinstance(e, str) else e.decode() async for e in r.body_iterator]).encode()
            return httpx.Response(r.status_code, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(r.status_code, content=r.body, headers={"content-type": "application/json"})

    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
                                _strict_response_validation=True)
    client.model_name = ing.model_name
    client.quote_id = ing.serving.tokenizer.convert_tokens_to_ids('"')
    yield client, ing.model_name
    await rep.engine.shutdown()


async def test_json_schema_and_json_object_on_chat_and_completions(app):
    client, model = app
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = await client.chat.completions.create(model=model, messages=MSGS, response_format=rf, max_tokens=80,
                                                temperature=1.0, seed=1, n=2)
    for c in chat.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    comp = await client.completions.create(model=model, prompt="JSON:", max_tokens=80, temperature=0.0,
                                           extra_body={"response_format": rf})
    jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
    # streamed: plain content chunks that join to the same document
    stream = await client.chat.completions.create(model=model, messages=MSGS, response_format=rf, max_tokens=80,
                                                  temperature=0.0, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    jsonschema.validate(json.loads(text), PERSON)
    # a random model rarely closes a free-form string: a bias on '"' lets json_object's keys end
    obj = await client.chat.completions.create(model=model, messages=MSGS, response_format={"type": "json_object"},
                                               max_tokens=120, temperature=1.0, seed=2,
                                               logit_bias={str(client.quote_id): 6})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)


async def test_vllm_extensions_regex_choice_and_guided_json(app):
    client, model = app
    r = await client.completions.create(model=model, prompt="id:", max_tokens=20, temperature=1.0, seed=3,
                                        extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}})
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.choices[0].text)
    r = await client.chat.completions.create(model=model, messages=MSGS, max_tokens=20, temperature=1.0, seed=4,
                                             extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = await client.chat.completions.create(model=model, messages=MSGS, max_tokens=80, temperature=0.0,
                                             extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_tool_calls_whole_and_streamed(app, choice):
    client, model = app
    named = isinstance(choice, dict)
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    kw = dict(model=model, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=1.0,
              seed=5, parallel_tool_calls=False)
    r = await client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = c.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_time" if named else calls[0].function.name in schemas
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])

    chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
    deltas = [tc for ch in chunks for choice_ in ch.choices for tc in (choice_.delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])     # then argument fragments
    assert len(deltas) > 2
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), schemas[deltas[0].function.name])
    # same seed, same call
    assert (deltas[0].function.name, args) == (calls[0].function.name, calls[0].function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


async def test_required_allows_parallel_calls_each_validating(app):
    client, model = app
    r = await client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="required",
                                             max_tokens=200, temperature=1.0, seed=11, n=3)
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for c in r.choices:
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            assert c.message.tool_calls
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


async def test_a_multi_turn_exchange_with_tool_results(app):
    client, model = app
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = await client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                             max_tokens=5, temperature=0.0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kw,param", [
    (dict(tools=TOOLS), "tool_choice"),                                           # auto by default
    (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.function.name"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
    (dict(extra_body={"guided_grammar": "root ::= undefined_rule"}), "guided_grammar"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
    (dict(response_format={"type": "json_object"}, extra_body={"min_tokens": 3}), "min_tokens"),
])
async def test_bad_requests_are_400s_naming_the_field(app, kw, param):
    client, model = app
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=model, messages=MSGS, max_tokens=5, **kw)
    err = e.value.body
    assert err["param"] == param or (param == "tools.function.name" and err["param"].startswith("tools")), err
    # the server keeps serving
    ok = await client.chat.completions.create(model=model, messages=MSGS, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_streamed_tool_calls_keep_choices_apart_with_n(app):
    client, model = app
    chunks = [ch async for ch in await client.chat.completions.create(
        model=model, messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=1.0, seed=9, n=2, stream=True)]
    args = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                args[c.index] += tc.function.arguments or ""
    for text in args.values():
        jsonschema.validate(json.loads(text), WEATHER)


async def test_the_python_handle_api_takes_the_same_fields(checkpoints):
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica
    path = checkpoints["llama"]
    rep = LLMReplica(EngineConfig(model=path, cache={"num_blocks": 128, "block_size": 4}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": {"model": path}}))
    out = await ing.chat({"messages": MSGS, "max_tokens": 60, "temperature": 0.0, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    call = out["choices"][0]["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
    out = await ing.completions({"prompt": "x", "max_tokens": 60, "temperature": 0.0,
                                 "response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                                             "schema": PERSON}}})
    jsonschema.validate(json.loads(out["choices"][0]["text"]), PERSON)
    assert not rep.engine.engine.has_unfinished_requests()
    await rep.engine.shutdown()
