"""Cancelling rows (`reactor cancel`, the dashboard's cancel): pending and active rows become
`cancelled`, a terminal state beside `done` and `failed`.

Rows are cancelled in batches of `batch_size`, each its own short transaction: by photo id
(rows a claim or an outcome holds are waited for, then checked again, so a row whose handler
has just finished stays `done`), or every pending row of a type (`SKIP LOCKED`: never waiting
behind a claim). After each batch commits, the started RQ jobs of the rows that were active
are asked to stop (`reactor.rq.stop`). Nothing depends on that stop arriving: every outcome a
worker writes is fenced on `state = 'active'` at its token and the fenced start refuses a row
that is not active or pending, so an attempt that ends after the cancel changes nothing and a
queued job never runs its handler. `requeue` and `submit()` re-arm a cancelled row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from reactor.jobs import JobRef
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.rq.stop import stop_started

__all__ = ["CancelResult", "cancel_pending", "cancel_photos", "reason_for"]

DEFAULT_CANCEL_BATCH = 5000


@dataclass(frozen=True)
class CancelResult:
    """Rows cancelled, and how many of their started jobs were asked to stop."""

    cancelled: int = 0
    stopped: int = 0


def reason_for(by: str) -> str:
    """The `last_error` of a row cancelled by `by` (`user@host`, a dashboard user)."""
    return f"cancelled by {by}"


def cancel_photos(
    conn: Connection,
    client: redis.Redis | None,
    photo_ids: Sequence[str],
    job_type: str | None,
    by: str,
    *,
    batch_size: int = DEFAULT_CANCEL_BATCH,
) -> CancelResult:
    """Cancel the pending/active rows of these photos (of `job_type`, if given); with a Redis
    `client`, ask the workers running their jobs to stop.

    Raises:
        DatabaseError: a batch failed (it was rolled back; the batches before it stay).
        RedisUnavailableError: Redis failed (the rows are cancelled; their outcomes are fenced off).
    """
    ids = sorted(set(photo_ids))  # one lock order for every cancel: no deadlock
    cancelled = stopped = 0
    for start in range(0, len(ids), batch_size):
        params = {"photo_ids": ids[start : start + batch_size], "type": job_type}
        refs = _cancel_batch(conn, queries.CANCEL_PHOTOS, params, by, cancelled)
        cancelled += len(refs)
        if client is not None:
            stopped += stop_started(client, refs)
    return CancelResult(cancelled, stopped)


def cancel_pending(
    conn: Connection, job_type: str, by: str, *, batch_size: int = DEFAULT_CANCEL_BATCH
) -> CancelResult:
    """Cancel every pending row of `job_type`, batch by batch, skipping rows a claim holds.

    Raises:
        DatabaseError: a batch failed (it was rolled back; the batches before it stay).
    """
    cancelled = 0
    while True:
        params = {"type": job_type, "limit": batch_size}
        count = len(_cancel_batch(conn, queries.CANCEL_PENDING, params, by, cancelled))
        cancelled += count
        if count < batch_size:
            return CancelResult(cancelled)


def _cancel_batch(
    conn: Connection, query: str, params: Mapping[str, object], by: str, done: int
) -> list[JobRef]:
    with translating(f"cancel failed after {done} rows"), conn.transaction():
        rows = conn.execute(query, {**params, "reason": reason_for(by)}).fetchall()
    return [JobRef(job_type, photo_id, int(token)) for job_type, photo_id, token in rows]
