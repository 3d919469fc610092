"""The producer API: put a photo job into `photo_jobs` inside the caller's transaction.

This is a transactional outbox: the row commits or rolls back with the photo it belongs to,
and its NOTIFY (sent by the trigger) is delivered only if it commits. `submit` never commits.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from reactor.validate import validate_job

__all__ = ["DEFAULT_JOB_TYPE", "submit"]

DEFAULT_JOB_TYPE = "photo.process"

# A pending/active row is left as it is (idempotent); a done/failed row is re-armed: a new
# life at attempts 0, its earlier attempts added to prior_attempts so that the fencing token
# (prior_attempts + attempts) goes on growing. `xmax = 0` tells an inserted row from an
# updated one.
_SUBMIT = """
INSERT INTO photo_jobs AS j (photo_id, type, next_retry_at, max_attempts)
VALUES (%(photo_id)s, %(type)s, %(run_at)s, coalesce(%(max_attempts)s, 5))
ON CONFLICT (photo_id, type) DO UPDATE
   SET state = 'pending',
       prior_attempts = j.prior_attempts + j.attempts,
       attempts = 0,
       next_retry_at = coalesce(EXCLUDED.next_retry_at, now()),  -- due from the re-arm
       last_error = NULL,
       max_attempts = CASE WHEN %(max_attempts)s::int IS NULL THEN j.max_attempts
                           ELSE EXCLUDED.max_attempts END
 WHERE j.state IN ('done', 'failed')
RETURNING (xmax = 0) AS inserted
"""


def submit(
    conn: psycopg.Connection[Any],
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name, fixed by the spec
    *,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> bool:
    """Insert (or re-arm) the job of `photo_id` in the caller's current transaction.

    Args:
        conn: the caller's connection; its transaction decides whether the job exists.
        photo_id: the photo.
        type: the job type (must have a route in the reactor to be dispatched).
        run_at: not before this time (timezone-aware); None = at once.
        max_attempts: attempts before a failure is final; None = the table default (5), or
            the existing row's value when a done/failed row is re-armed.

    Returns:
        True when a row was inserted or re-armed; False when it was already pending/active.

    Raises:
        InvalidJobError: the photo id or the type is invalid (checked before the database).
        psycopg.Error: the insert failed.
    """
    validate_job(photo_id, type)
    row = conn.execute(
        _SUBMIT,
        {"photo_id": photo_id, "type": type, "run_at": run_at, "max_attempts": max_attempts},
    ).fetchone()
    return row is not None
