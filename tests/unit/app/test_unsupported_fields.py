"""Issue 27.1: a field the server does not implement is a 400 naming it, never dropped; what the official
`openai` client sends (captured from its own requests) still passes."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from affinity_serve.app.errors import APIError
from affinity_serve.app.prompts import RequestKind
from tests.unit.app.test_hostile_inputs import http_request, ingress

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


async def _post(checkpoints, kind, body):
    ing, handle = ingress(checkpoints)
    r = await asyncio.wait_for(ing._http(kind, http_request(json.dumps(body).encode())), 5)
    return r, json.loads(r.body) if r.status_code != 200 or not body.get("stream") else None, handle


@pytest.mark.parametrize("kind,body,names,param", [
    (RequestKind.CHAT, {**CHAT, "functions": [{"name": "f"}]}, ["'functions'"], "functions"),
    (RequestKind.CHAT, {**CHAT, "audio": {}, "modalities": ["text"]}, ["'audio'", "'modalities'"], "audio"),
    (RequestKind.CHAT, {**CHAT, "reasoning_effort": "low"}, ["'reasoning_effort'"], "reasoning_effort"),
    (RequestKind.COMPLETION, {**COMPLETION, "suffix": "x"}, ["'suffix'"], "suffix"),
    (RequestKind.COMPLETION, {**COMPLETION, "use_beam_search": True}, ["'use_beam_search'"], "use_beam_search"),
    (RequestKind.COMPLETION, {**COMPLETION, "stream_options": {"include_usage": True, "include_obfuscation": 1}},
     ["'stream_options.include_obfuscation'"], "stream_options.include_obfuscation"),
    (RequestKind.CHAT, {**CHAT, "messages": [{"role": "user", "content": "x", "audio": 1}]},
     ["'messages.audio'"], "messages.audio"),
    (RequestKind.CHAT, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, ["'image_url'"], "messages.content.type"),
    (RequestKind.CHAT, {**CHAT, "messages": [{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": "y", "refusal": "no"}]},
     ["'messages.refusal'"], "messages.refusal"),
])
async def test_unimplemented_fields_are_a_400_naming_them(checkpoints, kind, body, names, param):
    r, body_out, handle = await _post(checkpoints, kind, body)
    err = body_out["error"]
    assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert all(n in err["message"] for n in names), err
    assert "generate" not in [name for name, _ in handle.calls]


async def test_the_python_handle_api_refuses_them_too(checkpoints):
    ing, handle = ingress(checkpoints)
    with pytest.raises(APIError) as e:
        await ing.chat({**CHAT, "parallel_tool_calls_x": True})
    assert e.value.status_code == 400 and e.value.param == "parallel_tool_calls_x"


def _captured(call) -> dict:
    """The JSON body the official client sends for `call(client)` (its transport answers nothing useful)."""
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(500, json={"error": {"message": "captured"}})

    client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with pytest.raises(openai.APIStatusError):
        call(client)
    return seen[0]


@pytest.mark.parametrize("kind,call", [
    (RequestKind.CHAT, lambda c: c.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": "bob"}],
        max_tokens=2, temperature=0.5, top_p=0.9, n=1, stop=["x"], seed=1, user="u", logprobs=True,
        top_logprobs=2, presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"5": 1})),
    (RequestKind.CHAT, lambda c: c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=2, stream=True, stream_options={"include_usage": True})),
    (RequestKind.CHAT, lambda c: c.chat.completions.create(        # an assistant message from a response
        model="m", max_tokens=2, messages=[{"role": "user", "content": "q"}, ChatCompletionMessage.model_validate(
            {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None,
             "function_call": None})])),
    (RequestKind.COMPLETION, lambda c: c.completions.create(
        model="m", prompt="hi", max_tokens=2, echo=False, logprobs=1, best_of=1, user="u",
        extra_body={"top_k": 5, "min_tokens": 1, "ignore_eos": True})),
])
async def test_what_the_openai_client_sends_still_passes(checkpoints, kind, call):
    body = _captured(call)
    body.pop("model")                      # the fake ingress serves its own model name
    r, _, handle = await _post(checkpoints, kind, body)
    assert r.status_code == 200, r.body
    assert "generate" in [name for name, _ in handle.calls]
