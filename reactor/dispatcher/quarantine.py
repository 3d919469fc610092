"""Types left out of drains because their claim fails, and until when.

A claim that fails with a statement error, after the rows whose claim fails alone were left out
(`reactor.dispatcher.refused`), is its type's own problem: the type is quarantined, logged once
(`type_quarantined`), and skipped by drains for `QUARANTINE_BASE_SECONDS`, doubling with each
further failure up to `QUARANTINE_MAX_SECONDS`, so a type the claim cannot handle does not stop
the others; its first claim that succeeds ends it (`type_recovered`).

The loop thread writes it; `/healthz` reads a copy of its items from the metrics thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

__all__ = ["QUARANTINE_BASE_SECONDS", "QUARANTINE_MAX_SECONDS", "Quarantine", "Quarantines"]

logger = logging.getLogger("reactor.dispatcher.drain")

#: A type whose claim fails with a statement error is left out of drains for this long,
#: doubling on each further failure up to the maximum.
QUARANTINE_BASE_SECONDS = 1.0
QUARANTINE_MAX_SECONDS = 60.0


@dataclass(frozen=True)
class Quarantine:
    """A type left out of drains because its claim fails (a row the claim cannot handle)."""

    failures: int
    until: float
    error: str


class Quarantines(dict[str, Quarantine]):
    """The quarantined types, by name."""

    def failed(self, job_type: str, error: str) -> None:
        """A claim of `job_type` failed: quarantine it (again, for longer)."""
        previous = self.get(job_type)
        failures = 1 if previous is None else previous.failures + 1
        pause = min(QUARANTINE_MAX_SECONDS, QUARANTINE_BASE_SECONDS * 2 ** (failures - 1))
        self[job_type] = Quarantine(failures, time.monotonic() + pause, error)
        if previous is None:
            logger.error(
                "type_quarantined type=%s error=%s (left out of drains, not the other types "
                "for it; retried with backoff up to %gs)",
                job_type,
                error,
                QUARANTINE_MAX_SECONDS,
            )

    def recovered(self, job_type: str) -> None:
        """A claim of `job_type` succeeded: its quarantine, if any, is over."""
        if self.pop(job_type, None) is not None:
            logger.info("type_recovered type=%s", job_type)
