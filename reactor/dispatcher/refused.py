"""Rows whose claim fails alone: found, left out of their type's claims, and named.

The schema's bounds keep the claim's own arithmetic safe (the token cannot overflow), but a
row can still make the claim of its whole batch fail: a user's trigger refusing it, a
constraint added `NOT VALID` that the row breaks. When a claim fails with a statement error,
`RefusedRows.search` looks for such rows: it reads the photo ids the claim would take and
claims halves of them in transactions that are always rolled back, down to single rows (about
two probes per halving for each row found). Each row found is left out of its type's claims
(1 s, doubling to 60 s for each further failure), logged once (`row_refused`), has the reason
written into its own `last_error` when the row accepts that write (so `reactor status` and
`reactor failures` name it), and is shown on `/healthz` (which stays 200: the type flows). A
search that finds no single failing row, or more than `MAX_REFUSED_PER_SEARCH`, is the type's
own problem: the caller quarantines the whole type, as for a failing claim before.

Thread-safe: `/healthz` reads the refused rows from the metrics server's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reactor.errors import StatementError
from reactor.jobs import short_id
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.validate import error_column

__all__ = ["CLAIM_REFUSED_PREFIX", "MAX_REFUSED_PER_SEARCH", "RefusedRow", "RefusedRows"]

logger = logging.getLogger(__name__)

#: How the `last_error` of a refused row starts (`reactor status` lists such pending rows).
CLAIM_REFUSED_PREFIX = "claim refused: "
#: More single rows than this failing in one batch is the type's problem, not a row's.
MAX_REFUSED_PER_SEARCH = 4
#: A refused row is left out this long, doubling on each further failure up to the maximum.
REFUSED_BASE_SECONDS = 1.0
REFUSED_MAX_SECONDS = 60.0


@dataclass(frozen=True)
class RefusedRow:
    """A row left out of its type's claims because its claim fails."""

    type: str
    photo_id: str
    failures: int
    until: float
    error: str


class RefusedRows:
    """The rows of each type whose claim failed alone, and until when they are left out."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], RefusedRow] = {}
        self._lock = threading.Lock()

    def skipped(self, job_type: str) -> list[str]:
        """The photo ids of `job_type` to leave out of its claim now (none, nearly always).
        A row whose pause ended more than the longest pause ago is forgotten (deleted, or
        claimed by another reactor)."""
        if not self._rows:
            return []
        now = time.monotonic()
        with self._lock:
            for key in [k for k, r in self._rows.items() if r.until < now - REFUSED_MAX_SECONDS]:
                del self._rows[key]
            return [r.photo_id for r in self._rows.values() if r.type == job_type and r.until > now]

    def claimed(self, job_type: str, rows: Sequence[Sequence[Any]]) -> None:
        """Forget the refused rows among `rows` (type, photo_id, ...): their claim went through."""
        if not self._rows:
            return
        with self._lock:
            for row in rows:
                if self._rows.pop((job_type, row[1]), None) is not None:
                    logger.info("row_recovered type=%s photo_id=%s", job_type, short_id(row[1]))

    def current(self) -> list[RefusedRow]:
        """The rows whose claim failed and has not gone through since (for `/healthz` and the
        sweep's result)."""
        with self._lock:
            return list(self._rows.values())

    def search(
        self, conn: Connection, job_type: str, limit: int, window: float | None = None
    ) -> bool:
        """After a claim of `job_type` failed: find the rows among the next `limit` due ones
        (due within `window` seconds, as the claim read: `reactor.dispatcher.bounds`) whose
        claim fails alone and leave them out. True when some were found (claim again); False
        when the failure is not one row's (quarantine the type).

        Raises:
            DatabaseError: the connection failed.
        """
        skip = self.skipped(job_type)
        params = {"type": job_type, "limit": limit, "skip": skip, "window": window}
        with translating("refused-row search failed", conn), conn.transaction():
            todo = [[row[0] for row in conn.execute(queries.DUE_PHOTO_IDS, params)]]
        found: list[tuple[str, str]] = []
        while todo:
            part = todo.pop()
            error = _probe(conn, job_type, part) if part else None
            if error is None:
                continue
            if len(part) > 1:
                half = len(part) // 2
                todo += [part[half:], part[:half]]
                continue
            found.append((part[0], error))
            if len(found) > MAX_REFUSED_PER_SEARCH:
                return False
        for photo_id, error in found:
            self.refuse(conn, job_type, photo_id, error)
        return bool(found)

    def refuse(self, conn: Connection, job_type: str, photo_id: str, error: str) -> None:
        """Leave the row out of its type's claims (for longer if it already was), logged and
        noted in its `last_error` the first time.

        Raises:
            DatabaseError: the connection failed.
        """
        with self._lock:
            previous = self._rows.get((job_type, photo_id))
            failures = 1 if previous is None else previous.failures + 1
            pause = min(REFUSED_MAX_SECONDS, REFUSED_BASE_SECONDS * 2 ** (failures - 1))
            self._rows[job_type, photo_id] = RefusedRow(
                job_type, photo_id, failures, time.monotonic() + pause, error
            )
        if previous is not None:
            return
        noted = _note(conn, job_type, photo_id, error)
        logger.error(
            "row_refused type=%s photo_id=%s error=%s (left out of claims, retried with "
            "backoff up to %gs; other rows of the type go on%s)",
            job_type,
            short_id(photo_id),
            error,
            REFUSED_MAX_SECONDS,
            "" if noted else "; the row refused the note in its last_error too",
        )


def _probe(conn: Connection, job_type: str, photo_ids: list[str]) -> str | None:
    """Whether the claim of exactly these rows fails (None: it does not); rolled back."""
    try:
        with translating("claim failed", conn), conn.transaction(force_rollback=True):
            conn.execute(queries.CLAIM_PROBE, {"type": job_type, "photo_ids": photo_ids})
    except StatementError as exc:
        return str(exc)
    return None


def _note(conn: Connection, job_type: str, photo_id: str, error: str) -> bool:
    """Write why the claim fails into the row's last_error; False when the row refuses that."""
    params = {
        "type": job_type,
        "photo_id": photo_id,
        "error": error_column(CLAIM_REFUSED_PREFIX + error),
    }
    try:
        with translating("claim-refused note failed", conn), conn.transaction():
            conn.execute(queries.NOTE_CLAIM_REFUSED, params)
    except StatementError:
        return False
    return True
