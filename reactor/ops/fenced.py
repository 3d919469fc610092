"""A dashboard action on one row as the page showed it (`reactor.ops.action_requests.Fence`):
requeue or cancel the row only while it is still in the state, at the token, the page showed.

One transaction, its lock waits ending after `lock_timeout_ms` (`LockBusyError`, nothing
changed): the row is read with a share lock (ATTEMPT_RECHECK: FOR SHARE waits for a claim or an
outcome in flight, then holds the row until the commit, so nobody moves it between the look and
the change), compared with the fence, then changed by the CLI's own statement (REQUEUE_PHOTOS,
CANCEL_PHOTOS). A row that has moved on, or is gone (archived, pruned), raises
`RowChangedError` and nothing changes. Two such actions on one row at once may deadlock on
their shared locks: Postgres ends one (a `DatabaseError`: nothing changed by it). A cancel asks
RQ to stop the row's started job after the commit, as `reactor.ops.cancel` does (Redis failing:
`StopNotSentError`, the row stays cancelled).
"""

from __future__ import annotations

import redis

from reactor.errors import ReactorError
from reactor.jobs import JobRef
from reactor.ops.action_requests import Fence
from reactor.ops.cancel import CancelResult, reason_for, stop_cancelled
from reactor.pg import queries
from reactor.pg.db import Connection, translating

__all__ = ["RowChangedError", "cancel_row", "requeue_row"]


class RowChangedError(ReactorError):
    """The row is no longer as the page showed it (or is gone): nothing was done."""

    def __init__(self, photo_id: str) -> None:
        super().__init__(photo_id)
        self.photo_id = photo_id


def _still_as_shown(conn: Connection, photo_id: str, job_type: str, fence: Fence) -> None:
    row = conn.execute(queries.ATTEMPT_RECHECK, {"photo_id": photo_id, "type": job_type}).fetchone()
    if (
        row is None
        or (fence.state is not None and row[0] != fence.state)
        or (fence.token is not None and int(row[1]) != fence.token)
    ):
        raise RowChangedError(photo_id)


def requeue_row(
    conn: Connection, photo_id: str, job_type: str, fence: Fence, *, lock_timeout_ms: int
) -> int:
    """Requeue the row if it is still as `fence` says; rows moved (0 or 1).

    Raises:
        RowChangedError: it is not (nothing changed).
        LockBusyError: it was held past `lock_timeout_ms` (nothing changed).
        DatabaseError, StatementError: the transaction failed (nothing changed).
    """
    with translating("requeue failed", conn), conn.transaction():
        conn.execute(queries.SET_LOCAL_LOCK_TIMEOUT, {"timeout": f"{lock_timeout_ms}ms"})
        _still_as_shown(conn, photo_id, job_type, fence)
        params = {"photo_ids": [photo_id], "type": job_type}
        return conn.execute(queries.REQUEUE_PHOTOS, params).rowcount


def cancel_row(
    conn: Connection,
    client: redis.Redis | None,
    photo_id: str,
    job_type: str,
    fence: Fence,
    *,
    by: str,
    lock_timeout_ms: int,
) -> CancelResult:
    """Cancel the row if it is still as `fence` says; then, with a Redis `client`, ask the
    worker running its job to stop.

    Raises:
        RowChangedError: it is not (nothing changed).
        LockBusyError: it was held past `lock_timeout_ms` (nothing changed).
        DatabaseError, StatementError: the transaction failed (nothing changed).
        StopNotSentError: Redis failed; the row is cancelled (the error's `result`).
    """
    with translating("cancel failed", conn), conn.transaction():
        conn.execute(queries.SET_LOCAL_LOCK_TIMEOUT, {"timeout": f"{lock_timeout_ms}ms"})
        _still_as_shown(conn, photo_id, job_type, fence)
        params = {"photo_ids": [photo_id], "type": job_type, "reason": reason_for(by)}
        rows = conn.execute(queries.CANCEL_PHOTOS, params).fetchall()
    return stop_cancelled(client, [JobRef(t, p, int(token)) for t, p, token in rows])
