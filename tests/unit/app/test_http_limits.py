"""Issue 33.3 and 33.5: the HTTP layer's limits, enforced in Serve's proxy by HTTPLimitsMiddleware: client
hint headers removed, header size, body read timeout and size, requests in flight per client and in all.
ASGI-level checks, then the middleware under a real uvicorn server (httptools, as Serve's proxy runs it) on
127.0.0.1 with stalling raw-socket clients."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from affinity_serve.app.http import HTTPLimitsMiddleware
from tests.ports import free_port


class Inner:
    """The proxy's stand-in: reads the whole body, answers 200 with what it saw; counts its concurrency."""

    def __init__(self, hold_s: float = 0.0):
        self.hold_s = hold_s
        self.scopes: list[dict] = []
        self.active = self.max_active = 0

    async def __call__(self, scope, receive, send):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            self.scopes.append(scope)
            body = b""
            while True:
                m = await receive()
                body += m.get("body", b"")
                if not m.get("more_body"):
                    break
            await asyncio.sleep(self.hold_s)
            out = json.dumps({"len": len(body)}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": out})
        finally:
            self.active -= 1


async def call(mw, *, headers=(), messages=None, path="/v1/completions", client=("10.0.0.1", 5)):
    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers), "client": client,
             "query_string": b""}
    queue = list(messages if messages is not None else [{"type": "http.request", "body": b"{}", "more_body": False}])
    sent: list[dict] = []

    async def receive():
        if queue:
            m = queue.pop(0)
            if "delay" in m:
                await asyncio.sleep(m["delay"])
            return m
        await asyncio.sleep(3600)

    async def send(m):
        sent.append(m)

    await mw(scope, receive, send)
    status = sent[0]["status"] if sent else None
    body = json.loads(sent[1]["body"]) if len(sent) > 1 else None
    return status, body, dict(sent[0]["headers"]) if sent else {}


async def test_clients_cannot_switch_off_abort_on_disconnect_or_the_timeout():
    inner = Inner()
    mw = HTTPLimitsMiddleware(inner)
    status, _, _ = await call(mw, headers=[(b"x-request-disconnect-disabled", b"?1"),
                                           (b"X-Request-Timeout-Seconds", b"0"), (b"x-other", b"kept")])
    assert status == 200
    names = [k.lower() for k, _ in inner.scopes[0]["headers"]]
    assert b"x-request-disconnect-disabled" not in names and b"x-request-timeout-seconds" not in names
    assert b"x-other" in names


async def test_large_headers_are_a_431_before_the_app():
    inner = Inner()
    mw = HTTPLimitsMiddleware(inner, max_header_bytes=2048)
    status, body, _ = await call(mw, headers=[(b"authorization", b"x" * 4096)])
    assert status == 431 and body["error"]["code"] == "headers_too_large" and not inner.scopes


async def test_a_stalled_body_is_a_408_and_never_reaches_the_app():
    inner = Inner()
    mw = HTTPLimitsMiddleware(inner, body_read_timeout_s=0.2)
    t = time.monotonic()
    status, body, headers = await call(mw, messages=[{"type": "http.request", "body": b'{"a"', "more_body": True}])
    assert status == 408 and body["error"]["code"] == "body_read_timeout" and headers[b"connection"] == b"close"
    assert time.monotonic() - t < 10 and not inner.scopes          # bounded (a stalled body is forever)


async def test_a_body_over_the_limit_is_a_413_while_it_is_read():
    inner = Inner()
    mw = HTTPLimitsMiddleware(inner, max_body_bytes=1000)
    chunks = [{"type": "http.request", "body": b"x" * 600, "more_body": True}] * 2
    chunks += [{"type": "http.request", "body": b"x" * 10**6, "more_body": False, "delay": 3600}]   # never read
    status, body, _ = await call(mw, messages=chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large" and not inner.scopes


async def test_each_refusal_is_logged_in_the_proxys_log_with_its_path_and_request_id():
    """The ingress never sees these: without this line they were in no log and no counter (acceptance)."""
    import logging

    from affinity_serve.app import errors
    from affinity_serve.app.http import proxy_logger
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    proxy_logger.addHandler(handler)
    level, proxy_logger.level = proxy_logger.level, logging.DEBUG
    errors._last_warning.clear()
    try:
        mw = HTTPLimitsMiddleware(Inner(), max_body_bytes=10)
        status, _, _ = await call(mw, headers=[(b"x-request-id", b"big-1")],
                                  messages=[{"type": "http.request", "body": b"x" * 11, "more_body": False}])
        assert status == 413
        mw = HTTPLimitsMiddleware(Inner(), max_connections=0)
        for _ in range(3):
            assert (await call(mw))[0] == 503
    finally:
        proxy_logger.removeHandler(handler)
        proxy_logger.level = level
    big = records[0]
    assert big.levelname == "INFO" and big.request_id == "big-1" and big.route == "/v1/completions"
    assert "413 request_too_large" in big.getMessage() and "big-1" in big.getMessage()
    # 503s: one WARNING, the others at DEBUG (counted by the next WARNING), as the ingress logs its own
    assert [r.levelname for r in records[1:]] == ["WARNING", "DEBUG", "DEBUG"]
    assert "503 too_many_connections" in records[1].getMessage()


async def test_a_body_in_chunks_is_replayed_whole():
    inner = Inner()
    mw = HTTPLimitsMiddleware(inner)
    chunks = [{"type": "http.request", "body": b"ab", "more_body": True},
              {"type": "http.request", "body": b"cd", "more_body": True, "delay": 0.05},
              {"type": "http.request", "body": b"e", "more_body": False}]
    status, body, _ = await call(mw, messages=chunks)
    assert status == 200 and body == {"len": 5}


async def test_requests_in_flight_are_bounded_per_client_and_in_all_but_not_health():
    inner = Inner(hold_s=0.3)
    mw = HTTPLimitsMiddleware(inner, max_connections=3, max_connections_per_client=2, retry_after_s=4)
    a = ("10.0.0.1", 1)
    first = [asyncio.create_task(call(mw, client=a)) for _ in range(2)]
    await asyncio.sleep(0.05)
    status, body, headers = await call(mw, client=a)
    assert status == 429 and body["error"]["code"] == "too_many_connections" and headers[b"retry-after"] == b"4"
    other = asyncio.create_task(call(mw, client=("10.0.0.2", 1)))
    await asyncio.sleep(0.05)
    status, body, _ = await call(mw, client=("10.0.0.3", 1))
    assert status == 503 and body["error"]["code"] == "too_many_connections"
    assert (await call(mw, client=a, path="/health"))[0] == 200             # probes are never refused
    assert [s for s, _, _ in await asyncio.gather(*first, other)] == [200, 200, 200]
    assert mw.num_in_flight == 0 and mw.num_in_flight_by_client == {}
    assert (await call(mw, client=a))[0] == 200


# ---------------------------------------------------------------- under a real server
@pytest.fixture
def server():
    """uvicorn (httptools, as Serve's proxy) on 127.0.0.1 serving the middleware over an app with 4 slots."""
    import uvicorn

    inner = Inner(hold_s=0.05)
    slots = asyncio.Semaphore(4)

    async def limited(scope, receive, send):       # like an ingress with max_ongoing_requests=4
        async with slots:
            await inner(scope, receive, send)

    app = HTTPLimitsMiddleware(limited, body_read_timeout_s=4.0, max_connections_per_client=1000)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", lifespan="off",
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port, inner
    srv.should_exit = True
    thread.join(5)


def _stalled(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100\r\n\r\n{\"prompt\"")
    return s


def test_stalled_bodies_do_not_starve_normal_requests(server):
    import httpx

    port, inner = server
    stalled = [_stalled(port) for _ in range(40)]        # 10x the app's slots
    try:
        time.sleep(0.2)
        t = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b'{"prompt": "hi"}', timeout=5)
        # starved, it would wait for the stalled bodies' 408s at the body timeout (4 s)
        assert r.status_code == 200 and time.monotonic() - t < 3.0
        assert inner.max_active <= 1                     # no stalled client ever held a slot
        answers = []
        for s in stalled:                                # each gets its 408 after the body timeout
            s.settimeout(5)
            answers.append(s.recv(4096).split(b"\r\n", 1)[0])
        assert set(answers) == {b"HTTP/1.1 408 Request Timeout"}
    finally:
        for s in stalled:
            s.close()


def test_the_proxy_callback_builds_the_middleware_from_the_environment(monkeypatch):
    """Ray 2.60's proxy takes middlewares only from RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH."""
    from ray.serve._private.utils import call_function_from_import_path

    from affinity_serve.app.builder import http_limits_env
    from affinity_serve.app.config import AppConfig
    env = http_limits_env(AppConfig.model_validate({"serve": {"body_read_timeout_s": 3, "max_connections": 7}}))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (mw,) = call_function_from_import_path(env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"])
    built = mw.cls(Inner(), *mw.args, **mw.kwargs)
    assert isinstance(built, HTTPLimitsMiddleware)
    assert (built.body_read_timeout_s, built.max_connections, built.max_header_bytes) == (3, 7, 16 * 1024)
