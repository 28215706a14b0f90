"""tool_choice "auto" with a Hermes/Qwen chat template (issue 27): the tools reach the prompt through the
template, a `<tool_call>` block the model writes comes back as `tool_calls` (whole and streamed, the text around
it as content), plain text stays content; the official openai client reads both. The replica is a fake that
"generates" a fixed text, as a model trained on the format would."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest

from app.config import AppConfig
from app.prompts import RequestKind
from app.protocol import ReplicaChunk
from tests.unit.app.conftest import LocalHandle
from engine import EngineLimits
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
    """Streams `text` in 4-character chunks, then finishes with "stop"; records the prompts it got."""

    def __init__(self):
        self.text = ""
        self.prompts: list[list[int]] = []

    async def generate(self, req):
        self.prompts.append(req.prompt_token_ids)
        pieces = [self.text[i:i + 4] for i in range(0, len(self.text), 4)] or [""]
        for n, piece in enumerate(pieces):
            yield ReplicaChunk(0, piece, [10], "stop" if n == len(pieces) - 1 else None,
                               num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")

    async def limits(self):
        return LIMITS

    async def debug_state(self):
        return {}


@pytest.fixture
def hermes(checkpoints, tmp_path):
    from app.ingress import Ingress
    path = tmp_path / "hermes"
    shutil.copytree(checkpoints["llama"], path)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    replica = TextReplica()
    ing = Ingress(LocalHandle(replica), AppConfig.model_validate(
        {"engine": {"model": str(path)}, "serve": {"first_token_timeout_s": 5}}).model_dump())

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


async def test_auto_reads_a_hermes_call_back_whole(hermes):
    client, ing, replica = hermes
    replica.text = CALL_TEXT
    r = await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
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
