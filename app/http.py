"""HTTP plumbing: for the ingress routes the API-key check, reading a JSON body, SSE framing and error
responses; for Serve's HTTP proxy the middleware that enforces the HTTP layer's limits (docs/limits.md)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from affinity_serve.app.errors import APIError, log_failure

#: the proxy's refusals (HTTPLimitsMiddleware) go to Serve's proxy log: a child of Serve's logger, whose handlers
#: the proxy process has (our JSON logging is set up in the app's replicas, not in Serve's proxy)
proxy_logger = logging.getLogger("ray.serve.affinity_http_limits")


def error_response(err: APIError) -> JSONResponse:
    """The OpenAI error body with its status (and Retry-After for 429/503). Text that cannot be sent as
    UTF-8 (a lone surrogate a client sent, echoed in a message) is replaced, never a second failure."""
    headers = {}
    if err.retry_after_s is not None and err.status_code in (429, 503):
        headers["Retry-After"] = str(err.retry_after_s)
    body = {"error": {k: _utf8(v) for k, v in err.body()["error"].items()}}
    return JSONResponse(body, status_code=err.status_code, headers=headers)


def _utf8(value: Any) -> Any:
    if isinstance(value, str) and not value.isascii():
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


@dataclass(frozen=True, slots=True)
class APIKeyDigest:
    """What the ingress keeps of the API key: a salted SHA-256, never the key (Serve stores a deployment's
    arguments in its controller and the GCS, which anyone reaching Ray could read). Use a long random key:
    a short one could be guessed from the digest."""

    salt: bytes
    digest: bytes

    @classmethod
    def of(cls, key: str) -> "APIKeyDigest":
        salt = os.urandom(16)
        return cls(salt, hashlib.sha256(salt + key.encode()).digest())

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(self.digest, hashlib.sha256(self.salt + presented.encode()).digest())

    def __repr__(self) -> str:
        return "APIKeyDigest(...)"


def check_api_key(request: Request, api_key: APIKeyDigest | None) -> None:
    """Raise a 401 unless the request carries `Authorization: Bearer <key>` (when a key is configured)."""
    if api_key is None:
        return
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not api_key.matches(presented.strip()):
        raise APIError("missing or invalid API key (send 'Authorization: Bearer <key>')", 401,
                       "authentication_error", None, "invalid_api_key")


def is_json_media_type(content_type: str | None) -> bool:
    """application/json or an `application/*+json` type, parameters allowed. A missing Content-Type counts
    as JSON (hand-written HTTP clients often send none); every other type, form-encoded included (what
    `curl -d` sends unless told `-H 'Content-Type: application/json'`), does not."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json_body(request: Request, max_bytes: int, max_depth: int = 32) -> dict[str, Any]:
    """The body as a JSON object: 415 for a non-JSON Content-Type, 413 when too large, 400 when malformed,
    nested deeper than `max_depth`, holding NaN/Infinity or a string that is not valid Unicode (a lone
    surrogate escape such as "\\ud800", which would fail later in logs, the tokenizer or the response)."""
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        raise APIError(f"unsupported Content-Type '{content_type}': send the body as JSON with "
                       "'Content-Type: application/json'", 415, "invalid_request_error", None,
                       "unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():          # a chunked body has no length: count while reading
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    del chunks
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}", 400, "invalid_request_error", None,
                       "invalid_json") from None
    except RecursionError:            # the parser's own bound (about 1,000 levels), below ours or not
        raise _too_deep(max_depth) from None
    finally:
        del raw                       # a large body is not kept alive by this frame (a traceback, a 400)
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", 400, "invalid_request_error", None, "invalid_json")
    check_json_value(body, max_depth)
    return body


def _no_constant(name: str) -> Any:
    raise APIError(f"request body is not valid JSON: {name} is not a JSON number", 400, "invalid_request_error",
                   None, "invalid_json")


def check_json_value(value: Any, max_depth: int) -> None:
    """400 unless `value` (parsed JSON, or the dict a Python caller passed) nests at most `max_depth` levels
    and every string (keys too) is valid Unicode. Iterative: depth cannot exhaust the stack here."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, item in items:
            if isinstance(k, str):
                _check_text(k, path)
            stack.append((item, depth + 1, f"{path}.{k}" if path else str(k)))


def _check_text(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"invalid value for '{path or 'body'}': the string holds a lone UTF-16 surrogate "
                       "(not valid Unicode)", 400, "invalid_request_error", path or None,
                       "invalid_unicode") from None


def _too_deep(max_depth: int) -> APIError:
    return APIError(f"request body is nested deeper than {max_depth} levels (serve.max_json_depth)", 400,
                    "invalid_request_error", None, "invalid_json")


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"request body is larger than {max_bytes} bytes", 413, "invalid_request_error", None,
                    "request_too_large")


async def sse(first: dict, rest: AsyncIterator[dict], on_error: Callable[[BaseException], APIError],
              stop: asyncio.Event | None = None) -> AsyncIterator[str]:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`. A failure after the first
    byte cannot change the status any more: it is sent in-band as an error object (from `on_error`). Once
    `stop` is set (the server ends its drain), the stream ends the same way: `rest` is closed (its replica
    calls cancelled), an error event says the server is shutting down, then `data: [DONE]`."""
    yield f"data: {json.dumps(first)}\n\n"
    it = rest.__aiter__()
    try:
        while True:
            try:
                chunk = await _next_unless_stopped(it, stop)
            except StopAsyncIteration:
                break
            yield f"data: {json.dumps(chunk)}\n\n"
    except _Stopped:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
        yield f"data: {json.dumps(SHUTTING_DOWN.body())}\n\n"
    except Exception as e:
        yield f"data: {json.dumps(on_error(e).body())}\n\n"
    yield "data: [DONE]\n\n"


#: what a stream still running when the server's drain time is up ends with (in-band: the status was sent)
SHUTTING_DOWN = APIError("the server is shutting down and ended this stream; retry the request", 503,
                         "service_unavailable", None, "server_shutdown", retry_after_s=1)


class _Stopped(Exception):
    pass


async def _next_unless_stopped(it: Any, stop: asyncio.Event | None) -> Any:
    if stop is None:
        return await it.__anext__()
    if stop.is_set():
        raise _Stopped
    nxt = asyncio.ensure_future(it.__anext__())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if nxt.done():
        return nxt.result()
    nxt.cancel()
    try:
        await nxt
    except (asyncio.CancelledError, StopAsyncIteration):
        pass
    raise _Stopped


# ---------------------------------------------------------------- the HTTP layer's own limits (Serve's proxy)
#: Ray Serve headers that let a client change how the proxy treats its request: `?1` keeps a request running
#: after its client went away (its KV blocks held for nobody), a timeout <= 0 disables the request timeout.
#: They are for a trusted front proxy; a client must not set them, so they are removed (issue 33).
CLIENT_HINT_HEADERS = frozenset({b"x-request-disconnect-disabled", b"x-request-timeout-seconds"})


#: What the CLI sets in the environment of the Ray it starts (builder.http_limits_env), so that Serve's proxy
#: installs the middleware (Ray 2.60 takes proxy middlewares only from this callback, not from HTTPOptions).
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "affinity_serve.app.http:proxy_middlewares"
HTTP_LIMITS_ENV = "AFFINITY_SERVE_HTTP_LIMITS"


def proxy_middlewares() -> list:
    """Serve's proxy calls this at start-up (PROXY_CALLBACK_ENV): HTTPLimitsMiddleware with the limits the
    JSON in HTTP_LIMITS_ENV gives (HTTPLimitsMiddleware's keyword arguments; the defaults where unset), and
    the header guard on the proxy's HTTP parser (install_header_guard)."""
    from starlette.middleware import Middleware
    limits = parse_http_limits(os.environ.get(HTTP_LIMITS_ENV) or "{}")
    install_header_guard(limits.get("max_header_bytes", 16 * 1024))
    return [Middleware(HTTPLimitsMiddleware, **limits)]


#: the limits HTTP_LIMITS_ENV may set (HTTPLimitsMiddleware's numeric keyword arguments)
HTTP_LIMIT_KEYS = ("max_header_bytes", "max_body_bytes", "body_read_timeout_s", "max_connections",
                   "max_connections_per_client", "retry_after_s")


def parse_http_limits(text: str) -> dict[str, Any]:
    """HTTP_LIMITS_ENV's JSON, checked: an object of HTTP_LIMIT_KEYS with positive numbers. Raises ValueError in
    one line naming the variable and the key (a misspelled key would otherwise fail the proxy's start-up with a
    TypeError far from its cause)."""
    import difflib
    try:
        limits = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{HTTP_LIMITS_ENV} is not valid JSON: {e}") from None
    if not isinstance(limits, dict):
        raise ValueError(f"{HTTP_LIMITS_ENV} must be a JSON object of limits ({', '.join(HTTP_LIMIT_KEYS)})")
    for key, value in limits.items():
        if key not in HTTP_LIMIT_KEYS:
            near = difflib.get_close_matches(str(key), HTTP_LIMIT_KEYS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(HTTP_LIMIT_KEYS)})"
            raise ValueError(f"{HTTP_LIMITS_ENV}: unknown limit '{key}'{hint}")
        whole = key != "body_read_timeout_s"           # the others count bytes, connections or seconds
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0:
            kind = "a positive integer" if whole else "a positive number"
            raise ValueError(f"{HTTP_LIMITS_ENV}: '{key}' must be {kind}, got {value!r}")
    return limits


#: what the header guard lets a request's header block grow to beyond max_header_bytes before it answers 431:
#: it counts whole reads (the socket hands over up to 256 KiB at once), so a read that completes the headers
#: of one request and starts the next is never mistaken for a large header block
HEADER_GUARD_SLACK_BYTES = 256 * 1024


def install_header_guard(max_header_bytes: int) -> None:
    """Bound what uvicorn's httptools parser (Serve's proxy's HTTP server) reads of a request's header block:
    past max_header_bytes + HEADER_GUARD_SLACK_BYTES with the headers still incomplete, it answers 431 (OpenAI
    body) and closes the connection. Without it a 64 MB header block was read and held in full before the
    middleware's exact 431 (+136 MB in the proxy, issue 33.3). uvicorn's h11 parser is bounded by h11 already
    (16 KiB). Idempotent; patches the class, so servers started before and after both use it."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:                  # no httptools: uvicorn uses h11
        return
    limit = max_header_bytes + HEADER_GUARD_SLACK_BYTES
    original = getattr(HttpToolsProtocol, "_affinity_original", None)
    if original is None:
        original = (HttpToolsProtocol.data_received, HttpToolsProtocol.on_message_begin,
                    HttpToolsProtocol.on_headers_complete)
        HttpToolsProtocol._affinity_original = original
    data_received, on_message_begin, on_headers_complete = original
    body = json.dumps(APIError(f"request headers are larger than {max_header_bytes} bytes", 431,
                               "invalid_request_error", None, "headers_too_large").body()).encode()
    refusal = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
               b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    def guarded_data_received(self, data: bytes) -> None:
        data_received(self, data)
        if getattr(self, "_affinity_in_headers", True) and not self.transport.is_closing():
            self._affinity_header_bytes = getattr(self, "_affinity_header_bytes", 0) + len(data)
            if self._affinity_header_bytes > limit:
                self.transport.write(refusal)
                self.transport.close()

    def guarded_message_begin(self) -> None:
        self._affinity_in_headers, self._affinity_header_bytes = True, 0
        on_message_begin(self)

    def guarded_headers_complete(self) -> None:
        self._affinity_in_headers = False
        on_headers_complete(self)

    HttpToolsProtocol.data_received = guarded_data_received
    HttpToolsProtocol.on_message_begin = guarded_message_begin
    HttpToolsProtocol.on_headers_complete = guarded_headers_complete


class HTTPLimitsMiddleware:
    """ASGI middleware for Serve's HTTP proxy (installed through `proxy_middlewares`; builder.http_limits_env).

    Per request, before the proxy routes it anywhere: Ray Serve's client-hint headers are removed; headers
    larger than `max_header_bytes` in all are a 431; at most `max_connections` requests are in flight (503
    beyond) and `max_connections_per_client` per client address (429 beyond); the body is read here in full
    within `body_read_timeout_s` (408 otherwise) and at most `max_body_bytes` (413), so a client that
    stalls its body, or sends a huge one, holds a proxy coroutine for a bounded time and never a slot of the
    ingress. Paths in `exempt_paths` (health probes, the proxy's own /-/ routes) skip the in-flight limits.
    Rejections carry the OpenAI error body.
    """

    def __init__(self, app: Any, *, max_header_bytes: int = 16 * 1024, max_body_bytes: int = 4 * 2**20,
                 body_read_timeout_s: float = 15.0, max_connections: int = 1024,
                 max_connections_per_client: int = 256, retry_after_s: int = 1,
                 exempt_paths: tuple[str, ...] = ("/health", "/metrics", "/-/")):
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.retry_after_s = retry_after_s
        self.exempt_paths = exempt_paths
        self.num_in_flight = 0
        self.num_in_flight_by_client: dict[str, int] = {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in CLIENT_HINT_HEADERS]
        scope = {**scope, "headers": headers}
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            await _refuse(send, scope, APIError(f"request headers are larger than {self.max_header_bytes} bytes",
                                                431, "invalid_request_error", None, "headers_too_large"))
            return
        path = scope.get("path", "")
        if any(path == p or path.endswith(p) or (p.endswith("/") and path.startswith(p)) for p in self.exempt_paths):
            await self.app(scope, receive, send)
            return
        client = str((scope.get("client") or ("unknown",))[0])
        refusal = self._admit(client)
        if refusal is not None:
            await _refuse(send, scope, refusal)
            return
        try:
            await self._with_body(scope, receive, send)
        finally:
            self.num_in_flight -= 1
            left = self.num_in_flight_by_client[client] - 1
            if left:
                self.num_in_flight_by_client[client] = left
            else:
                del self.num_in_flight_by_client[client]

    def _admit(self, client: str) -> APIError | None:
        if self.num_in_flight >= self.max_connections:
            return APIError(f"the server has {self.max_connections} requests in flight (serve.max_connections); "
                            "retry later", 503, "service_unavailable", None, "too_many_connections",
                            retry_after_s=self.retry_after_s)
        if self.num_in_flight_by_client.get(client, 0) >= self.max_connections_per_client:
            return APIError(f"this client has {self.max_connections_per_client} requests in flight "
                            "(serve.max_connections_per_client); retry later", 429, "rate_limit_error", None,
                            "too_many_connections", retry_after_s=self.retry_after_s)
        self.num_in_flight += 1
        self.num_in_flight_by_client[client] = self.num_in_flight_by_client.get(client, 0) + 1
        return None

    async def _with_body(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Read the whole body under the bounds, then run the app on it (later receives: the client's own,
        so a disconnect still reaches the proxy and cancels the request)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return                                   # gone before its body: nothing to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        await _refuse(send, scope, _too_large(self.max_body_bytes))
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _refuse(send, scope, APIError(f"the request body was not received within "
                                                f"{self.body_read_timeout_s:g}s (serve.body_read_timeout_s)", 408,
                                                "invalid_request_error", None, "body_read_timeout"))
            return
        body: list[bytes] | None = [b"".join(chunks)]
        del chunks

        async def replay() -> dict:
            nonlocal body
            if body is not None:
                message = {"type": "http.request", "body": body[0], "more_body": False}
                body = None
                return message
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send: Callable, scope: dict, err: APIError) -> None:
    """Answer `err` and log it by the app's rule (4xx at INFO; 429/503 WARNING at most one per code every
    10 s), in Serve's proxy log with the request's path and id: these never reach the ingress, so neither its
    log nor affinity_http_requests_total sees them."""
    rid = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
    log_failure(proxy_logger, err, err, f"refused by the HTTP limits: {err.status_code} {err.code} on "
                f"{scope.get('path', '')}" + (f" (request id {rid})" if rid else "") + f": {err.message}",
                route=scope.get("path", ""), request_id=rid)
    await _send_error(send, err)


async def _send_error(send: Callable, err: APIError) -> None:
    response = error_response(err)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": [*response.raw_headers, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": response.body})
