"""photo-reactor: turn committed `photo_jobs` rows into RQ jobs, fast, losing none: delivery is
at least once, with fenced outcomes (a handler may run again; only the current attempt counts).

Public API: `submit`, `submit_many`, `submit_async`, `submit_many_async`, `cancel` and
`cancel_async` (producer side) and
the `InvalidJobError` they raise for a bad type or photo id, `PermanentError` (raised by
handlers), and the RQ worker
classes `Worker` and `SimpleWorker` (loaded on first use, so producers do not import RQ's
worker machinery).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from reactor.errors import InvalidJobError, PermanentError
from reactor.producer import (
    cancel,
    cancel_async,
    submit,
    submit_async,
    submit_many,
    submit_many_async,
)

if TYPE_CHECKING:
    from reactor.worker.classes import SimpleWorker, Worker

__all__ = [
    "InvalidJobError",
    "PermanentError",
    "SimpleWorker",
    "Worker",
    "__version__",
    "cancel",
    "cancel_async",
    "submit",
    "submit_async",
    "submit_many",
    "submit_many_async",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("Worker", "SimpleWorker"):
        return getattr(importlib.import_module("reactor.worker.classes"), name)
    raise AttributeError(f"module 'reactor' has no attribute {name!r}")
