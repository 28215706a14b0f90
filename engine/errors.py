"""Engine exception hierarchy: what went wrong, and which request field to change."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request (or its sampling parameters) is malformed; nothing was queued.

    `param` names the offending field (OpenAI's `param`), `code` is a short machine-readable tag.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context window or the KV pool."""

    def __init__(self, message: str, *, param: str | None = "prompt"):
        super().__init__(message, param=param, code="context_length_exceeded")


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in flight."""

    def __init__(self, req_id: str):
        super().__init__(f"request id {req_id!r} is already in flight; use a unique id",
                         param="request_id", code="duplicate_request_id")


class EngineDeadError(EngineError):
    """The engine's step loop failed in a way it cannot recover from; the replica must restart."""


class ModelLoadError(EngineError):
    """A checkpoint directory is missing files or describes an unsupported model."""
