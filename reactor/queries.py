"""Every SQL statement the reactor runs at runtime, by name.

Values are always bound parameters; nothing here is assembled from strings. The claim and
re-dispatch queries lock with `FOR UPDATE SKIP LOCKED` so any number of reactors can run at
once, and they
pick rows by `ctid = ANY(ARRAY(...))`: measured, that shape keeps its plan at every batch size
and table shape, where `(key) IN (SELECT ...)` flips to a hash join over the whole table (NOTES).
The pending index is on (type, coalesce(next_retry_at, created_at)); each pending query filters
on one type and orders by that expression, so it is one index range scan.
"""

from __future__ import annotations

__all__ = [
    "ATTEMPT_DONE",
    "ATTEMPT_FAILED",
    "ATTEMPT_HEARTBEAT",
    "ATTEMPT_RETRY",
    "ATTEMPT_START",
    "ATTEMPT_STATE",
    "BACKLOG",
    "CLAIM_DUE",
    "LIST_ACTIVE",
    "NEXT_DUE_IN",
    "OLDEST_DUE_AGE",
    "PENDING_TYPES",
    "REDISPATCH",
]

#: Claim up to `limit` due pending rows of one type: a new attempt each, now `active`.
CLAIM_DUE = """
UPDATE photo_jobs AS j
   SET state = 'active', attempts = j.attempts + 1
 WHERE j.ctid = ANY (ARRAY(
         SELECT p.ctid
           FROM photo_jobs AS p
          WHERE p.type = %(type)s
            AND p.state = 'pending'
            AND coalesce(p.next_retry_at, p.created_at) <= now()
          ORDER BY coalesce(p.next_retry_at, p.created_at)
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
   AND j.state = 'pending'
RETURNING j.type, j.photo_id, j.attempts, j.state
"""

#: Seconds until the earliest pending row of the given types becomes due (NULL if none).
#: Capped at a day, so a row parked at 'infinity' neither breaks the arithmetic nor matters.
NEXT_DUE_IN = """
SELECT extract(epoch FROM least(min(d.due), now() + interval '1 day') - now())::float8
  FROM unnest(%(types)s::text[]) AS t(type)
 CROSS JOIN LATERAL (
        SELECT coalesce(p.next_retry_at, p.created_at) AS due
          FROM photo_jobs AS p
         WHERE p.type = t.type
           AND p.state = 'pending'
           AND coalesce(p.next_retry_at, p.created_at) > now()
         ORDER BY coalesce(p.next_retry_at, p.created_at)
         LIMIT 1) AS d
"""

#: One page of active rows of the given types, for the rescue pass, with whether each is
#: stale (no heartbeat for `stale_after` seconds). Keyset-paged in (updated_at, type,
#: photo_id) order up to `until` (the sweep's start), so rows re-dispatched during the sweep
#: (their updated_at moves to now) are not visited twice.
LIST_ACTIVE = """
SELECT type, photo_id, attempts, updated_at,
       updated_at < now() - make_interval(secs => %(stale_after)s::float8) AS stale
  FROM photo_jobs
 WHERE state = 'active'
   AND type = ANY (%(types)s::text[])
   AND updated_at <= %(until)s
   AND (updated_at, type, photo_id) > (%(after_at)s, %(after_type)s, %(after_id)s)
 ORDER BY updated_at, type, photo_id
 LIMIT %(limit)s
"""

#: Re-dispatch the listed active rows as a new attempt (or fail them when their attempts are
#: spent, with `%(why)s` in last_error), if they are still at the attempt seen and, when
#: `stale_after` is given, still without a heartbeat for that long (re-checked under the lock).
REDISPATCH = """
UPDATE photo_jobs AS j
   SET attempts = CASE WHEN j.attempts < j.max_attempts THEN j.attempts + 1 ELSE j.attempts END,
       state = CASE WHEN j.attempts < j.max_attempts THEN 'active' ELSE 'failed' END,
       last_error = CASE WHEN j.attempts < j.max_attempts THEN j.last_error
                    ELSE format('%%s: attempt %%s of %%s', %(why)s::text,
                                j.attempts, j.max_attempts) END
 WHERE j.ctid = ANY (ARRAY(
         SELECT a.ctid
           FROM photo_jobs AS a
           JOIN unnest(%(types)s::text[], %(photo_ids)s::text[], %(attempts)s::int[])
                AS l(type, photo_id, attempts)
             ON (a.type, a.photo_id, a.attempts) = (l.type, l.photo_id, l.attempts)
          WHERE a.state = 'active'
            AND (%(stale_after)s::float8 IS NULL
                 OR a.updated_at < now() - make_interval(secs => %(stale_after)s::float8))
            FOR UPDATE SKIP LOCKED))
   AND j.state = 'active'
RETURNING j.type, j.photo_id, j.attempts, j.state
"""

#: The distinct types that have pending rows (a loose index scan: O(types), not O(rows)).
PENDING_TYPES = """
WITH RECURSIVE t(type) AS (
    (SELECT type FROM photo_jobs WHERE state = 'pending' ORDER BY type LIMIT 1)
    UNION ALL
    SELECT (SELECT p.type FROM photo_jobs AS p
             WHERE p.state = 'pending' AND p.type > t.type
             ORDER BY p.type LIMIT 1)
      FROM t WHERE t.type IS NOT NULL
)
SELECT type FROM t WHERE type IS NOT NULL
"""

#: Pending and active rows by type: two halves, so each reads only its partial index.
BACKLOG = """
SELECT type, 'pending', count(*) FROM photo_jobs WHERE state = 'pending' GROUP BY type
UNION ALL
SELECT type, 'active', count(*) FROM photo_jobs WHERE state = 'active' GROUP BY type
"""

#: Seconds since the oldest due pending row of each given type became due (0 if none).
OLDEST_DUE_AGE = """
SELECT t.type,
       -- clamp '-infinity' (greatest() would also turn a NULL "none due" into 1970)
       CASE WHEN d.due IS NULL THEN 0
            ELSE extract(epoch FROM now() - greatest(d.due, '1970-01-01'::timestamptz))
       END::float8
  FROM unnest(%(types)s::text[]) AS t(type)
  LEFT JOIN LATERAL (
        SELECT coalesce(p.next_retry_at, p.created_at) AS due
          FROM photo_jobs AS p
         WHERE p.type = t.type
           AND p.state = 'pending'
           AND coalesce(p.next_retry_at, p.created_at) <= now()
         ORDER BY coalesce(p.next_retry_at, p.created_at)
         LIMIT 1) AS d ON true
"""


# -- the worker side: one attempt's lifecycle, every transition fenced by the attempt number --

#: Fenced start: the row is `active` at this attempt, or `pending` at the attempt before (the
#: claim's COMMIT was lost after the enqueue: this job takes the row over). No row: skip.
#: Its commit does not wait for the WAL flush (`synchronous_commit` off for this statement's
#: own transaction): it is on every job's latency path, and losing it in a server crash is
#: harmless (the row keeps the claim's state, or stays pending and is dispatched again; the
#: durable outcome write is fenced either way).
ATTEMPT_START = """
UPDATE photo_jobs
   SET state = 'active', attempts = %(attempt)s
  FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND ((state = 'active' AND attempts = %(attempt)s)
     OR (state = 'pending' AND attempts = %(attempt)s - 1))
RETURNING max_attempts
"""

#: Why a start was refused (for the log line only).
ATTEMPT_STATE = """
SELECT state, attempts FROM photo_jobs WHERE photo_id = %(photo_id)s AND type = %(type)s
"""

#: Heartbeat of a running attempt: keeps the sweep from rescuing it.
ATTEMPT_HEARTBEAT = """
UPDATE photo_jobs SET updated_at = now()
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND attempts = %(attempt)s
"""

#: Success.
ATTEMPT_DONE = """
UPDATE photo_jobs SET state = 'done', next_retry_at = NULL, last_error = NULL
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND attempts = %(attempt)s
"""

#: Final failure (a permanent error, or the last attempt failed).
ATTEMPT_FAILED = """
UPDATE photo_jobs SET state = 'failed', last_error = %(error)s
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND attempts = %(attempt)s
"""

#: A failed attempt with attempts left: pending again, due after `delay` seconds.
ATTEMPT_RETRY = """
UPDATE photo_jobs
   SET state = 'pending', last_error = %(error)s,
       next_retry_at = now() + make_interval(secs => %(delay)s)
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND attempts = %(attempt)s
"""
