"""Logging set-up for the CLI (the only place logging is configured).

Two formats: `text` for people, `json` (one object per line) for log pipelines. Every record's
message of photo-reactor's own loggers starts with an event name (`batch_dispatched`,
`connection_lost`, ...); the JSON form puts it in its own field (`null` for loggers outside
`reactor`, RQ's or a handler's, whose messages are prose) and, when the record was written
inside a valid span (`reactor.tracing`), adds the `trace_id` and `span_id` of that span.
Messages pass through `redact`, so no password reaches a log.
"""

from __future__ import annotations

import json
import logging
import sys

from reactor import tracing
from reactor.redact import redact

__all__ = ["configure_logging"]


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = redact(record.getMessage())
        event: str | None = None
        rest = message
        if record.name == "reactor" or record.name.startswith("reactor."):
            event, _, rest = message.partition(" ")
        payload: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event,
            "message": rest,
        }
        ids = tracing.current_ids()
        if ids is not None:  # the record joins the trace of the span it was written in
            payload["trace_id"], payload["span_id"] = ids
        if record.exc_info:
            payload["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(payload, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send the `reactor` loggers to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
