"""Rows whose claim fails alone: found, left out of their type's claims, and named.

The schema's bounds keep the claim's own arithmetic safe (the token cannot overflow), but a
row can still make the claim of its whole batch fail: a user's trigger refusing it, a
constraint added `NOT VALID` that the row breaks. When a claim fails with a statement error,
`RefusedRows.search` looks for such rows: it reads the photo ids the claim would take and
claims halves of them in transactions that are always rolled back, down to single rows (about
two probes per halving for each row found). Each row found (or named by the enqueue: a job
key of the wrong kind, `reactor.dispatcher.drain`) is left out of its type's claims (1 s,
doubling to 60 s for each further failure), has the reason written into its own `last_error`
when the row accepts that write (so `reactor status` and `reactor failures` name it), and is
shown on `/healthz` (which stays 200: the type flows). A search that finds no single failing
row, or more than `MAX_REFUSED_PER_SEARCH`, is the type's own problem: the caller quarantines
the whole type, as for a failing claim before.

Logged, since whoever can write to Redis can refuse thousands of rows: the rows one failure
refuses for the first time make one `row_refused` record (the first row named, how many), at
most one a minute per type, with how many rows were held back since the last one; a row
refused again is not new. The rows of a batch that go through make one `row_recovered`.

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
from reactor.throttle import LogThrottle
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
#: At most one `row_refused` record per type this often.
REFUSED_LOG_SECONDS = 60.0


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
        self._logs: dict[str, LogThrottle] = {}
        #: Rows of each type refused for the first time and not logged (throttled) yet.
        self._held_back: dict[str, int] = {}

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
            recovered = [r[1] for r in rows if self._rows.pop((job_type, r[1]), None) is not None]
        if recovered:
            logger.info(
                "row_recovered type=%s photo_id=%s rows=%d",
                job_type,
                short_id(recovered[0]),
                len(recovered),
            )

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
        self.refuse(conn, job_type, found)
        return bool(found)

    def refuse(self, conn: Connection, job_type: str, rows: Sequence[tuple[str, str]]) -> None:
        """Leave `rows` of `job_type` (photo id, why) out of its claims, each for longer if it
        already was; those refused for the first time are noted in their `last_error` and
        logged (see the module docstring).

        Raises:
            DatabaseError: the connection failed.
        """
        first: list[tuple[str, str]] = []
        now = time.monotonic()
        with self._lock:
            for photo_id, error in rows:
                previous = self._rows.get((job_type, photo_id))
                failures = 1 if previous is None else previous.failures + 1
                pause = min(REFUSED_MAX_SECONDS, REFUSED_BASE_SECONDS * 2 ** (failures - 1))
                self._rows[job_type, photo_id] = RefusedRow(
                    job_type, photo_id, failures, now + pause, error
                )
                if previous is None:
                    first.append((photo_id, error))
        if first:
            self._log(job_type, first, _note_all(conn, job_type, first))

    def _log(self, job_type: str, first: list[tuple[str, str]], unnoted: int) -> None:
        throttle = self._logs.setdefault(job_type, LogThrottle(1, REFUSED_LOG_SECONDS))
        with self._lock:
            held = self._held_back.pop(job_type, 0)
            if not throttle.allow():
                self._held_back[job_type] = held + len(first)
                return
            throttle.suppressed()  # it counts records; `held` counts rows
        photo_id, error = first[0]
        logger.error(
            "row_refused type=%s photo_id=%s error=%s rows=%d suppressed=%d (left out of "
            "claims, retried with backoff up to %gs; other rows of the type go on; `reactor "
            "status` names them%s)",
            job_type,
            short_id(photo_id),
            error,
            len(first),
            held,
            REFUSED_MAX_SECONDS,
            f"; {unnoted} refused the note in their last_error too" if unnoted else "",
        )


def _probe(conn: Connection, job_type: str, photo_ids: list[str]) -> str | None:
    """Whether the claim of exactly these rows fails (None: it does not); rolled back."""
    try:
        with translating("claim failed", conn), conn.transaction(force_rollback=True):
            conn.execute(queries.CLAIM_PROBE, {"type": job_type, "photo_ids": photo_ids})
    except StatementError as exc:
        return str(exc)
    return None


def _note_all(conn: Connection, job_type: str, rows: list[tuple[str, str]]) -> int:
    """Write why each row's claim fails into its last_error; how many rows refused that. One
    transaction for them all (a thousand planted keys cost one commit, not a thousand); when a
    row refuses, each row in a transaction of its own.

    Raises:
        DatabaseError: the connection failed.
    """
    params = [
        {"type": job_type, "photo_id": p, "error": error_column(CLAIM_REFUSED_PREFIX + e)}
        for p, e in rows
    ]
    try:
        with (
            translating("claim-refused notes failed", conn),
            conn.transaction(),
            conn.cursor() as cursor,
        ):
            cursor.executemany(queries.NOTE_CLAIM_REFUSED, params)
    except StatementError:
        return sum(not _note(conn, job_type, p, e) for p, e in rows)
    return 0


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
