"""Issue 33.3: Serve's proxy (uvicorn with httptools) read a 64 MB header block in full before its 431. With
the guard its parser answers 431 once a header block passes max_header_bytes + slack, long before the end."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import pytest

pytest.importorskip("httptools")

from affinity_serve.app.http import HEADER_GUARD_SLACK_BYTES, install_header_guard  # noqa: E402
from tests.ports import free_port


async def _echo_app(scope, receive, send):
    assert scope["type"] == "http"
    size = 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    body = json.dumps({"body_bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                   (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    import uvicorn
    install_header_guard(8192)
    port = free_port()
    config = uvicorn.Config(_echo_app, host="127.0.0.1", port=port, http="httptools", lifespan="off",
                            log_level="critical")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    thread.join(10)


def _request(port: int, head_extra: bytes, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + head_extra
                  + b"\r\n" + body)
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_a_huge_header_block_is_refused_before_it_is_read(server):
    chunk = b"x-pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
        try:
            while sent < 64 * 2**20 and not answer:
                s.sendall(chunk)
                sent += len(chunk)
                if select.select([s], [], [], 0.01)[0]:
                    answer = s.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            answer = answer or s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    assert b"connection: close" in answer.lower()
    assert sent <= 8192 + HEADER_GUARD_SLACK_BYTES + 8 * len(chunk), sent       # not 64 MB


def test_ordinary_requests_pass_the_guard(server):
    """Headers under the limit (the middleware checks them exactly) and a large body sent at once with them:
    the body's bytes never count as header bytes."""
    r = _request(server, b"x-ok: " + b"b" * 7000 + b"\r\n")
    assert r.startswith(b"HTTP/1.1 200") and json.loads(r.split(b"\r\n\r\n", 1)[1]) == {"body_bytes": 0}
    body = b"{" + b" " * (2 * 2**20) + b"}"
    r = _request(server, b"content-type: application/json\r\n", body)
    assert r.startswith(b"HTTP/1.1 200") and json.loads(r.split(b"\r\n\r\n", 1)[1]) == {"body_bytes": len(body)}
