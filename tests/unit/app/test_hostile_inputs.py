"""Issue 33: hostile and unlucky traffic at the ingress, without Ray (local handles, the ingress's own
HTTP path): batched prompts, fuzzed fields, deep JSON, disconnects, health under load, the API key."""
from __future__ import annotations

import asyncio
import json

import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.app.fanout import merged_chunks, replica_requests
from affinity_serve.app.prompts import PreparedRequest, RequestKind
from affinity_serve.app.protocol import ReplicaChunk
from affinity_serve.engine import EngineLimits, SamplingParams
from tests.unit.app.conftest import LocalHandle

LIMITS = EngineLimits(max_model_len=64, vocab_size=10**6, max_kv_tokens=64)


class FakeReplica:
    """Streams `n_tokens` tokens per sequence; publishes LIMITS."""

    def __init__(self, n_tokens: int = 2):
        self.n_tokens = n_tokens
        self.generated: list = []

    async def generate(self, req):
        self.generated.append(req)
        for i in range(req.sampling_params.n):
            for t in range(self.n_tokens):
                yield ReplicaChunk("", i, "ab"[t % 2], [10 + t], "length" if t == self.n_tokens - 1 else None,
                                   num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")

    async def limits(self):
        return LIMITS

    async def debug_state(self):
        return {}


def ingress(checkpoints, replica=None, **serve):
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]},
                                    "serve": {"first_token_timeout_s": 0.5, **serve}})
    handle = LocalHandle(replica or FakeReplica())
    return Ingress(handle, cfg), handle


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


# ---------------------------------------------------------------- finding 2: fuzzed fields
@pytest.mark.parametrize("kind,body,param", [
    (RequestKind.COMPLETION, '{"prompt": "hi", "max_tokens": 2, "request_id": "\\ud800"}', "request_id"),
    (RequestKind.COMPLETION, '{"prompt": "\\udfff x", "max_tokens": 2}', "prompt"),
    (RequestKind.COMPLETION, '{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt.1"),
    (RequestKind.CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', "model"),
    (RequestKind.CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (RequestKind.CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "top_k": 18446744073709551616}', "top_k"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "max_tokens": 18446744073709551616}', "max_tokens"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "min_tokens": 4294967296}', "min_tokens"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "priority": -9223372036854775809}', "priority"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "stop_token_ids": [1, 18446744073709551616]}', "stop_token_ids.1"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "logit_bias": {"18446744073709551616": 1}}', "logit_bias"),
    (RequestKind.COMPLETION, '{"prompt": "hi", "temperature": NaN}', None),
    (RequestKind.COMPLETION, '{"prompt": "hi", "repetition_penalty": Infinity}', None),
    (RequestKind.COMPLETION, '{"prompt": "hi", "presence_penalty": -Infinity}', None),
    (RequestKind.CHAT, '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4.5}', "max_tokens"),
    (RequestKind.CHAT, '{"messages": [{"role": "user", "content": "x"}], "top_k": 2.5}', "top_k"),
    (RequestKind.CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', None),
])
async def test_hostile_fields_are_400s_with_the_openai_body(checkpoints, kind, body, param):
    ing, handle = ingress(checkpoints)
    r = await asyncio.wait_for(ing._http(kind, http_request(body.encode())), 5)
    err = json.loads(r.body)["error"]
    assert r.status_code == 400, err
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert "generate" not in [name for name, _ in handle.calls]


async def test_an_integral_float_is_the_integer_and_answers(checkpoints):
    """`max_tokens: 4.0` (as JavaScript clients send it) is 4 (it hung a chat request before); 4.5 is a 400."""
    ing, _ = ingress(checkpoints, FakeReplica(n_tokens=4))
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4.0, "stream": stream}
        r = await asyncio.wait_for(ing._http(RequestKind.CHAT, http_request(json.dumps(body).encode())), 5)
        assert r.status_code == 200
        if stream:
            events = [e async for e in r.body_iterator]
            assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events)


async def test_the_python_handle_api_refuses_surrogates_too(checkpoints):
    from affinity_serve.app.errors import APIError
    ing, _ = ingress(checkpoints)
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "request_id": "\ud800"})
    assert e.value.status_code == 400 and e.value.code == "invalid_unicode"


def test_an_error_message_holding_a_surrogate_is_still_a_json_body():
    from affinity_serve.app.errors import APIError
    from affinity_serve.app.http import error_response
    r = error_response(APIError("model '\ud800' not found", 404, code="model_not_found"))
    assert r.status_code == 404 and json.loads(r.body)["error"]["code"] == "model_not_found"


# A seeded schema fuzz over both endpoints: valid values mixed with hostile ones for every field.
def _hostile_values():
    from hypothesis import strategies as st
    big = st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1, 10**30])
    odd_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), 4.0, 4.5, 1e308, -0.0])
    text = st.text(max_size=12)
    surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc00" * 3])
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 40), big, odd_floats, text, surrogates)
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(text, inner, max_size=3)), max_leaves=8)


_COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                  "presence_penalty", "frequency_penalty", "logit_bias", "seed", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                  "priority", "cache_salt", "request_id", "return_token_ids"]
_FIELDS = {RequestKind.COMPLETION: _COMMON_FIELDS + ["prompt", "logprobs", "echo", "prompt_logprobs", "best_of"],
           RequestKind.CHAT: _COMMON_FIELDS + ["messages", "logprobs", "top_logprobs", "max_completion_tokens"]}


def _bodies(kind):
    from hypothesis import strategies as st
    value = _hostile_values()
    base = ({"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 100), min_size=1, max_size=5),
                                 st.lists(st.lists(st.integers(-1, 2**33), max_size=4), max_size=3), value)}
            if kind is RequestKind.COMPLETION else
            {"messages": st.one_of(st.lists(st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                 "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
                     {"type": st.just("text"), "text": value}), max_size=2), value)}), max_size=3), value)})
    optional = {f: st.one_of(value, st.integers(0, 8), st.floats(0, 2)) for f in _FIELDS[kind] if f not in base}
    return st.fixed_dictionaries(base, optional=optional)


@pytest.mark.parametrize("kind", [RequestKind.COMPLETION, RequestKind.CHAT])
def test_schema_fuzz_never_a_5xx_nor_a_hang(checkpoints, kind):
    from hypothesis import HealthCheck, given, seed, settings

    ing, _ = ingress(checkpoints, FakeReplica(n_tokens=2))

    async def one(body: dict) -> None:
        raw = json.dumps(body, allow_nan=True).encode()        # NaN/Infinity literals, \\ud800 escapes
        r = await ing._http(kind, http_request(raw))
        assert r.status_code < 500, (body, getattr(r, "body", b""))
        if r.status_code == 200 and hasattr(r, "body_iterator"):
            events = [e async for e in r.body_iterator]
            assert events[-1] == "data: [DONE]\n\n"
            assert not any('"server_error"' in e for e in events), (body, events)
        elif r.status_code >= 400:
            assert set(json.loads(r.body)["error"]) == {"message", "type", "param", "code"}

    @seed(33)
    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(_bodies(kind))
    def check(body):
        asyncio.run(asyncio.wait_for(one(body), 5))        # a hang fails as a TimeoutError

    check()


# ---------------------------------------------------------------- finding 12: deep JSON
@pytest.mark.parametrize("kind,raw", [
    (RequestKind.CHAT, b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": ' + b"[" * 2000
     + b"]" * 2000 + b"}"),
    (RequestKind.COMPLETION, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    (RequestKind.COMPLETION, b'{"prompt": "hi", "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}"),
])
async def test_deeply_nested_json_is_a_400(checkpoints, kind, raw):
    ing, handle = ingress(checkpoints)
    r = await asyncio.wait_for(ing._http(kind, http_request(raw)), 5)
    err = json.loads(r.body)["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and "nested deeper than 32" in err["message"]
    assert "generate" not in [name for name, _ in handle.calls]


async def test_nesting_is_bounded_for_python_callers_too_and_the_bound_is_configurable(checkpoints):
    from affinity_serve.app.errors import APIError
    ing, _ = ingress(checkpoints, max_json_depth=4)
    nested: dict = {"prompt": "hi"}
    for _ in range(5):
        nested = {"x": nested}
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "extra": nested})
    assert e.value.status_code == 400 and "nested deeper than 4" in e.value.message
    ok = await ing._http(RequestKind.COMPLETION,
                         http_request(b'{"prompt": [[1, 2]], "max_tokens": 1, "logit_bias": {"5": 1}}'))
    assert ok.status_code == 200


# ---------------------------------------------------------------- finding 4: client disconnects
async def test_a_client_disconnect_mid_body_is_a_499_logged_without_a_traceback(checkpoints, app_logs):
    from starlette.requests import Request
    ing, handle = ingress(checkpoints)
    codes: list[int] = []
    ing.metrics.record_http = lambda route, status: codes.append(status)
    parts = [{"type": "http.request", "body": b'{"prompt": "hel', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return parts.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
    for _ in range(3):
        parts[:] = [{"type": "http.request", "body": b'{"prompt": "hel', "more_body": True},
                    {"type": "http.disconnect"}]
        r = await ing._http(RequestKind.COMPLETION, Request(scope, receive))
        assert r.status_code == 499 and json.loads(r.body)["error"]["code"] == "client_closed_request"
    assert codes == [499] * 3                                     # counted as client closes, not 5xx
    failures = [rec for rec in app_logs.records if rec.getMessage() == "request failed"]
    assert len(failures) == 3 and all(rec.levelname == "INFO" and not rec.exc_info for rec in failures)
    assert "generate" not in [name for name, _ in handle.calls]


def test_a_cancelled_replica_task_is_a_cancellation_not_a_server_error():
    from ray.exceptions import TaskCancelledError

    from affinity_serve.app.errors import to_api_error
    err = to_api_error(TaskCancelledError())
    assert (err.status_code, err.code) == (499, "cancelled")


# ---------------------------------------------------------------- finding 6: health from state
async def test_health_answers_from_state_while_every_replica_slot_is_busy(checkpoints):
    """Replicas whose request slots are all taken never answer a call; /health must not need one."""
    release = asyncio.Event()

    class Busy(FakeReplica):
        async def debug_state(self):
            await asyncio.sleep(3600)

        async def limits(self):
            await release.wait()
            return LIMITS

    ing, handle = ingress(checkpoints, Busy())
    # wait_for only guards against a hang (debug_state never answers); what must hold is that /health asks
    # the replicas for nothing but their limits, checked below from the calls
    r = await asyncio.wait_for(ing.http_health(), 30)
    assert r.status_code == 503 and json.loads(r.body)["error"]["code"] == "starting"
    release.set()                                  # the model loaded: its limits arrive (asked once)
    await asyncio.sleep(0.05)
    for _ in range(20):
        r = await asyncio.wait_for(ing.http_health(), 30)
        assert r.status_code == 200
    assert json.loads(r.body)["status"] == "ok"
    assert {name for name, _ in handle.calls} == {"limits"}       # asked until answered, then never again


async def test_metrics_is_a_503_while_the_apps_hub_cannot_be_asked(checkpoints, monkeypatch, app_logs):
    """...logged with the scrape's request id, and not counted as an API response (a 200 scrape is not either:
    docs/observability.md, /metrics is not counted)."""
    from affinity_serve.app.metrics_hub import MetricsUnavailable

    ing, _ = ingress(checkpoints)
    counted = []
    ing.metrics.record_http = lambda route, status: counted.append((route, status))

    async def unreachable(*a, **k):
        raise MetricsUnavailable("the metrics hub of app 'affinity' is unreachable (RayActorError)")
    monkeypatch.setattr(ing.metrics_exporter, "render", unreachable)
    r = await ing.http_metrics(http_request(b"", path="/metrics", method="GET", headers={"x-request-id": "scrape-7"}))
    err = json.loads(r.body)["error"]
    assert (r.status_code, err["type"], err["code"]) == (503, "service_unavailable", "metrics_unavailable")
    assert "unreachable" in err["message"] and r.headers["retry-after"] == "1"
    assert counted == []
    [line] = [rec for rec in app_logs.records if getattr(rec, "code", None) == "metrics_unavailable"]
    assert _request_id_of(line) == "scrape-7"


def _request_id_of(record) -> str | None:
    from affinity_serve.observability.logs import JsonFormatter
    return json.loads(JsonFormatter().format(record)).get("request_id")


@pytest.mark.parametrize("route,body", [("http_tokenize", {"prompt": 5}), ("http_detokenize", {"tokens": [10**6]})])
async def test_a_failed_token_route_logs_the_clients_request_id(checkpoints, app_logs, route, body):
    ing, _ = ingress(checkpoints)
    r = await getattr(ing, route)(http_request(json.dumps(body).encode(), path="/" + route[5:],
                                               headers={"x-request-id": f"tok-{route}"}))
    assert r.status_code == 400
    [line] = [rec for rec in app_logs.records if getattr(rec, "status", None) == 400]
    assert _request_id_of(line) == f"tok-{route}"


async def test_a_failed_model_lookup_logs_the_clients_request_id(checkpoints, app_logs):
    ing, _ = ingress(checkpoints)
    r = await ing.http_model("nope", http_request(b"", path="/v1/models/nope", method="GET",
                                                  headers={"x-request-id": "card-1"}))
    assert r.status_code == 404
    [line] = [rec for rec in app_logs.records if getattr(rec, "status", None) == 404]
    assert _request_id_of(line) == "card-1"


async def test_health_is_503_when_the_router_sees_no_replica_unless_scaled_to_zero(checkpoints, monkeypatch):
    ing, _ = ingress(checkpoints)
    await ing.serving.limits()
    monkeypatch.setattr(ing.serving, "_num_replicas", lambda: 0)
    r = await ing.http_health()
    assert r.status_code == 503 and json.loads(r.body)["error"]["code"] == "no_replica_running"
    monkeypatch.setattr(ing.serving, "_num_replicas", lambda: 2)
    r = await ing.http_health()
    assert r.status_code == 200 and json.loads(r.body)["num_replicas"] == 2
    ing0, _ = ingress(checkpoints)
    ing0.cfg = AppConfig.model_validate({**ing0.cfg.model_dump(),
                                         "autoscaling": {"enabled": True, "min_replicas": 0}})
    await ing0.serving.limits()
    monkeypatch.setattr(ing0.serving, "_num_replicas", lambda: 0)
    r = await ing0.http_health()
    assert r.status_code == 200 and json.loads(r.body)["status"] == "scaled_to_zero"


# ---------------------------------------------------------------- finding 14: the ingress's side of the drain
async def test_drain_refuses_new_requests_counts_streams_and_ends_them_on_request(checkpoints, monkeypatch):
    from types import SimpleNamespace

    from ray import serve

    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="ing-1")))

    class Slow(FakeReplica):
        async def generate(self, req):
            for t in range(1000):
                await asyncio.sleep(0.01)
                yield ReplicaChunk("", 0, "a", [10 + t % 5], None, replica_id="r1")

    ing, _ = ingress(checkpoints, Slow(), first_token_timeout_s=5)
    body = json.dumps({"prompt": [[1, 2]], "max_tokens": 60, "stream": True}).encode()
    r = await ing._http(RequestKind.COMPLETION, http_request(body))
    assert r.status_code == 200 and ing.num_in_flight == 1
    events: list[str] = []

    async def consume():
        async for e in r.body_iterator:
            events.append(e)
    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    assert await ing.drain() == {"ingress_replica_id": "ing-1", "num_in_flight": 1}
    late = await ing._http(RequestKind.COMPLETION, http_request(b'{"prompt": "x"}'))
    assert late.status_code == 503 and json.loads(late.body)["error"]["code"] == "draining"
    assert late.headers["connection"] == "close"
    assert json.loads((await ing.http_health()).body)["error"]["code"] == "draining"
    assert (await ing.drain(end_streams=True))["num_in_flight"] == 1
    await asyncio.wait_for(task, 2)
    assert events[-1] == "data: [DONE]\n\n" and json.loads(events[-2][6:])["error"]["code"] == "server_shutdown"
    assert ing.num_in_flight == 0 and (await ing.drain())["num_in_flight"] == 0


# ---------------------------------------------------------------- finding 8 (part): route before the stream starts
@pytest.mark.parametrize("kind,body", [
    (RequestKind.CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}),
    (RequestKind.COMPLETION, {"prompt": "x", "max_tokens": 2, "stream": True}),
])
async def test_an_overloaded_stream_is_a_429_status_not_an_in_band_error(checkpoints, kind, body):
    """Chat streams sent the role chunk before routing: a 200 was committed and the 429 became an event."""
    from ray.serve.exceptions import BackPressureError

    class Full(FakeReplica):
        async def generate(self, req):
            raise BackPressureError(num_queued_requests=3, max_queued_requests=2)
            yield  # pragma: no cover

    ing, _ = ingress(checkpoints, Full())
    r = await ing._http(kind, http_request(json.dumps(body).encode()))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert json.loads(r.body)["error"]["code"] == "overloaded"


# ---------------------------------------------------------------- tokenizing off the event loop
async def test_a_slow_tokenization_does_not_stall_the_event_loop(checkpoints):
    """A prompt of megabytes takes the tokenizer seconds: other requests' streams must go on meanwhile."""
    import time as _time

    ing, _ = ingress(checkpoints)
    real = ing.serving.tokenizer

    class Slow:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text, *a, **kw):
            _time.sleep(0.5)                      # holds its thread, as a long encode does
            return real.encode(text, *a, **kw)

    ing.serving.tokenizer = Slow()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1
    t = asyncio.create_task(ticker())
    r = await ing._http(RequestKind.COMPLETION, http_request(b'{"prompt": "hello there", "max_tokens": 2}'))
    t.cancel()
    assert r.status_code == 200 and ticks >= 10, ticks


async def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(checkpoints):
    """No Content-Length (chunked): the ingress stops reading at the limit instead of buffering it all."""
    from starlette.requests import Request
    ing, _ = ingress(checkpoints, max_request_body_bytes=4096)
    sent = 0

    async def receive():
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": b"x" * 1024, "more_body": sent < 100_000}   # ~100 MB

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]}
    r = await ing._http(RequestKind.COMPLETION, Request(scope, receive))
    assert r.status_code == 413 and json.loads(r.body)["error"]["code"] == "request_too_large"
    assert sent <= 5


async def test_health_at_zero_before_any_replica_answered_starts_none(checkpoints, monkeypatch):
    """Scaled to zero (or deployed with initial_replicas 0) and no replica has answered yet: /health asked a
    replica for the engine's limits, which started one (a load balancer's probe undid the scale to zero) and
    answered 503 `starting` meanwhile. Now it answers 200 `scaled_to_zero` and calls nothing."""
    ing, handle = ingress(checkpoints)
    # deployed with min_replicas 1: its replica is loading, so the probe asks (and says "starting" meanwhile)
    ing.cfg = AppConfig.model_validate({**ing.cfg.model_dump(), "autoscaling": {"enabled": True, "min_replicas": 0}})
    monkeypatch.setattr(ing.serving, "_num_replicas", lambda: None)        # no router yet
    assert not ing._starts_at_zero()
    ing.cfg = AppConfig.model_validate({**ing.cfg.model_dump(), "autoscaling": {
        "enabled": True, "min_replicas": 0, "initial_replicas": 0}})
    r = await ing.http_health()
    assert r.status_code == 200 and json.loads(r.body)["status"] == "scaled_to_zero"
    assert handle.calls == []
    monkeypatch.setattr(ing.serving, "_num_replicas", lambda: 1)           # a replica runs: its limits are asked
    r = await ing.http_health()
    assert r.status_code == 200 and json.loads(r.body)["status"] == "ok"
    assert {name for name, _ in handle.calls} == {"limits"}


@pytest.mark.parametrize("retry_after_s, header", [(1, "4"), (7, "7")])
async def test_an_admission_refusal_over_http_says_to_retry_after_the_predicted_excess(checkpoints, retry_after_s,
                                                                                      header):
    """429 queue_full: Retry-After is the predicted wait's excess over serve.max_queue_wait_s (13.2 - 10 s: 4),
    or serve.retry_after_s where that is longer (the ingress's failure exit set it for every 429 before)."""
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.routing import debug
    from tests.unit.app.test_admission import FakeRouter, NamedHandle

    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]},
                                    "serve": {"max_queue_wait_s": 10.0, "retry_after_s": retry_after_s}})
    handle = NamedHandle(FakeReplica(), f"retry-after-{retry_after_s}")
    ing = Ingress(handle, cfg)
    router = FakeRouter(wait=13.2)
    debug.register(handle.app_name, handle.deployment_name, router)
    r = await ing._http(RequestKind.COMPLETION, http_request(b'{"prompt": [1, 2, 3], "max_tokens": 2}'))
    assert r.status_code == 429 and json.loads(r.body)["error"]["code"] == "queue_full"
    assert r.headers["retry-after"] == header
