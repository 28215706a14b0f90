"""HTTP plumbing for the ingress routes: API-key check, reading a JSON body, SSE framing, error responses."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from app.errors import APIError


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


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise a 401 unless the request carries `Authorization: Bearer <api_key>` (when one is configured)."""
    if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
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
    raw = await request.body()
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
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


async def sse(first: dict, rest: AsyncIterator[dict],
              on_error: Callable[[BaseException], APIError]) -> AsyncIterator[str]:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`. A failure after the first
    byte cannot change the status any more: it is sent in-band as an error object (from `on_error`)."""
    yield f"data: {json.dumps(first)}\n\n"
    try:
        async for chunk in rest:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as e:
        yield f"data: {json.dumps(on_error(e).body())}\n\n"
    yield "data: [DONE]\n\n"
