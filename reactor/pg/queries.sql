-- Every SQL statement photo-reactor runs at runtime, by name. `reactor.pg.queries` loads this
-- file once at import: each block starts at its `-- name: NAME` line, and the comment lines
-- right after it (what the statement does and guarantees) are not sent to the server.
-- Values are always bound parameters (%(name)s; a literal percent sign is written %%, except
-- in a statement that takes no parameters, which psycopg sends as it is: there it is %).
-- A call that reaches pg_catalog's function or operator only through a polymorphic type,
-- VARIADIC "any" or a cast (unnest, format, count(x), make_interval of a bound number,
-- oid = regclass) names pg_catalog or casts its arguments to an exact match: Postgres prefers
-- an exact match in any schema of the search_path, which whoever may create there can plant.
-- (unnest(a, b, ...) in FROM is pg_catalog's by the grammar, which only takes it unqualified.)

-- name: CLAIM_DUE
-- Claim up to `limit` due pending rows of one type: a new attempt each, now `active`, returned
-- with its token (`prior_attempts + attempts`, the number its job id carries) and its stored
-- trace context (the job carries it). A row
-- whose attempts are already spent (max_attempts lowered by hand) is failed instead, never
-- counted past its limit: it comes back with state `failed` and is not enqueued. Nothing
-- while the type is paused (the check does not depend on the row, so it is planned as a
-- one-time filter: one primary-key probe per claim, no extra round trip). Rows whose claim
-- failed alone (`skip`, photo ids: `reactor.dispatcher.refused`) are left out. Only rows due
-- within `window` seconds before now() are read (NULL: every due row), the lower bound of the
-- index range (`reactor.dispatcher.bounds`); computed in a sub-select, so that every window
-- gets the same plan (a value the planner sees would have it plan each claim anew). The outer UPDATE finds the rows by ctid alone:
-- the inner lock keeps them pending (FOR UPDATE rechecks `state` on the latest version), and an
-- outer `state = 'pending'` would let the planner read the whole pending index for it, the
-- entries a held snapshot keeps included. Its COMMIT must stay durable (`synchronous_commit`
-- on): an asynchronous commit is visible, and its row locks released, before it is flushed,
-- so a worker could run a handler on a claim that a crash then loses, and the next claim
-- would give the same token out again.
UPDATE photo_jobs AS j
   SET state = CASE WHEN j.attempts < j.max_attempts THEN 'active' ELSE 'failed' END,
       attempts = CASE WHEN j.attempts < j.max_attempts THEN j.attempts + 1 ELSE j.attempts END,
       last_error = CASE WHEN j.attempts < j.max_attempts THEN j.last_error
                    ELSE pg_catalog.format('attempts spent before dispatch: attempt %%s of %%s',
                                j.attempts, j.max_attempts) END
 WHERE j.ctid = ANY (ARRAY(
         SELECT p.ctid
           FROM photo_jobs AS p
          WHERE p.type = %(type)s
            AND p.state = 'pending'
            AND coalesce(p.next_retry_at, p.created_at) <= now()
            AND coalesce(p.next_retry_at, p.created_at)
                >= (SELECT coalesce(now() - make_interval(secs => %(window)s::float8),
                                    '-infinity'))
            AND NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = %(type)s)
            AND p.photo_id <> ALL (%(skip)s::text[])
          ORDER BY coalesce(p.next_retry_at, p.created_at)
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
RETURNING j.type, j.photo_id, j.prior_attempts + j.attempts, j.state, j.traceparent, j.tracestate

-- name: DUE_PHOTO_IDS
-- The photo ids CLAIM_DUE would take now, in the same `window` (locks not taken: a read, for
-- the search of a row that makes the claim fail).
SELECT p.photo_id
  FROM photo_jobs AS p
 WHERE p.type = %(type)s
   AND p.state = 'pending'
   AND coalesce(p.next_retry_at, p.created_at) <= now()
   AND coalesce(p.next_retry_at, p.created_at)
       >= (SELECT coalesce(now() - make_interval(secs => %(window)s::float8), '-infinity'))
   AND p.photo_id <> ALL (%(skip)s::text[])
 ORDER BY coalesce(p.next_retry_at, p.created_at)
 LIMIT %(limit)s

-- name: CLAIM_PROBE
-- CLAIM_DUE's UPDATE and RETURNING (keep them in step) on the given pending rows of one type,
-- run in a transaction that is always rolled back: does the claim of exactly these rows fail?
UPDATE photo_jobs AS j
   SET state = CASE WHEN j.attempts < j.max_attempts THEN 'active' ELSE 'failed' END,
       attempts = CASE WHEN j.attempts < j.max_attempts THEN j.attempts + 1 ELSE j.attempts END,
       last_error = CASE WHEN j.attempts < j.max_attempts THEN j.last_error
                    ELSE pg_catalog.format('attempts spent before dispatch: attempt %%s of %%s',
                                j.attempts, j.max_attempts) END
 WHERE j.ctid = ANY (ARRAY(
         SELECT p.ctid
           FROM photo_jobs AS p
          WHERE p.type = %(type)s AND p.photo_id = ANY (%(photo_ids)s::text[])
            AND p.state = 'pending'
            FOR UPDATE SKIP LOCKED))
RETURNING j.type, j.photo_id, j.prior_attempts + j.attempts, j.state, j.traceparent, j.tracestate

-- name: BACKEND_PID
-- The process id of the session's Postgres backend (compared with the one its start-up
-- reported: a pooler between reports its own).
SELECT pg_backend_pid()

-- name: DUE_TYPES
-- Which of the given types have a pending row due within its claim's `window` (seconds back
-- from now(), as CLAIM_DUE reads) and are not paused: the probe a poll runs before claiming,
-- outside any transaction. One index probe per type; a row another transaction has locked or
-- one the claims refuse still counts (the claim then finds nothing, as without the probe).
SELECT t.type
  FROM unnest(%(types)s::text[], %(windows)s::float8[]) AS t(type, secs)
 WHERE EXISTS (SELECT FROM photo_jobs AS p
                WHERE p.type = t.type
                  AND p.state = 'pending'
                  AND coalesce(p.next_retry_at, p.created_at) <= now()
                  AND coalesce(p.next_retry_at, p.created_at)
                      >= now() - make_interval(secs => t.secs))
   AND NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = t.type)

-- name: NOTE_CLAIM_REFUSED
-- Write why a pending row's claim fails into its last_error (`reactor status` and `reactor
-- failures` show it); the row stays pending, as due as before. A row locked elsewhere (a
-- claim of the reactor's other connection, in flight) is passed over: the note never waits.
UPDATE photo_jobs SET last_error = %(error)s
 WHERE (type, photo_id) = (SELECT type, photo_id FROM photo_jobs
                            WHERE type = %(type)s AND photo_id = %(photo_id)s
                              AND state = 'pending'
                              FOR UPDATE SKIP LOCKED)

-- name: NEXT_DUE_IN
-- Seconds until the earliest pending row of the given types becomes due (NULL if none).
-- Capped at a day, so a row parked at 'infinity' neither breaks the arithmetic nor matters.
-- Paused types are left out: their rows becoming due is no reason to wake up.
SELECT extract(epoch FROM least(min(d.due), now() + interval '1 day') - now())::float8
  FROM pg_catalog.unnest(%(types)s::text[]) AS t(type)
 CROSS JOIN LATERAL (
        SELECT coalesce(p.next_retry_at, p.created_at) AS due
          FROM photo_jobs AS p
         WHERE p.type = t.type
           AND p.state = 'pending'
           AND coalesce(p.next_retry_at, p.created_at) > now()
         ORDER BY coalesce(p.next_retry_at, p.created_at)
         LIMIT 1) AS d
 WHERE NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = t.type)

-- name: LIST_ACTIVE
-- One page of active rows of the given types, for the rescue pass, with whether each is
-- stale (no write for `stale_after` seconds: neither its claim's `updated_at` nor a later
-- `heartbeat_at`) and quiet (none for `gone_after`), and whether its type is paused (left
-- active: rescuing it would dispatch the type). Keyset-paged in (updated_at, type, photo_id)
-- order up to `until` (the sweep's start): rows claimed during the sweep (their updated_at
-- moves to now) are left to the next one, and a rescue moves only heartbeat_at, so a
-- re-dispatched row stays behind the page key and is not visited twice. The page is read in
-- the active rows' index order (a page costs its own rows, not all those after the key), and
-- paused types are told, not filtered, so that no anti-join hides that order from the planner.
-- The page key's updated_at comes back as text and goes back as `after_at`: exact, and
-- whatever a row written before sql/0012 holds ('-infinity', a year Python's datetime cannot
-- hold) it cannot fail the pass.
SELECT p.type, p.photo_id, p.attempts, p.updated_at::text,
       EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = p.type) AS paused,
       p.stale, p.quiet
  FROM (SELECT type, photo_id, prior_attempts + attempts AS attempts, updated_at,
               greatest(updated_at, heartbeat_at)
                   < now() - make_interval(secs => %(stale_after)s::float8) AS stale,
               greatest(updated_at, heartbeat_at)
                   < now() - make_interval(secs => %(gone_after)s::float8) AS quiet
          FROM photo_jobs
         WHERE state = 'active'
           AND type = ANY (%(types)s::text[])
           AND updated_at <= %(until)s
           AND (updated_at, type, photo_id)
               > (%(after_at)s::timestamptz, %(after_type)s, %(after_id)s)
         ORDER BY photo_jobs.updated_at, photo_jobs.type, photo_jobs.photo_id
         LIMIT %(limit)s) AS p
 ORDER BY p.updated_at, p.type, p.photo_id

-- name: REDISPATCH
-- Re-dispatch the listed active rows as a new attempt (or fail them when their attempts are
-- spent, with `%(why)s` in last_error), if they are still at the token seen (`tokens`) and, when
-- `stale_after` is given, still without a heartbeat for that long (re-checked under the lock),
-- and their type is not paused. A re-dispatched row keeps its last_error, or takes
-- `%(error)s` when one is given. Staying active, it is stamped in heartbeat_at, not
-- updated_at (the table's trigger): no indexed column changes, a heap-only update.
UPDATE photo_jobs AS j
   SET attempts = CASE WHEN j.attempts < j.max_attempts THEN j.attempts + 1 ELSE j.attempts END,
       state = CASE WHEN j.attempts < j.max_attempts THEN 'active' ELSE 'failed' END,
       last_error = CASE WHEN j.attempts < j.max_attempts
                         THEN coalesce(%(error)s::text, j.last_error)
                    ELSE pg_catalog.format('%%s: attempt %%s of %%s', %(why)s::text,
                                j.attempts, j.max_attempts) END
 WHERE j.ctid = ANY (ARRAY(
         SELECT a.ctid
           FROM photo_jobs AS a
           JOIN unnest(%(types)s::text[], %(photo_ids)s::text[], %(tokens)s::bigint[])
                AS l(type, photo_id, token)
             ON (a.type, a.photo_id) = (l.type, l.photo_id)
            AND a.prior_attempts + a.attempts = l.token
          WHERE a.state = 'active'
            AND NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = a.type)
            AND (%(stale_after)s::float8 IS NULL
                 OR greatest(a.updated_at, a.heartbeat_at)
                    < now() - make_interval(secs => %(stale_after)s::float8))
            FOR UPDATE SKIP LOCKED))
   AND j.state = 'active'
RETURNING j.type, j.photo_id, j.prior_attempts + j.attempts, j.state, j.traceparent, j.tracestate

-- name: PENDING_TYPES
-- The distinct types that have pending rows (a loose index scan: O(types), not O(rows)).
WITH RECURSIVE t(type) AS (
    (SELECT type FROM photo_jobs WHERE state = 'pending' ORDER BY type LIMIT 1)
    UNION ALL
    SELECT (SELECT p.type FROM photo_jobs AS p
             WHERE p.state = 'pending' AND p.type > t.type
             ORDER BY p.type LIMIT 1)
      FROM t WHERE t.type IS NOT NULL
)
SELECT type FROM t WHERE type IS NOT NULL

-- name: BACKLOG
-- Pending and active rows by type: two halves, so each reads only its partial index.
SELECT type, 'pending', count(*) FROM photo_jobs WHERE state = 'pending' GROUP BY type
UNION ALL
SELECT type, 'active', count(*) FROM photo_jobs WHERE state = 'active' GROUP BY type

-- name: OLDEST_DUE_AGE
-- Seconds since the oldest due pending row of each given type became due (0 if none).
SELECT t.type,
       -- clamp '-infinity' (greatest() would also turn a NULL "none due" into 1970)
       CASE WHEN d.due IS NULL THEN 0
            ELSE extract(epoch FROM now() - greatest(d.due, '1970-01-01'::timestamptz))
       END::float8
  FROM pg_catalog.unnest(%(types)s::text[]) AS t(type)
  LEFT JOIN LATERAL (
        SELECT coalesce(p.next_retry_at, p.created_at) AS due
          FROM photo_jobs AS p
         WHERE p.type = t.type
           AND p.state = 'pending'
           AND coalesce(p.next_retry_at, p.created_at) <= now()
         ORDER BY coalesce(p.next_retry_at, p.created_at)
         LIMIT 1) AS d ON true

-- name: OLDEST_DUE_AGE_OTHERS
-- Seconds since the oldest due pending row of any type not given became due (0 if none): one
-- read of the pending rows, as the backlog's count.
SELECT CASE WHEN min(d.due) IS NULL THEN 0
            ELSE extract(epoch FROM now() - greatest(min(d.due), '1970-01-01'::timestamptz))
       END::float8
  FROM (SELECT coalesce(p.next_retry_at, p.created_at) AS due
          FROM photo_jobs AS p
         WHERE p.state = 'pending'
           AND p.type <> ALL (%(types)s::text[])
           AND coalesce(p.next_retry_at, p.created_at) <= now()) AS d

-- name: LOCK_ROUTES
-- Serialises route registrations: two reactors starting at once cannot both see no conflict.
LOCK TABLE reactor_routes IN SHARE ROW EXCLUSIVE MODE

-- name: ROUTES_LOCK_TRY
-- Take this reactor's session-level liveness lock (true when granted).
SELECT pg_catalog.pg_try_advisory_lock(reactor_routes_lock_class(), %(lock_key)s)

-- name: ROUTES_KEPT
-- Whether this reactor's routes are in order: (its rows recorded and not marked stopped,
-- whether some session holds its lock). Reads only.
SELECT count(*), reactor_routes_lock_held(%(lock_key)s::integer)
  FROM reactor_routes
 WHERE lock_key = %(lock_key)s AND stopped_at IS NULL

-- name: ROUTES_LOCK_KEEP
-- Take the lock again if the backend recorded with it no longer holds it (behind a
-- transaction pooler, the server session that took it may have been closed): `held`,
-- `taken` (this session holds it now: ROUTES_LOCK_OWNER follows in the same transaction) or
-- `refused` (another session holds the key).
SELECT CASE WHEN reactor_routes_lock_held(%(lock_key)s::integer) THEN 'held'
            WHEN pg_catalog.pg_try_advisory_lock(reactor_routes_lock_class(), %(lock_key)s)
                 THEN 'taken'
            ELSE 'refused' END

-- name: ROUTES_LOCK_OWNER
-- The session that holds the liveness lock now is the one whose hold counts.
UPDATE reactor_routes SET backend_pid = pg_backend_pid() WHERE lock_key = %(lock_key)s

-- name: ROUTES_STOPPED
-- A stopping reactor's rows are no longer live, whichever session holds its lock.
UPDATE reactor_routes SET stopped_at = now()
 WHERE lock_key = ANY (%(own_keys)s::integer[]) AND stopped_at IS NULL

-- name: ROUTES_LOCK_TIMEOUT
-- How long upkeep waits for the routes' table lock (a registration holds it for a moment).
SET LOCAL lock_timeout = '2s'

-- name: ROUTES_UNLOCK
-- Release the lock (when this session holds it).
SELECT pg_catalog.pg_advisory_unlock(reactor_routes_lock_class(), %(lock_key)s)

-- name: LIVE_ROUTE_CONFLICTS
-- Routes recorded by other live reactors for the given types that differ from ours.
SELECT r.type, r.handler, r.queue, r.registered_by, r.registered_at
  FROM reactor_routes AS r
  JOIN unnest(%(types)s::text[], %(handlers)s::text[], %(queues)s::text[])
       AS m(type, handler, queue) ON m.type = r.type
 WHERE (r.handler, r.queue) <> (m.handler, m.queue)
   AND r.lock_key <> %(lock_key)s
   AND reactor_routes_live(r.lock_key)
 ORDER BY r.type, r.registered_at

-- name: FORGET_DEAD_ROUTES
-- Forget, for the given types, every row that is not live (the rows of stopped reactors), and
-- our own earlier rows; then record ours.
DELETE FROM reactor_routes AS r
 WHERE r.type = ANY (%(types)s::text[])
   AND (r.lock_key = ANY (%(own_keys)s::integer[]) OR NOT reactor_routes_live(r.lock_key))

-- name: RECORD_ROUTE
-- The rows are recorded by the session that took the lock (same transaction), so its pid is
-- the holder whose lock makes them live.
INSERT INTO reactor_routes (type, handler, queue, lock_key, registered_by, backend_pid)
SELECT t.type, t.handler, t.queue, %(lock_key)s, %(registered_by)s, pg_backend_pid()
  FROM unnest(%(types)s::text[], %(handlers)s::text[], %(queues)s::text[])
       AS t(type, handler, queue)

-- name: RECORDED_ROUTES
-- Every recorded route, the newest row of each type first, with how many live reactors use it.
SELECT r.type, r.handler, r.queue, max(r.registered_at) AS registered_at,
       count(*) FILTER (WHERE reactor_routes_live(r.lock_key)) AS live_reactors,
       string_agg(r.registered_by, ', ' ORDER BY r.registered_at)
           FILTER (WHERE reactor_routes_live(r.lock_key)) AS live_by
  FROM reactor_routes AS r
 GROUP BY r.type, r.handler, r.queue
 ORDER BY r.type, max(r.registered_at) DESC

-- name: FOUND_PHOTO_IDS
-- The photo ids among the given ones that have a row (of `type`, if given), in photo_jobs or
-- archived.
SELECT photo_id
  FROM photo_jobs
 WHERE photo_id = ANY (%(photo_ids)s::text[])
   AND (%(type)s::text IS NULL OR type = %(type)s)
UNION
SELECT photo_id
  FROM photo_jobs_history
 WHERE photo_id = ANY (%(photo_ids)s::text[])
   AND (%(type)s::text IS NULL OR type = %(type)s)

-- name: FAILURES
-- The latest failed and cancelled rows and rows that failed at least once and will be retried
-- (or are being retried), newest first, of one type or of all (`reactor failures`, the dashboard). Each
-- branch is one walk of its state's index, newest first, stopped at the limit (pending and
-- active rows in arms of their own: `state IN (...)` was planned as a scan of the table). `last_error`
-- comes whole, or cut to `error_chars` (the dashboard: a hostile row may hold a huge one).
-- A row's time is its last write: an active row's last heartbeat or rescue when it had one
-- since its claim (heartbeat_at; NULL in every other state). Times are clamped to what
-- Python's datetime holds in any time zone (0001-01-02 to 9999-12-30 UTC): a row written
-- before sql/0012 may hold 'infinity' or '-infinity'.
SELECT f.type, f.photo_id, f.state, f.attempts, f.max_attempts,
       CASE WHEN %(error_chars)s::int IS NULL THEN f.last_error
            ELSE left(f.last_error, %(error_chars)s::int) END,
       least(greatest(f.updated_at, f.heartbeat_at, '0001-01-02 00:00:00+00'),
             '9999-12-30 00:00:00+00'),
       CASE WHEN f.state = 'pending'  -- a failed row retries never
            THEN least(greatest(f.next_retry_at, '0001-01-02 00:00:00+00'),
                       '9999-12-30 00:00:00+00') END,
       f.prior_attempts + f.attempts  -- the token: the dashboard's forms are fenced by it
  FROM ((SELECT * FROM photo_jobs
          WHERE state = 'failed' AND (%(type)s::text IS NULL OR type = %(type)s)
          ORDER BY updated_at DESC LIMIT %(limit)s)
        UNION ALL
        (SELECT * FROM photo_jobs
          WHERE state = 'cancelled' AND (%(type)s::text IS NULL OR type = %(type)s)
          ORDER BY updated_at DESC LIMIT %(limit)s)
        UNION ALL
        (SELECT * FROM photo_jobs
          WHERE state = 'pending' AND last_error IS NOT NULL
            AND (%(type)s::text IS NULL OR type = %(type)s)
          ORDER BY updated_at DESC LIMIT %(limit)s)
        UNION ALL
        (SELECT * FROM photo_jobs
          WHERE state = 'active' AND last_error IS NOT NULL
            AND (%(type)s::text IS NULL OR type = %(type)s)
          ORDER BY greatest(updated_at, heartbeat_at) DESC LIMIT %(limit)s)) AS f
 ORDER BY greatest(f.updated_at, f.heartbeat_at) DESC
 LIMIT %(limit)s

-- name: FAILURES_COUNT
-- `reactor failures`: how many rows `FAILURES` would list without its limit.
-- One arm per state, so each reads its own index (an OR of states was a scan of the table).
SELECT sum(n)::bigint
  FROM (SELECT count(*) FROM photo_jobs
         WHERE state = 'failed' AND (%(type)s::text IS NULL OR type = %(type)s)
        UNION ALL
        SELECT count(*) FROM photo_jobs
         WHERE state = 'cancelled' AND (%(type)s::text IS NULL OR type = %(type)s)
        UNION ALL
        SELECT count(*) FROM photo_jobs
         WHERE state = 'pending' AND last_error IS NOT NULL
           AND (%(type)s::text IS NULL OR type = %(type)s)
        UNION ALL
        SELECT count(*) FROM photo_jobs
         WHERE state = 'active' AND last_error IS NOT NULL
           AND (%(type)s::text IS NULL OR type = %(type)s)) AS c(n)

-- name: PAUSE_TYPES
-- Pause the given types (already paused ones are left as they are); returns those paused now.
INSERT INTO reactor_paused_types (type, paused_by)
SELECT t.type, %(paused_by)s FROM pg_catalog.unnest(%(types)s::text[]) AS t(type)
    ON CONFLICT (type) DO NOTHING
RETURNING type

-- name: RESUME_TYPES
-- Resume the given types; returns those that were paused. The table's DELETE trigger
-- notifies the reactors.
DELETE FROM reactor_paused_types WHERE type = ANY (%(types)s::text[]) RETURNING type

-- name: PAUSED_TYPES
-- Every paused type, with when and by whom; `paused_at` clamped to the years Python's datetime
-- holds (a role that may write the table may write 'infinity' or year 294276 there).
SELECT type,
       least(greatest(paused_at, '0002-01-01 00:00+00'), '9998-12-31 00:00+00') AS paused_at,
       paused_by
  FROM reactor_paused_types ORDER BY type

-- name: KNOWN_TYPES
-- Which of the given types the database knows: it has rows or is paused. (An unknown type
-- reads the whole table once; this runs only for `reactor pause`/`resume` of unrouted types.)
SELECT t.type
  FROM pg_catalog.unnest(%(types)s::text[]) AS t(type)
 WHERE EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = t.type)
    OR EXISTS (SELECT FROM photo_jobs AS p WHERE p.type = t.type)

-- name: PRUNE_FINISHED
-- Delete up to `limit` rows in `state` (done or failed) last updated more than `age` seconds
-- ago, oldest first: one range of the finished-rows index, rows locked by others skipped.
DELETE FROM photo_jobs
 WHERE ctid = ANY (ARRAY(
         SELECT ctid FROM photo_jobs
          WHERE state = %(state)s
            AND updated_at < now() - make_interval(secs => %(age)s::float8)
          ORDER BY updated_at
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
   AND state = %(state)s

-- name: COUNT_FINISHED
-- How many rows PRUNE_FINISHED would delete in all (`reactor prune --dry-run`), reading at
-- most `limit` of them (NULL: all, an exact count): a count that reaches `limit` stopped
-- early, and the caller asks the planner instead (ESTIMATE_FINISHED).
SELECT count(*)
  FROM (SELECT FROM photo_jobs
         WHERE state = %(state)s
           AND updated_at < now() - make_interval(secs => %(age)s::float8)
         LIMIT %(limit)s) AS f

-- name: ESTIMATE_FINISHED
-- The planner's estimate of COUNT_FINISHED's rows (keep the two conditions in step), from the
-- table's statistics: a one-row EXPLAIN in JSON ("Plan Rows").
EXPLAIN (FORMAT JSON)
SELECT FROM photo_jobs
 WHERE state = %(state)s
   AND updated_at < now() - make_interval(secs => %(age)s::float8)

-- name: ARCHIVE_FINISHED
-- Move up to `limit` rows in `state` (done, failed or cancelled) last updated more than `age`
-- seconds ago and before `before` (a UTC month's start, 'YYYY-MM-DD': from there on a month
-- may lack its partition, see HISTORY_BATCH_MONTHS), oldest first, from photo_jobs to
-- photo_jobs_history in one statement: the rows PRUNE_FINISHED would delete, inserted as they
-- were (`updated_at` as `finished_at`), except rows of a year BC, which no partition's name can
-- hold (prune deletes them). Rows locked by others are skipped; a failure moves none.
WITH moved AS (
     DELETE FROM photo_jobs
      WHERE ctid = ANY (ARRAY(
              SELECT ctid FROM photo_jobs
               WHERE state = %(state)s
                 AND updated_at >= '0001-01-01 00:00:00+00'
                 AND updated_at < now() - make_interval(secs => %(age)s::float8)
                 AND updated_at < (%(before)s::timestamp AT TIME ZONE 'UTC')
               ORDER BY updated_at
               LIMIT %(limit)s
                 FOR UPDATE SKIP LOCKED))
        AND state = %(state)s
  RETURNING photo_id, type, state, attempts, max_attempts, prior_attempts, last_error,
            created_at, updated_at, traceparent, tracestate)
INSERT INTO photo_jobs_history (photo_id, type, state, attempts, max_attempts, prior_attempts,
                                last_error, created_at, finished_at, traceparent, tracestate)
SELECT photo_id, type, state, attempts, max_attempts, prior_attempts, last_error,
       created_at, updated_at, traceparent, tracestate
  FROM moved

-- name: HISTORY_BATCH_MONTHS
-- Before each ARCHIVE_FINISHED batch of `state`: the UTC months of the `limit` rows it would
-- move next (the oldest, read without locks: one range of the finished-rows index), oldest
-- first: the month's start and the next month's ('YYYY-MM-DD'), its rows, whether its
-- partition exists. At most `limit` months, however many months the table spans.
SELECT to_char(m.month, 'YYYY-MM-DD'),
       to_char(m.month + interval '1 month', 'YYYY-MM-DD'),
       m.rows,
       to_regclass('public.photo_jobs_history_' || to_char(m.month, 'YYYY_MM')) IS NOT NULL
  FROM (SELECT date_trunc('month', n.updated_at AT TIME ZONE 'UTC') AS month,
               count(*) AS rows
          FROM (SELECT updated_at FROM photo_jobs
                 WHERE state = %(state)s
                   AND updated_at >= '0001-01-01 00:00:00+00'
                   AND updated_at < now() - make_interval(secs => %(age)s::float8)
                 ORDER BY updated_at
                 LIMIT %(limit)s) AS n
         GROUP BY 1) AS m
 ORDER BY m.month

-- name: ADD_HISTORY_MONTHS
-- Create the missing history partitions of `months` (UTC months' starts, 'YYYY-MM-DD') and,
-- with `ahead`, of the months of the cutoff (`age` seconds ago), of now and of the next (rows
-- that pass the cutoff later find theirs made): how many were created.
SELECT coalesce(sum(photo_jobs_history_add_months(m, m)), 0)
  FROM (SELECT given AT TIME ZONE 'UTC'
          FROM pg_catalog.unnest(%(months)s::timestamp[]) AS given
         UNION
        SELECT at
          FROM pg_catalog.unnest(ARRAY[now() - make_interval(secs => %(age)s::float8), now(),
                                       (now() AT TIME ZONE 'UTC' + interval '1 month')
                                           AT TIME ZONE 'UTC']) AS at
         WHERE %(ahead)s) AS months(m)

-- name: DROP_HISTORY_BEFORE
-- Drop the history months whose every row finished more than `age` seconds ago: their names.
SELECT photo_jobs_history_drop_before(now() - make_interval(secs => %(age)s::float8))

-- name: HISTORY_MONTHS_BEFORE
-- What DROP_HISTORY_BEFORE would drop (`reactor archive --dry-run`): each month's partition,
-- its rows as the statistics have them (0 before its first ANALYZE) and when its month ends.
SELECT name, estimated_rows, ends
  FROM photo_jobs_history_months_before(now() - make_interval(secs => %(age)s::float8))

-- name: HISTORY_MONTH_ROWS
-- The rows of the history's month ending at `ends` (a UTC month: only its partition is read).
SELECT count(*) FROM photo_jobs_history
 WHERE finished_at >= (%(ends)s::timestamptz AT TIME ZONE 'UTC' - interval '1 month')
                      AT TIME ZONE 'UTC'
   AND finished_at < %(ends)s::timestamptz

-- name: HISTORY_COUNT_UP_TO
-- `reactor status`: rows in photo_jobs_history, reading at most `limit` of them (NULL: all),
-- and its monthly partitions; a count that reaches `limit` stopped early, and the caller
-- asks the planner instead (ESTIMATE_HISTORY).
SELECT (SELECT count(*) FROM (SELECT FROM photo_jobs_history LIMIT %(limit)s) AS h),
       (SELECT count(*) FROM pg_inherits
         WHERE inhparent = 'photo_jobs_history'::regclass::oid)

-- name: ESTIMATE_HISTORY
-- The planner's estimate of the rows in photo_jobs_history (a one-row EXPLAIN in JSON).
EXPLAIN (FORMAT JSON) SELECT FROM photo_jobs_history

-- name: RESTORE_ARCHIVED
-- `reactor requeue` of photos whose rows were archived: the latest archived life of each
-- (photo, type) among the given ids (of `type`, if not NULL) that has no row in photo_jobs
-- comes back as a pending row, due now, at attempts 0 and with that life's max_attempts, its
-- token going on from the highest of every archived life (a finished_at is only a clock's
-- word, so the latest life need not hold the highest token). The history rows stay.
INSERT INTO photo_jobs (photo_id, type, max_attempts, prior_attempts, next_retry_at)
SELECT l.photo_id, l.type, l.max_attempts, l.token, now()
  FROM (SELECT DISTINCT ON (h.photo_id, h.type) h.photo_id, h.type, h.max_attempts,
               pg_catalog.max(h.prior_attempts + h.attempts)
                   OVER (PARTITION BY h.photo_id, h.type) AS token
          FROM photo_jobs_history AS h
         WHERE h.photo_id = ANY (%(photo_ids)s::text[])
           AND (%(type)s::text IS NULL OR h.type = %(type)s)
         ORDER BY h.photo_id, h.type, h.finished_at DESC) AS l
 ORDER BY l.photo_id, l.type
ON CONFLICT (photo_id, type) DO NOTHING

-- name: CURRENT_MINUTE
-- The dashboard: the database's clock, and its current minute (the right end of the
-- per-minute charts).
SELECT now(), date_trunc('minute', now())

-- name: FINISHED_BY_MINUTE
-- The dashboard: rows finished in the last 60 minutes (up to `minute`), by the minute of
-- their last update, type and state, with the attempts they took. Rows re-submitted or
-- pruned since are not counted. One range of the finished-rows index per state (one arm
-- each: with `state IN (...)` Postgres estimated a large share of the table and scanned it).
-- Rows updated after `minute` (clock skew, or 'infinity' written before sql/0012) are left out.
SELECT date_trunc('minute', updated_at) AS minute, type, 'done', count(*), sum(attempts)
  FROM photo_jobs
 WHERE state = 'done'
   AND updated_at >= %(minute)s::timestamptz - interval '59 minutes'
   AND updated_at < %(minute)s::timestamptz + interval '1 minute'
 GROUP BY 1, 2
UNION ALL
SELECT date_trunc('minute', updated_at) AS minute, type, 'failed', count(*), sum(attempts)
  FROM photo_jobs
 WHERE state = 'failed'
   AND updated_at >= %(minute)s::timestamptz - interval '59 minutes'
   AND updated_at < %(minute)s::timestamptz + interval '1 minute'
 GROUP BY 1, 2

-- name: REACTOR_SESSIONS
-- The dashboard: the reactors' connections to this database (the listener of each listening
-- reactor, the work connection of each), and whether the session holds every doorbell key in
-- exclusive mode (armed: writers ring it). Other roles' sessions are visible only to a
-- superuser or a member of pg_read_all_stats.
SELECT a.pid, substr(a.application_name, 15), host(a.client_addr), a.backend_start,
       a.pid IN (SELECT l.pid
                   FROM pg_locks AS l
                  WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
                    AND l.database = (SELECT oid FROM pg_database
                                       WHERE datname = current_database())
                    AND l.classid = (photo_jobs_doorbell_key() >> 32)::oid
                    AND l.objid::bigint - (photo_jobs_doorbell_key() & 4294967295)
                        BETWEEN 0 AND photo_jobs_doorbell_stripes() - 1
                  GROUP BY l.pid
                 HAVING pg_catalog.count(DISTINCT l.objid)
                        = photo_jobs_doorbell_stripes()) AS armed
  FROM pg_stat_activity AS a
 WHERE a.datname = current_database()
   AND a.application_name IN ('photo-reactor listener', 'photo-reactor work')
 ORDER BY a.backend_start, a.pid

-- name: LEDGER_PROBLEM
-- Why the migrations must not touch `public.reactor_migrations` and
-- `public.reactor_migration_begin` as they are (NULL: they are absent, or exactly what sql/0001
-- makes, owned by the role running the migrations). Migrations insert into that table with
-- the migrating role's rights, often a superuser's: a table someone else made could run their
-- code then (a trigger, a rule, a default, an index expression, a policy). sql/0001 runs the
-- same checks before it creates anything. It takes no parameters: its `%I` reach format().
WITH t AS (SELECT c.oid, c.relkind, c.relowner, c.relrowsecurity
             FROM pg_catalog.pg_class AS c
            WHERE c.oid = pg_catalog.to_regclass('public.reactor_migrations')::oid),
     f AS (SELECT p.proowner
             FROM pg_catalog.pg_proc AS p
            WHERE p.oid = pg_catalog.to_regprocedure(
                      'public.reactor_migration_begin(integer, text)')::oid)
SELECT CASE
  WHEN (SELECT relkind FROM t) <> 'r' THEN 'is not a plain table'
  WHEN (SELECT relowner FROM t) <> (SELECT oid FROM pg_catalog.pg_roles
                                     WHERE rolname = current_user)
    THEN pg_catalog.format('is owned by role %I, not by %I (the role running the migrations)',
                           (SELECT relowner FROM t)::regrole, current_user)
  WHEN (SELECT proowner FROM f) <> (SELECT oid FROM pg_catalog.pg_roles
                                     WHERE rolname = current_user)
    THEN pg_catalog.format('has a function reactor_migration_begin owned by role %I, not by %I',
                           (SELECT proowner FROM f)::regrole, current_user)
  WHEN NOT EXISTS (SELECT 1 FROM t) THEN NULL
  WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = (SELECT oid FROM t))
    THEN 'has triggers'
  WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite WHERE ev_class = (SELECT oid FROM t))
    THEN 'has rules'
  WHEN (SELECT relrowsecurity FROM t)
       OR EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = (SELECT oid FROM t))
    THEN 'has row-level security policies'
  WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_inherits
                WHERE (SELECT oid FROM t) IN (inhrelid, inhparent))
    THEN 'is part of an inheritance tree'
  WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
                WHERE conrelid = (SELECT oid FROM t) AND contype NOT IN ('p', 'n'))
       OR EXISTS (SELECT 1 FROM pg_catalog.pg_index
                   WHERE indrelid = (SELECT oid FROM t) AND NOT indisprimary)
    THEN 'has constraints or indexes that sql/0001 does not make'
  WHEN NOT coalesce(
         (SELECT pg_catalog.array_agg(a.attname::text || ' ' || a.atttypid::regtype::text
                                      || ' ' || coalesce(pg_catalog.pg_get_expr(d.adbin,
                                                                                d.adrelid), '')
                                      ORDER BY a.attnum)
            FROM pg_catalog.pg_attribute AS a
            LEFT JOIN pg_catalog.pg_attrdef AS d ON (d.adrelid, d.adnum) = (a.attrelid, a.attnum)
           WHERE a.attrelid = (SELECT oid FROM t) AND a.attnum > 0 AND NOT a.attisdropped)
         OPERATOR(pg_catalog.=) ARRAY['version integer ', 'name text ',
                                      'applied_at timestamp with time zone now()'],
         false)
    THEN 'has columns, types or defaults that sql/0001 does not make'
END

-- name: SET_IDLE_IN_TRANSACTION_TIMEOUT
-- End this session when it sits idle inside a transaction longer than `timeout` (e.g.
-- '15000ms'): Postgres closes it and the transaction rolls back, releasing its row locks.
-- For the session, so only on connections that are known to have one (no pooler between).
SELECT set_config('idle_in_transaction_session_timeout', %(timeout)s, false)

-- name: SERVER_READ_ONLY
-- Whether this session cannot write: a standby (in recovery) or a read-only default.
SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool

-- name: SEARCH_PATH_WRITERS
-- `reactor run` at start: the schemas of this session's search_path (its temporary schema left
-- out) in which roles other than superusers, photo_jobs' owner and its members may CREATE,
-- with those roles (predefined pg_ roles left out: their members are listed). A function or
-- operator such a role puts there can take this session's unqualified calls over.
SELECT n.nspname::text, pg_catalog.array_agg(r.rolname::text ORDER BY r.rolname)
  FROM pg_catalog.unnest(pg_catalog.current_schemas(false)) AS s(name)
  JOIN pg_catalog.pg_namespace AS n ON n.nspname = s.name
  JOIN pg_catalog.pg_roles AS r ON pg_catalog.has_schema_privilege(r.oid, n.oid, 'CREATE')
 WHERE n.oid <> pg_catalog.pg_my_temp_schema()
   AND NOT r.rolsuper
   AND NOT pg_catalog.starts_with(r.rolname::text, 'pg_')
   AND NOT pg_catalog.pg_has_role(
             r.oid,
             (SELECT c.relowner FROM pg_catalog.pg_class AS c
               WHERE c.oid = pg_catalog.to_regclass('public.photo_jobs')::oid),
             'MEMBER')
 GROUP BY n.nspname
 ORDER BY n.nspname

-- the LISTEN session and the doorbell --------------------------------------------------------

-- name: LISTEN
-- Listen to the channel the NOTIFY triggers use (`reactor.dispatcher.listener.CHANNEL`).
LISTEN photo_jobs

-- name: SET_LOCK_TIMEOUT
-- The listener session's lock timeout (`timeout`, e.g. '10ms'): how long an arm waits.
SELECT set_config('lock_timeout', %(timeout)s, false)

-- name: PING
-- The idle listener's liveness probe; on a claim-ahead session, the statement after a claim
-- read from pipeline mode, which arms the idle-in-transaction timeout again.
SELECT 1

-- The doorbell is `photo_jobs_doorbell_stripes()` advisory lock keys from
-- `photo_jobs_doorbell_key()` on (sql/0004); armed means holding all of them in exclusive
-- mode. Each statement takes them row by row in generate_series order, that is in key order,
-- so two arming reactors cannot deadlock.

-- name: DOORBELL_TRY_ARM
-- Take every doorbell key without waiting (true when all were granted).
SELECT bool_and(pg_try_advisory_lock(photo_jobs_doorbell_key() + s))
  FROM generate_series(0, photo_jobs_doorbell_stripes() - 1) AS s

-- name: DOORBELL_ARM
-- Take every doorbell key, queueing behind writers in flight (bounded by the lock timeout).
SELECT pg_catalog.count(pg_advisory_lock(photo_jobs_doorbell_key() + s))
  FROM generate_series(0, photo_jobs_doorbell_stripes() - 1) AS s

-- name: DOORBELL_RELEASE
-- Release every session-level advisory lock of the listener session, which only ever takes
-- the doorbell's: so a partial arm, or a key counted twice (a retry after a partial try, a
-- timeout that raced its grant), cannot stay behind.
SELECT pg_advisory_unlock_all()

-- name: DOORBELL_HOLDERS
-- How many stripes this session holds in exclusive mode, whether one other session holds
-- every stripe so (an armed reactor: any role may take an advisory lock, so a session holding
-- only some of them is a writer in flight or a squatter, and writers on the other stripes do
-- not notify), and how many stripes there are (a bigint key is classid = high 32 bits,
-- objid = low 32 bits, objsubid = 1 in pg_locks).
WITH held AS (
    SELECT l.pid, pg_catalog.count(DISTINCT l.objid) AS stripes
      FROM pg_locks AS l
     WHERE l.locktype = 'advisory'
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.classid = (photo_jobs_doorbell_key() >> 32)::oid
       AND l.objid BETWEEN (photo_jobs_doorbell_key() & 4294967295)::oid
                       AND ((photo_jobs_doorbell_key() & 4294967295)
                            + photo_jobs_doorbell_stripes() - 1)::oid
       AND l.objsubid = 1
       AND l.mode = 'ExclusiveLock'
       AND l.granted
     GROUP BY l.pid
)
SELECT coalesce(max(stripes) FILTER (WHERE pid = pg_backend_pid()), 0),
       coalesce(bool_or(pid <> pg_backend_pid() AND stripes = photo_jobs_doorbell_stripes()),
                false),
       photo_jobs_doorbell_stripes()
  FROM held

-- migrations ---------------------------------------------------------------------------------

-- name: LEDGER_EXISTS
-- Whether the migrations ledger exists (false: a database never migrated).
SELECT to_regclass('reactor_migrations') IS NOT NULL

-- name: APPLIED_VERSIONS
-- The versions the ledger records.
SELECT version FROM reactor_migrations

-- name: SCHEMA_VERSION
-- The highest applied version (0 for an empty ledger).
SELECT coalesce(max(version), 0) FROM reactor_migrations

-- name: SET_SEARCH_PATH
-- The migrate session's search_path (`search_path`), for the whole session.
SELECT pg_catalog.set_config('search_path', %(search_path)s, false)

-- name: SEARCH_PATH_NOW
-- The session's search_path, to be put back after a migration file set its own (SET LOCAL)
-- inside a transaction that goes on (Django's migration, which records itself after).
SELECT pg_catalog.current_setting('search_path')

-- name: SET_LOCAL_SEARCH_PATH
-- `search_path` for the rest of this transaction only.
SELECT pg_catalog.set_config('search_path', %(search_path)s, true)

-- name: MIGRATION_LOCK
-- The advisory lock `reactor migrate` holds while it applies files (`key`): taken if free.
SELECT pg_catalog.pg_try_advisory_lock(%(key)s)

-- name: MIGRATION_LOCK_HOLDER
-- Who holds that lock (any role may take an advisory key, so it may not be a migration).
SELECT l.pid, a.usename, a.application_name
  FROM pg_catalog.pg_locks AS l
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_catalog.pg_database
                      WHERE datname = pg_catalog.current_database())
   AND l.classid = (%(key)s::int8 >> 32)::oid
   AND l.objid = (%(key)s::int8 & 4294967295)::oid
 LIMIT 1

-- name: MIGRATION_UNLOCK
SELECT pg_catalog.pg_advisory_unlock(%(key)s)

-- the sweep and the operator's commands -------------------------------------------------------

-- name: DATABASE_NOW
-- The database's clock (the sweep pages active rows up to its start).
SELECT now()

-- name: FINISHED_COUNTS_UP_TO
-- `reactor status`, the dashboard: rows of one finished state (done, failed, cancelled) by
-- type, reading at most `limit` of them (NULL: all, an exact count). A total under `limit` is
-- exact; one that reaches it stopped early, and the caller asks the planner instead
-- (ESTIMATE_ROWS_OF_TYPE): counting millions of done rows is a scan of the table.
SELECT type, count(*)
  FROM (SELECT type FROM photo_jobs WHERE state = %(state)s LIMIT %(limit)s) AS f
 GROUP BY type

-- name: ESTIMATE_ROWS_OF_STATE
-- The planner's estimate of the rows in one state (from the table's statistics, scaled to its
-- current size: no row is read), as a one-row EXPLAIN in JSON ("Plan Rows").
EXPLAIN (FORMAT JSON) SELECT FROM photo_jobs WHERE state = %(state)s

-- name: ESTIMATE_ROWS_OF_TYPE
-- The planner's estimate of the rows of one type in one state (from the table's statistics,
-- scaled to its current size: no row is read), as a one-row EXPLAIN in JSON ("Plan Rows").
EXPLAIN (FORMAT JSON) SELECT FROM photo_jobs WHERE state = %(state)s AND type = %(type)s

-- name: COMMON_TYPES
-- The types the table's statistics (the last ANALYZE) list as common: which types to ask
-- the planner about when finished rows are too many to read.
SELECT v.type
  FROM pg_stats AS s, pg_catalog.unnest(s.most_common_vals::text::text[]) AS v(type)
 WHERE s.schemaname = 'public' AND s.tablename = 'photo_jobs' AND s.attname = 'type'

-- name: HORIZON_HOLDERS
-- What holds back the xmin horizon, the oldest transaction whose view vacuum must keep row
-- versions for: the oldest of each kind, with its age in transactions (`age(xid)`) and, where
-- Postgres records a start, in seconds. Backends: this database's sessions (and those of no
-- database: a walsender passing a standby's hot_standby_feedback) with a snapshot or a
-- transaction id, age from `xact_start`; the reading session and autovacuum workers (whose
-- xmin vacuum ignores) are left out; other roles' sessions show no start (and, depending on
-- the server version, no xmin) without pg_read_all_stats (VACUUM_HEALTH counts those).
-- Prepared transactions of this database, age
-- from `prepared`. Replication slots' `xmin` (holds back every table) and `catalog_xmin`
-- (only the catalogs): no time recorded, transactions only.
(SELECT 'backend', a.pid::text,
        extract(epoch FROM now() - a.xact_start)::float8,
        greatest(age(a.backend_xmin), age(a.backend_xid)),
        a.state, a.application_name, a.datname, a.usename
   FROM pg_stat_activity AS a
  WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    AND a.pid <> pg_backend_pid()
    AND (a.datid IS NULL OR a.datname = current_database())
    AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
  ORDER BY 4 DESC, 3 DESC NULLS LAST
  LIMIT 1)
UNION ALL
(SELECT 'prepared_xact', p.gid, extract(epoch FROM now() - p.prepared)::float8,
        age(p.transaction), NULL, NULL, p.database, p.owner
   FROM pg_prepared_xacts AS p
  WHERE p.database = current_database()
  ORDER BY 4 DESC
  LIMIT 1)
UNION ALL
(SELECT 'replication_slot', r.slot_name, NULL, age(r.xmin),
        CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, r.database, NULL
   FROM pg_replication_slots AS r
  WHERE r.xmin IS NOT NULL
  ORDER BY 4 DESC
  LIMIT 1)
UNION ALL
(SELECT 'replication_slot_catalog', r.slot_name, NULL, age(r.catalog_xmin),
        CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, r.database, NULL
   FROM pg_replication_slots AS r
  WHERE r.catalog_xmin IS NOT NULL
  ORDER BY 4 DESC
  LIMIT 1)

-- name: VACUUM_HEALTH
-- Whether vacuum keeps photo_jobs clean: the sessions of this database that this role sees
-- only in part (other roles', without pg_read_all_stats or pg_monitor: no state, no start,
-- and depending on the server version no xmin), the role; the table's live and dead tuples
-- and last vacuums (pg_stat_user_tables: zeros and NULLs while track_counts is off); the
-- server's `autovacuum` and `track_counts` settings and the table's own `autovacuum_enabled`
-- (true when not set); how full the server's NOTIFY queue is (0 to 1, shared by every database
-- of the server: a session that LISTENs and stays in one transaction keeps it from emptying,
-- and once it is full every transaction that notifies fails at COMMIT).
SELECT (SELECT count(*)
          FROM pg_stat_activity AS a
         WHERE a.query = '<insufficient privilege>' AND a.datname = current_database()),
       current_user::text,
       coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0), s.last_autovacuum, s.last_vacuum,
       current_setting('autovacuum')::boolean,
       current_setting('track_counts')::boolean,
       coalesce((SELECT o.option_value::boolean
                   FROM pg_options_to_table(c.reloptions) AS o
                  WHERE o.option_name = 'autovacuum_enabled'), true),
       pg_catalog.pg_notification_queue_usage()
  FROM pg_class AS c
  LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
 WHERE c.oid = 'public.photo_jobs'::regclass::oid

-- name: STATUS_PER_TYPE
-- `reactor status`: per given type, the age of the oldest due row, the next retry, and how
-- many active rows have had no write for `stale_after` seconds (neither updated_at nor
-- heartbeat_at: the index range on updated_at, then heartbeat_at checked on those rows).
SELECT t.type,
       (SELECT CASE WHEN min(due) IS NULL THEN NULL  -- none due (greatest() skips NULLs)
                    ELSE extract(epoch FROM now() - greatest(min(due), '1970-01-01'::timestamptz))
               END::float8
          FROM (SELECT coalesce(p.next_retry_at, p.created_at) AS due
                  FROM photo_jobs AS p
                 WHERE p.type = t.type AND p.state = 'pending'
                   AND coalesce(p.next_retry_at, p.created_at) <= now()) AS d),
       (SELECT min(p.next_retry_at)::text  -- text: 'infinity' has no Python datetime
          FROM photo_jobs AS p
         WHERE p.type = t.type AND p.state = 'pending'
           AND coalesce(p.next_retry_at, p.created_at) > now()),
       (SELECT count(*)
          FROM photo_jobs AS a
         WHERE a.type = t.type AND a.state = 'active'
           AND a.updated_at < now() - make_interval(secs => %(stale_after)s::float8)
           AND (a.heartbeat_at IS NULL
                OR a.heartbeat_at < now() - make_interval(secs => %(stale_after)s::float8)))
  FROM pg_catalog.unnest(%(types)s::text[]) AS t(type)

-- name: STATUS_OTHER_TYPES
-- `reactor status`: STATUS_PER_TYPE's figures of every type but the given ones, together (the
-- types it does not name, however many): the age of the oldest due row of any of them, their
-- next retry, their active rows with no write for `stale_after` seconds. One pass over the
-- pending rows, as BACKLOG's, not a lookup per type.
SELECT CASE WHEN min(p.due) FILTER (WHERE p.due <= now()) IS NULL THEN NULL
            ELSE extract(epoch FROM now() - greatest(min(p.due) FILTER (WHERE p.due <= now()),
                                                     '1970-01-01'::timestamptz))
       END::float8,
       (min(p.next_retry_at) FILTER (WHERE p.due > now()))::text,
       (SELECT count(*)
          FROM photo_jobs AS a
         WHERE a.state = 'active' AND a.type <> ALL (%(types)s::text[])
           AND a.updated_at < now() - make_interval(secs => %(stale_after)s::float8)
           AND (a.heartbeat_at IS NULL
                OR a.heartbeat_at < now() - make_interval(secs => %(stale_after)s::float8)))
  FROM (SELECT coalesce(next_retry_at, created_at) AS due, next_retry_at
          FROM photo_jobs
         WHERE state = 'pending' AND type <> ALL (%(types)s::text[])) AS p

-- name: CLAIM_REFUSED_ROWS
-- `reactor status`: pending rows whose claim a reactor found failing (their last_error starts
-- with `prefix`), the latest first.
SELECT type, photo_id, last_error
  FROM photo_jobs
 WHERE state = 'pending' AND starts_with(last_error, %(prefix)s)
 ORDER BY updated_at DESC
 LIMIT %(limit)s

-- name: SET_LOCAL_LOCK_TIMEOUT
-- The lock timeout (`timeout`, e.g. '3000ms') of the rest of this transaction only: how long a
-- dashboard action waits for a row another session holds before it fails, changing nothing.
SELECT set_config('lock_timeout', %(timeout)s, true)

-- name: REQUEUE_FAILED
-- Move up to `limit` failed rows (of `type`, if not NULL) back to pending: a new life, at
-- attempts 0, whose attempts of earlier lives are added to prior_attempts (the token goes on:
-- the trigger photo_jobs_new_life does both), due from now (so the age of the oldest due row
-- counts from the requeue, not the insert).
UPDATE photo_jobs
   SET state = 'pending', next_retry_at = now(), last_error = NULL
 WHERE ctid = ANY (ARRAY(
         SELECT ctid FROM photo_jobs
          WHERE state = 'failed' AND (%(type)s::text IS NULL OR type = %(type)s)
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
   AND state = 'failed'

-- name: REQUEUE_PHOTOS
-- Move the done/failed/cancelled rows of the given photos (of `type`, if not NULL) back to
-- pending, as REQUEUE_FAILED does.
UPDATE photo_jobs
   SET state = 'pending', next_retry_at = now(), last_error = NULL
 WHERE photo_id = ANY (%(photo_ids)s::text[])
   AND (%(type)s::text IS NULL OR type = %(type)s)
   AND state IN ('done', 'failed', 'cancelled')

-- name: CANCEL_PHOTOS
-- Cancel the pending/active rows of the given photos (of `type`, if not NULL): `cancelled`,
-- a terminal state, with `reason` in last_error; returns each row cancelled with its token
-- (an active row's running job is the one to stop). A row locked by a claim or an outcome in
-- flight is waited for and checked again: one that has just become done stays done. Every
-- outcome a worker writes is fenced on `state = 'active'`, and the fenced start takes over only
-- a `pending` row, so a job of a cancelled row neither starts nor writes anything. The caller
-- passes the ids sorted (two cancels lock their rows in the same order: no deadlock).
UPDATE photo_jobs
   SET state = 'cancelled', next_retry_at = NULL, last_error = %(reason)s
 WHERE photo_id = ANY (%(photo_ids)s::text[])
   AND (%(type)s::text IS NULL OR type = %(type)s)
   AND state IN ('pending', 'active')
RETURNING type, photo_id, prior_attempts + attempts

-- name: CANCEL_COUNTED
-- CANCEL_PHOTOS for `reactor.cancel()` (keep the two in step): how many rows it cancelled, as
-- a one-row result (true in psycopg's pipeline mode, where a cursor's rowcount is -1).
WITH cancelled AS (
     UPDATE photo_jobs
        SET state = 'cancelled', next_retry_at = NULL, last_error = %(reason)s
      WHERE photo_id = ANY (%(photo_ids)s::text[])
        AND (%(type)s::text IS NULL OR type = %(type)s)
        AND state IN ('pending', 'active')
     RETURNING 1)
SELECT count(*) FROM cancelled

-- name: CANCEL_PENDING
-- Cancel up to `limit` pending rows of `type`, as CANCEL_PHOTOS does: one range of the pending
-- index, rows a claim holds skipped (they are being dispatched: cancel them by id).
UPDATE photo_jobs
   SET state = 'cancelled', next_retry_at = NULL, last_error = %(reason)s
 WHERE ctid = ANY (ARRAY(
         SELECT ctid FROM photo_jobs
          WHERE type = %(type)s AND state = 'pending'
          ORDER BY coalesce(next_retry_at, created_at)
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
   AND state = 'pending'
RETURNING type, photo_id, prior_attempts + attempts

-- name: RECENTLY_FAILED
-- Rows of each type that went to `failed` (attempts spent, a PermanentError, failed by the
-- sweep) in the last `seconds` (the metrics, after each sweep): a range of the finished rows'
-- index, however much history the table holds.
SELECT type, count(*)
  FROM photo_jobs
 WHERE state = 'failed' AND updated_at > now() - make_interval(secs => %(seconds)s::float8)
 GROUP BY type

-- name: CANCELLED_COUNTS
-- Cancelled rows by type (the metrics, after each sweep): one walk of the cancelled-rows index.
SELECT type, count(*) FROM photo_jobs WHERE state = 'cancelled' GROUP BY type

-- the worker side: one attempt's lifecycle, every transition fenced by the token ---------
-- A job carries its row's token (`prior_attempts + attempts` when it was dispatched), which
-- grows with every dispatch over the row's whole history: a job of an earlier attempt or an
-- earlier life matches no row here and changes nothing.

-- name: ATTEMPT_START
-- The fenced start, in one round trip; returns the row's (attempts, max_attempts, seconds
-- since the row's last write: 0 when this statement stamped it) when the attempt may run: the
-- row is `active` at this token. One whose last write (greatest(updated_at, heartbeat_at)) is
-- younger than `fresh` seconds (the claim or a rescue stamped it not long ago) is only read:
-- no write, no new row version; any other is stamped (the table's trigger writes
-- heartbeat_at of a row that stays active: a heap-only update). The claim or rescue that
-- enqueued this job commits after the enqueue, so a worker
-- can read the row still at the token before: the UPDATE matches that row too, so that it
-- waits for the claim's row lock and then judges the row the claim left (its own state is
-- never changed; a row still at the token before, its claim rolled back, comes back not
-- runnable). No row at this token: ATTEMPT_RECHECK. The stamp's commit does not wait for the
-- WAL flush (`synchronous_commit` off for this statement's own transaction): it is on the
-- job's latency path, and losing it in a server crash is harmless (the row keeps the claim's
-- state; the durable outcome write is fenced either way).
WITH fresh AS (
     SELECT attempts, max_attempts,
            extract(epoch FROM now() - greatest(updated_at, heartbeat_at))::float8 AS written_ago
       FROM photo_jobs
      WHERE photo_id = %(photo_id)s AND type = %(type)s
        AND state = 'active' AND prior_attempts + attempts = %(token)s
        AND greatest(updated_at, heartbeat_at)
            > now() - pg_catalog.make_interval(secs => %(fresh)s)),
stamped AS (
     UPDATE photo_jobs
        SET state = photo_jobs.state
       FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
      WHERE NOT EXISTS (SELECT FROM fresh)
        AND photo_id = %(photo_id)s AND type = %(type)s
        AND ((state = 'active' AND prior_attempts + attempts = %(token)s)
          OR (state = 'pending' AND prior_attempts + attempts = %(token)s - 1))
     RETURNING state, prior_attempts + attempts AS token, attempts, max_attempts)
SELECT attempts, max_attempts, written_ago FROM fresh
 UNION ALL
SELECT attempts, max_attempts, 0::float8 FROM stamped
 WHERE state = 'active' AND token = %(token)s

-- name: ATTEMPT_RECHECK
-- The row's state and token once no transaction is moving it (FOR SHARE waits for one),
-- after ATTEMPT_START found it at no token it may run: the sweep's rescue moves a row from
-- `active` at the token before to this one, and enqueues this job before its COMMIT. The
-- lock ends with the statement. The dashboard's fenced requeue and cancel of one row
-- (`reactor.ops.fenced`) run it first in their transaction: there the lock holds the row, as
-- read, until their UPDATE has changed it.
SELECT state, prior_attempts + attempts FROM photo_jobs
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   FOR SHARE

-- name: ATTEMPT_HEARTBEAT
-- Heartbeat of a running attempt: keeps the sweep from rescuing it. It writes heartbeat_at,
-- which no index holds (updated_at is left as the claim stamped it), so it is a heap-only
-- update.
UPDATE photo_jobs SET heartbeat_at = now()
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND prior_attempts + attempts = %(token)s

-- name: ATTEMPT_DONE
-- Success.
UPDATE photo_jobs SET state = 'done', next_retry_at = NULL, last_error = NULL
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND prior_attempts + attempts = %(token)s

-- name: ATTEMPT_FAILED
-- Final failure (a permanent error, or the last attempt failed).
UPDATE photo_jobs SET state = 'failed', last_error = %(error)s
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND prior_attempts + attempts = %(token)s

-- name: ATTEMPT_RETRY
-- A failed attempt with attempts left: pending again, due after `delay` seconds.
UPDATE photo_jobs
   SET state = 'pending', last_error = %(error)s,
       next_retry_at = now() + pg_catalog.make_interval(secs => %(delay)s)
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND state = 'active' AND prior_attempts + attempts = %(token)s

-- the producer side -------------------------------------------------------------------------

-- name: SUBMIT_MANY
-- Insert the given photos' jobs of one type (`reactor.producer`), in the caller's transaction.
-- A pending/active row is left as it is (idempotent); a done/failed/cancelled row is re-armed:
-- pending again, due from now (or `run_at`); the table's trigger (photo_jobs_new_life) starts
-- its new life, at attempts 0 with its attempts added to prior_attempts, so the fencing token
-- goes on growing and producers need no grant on either column. Every row inserted or re-armed
-- gets the producer's trace context (NULL: none). Returns one row: how many rows were inserted
-- or re-armed (a count read as a result, which psycopg's pipeline mode delivers too, where the
-- cursor's rowcount is -1). One statement for any number of ids: the triggers send one
-- notification per type for all of them.
WITH submitted AS (
     INSERT INTO photo_jobs AS j (photo_id, type, next_retry_at, max_attempts, traceparent,
                                  tracestate)
     SELECT p.photo_id, %(type)s::text, %(run_at)s::timestamptz,
            coalesce(%(max_attempts)s::int, 5), %(traceparent)s::text, %(tracestate)s::text
       FROM pg_catalog.unnest(%(photo_ids)s::text[]) AS p(photo_id)
         ON CONFLICT (photo_id, type) DO UPDATE
        SET state = 'pending',
            traceparent = EXCLUDED.traceparent,
            tracestate = EXCLUDED.tracestate,
            next_retry_at = coalesce(EXCLUDED.next_retry_at, now()),
            last_error = NULL,
            max_attempts = CASE WHEN %(max_attempts)s::int IS NULL THEN j.max_attempts
                                ELSE EXCLUDED.max_attempts END
      WHERE j.state IN ('done', 'failed', 'cancelled')
     RETURNING 1)
SELECT count(*) FROM submitted

-- name: MAY_INSERT_ROWS
-- Whether this role may insert into photo_jobs (workers may run as a role that cannot).
SELECT has_table_privilege('photo_jobs', 'INSERT')

-- name: WARM_UP_ROW
-- A row that a process inserts, runs its statements on, and rolls back at start, so that the
-- first real row does not pay for the session's first write (its triggers and indexes are
-- loaded then). The rollback leaves nothing behind.
INSERT INTO photo_jobs (photo_id, type, state, attempts)
VALUES (%(photo_id)s, %(type)s, %(state)s, %(attempts)s)

-- the test kit (`reactor.testing`), on the caller's connection ------------------------------

-- name: KIT_SUBMITTED
-- Every row (of `type`, if not NULL), due or not, oldest due time first: what a test's code
-- submitted, as its own transaction sees it. `run_at` is when the row is due.
SELECT photo_id, type, state, attempts, max_attempts,
       coalesce(next_retry_at, created_at) AS run_at,
       coalesce(next_retry_at, created_at) <= now() AS due, last_error
  FROM photo_jobs
 WHERE %(type)s::text IS NULL OR type = %(type)s
 ORDER BY coalesce(next_retry_at, created_at), type, photo_id

-- name: KIT_ADVANCE
-- What waiting `seconds` would do to the pending rows (of `type`, if not NULL): each comes
-- due that much sooner, so a test runs a retry without sleeping.
UPDATE photo_jobs
   SET next_retry_at = coalesce(next_retry_at, created_at)
                       - pg_catalog.make_interval(secs => %(seconds)s)
 WHERE state = 'pending' AND (%(type)s::text IS NULL OR type = %(type)s)
