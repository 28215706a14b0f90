"""Structured (JSON) logs that carry the current request id."""
from __future__ import annotations

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, plus any `extra=` fields.

    A record logged with exc_info also gets exc_type, exc_message and the full traceback text.
    """

    _skip = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        for k, v in record.__dict__.items():
            if k not in self._skip and k != "request_id":
                out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["exc_message"] = str(record.exc_info[1])
            out["traceback"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out)


def configure_json_logging(level: str = "INFO", logger_names: tuple[str, ...] = ("affinity", "engine")) -> None:
    """Attach one JSON handler to each of our logger trees (the app's and the engine's); idempotent."""
    for name in logger_names:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
            h = logging.StreamHandler()
            h.setFormatter(JsonFormatter())
            logger.addHandler(h)
            logger.propagate = False
