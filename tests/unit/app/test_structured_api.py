"""Structured outputs and tool calls as a user meets them (found by an acceptance pass): typed handle requests
with a schema, schema keywords the grammar cannot enforce refused with a 400 naming where, and the tool-call
read-back's edge cases."""
from __future__ import annotations

import asyncio
import json

import pytest

from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.app.test_hostile_inputs import FakeReplica, http_request, ingress

pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "x"}]
MSGS_WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


async def _post(ing, kind: RequestKind, body: dict):
    r = await asyncio.wait_for(ing._http(kind, http_request(json.dumps(body).encode())), 5)
    return r.status_code, json.loads(r.body)


async def test_a_typed_handle_request_with_a_schema_is_sent_by_its_wire_names(checkpoints):
    """The models' Python field names (`json_schema.json_schema`, `json_`) are not the API's (`schema`, `json`):
    a typed request reached the ingress under the Python names and was a 400."""
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = await ing.chat(ChatCompletionRequest(messages=MESSAGES, max_tokens=2, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert out["object"] == "chat.completion"
    out = await ing.completions(CompletionRequest(prompt="x", max_tokens=2, structured_outputs={"json": schema}))
    assert out["object"] == "text_completion"
    specs = [r.sampling_params.structured_output for r in replica.generated]
    assert [json.loads(s.json) for s in specs] == [schema, schema]


@pytest.mark.parametrize("kind,body,param,named", [
    (RequestKind.CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format.json_schema.schema", "'uniqueItems'"),
    (RequestKind.COMPLETION, {"prompt": "x", "guided_json": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 3}},
        "$defs": {"s": {"type": "string"}}}}, "guided_json", "at properties.a: maxLength beside $ref"),
    (RequestKind.CHAT, {"messages": MESSAGES, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "tags", "parameters": {
            "type": "object", "properties": {"t": {"type": "array", "contains": {"const": 1}}}}}}]},
     "tools.tags.parameters", "at properties.t: 'contains'"),
])
async def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(checkpoints, kind, body, param,
                                                                               named):
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    status, out = await _post(ing, kind, {"max_tokens": 4, **body})
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and err["code"] == "invalid_grammar" and err["type"] == "invalid_request_error"
    assert named in err["message"] and "unsupported JSON schema" in err["message"]
    assert replica.generated == []


# ---------------------------------------------------------------- tool calls read back
async def _chat(client, ing, stream: bool, **kw):
    """(content, [(name, arguments text)], finish_reason) of one choice, whole or assembled from the stream."""
    kw = dict(model=ing.model_name, messages=MSGS_WEATHER, tools=TOOLS, max_tokens=50, **kw)
    if not stream:
        c = (await client.chat.completions.create(**kw)).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    chunks = [ch.choices[0] async for ch in await client.chat.completions.create(stream=True, **kw) if ch.choices]
    content = "".join(ch.delta.content or "" for ch in chunks) or None
    by_index: dict[int, list] = {}
    for ch in chunks:
        for t in ch.delta.tool_calls or []:
            entry = by_index.setdefault(t.index, [t.function.name, ""])
            entry[1] += t.function.arguments or ""
    return content, [tuple(v) for _, v in sorted(by_index.items())], chunks[-1].finish_reason


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_cut_by_a_stop_string_finishes_stop_not_tool_calls(checkpoints, tmp_path, stream):
    from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, _client
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE)
    replica.text, replica.stop_reason = '[{"name": "get_weather", "arguments": {"city": "Pa', "ris"
    content, calls, reason = await _chat(client, ing, stream, tool_choice="required", stop=["ris"])
    assert reason == "stop" and calls == [("get_weather", '{"city": "Pa')] and content is None
    replica.stop_reason = None          # the same text ended by the grammar would be a whole call
    replica.text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    content, calls, reason = await _chat(client, ing, stream, tool_choice="required")
    assert reason == "tool_calls" and calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_after_whole_calls_still_finishes_tool_calls(checkpoints, tmp_path, stream):
    """An agent's stop string (e.g. "\nObservation") that matches after the model's calls: the calls are whole,
    so clients that branch on finish_reason "tool_calls" must see it."""
    from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, _client
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE)
    replica.text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    replica.stop_reason = "Observation"
    content, calls, reason = await _chat(client, ing, stream, stop=["Observation"])
    assert reason == "tool_calls" and calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_cut_before_its_name_is_complete_keeps_its_text(checkpoints, tmp_path, stream):
    """OpenAI never sends `tool_calls: []`: no call came of the text, so the text is the content."""
    from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, _client
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE)
    replica.text, replica.finish = '[{"name": "get_wea', "length"
    content, calls, reason = await _chat(client, ing, stream, tool_choice="required")
    assert (content, calls, reason) == ('[{"name": "get_wea', [], "length")


@pytest.mark.parametrize("stream", [False, True])
async def test_hermes_reads_a_last_block_ended_without_its_closing_tag(checkpoints, tmp_path, stream):
    """Models often end a call with EOS instead of `</tool_call>`."""
    from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, _client
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE)
    replica.text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls, reason = await _chat(client, ing, stream)
    assert (content, calls, reason) == ("Sure. ", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    replica.text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'      # no call: text
    content, calls, reason = await _chat(client, ing, stream)
    assert (content, calls, reason) == (replica.text, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
async def test_hermes_content_is_the_same_whole_and_streamed(checkpoints, tmp_path, stream):
    """The text around calls, blanks and all; only whitespace around calls is no content at all."""
    from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, _client
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    replica.text = f"Sure thing. {call}\n{call} and after"
    content, calls, reason = await _chat(client, ing, stream)
    assert content == "Sure thing. \n and after" and len(calls) == 2 and reason == "tool_calls"
    replica.text = f"{call}\n{call}\n"
    content, calls, reason = await _chat(client, ing, stream)
    assert content is None and len(calls) == 2 and reason == "tool_calls"


async def test_vllms_backend_and_whitespace_fields_are_accepted_where_they_hold(checkpoints):
    replica = FakeReplica()
    ing, _ = ingress(checkpoints, replica)
    for extra in ({"guided_decoding_backend": "xgrammar"}, {"guided_decoding_backend": "auto"}):
        status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": "x", "max_tokens": 2,
                                                                 "guided_regex": "[a-z]+", **extra})
        assert status == 200, out
    status, out = await _post(ing, RequestKind.COMPLETION, {"prompt": "x", "max_tokens": 2, "structured_outputs": {
        "json": {"type": "object"}, "disable_any_whitespace": True}})
    assert status == 200, out
    status, out = await _post(ing, RequestKind.COMPLETION, {
        "prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]+", "guided_decoding_backend": "outlines"})
    assert status == 400 and out["error"]["param"] == "guided_decoding_backend"

