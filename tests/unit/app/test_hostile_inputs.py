"""Issue 33: hostile and unlucky traffic at the ingress, without Ray (local handles, the ingress's own
HTTP path): batched prompts, fuzzed fields, deep JSON, disconnects, health under load, the API key."""
from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AppConfig
from app.fanout import merged_chunks, replica_requests
from app.prompts import PreparedRequest, RequestKind
from app.protocol import ReplicaChunk
from engine import EngineLimits, SamplingParams
from tests.unit.app.conftest import LocalHandle

LIMITS = EngineLimits(max_model_len=64, vocab_size=10**6, max_kv_tokens=64)


class FakeReplica:
    """Streams `n_tokens` tokens per sequence; publishes LIMITS."""

    def __init__(self, n_tokens: int = 2):
        self.n_tokens = n_tokens
        self.generated: list = []

    async def generate(self, req):
        self.generated.append(req)
        for i in range(req.params.n):
            for t in range(self.n_tokens):
                yield ReplicaChunk(i, "ab"[t % 2], [10 + t], "length" if t == self.n_tokens - 1 else None,
                                   num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")

    async def limits(self):
        return LIMITS

    async def debug_state(self):
        return {}


def ingress(checkpoints, replica=None, **serve):
    from app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]},
                                    "serve": {"first_token_timeout_s": 0.5, **serve}})
    handle = LocalHandle(replica or FakeReplica())
    return Ingress(handle, cfg.model_dump()), handle


def http_request(body: bytes, path: str = "/v1/completions", headers: dict[str, str] | None = None,
                 chunks: list[bytes] | None = None, method: str = "POST"):
    """A Starlette request whose body arrives as `chunks` (default: `body` at once)."""
    from starlette.requests import Request
    hdrs = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    parts = list(chunks if chunks is not None else [body])

    async def receive():
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await asyncio.sleep(3600)       # the client stalls (or has gone: Starlette asks again after the body)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": path, "headers": hdrs, "query_string": b""}
    return Request(scope, receive)


def _prepared(num_prompts: int) -> PreparedRequest:
    return PreparedRequest(RequestKind.COMPLETION, "client-id", "m", [[1, 2]] * num_prompts, [None] * num_prompts,
                           SamplingParams(n=1), 1, logprobs=None, prompt_logprobs=None, echo=False,
                           echo_only=False, stream_usage=False, priority=0, cache_salt=None)


# ---------------------------------------------------------------- finding 1: batched prompts
async def test_each_prompt_of_a_batch_is_its_own_serve_call():
    """Inside a Serve request every handle call inherits the request's internal id, and Ray 2.60's router
    indexes waiting calls by it: calls sharing it are never all assigned (the fleet hung). Each prompt's call
    must carry its own internal id (Serve's parent-child bookkeeping is done by the fan-out itself)."""
    from ray.serve import context as serve_context

    seen: list[str] = []

    class Recording(FakeReplica):
        def generate(self, req):
            seen.append(serve_context._get_serve_request_context()._internal_request_id)
            return super().generate(req)

    serve_context._set_request_context(request_id="client", _internal_request_id="parent-internal-id")
    try:
        got = [i async for i, _ in merged_chunks(LocalHandle(Recording()), replica_requests(_prepared(8), {}), 5)]
    finally:
        serve_context._unset_request_context()
    assert sorted(set(got)) == list(range(8))
    assert len(seen) == 8 and len(set(seen)) == 8 and "parent-internal-id" not in seen
    assert serve_context._get_serve_request_context()._internal_request_id == ""     # the caller's is untouched


async def test_a_batch_over_max_prompts_per_request_is_a_400_before_anything_runs(checkpoints):
    ing, handle = ingress(checkpoints, max_prompts_per_request=4)
    ok = await ing._http(RequestKind.COMPLETION,
                         http_request(json.dumps({"prompt": [[1, 2]] * 4, "max_tokens": 2}).encode()))
    assert ok.status_code == 200 and len(json.loads(ok.body)["choices"]) == 4
    for prompt in ([[1, 2]] * 5, ["a"] * 5):
        r = await ing._http(RequestKind.COMPLETION,
                            http_request(json.dumps({"prompt": prompt, "max_tokens": 2}).encode()))
        body = json.loads(r.body)
        assert r.status_code == 400 and body["error"]["code"] == "too_many_prompts", body
        assert body["error"]["param"] == "prompt" and "at most 4" in body["error"]["message"]
    assert [name for name, _ in handle.calls].count("generate") == 4          # only the allowed batch ran
