"""One mapping from exceptions to HTTP statuses and the OpenAI error body, and how a failure is logged.

Logging rule: each failure is logged once, with its request id. A traceback is logged only for an
unexpected exception, by the code that caught it first (`log_failure`); an APIError or an EngineError was
raised on purpose (and the engine logs its own step failures with their traceback), so later layers log
one line. Expected client errors (4xx) are INFO, overload and unavailability (429/503) WARNING, at most one
per (status, code) every WARN_EVERY_S (the rest at DEBUG; the next WARNING counts them): under sustained
overload a WARNING per refused request would flood the log. A traceback never reaches a response body.
Serve would log every APIError a deployment method raises a second time, with its traceback, and its router
logs a WARNING for every request it refuses at `max_queued_requests` (which the ingress answers and logs as a
429 `overloaded` by the rule above); `drop_serve_duplicate_logs` filters those records out.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from affinity_serve.engine.errors import (ContextLengthExceededError, EngineDeadError, EngineError, InvalidRequestError,
                           ModelLoadError)


class APIError(Exception):
    """An error with an HTTP status and OpenAI error fields; picklable so it crosses Ray handles."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message, status_code, type, param, code, retry_after_s)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def to_api_error(exc: BaseException) -> APIError:
    """Classify any exception (pure: logs nothing); never leaks a stack trace into the message."""
    from ray.serve.exceptions import (BackPressureError, DeploymentUnavailableError,
                                      ReplicaUnavailableError, RequestCancelledError)
    from ray.exceptions import RayActorError, TaskCancelledError
    from starlette.requests import ClientDisconnect

    if isinstance(exc, APIError):
        return APIError(exc.message, exc.status_code, exc.type, exc.param, exc.code, exc.retry_after_s)
    if isinstance(exc, ContextLengthExceededError):
        return APIError(exc.message, 400, "invalid_request_error", exc.param, "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(exc.message, 400, "invalid_request_error", exc.param, exc.code or "invalid_value")
    if isinstance(exc, BackPressureError):
        return APIError("the server is overloaded; retry later", 429, "rate_limit_error", None,
                        "overloaded", retry_after_s=1)
    if isinstance(exc, RayActorError):      # ActorDiedError, ActorUnavailableError: the replica went away
        return APIError("the model replica serving this request stopped (scaled in past its graceful "
                        "shutdown timeout, or failed); retry later", 503, "service_unavailable", None,
                        "replica_unavailable", retry_after_s=1)
    if isinstance(exc, (DeploymentUnavailableError, ReplicaUnavailableError, EngineDeadError, TimeoutError)):
        return APIError("no healthy model replica is available; retry later", 503, "service_unavailable",
                        None, "replica_unavailable", retry_after_s=1)
    if isinstance(exc, (RequestCancelledError, TaskCancelledError)):
        return APIError("the request was cancelled", 499, "cancelled", None, "cancelled")
    if isinstance(exc, ClientDisconnect):      # the client went away mid-body: its choice, not a server error
        return APIError("the client closed the connection before the request was read", 499, "cancelled", None,
                        "client_closed_request")
    if isinstance(exc, ModelLoadError):
        return APIError(str(exc), 500, "server_error", None, "model_load_error")
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc and isinstance(cause, BaseException):
        inner = to_api_error(cause)
        if inner.status_code != 500:
            return inner
    return APIError("internal server error", 500, "server_error", None, "internal_error")


def log_failure(log: logging.Logger, exc: BaseException, api: APIError, message: str = "request failed",
                **fields: Any) -> None:
    """Log one failed request by the rule in the module docstring; `fields` go into the JSON record."""
    extra = {"status": api.status_code, "code": api.code, "param": api.param, "error": api.message, **fields}
    if api.status_code < 500 and api.status_code != 429:
        log.info(message, extra=extra)
    elif api.status_code != 500:
        similar = _similar_since_warning((api.status_code, api.code))
        if similar is None:
            log.debug(message, extra=extra)
        else:
            log.warning(message, extra={**extra, "similar_since_last_warning": similar} if similar else extra)
    elif isinstance(exc, APIError):      # str() of one that crossed a handle is the remote traceback
        log.error(message, extra=extra)
    elif isinstance(exc, EngineError):
        log.error(message, extra={**extra, "cause": f"{type(exc).__name__}: {exc}"})
    else:
        log.error(message, extra=extra, exc_info=exc)


#: overload/unavailable failures of one (status, code) get one WARNING this often; the rest are DEBUG
WARN_EVERY_S = 10.0
_last_warning: dict[tuple[int, str | None], tuple[float, int]] = {}    # key -> (when warned, quiet since)
_warn_lock = threading.Lock()


def _similar_since_warning(key: tuple[int, str | None]) -> int | None:
    """None: log this one quietly (one of its kind was warned less than WARN_EVERY_S ago); else warn, saying how
    many were logged quietly since the last warning of its kind."""
    now = time.monotonic()
    with _warn_lock:
        last = _last_warning.get(key)
        if last is not None and now - last[0] < WARN_EVERY_S:
            _last_warning[key] = (last[0], last[1] + 1)
            return None
        _last_warning[key] = (now, 0)
        return last[1] if last is not None else 0


#: how Serve's router words its refusal at max_queued_requests (ray.serve.exceptions.BackPressureError)
_SERVE_BACKPRESSURE = "Request dropped due to backpressure"


class _AlreadyLogged(logging.Filter):
    """Drops a log record about an APIError (whoever raised it logged the failure already) and Serve's router's
    WARNING per request refused at max_queued_requests (one per 429: the ingress logs those, rate-limited)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], APIError):
            return False
        return not (isinstance(record.msg, str) and record.msg.startswith(_SERVE_BACKPRESSURE))


def drop_serve_duplicate_logs() -> None:
    """Serve's replica wrapper logs "Request failed." with a traceback for any exception a deployment
    method raises (a 400 from the handle API included), and its router a WARNING per request refused at
    max_queued_requests; ours are logged by the rule above. Idempotent."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _AlreadyLogged) for f in serve_logger.filters):
        serve_logger.addFilter(_AlreadyLogged())


#: pydantic's names for the branches of a union, as they appear in an error's location
_TYPE_WORDS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _is_branch(seg: object) -> bool:
    """A location segment that names a union's branch (`str`, `list[int]`, `literal['a','b']`, a model's
    class name, a validator's wrapper), not a field or a dict key (`logit_bias.5`)."""
    return isinstance(seg, str) and (seg in _TYPE_WORDS or any(c in seg for c in "[]'") or seg[:1].isupper()
                                     or re.match(r"(function|constrained|lax|json-or-python)-", seg) is not None)


def _shape(tag: str, msg: str) -> str:
    """A union branch's name as a client reads it."""
    if tag.startswith("literal["):
        return msg.removeprefix("Input should be ")
    words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null",
             "list[int]": "a list of token ids", "list[str]": "a list of strings",
             "list[list[int]]": "a list of token-id lists"}
    if tag in words:
        return words[tag]
    if tag == "list[ContentPart]":
        return "a list of content parts"
    if tag.startswith("list["):
        return "a list"
    return "an object"


def pydantic_error(exc) -> APIError:
    """A pydantic ValidationError -> 400 naming the first offending field (`param` is the field's path, never
    a union branch's name). A value that fits none of a field's shapes names the shapes it accepts; a value
    that picked a shape but is wrong inside it names the inner error."""
    errs = [(tuple(p for p in e.get("loc", ()) if p != "body"), e) for e in exc.errors()]
    loc, err = errs[0]
    cut = next((i for i, p in enumerate(loc) if _is_branch(p)), None)
    if cut is not None:
        prefix = loc[:cut]
        union = [(lc, e) for lc, e in errs if lc[:cut] == prefix and len(lc) > cut and _is_branch(lc[cut])]
        inner = [(tuple(p for p in lc if not _is_branch(p)), e) for lc, e in union]
        deep = max(inner, key=lambda x: len(x[0]))
        if len(deep[0]) > len(prefix):           # one shape matched the outside: its own error
            loc, err = deep
        else:
            shapes = list(dict.fromkeys(_shape(str(lc[cut]), e.get("msg", "")) for lc, e in union))
            path = ".".join(str(p) for p in prefix)
            return APIError(f"invalid value for '{path}': expected {' or '.join(shapes)}", 400,
                            "invalid_request_error", path or None, "invalid_value")
    path = ".".join(str(p) for p in loc if not _is_branch(p))
    msg = err.get("msg", "invalid value")
    return APIError(f"invalid value for '{path}': {msg}" if path else msg, 400, "invalid_request_error",
                    path or None, "invalid_value")
