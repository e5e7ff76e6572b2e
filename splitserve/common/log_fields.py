"""Structured logs: the request id and the transfer id as fields of every line about a request.

Code that logs about a request takes a logger for it::

    log = request_log(logger, request_id, transfer_id)
    log.info("KV of %d tokens received", num_tokens)

Each record then carries ``request_id`` and ``transfer_id`` attributes. The
text format (:data:`TEXT_FORMAT`) prints them as ``request=... transfer=...``
after the logger's name, ``-`` when a line is about no request;
``--log-format json`` (:class:`JsonFormatter`) writes one JSON object a line
with them as keys, for log pipelines (Loki, Elasticsearch) to filter on.
"""

from __future__ import annotations

import json
import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] request=%(request_id)s transfer=%(transfer_id)s %(message)s"
_FIELDS = ("request_id", "transfer_id")


class RequestLog(logging.LoggerAdapter):
    """A logger whose records carry one request's ids."""

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}
        return msg, kwargs


def request_log(logger: logging.Logger, request_id: str, transfer_id: str | None = None) -> RequestLog:
    """``logger`` with ``request_id`` (and ``transfer_id``, if any) on every record it makes."""
    return RequestLog(logger, {"request_id": request_id, "transfer_id": transfer_id or "-"})


class RequestFieldsFilter(logging.Filter):
    """Gives records that are about no request ``-`` for both fields, so every format can name them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in _FIELDS:
            if not hasattr(record, name):
                setattr(record, name, "-")
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, the request's ids, message (and exception)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record), "level": record.levelname, "logger": record.name,
            "process": record.process, "request_id": getattr(record, "request_id", "-"),
            "transfer_id": getattr(record, "transfer_id", "-"), "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Log to stderr at ``level`` in ``log_format`` ("text" or "json"), with the request fields on every line."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {log_format!r}.")
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestFieldsFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
