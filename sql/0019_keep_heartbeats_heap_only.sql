-- 0019: the writes that keep an active row alive go to a column no index holds, so they are
-- heap-only (HOT) updates; photo_jobs gets storage and autovacuum settings fit for a queue.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0019_keep_heartbeats_heap_only.sql
--
-- `heartbeat_at` is written by the trigger photo_jobs_touch_updated_at on every update that
-- leaves an active row active: the worker's start and heartbeats, the sweep's re-dispatch of
-- a lost or stale attempt. Such an update no longer moves `updated_at`, which the partial
-- indexes of active, finished and cancelled rows hold, and changes no other indexed column,
-- so Postgres keeps the new row version on its page without new index entries. Every other
-- update stamps `updated_at` as before and clears `heartbeat_at`. An active row's last sign
-- of life is greatest(updated_at, heartbeat_at): what the sweep's staleness, the fenced
-- start's freshness and `reactor status` read.
--
-- Existing rows keep NULL there, which is what it means for each of them: no such write since
-- the row last changed state. Nothing is backfilled.
--
-- The storage parameters apply to pages written from now on (VACUUM FULL or a rewrite would
-- repack old ones; nothing needs that).
--
-- Locks: ADD COLUMN without a default changes the catalog only (no rewrite, no scan), under
-- an ACCESS EXCLUSIVE lock held until this file's transaction commits, a moment later; the
-- storage parameters take SHARE UPDATE EXCLUSIVE. The lock is waited for at most 5 s (a long
-- transaction holding the table would otherwise queue every claim behind this migration):
-- when that times out, run it again.

SELECT reactor_migration_begin(19, 'keep_heartbeats_heap_only');

SET LOCAL search_path = public, pg_temp;
SET LOCAL lock_timeout = '5s';

ALTER TABLE public.photo_jobs ADD COLUMN heartbeat_at timestamptz;

COMMENT ON COLUMN public.photo_jobs.heartbeat_at IS
    'Last write that left the active row active (the worker''s start and heartbeats, a rescue); NULL after every other update. Unindexed: those writes are heap-only.';

ALTER TABLE public.photo_jobs SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 10000
);

-- Only the timestamps: the new-life trigger (photo_jobs_new_life) still resets the counters,
-- and a re-arm is a change of state, so it clears heartbeat_at here.
CREATE OR REPLACE FUNCTION public.photo_jobs_touch_updated_at() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    IF OLD.state = 'active' AND NEW.state = 'active' THEN
        NEW.heartbeat_at := now();
    ELSE
        NEW.updated_at := now();
        NEW.heartbeat_at := NULL;
    END IF;
    RETURN NEW;
END;
$$;
