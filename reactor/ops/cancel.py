"""Cancelling rows (`reactor cancel`, the dashboard's cancel): pending and active rows become
`cancelled`, a terminal state beside `done` and `failed`.

Rows are cancelled in batches of `batch_size`, each its own short transaction: by photo id
(rows a claim or an outcome holds are waited for, then checked again, so a row whose handler
has just finished stays `done`), or every pending row of a type (`SKIP LOCKED`: never waiting
behind a claim). The row's state is the record: once every batch has committed, the started RQ
jobs of the rows cancelled by id are asked to stop (`reactor.rq.stop`), so a Redis that fails
never leaves part of the rows uncancelled. Nothing depends on that stop arriving: every outcome
a worker writes is fenced on `state = 'active'` at its token and the fenced start refuses a row
that is not active at its token, so an attempt that ends after the cancel changes nothing and
a queued job never runs its handler; a stop that Redis did not take (`StopNotSentError`, with
the counts) only lets a running handler finish for nothing. `requeue` and `submit()` re-arm a
cancelled row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from reactor.errors import ReactorError, RedisUnavailableError
from reactor.jobs import JobRef
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.rq.stop import stop_started

__all__ = [
    "CancelResult",
    "StopNotSentError",
    "cancel_pending",
    "cancel_photos",
    "reason_for",
    "stop_cancelled",
]

DEFAULT_CANCEL_BATCH = 5000


@dataclass(frozen=True)
class CancelResult:
    """Rows cancelled, how many of their started jobs were asked to stop, and (by
    `cancel_photos`) the photo ids of the rows cancelled."""

    cancelled: int = 0
    stopped: int = 0
    photo_ids: frozenset[str] = frozenset()


class StopNotSentError(RedisUnavailableError):
    """Redis failed after the rows were cancelled, before every started job of theirs was asked
    to stop: the rows stay cancelled (`result`), running handlers finish for nothing."""

    def __init__(self, result: CancelResult, cause: str) -> None:
        only = f" (only {result.stopped} were)" if result.stopped else ""
        super().__init__(
            f"Redis failed ({cause}): {_rows(result.cancelled)} cancelled, but their running "
            f"jobs were not asked to stop{only}: such a handler runs to its end and its "
            "outcome is discarded"
        )
        self.result = result


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


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
    lock_timeout_ms: int | None = None,
) -> CancelResult:
    """Cancel the pending/active rows of these photos (of `job_type`, if given); then, with a
    Redis `client`, ask the workers running their jobs to stop. With `lock_timeout_ms`, a
    batch waits at most that long for a row another session holds.

    Raises:
        LockBusyError: a row was held past `lock_timeout_ms` (that batch was rolled back).
        DatabaseError: a batch failed (it was rolled back; the batches before it stay, and
            their started jobs are asked to stop if Redis answers).
        StopNotSentError: Redis failed; every row is cancelled (the error's `result`).
    """
    ids = sorted(set(photo_ids))  # one lock order for every cancel: no deadlock
    refs: list[JobRef] = []
    try:
        for start in range(0, len(ids), batch_size):
            params = {"photo_ids": ids[start : start + batch_size], "type": job_type}
            refs += _cancel_batch(
                conn, queries.CANCEL_PHOTOS, params, by, len(refs), lock_timeout_ms=lock_timeout_ms
            )
    except ReactorError:
        with contextlib.suppress(StopNotSentError):  # the database's error is the one
            stop_cancelled(client, refs, batch_size)
        raise
    return stop_cancelled(client, refs, batch_size)


def stop_cancelled(
    client: redis.Redis | None, refs: Sequence[JobRef], batch_size: int = DEFAULT_CANCEL_BATCH
) -> CancelResult:
    """The result of cancelling the rows of `refs` (committed): with a Redis `client`, their
    started jobs asked to stop, `batch_size` at a time.

    Raises:
        StopNotSentError: Redis failed; the rows stay cancelled (the error's `result`).
    """
    cancelled = frozenset(r.photo_id for r in refs)
    stopped = 0
    if client is None:
        return CancelResult(len(refs), stopped, cancelled)
    for start in range(0, len(refs), batch_size):
        try:
            stopped += stop_started(client, refs[start : start + batch_size])
        except RedisUnavailableError as exc:
            raise StopNotSentError(CancelResult(len(refs), stopped, cancelled), str(exc)) from exc
    return CancelResult(len(refs), stopped, cancelled)


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
    conn: Connection,
    query: str,
    params: Mapping[str, object],
    by: str,
    done: int,
    *,
    lock_timeout_ms: int | None = None,
) -> list[JobRef]:
    with translating(f"cancel failed after {done} rows"), conn.transaction():
        if lock_timeout_ms is not None:
            conn.execute(queries.SET_LOCAL_LOCK_TIMEOUT, {"timeout": f"{lock_timeout_ms}ms"})
        rows = conn.execute(query, {**params, "reason": reason_for(by)}).fetchall()
    return [JobRef(job_type, photo_id, int(token)) for job_type, photo_id, token in rows]
