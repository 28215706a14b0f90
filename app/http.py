"""HTTP plumbing for the ingress routes: API-key check, reading a JSON body, SSE framing, error responses."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from app.errors import APIError


def error_response(err: APIError) -> JSONResponse:
    """The OpenAI error body with its status (and Retry-After for 429/503)."""
    headers = {}
    if err.retry_after_s is not None and err.status_code in (429, 503):
        headers["Retry-After"] = str(err.retry_after_s)
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


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


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: 415 for a non-JSON Content-Type, 413 when too large, 400 when malformed."""
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
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}", 400, "invalid_request_error", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", 400, "invalid_request_error", None, "invalid_json")
    return body


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
