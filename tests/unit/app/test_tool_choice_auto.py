"""tool_choice "auto" (issue 27) with Hermes/Qwen, Llama 3 JSON and Mistral chat templates: the parser is
chosen from the template, the tools reach the prompt through it, the calls the model writes come back as
`tool_calls` (whole and streamed, the text around them as content), plain text stays content; the official
openai client reads both. The replica is a fake that "generates" a fixed text, as a model trained on the format
would."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import ReplicaChunk
from tests.unit.app.conftest import LocalHandle
from affinity_serve.engine import EngineLimits
from tests.unit.app.test_hostile_inputs import http_request

LIMITS = EngineLimits(max_model_len=1024, vocab_size=10**6, max_kv_tokens=4096)

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class TextReplica:
    """Streams `text` in 4-character chunks, then finishes with `finish` ("stop"; `stop_reason` the stop string or
    token that ended it, None: the end of the grammar or turn); records the prompts it got."""

    def __init__(self):
        self.text = ""
        self.finish, self.stop_reason = "stop", None
        self.prompts: list[list[int]] = []

    async def generate(self, req):
        self.prompts.append(req.prompt_token_ids)
        pieces = [self.text[i:i + 4] for i in range(0, len(self.text), 4)] or [""]
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            yield ReplicaChunk("", 0, piece, [10], self.finish if last else None,
                               stop_reason=self.stop_reason if last else None,
                               num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")

    async def limits(self):
        return LIMITS

    async def debug_state(self):
        return {}


# Llama 3.1's way of offering JSON tools (custom tools in the user turn) and of rendering past calls
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if tools and loop.last %}Respond with a JSON for a function call: {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{{ c.function | tojson }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


def _client(checkpoints, tmp_path, template: str, serve: dict | None = None):
    from affinity_serve.app.ingress import Ingress
    path = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], path)
    (path / "chat_template.jinja").write_text(template)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    replica = TextReplica()
    ing = Ingress(LocalHandle(replica), AppConfig.model_validate(
        {"engine": {"model": str(path)}, "serve": {"first_token_timeout_s": 5, **(serve or {})}}))

    async def handler(request: httpx.Request) -> httpx.Response:
        r = await asyncio.wait_for(ing._http(RequestKind.CHAT, http_request(request.content, request.url.path)), 10)
        if hasattr(r, "body_iterator"):
            body = "".join([e if isinstance(e, str) else e.decode() async for e in r.body_iterator]).encode()
            return httpx.Response(r.status_code, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(r.status_code, content=r.body, headers={"content-type": "application/json"})

    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
                                _strict_response_validation=True)
    return client, ing, replica


@pytest.fixture
def hermes(checkpoints, tmp_path):
    return _client(checkpoints, tmp_path, HERMES_TEMPLATE)


@pytest.fixture(params=["llama3_json", "mistral"])
def json_format(request, checkpoints, tmp_path):
    """(client, ingress, replica, parser, texts): texts["call"] makes a call, with `Let me check.` before it."""
    template = LLAMA3_TEMPLATE if request.param == "llama3_json" else MISTRAL_TEMPLATE
    call = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}' if request.param == "llama3_json"
            else '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    # the marker is a special token: with skip_special_tokens (the default) the text has no marker, and a
    # reply that opens with the calls' JSON is read as calls
    bare = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
            if request.param == "llama3_json"
            else ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]')
    return (*_client(checkpoints, tmp_path, template), request.param,
            {"call": "Let me check. " + call, "bare": bare})


async def test_auto_reads_a_hermes_call_back_whole(hermes):
    client, ing, replica = hermes
    replica.text = CALL_TEXT
    r = await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check. "     # as streamed
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tool definitions went through the template into the prompt
    prompt = ing.serving.tokenizer.decode(replica.prompts[-1])
    assert "<tools>" in prompt and "get_weather" in prompt


async def test_auto_streams_content_then_the_call(hermes):
    client, ing, replica = hermes
    replica.text = CALL_TEXT
    chunks = [ch async for ch in await client.chat.completions.create(
        model=ing.model_name, messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=50, stream=True)]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "Let me check. " and "<tool" not in content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_leaves_plain_text_and_broken_blocks_as_content(hermes, stream):
    client, ing, replica = hermes
    replica.text = "No call needed. <tool_call>not json</tool_call> <tool_c"
    kw = dict(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    if not stream:
        c = (await client.chat.completions.create(**kw)).choices[0]
        assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content == replica.text
        return
    chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == replica.text
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]


async def test_the_parser_is_chosen_from_the_template(json_format):
    client, ing, replica, parser, texts = json_format
    from affinity_serve.app.tool_calls import detect_tool_parser
    assert detect_tool_parser(ing.serving.tokenizer) == parser
    replica.text = texts["call"]
    r = await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check. "     # as streamed
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = ing.serving.tokenizer.decode(replica.prompts[-1])
    assert "get_weather" in prompt                 # the tools went through the template


async def test_json_formats_stream_content_then_each_call(json_format):
    client, ing, replica, parser, texts = json_format
    replica.text = texts["call"]
    chunks = [ch async for ch in await client.chat.completions.create(
        model=ing.model_name, messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=50, stream=True)]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "Let me check. "
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_json_formats_read_calls_whose_marker_was_dropped(json_format, stream):
    """Two calls with the marker dropped from the text (a special token, skip_special_tokens): both come back,
    in order, with indices 0 and 1 when streamed."""
    client, ing, replica, parser, texts = json_format
    replica.text = texts["bare"]
    kw = dict(model=ing.model_name, messages=MSGS, tools=TWO_TOOLS, max_tokens=80)
    if not stream:
        c = (await client.chat.completions.create(**kw)).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    else:
        chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert [d.index for d in deltas] == [0, 1]
        got = [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", ["Sunny, 21 degrees.", "{not a call} at all", '[1, 2] and {"x": 1}', "  "])
async def test_json_formats_leave_text_that_is_no_call_as_content(json_format, stream, text):
    client, ing, replica, parser, texts = json_format
    replica.text = text
    kw = dict(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    if not stream:
        c = (await client.chat.completions.create(**kw)).choices[0]
        assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content == text
        return
    chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


async def test_json_formats_multi_turn_with_tool_results(json_format):
    """The call comes back to the template as the assistant's tool_calls, the result as a tool message, and
    the model's plain answer is content."""
    client, ing, replica, parser, texts = json_format
    replica.text = texts["call"]
    first = await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    msg = first.choices[0].message
    replica.text = "It is sunny in Paris."
    messages = MSGS + [msg.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 21}'}]
    again = await client.chat.completions.create(model=ing.model_name, messages=messages, tools=TOOLS,
                                                 max_tokens=50)
    assert again.choices[0].message.content == "It is sunny in Paris." and again.choices[0].message.tool_calls is None
    prompt = ing.serving.tokenizer.decode(replica.prompts[-1])
    assert "temp_c" in prompt and "Paris" in prompt
