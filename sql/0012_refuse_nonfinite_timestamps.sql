-- 0012: photo_jobs refuses 'infinity' and '-infinity' in created_at, updated_at and
-- next_retry_at.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0012_refuse_nonfinite_timestamps.sql
--
-- Python's datetime holds neither value: a row that had one could fail every read that
-- returns the column (the sweep's pass over active rows, `reactor failures`, the dashboard).
-- The reads now tolerate such rows (they were written before this migration); new ones are
-- refused here, at the writer, with the constraint's name in the error.
--
-- Existing non-finite values are replaced first, keeping what the row meant:
--   next_retry_at  'infinity' -> 9999-01-01 UTC: the row stays parked (NULL would dispatch it);
--                 '-infinity' -> 1970-01-01 UTC: the row stays due, first in line;
--   created_at     the same ('infinity' with no next_retry_at: still parked);
--   updated_at     becomes this transaction's now(): the updated_at trigger stamps every
--                  UPDATE. An active row so stamped is rescued `stale_after` later if its worker
--                  is gone (at once if its job is missing); retention counts a done or failed
--                  row's age from now.
--
-- Locks: the replacement runs before the constraints exist (row locks on the rows it
-- changes; reads and writes go on). The constraints are added NOT VALID (no scan), then
-- validated. This file is one transaction, so the ADD's ACCESS EXCLUSIVE lock is held until
-- COMMIT and the validating scan runs under it: claims wait for that scan. To avoid even that
-- on a very large table, run this file without its last statement, then
-- `ALTER TABLE photo_jobs VALIDATE CONSTRAINT ...` for each constraint in a transaction of
-- its own (SHARE UPDATE EXCLUSIVE: reads and writes go on); until then the constraints hold
-- for every row written, and the reads tolerate the rest.

SELECT reactor_migration_begin(12, 'refuse_nonfinite_timestamps');

-- Names in this file resolve in pg_catalog (searched first when not listed), then public, and
-- objects are created in public, whatever the session's search_path was.
SET LOCAL search_path = public, pg_temp;

UPDATE public.photo_jobs
   SET created_at = CASE WHEN isfinite(created_at) THEN created_at
                         WHEN created_at > now() THEN '9999-01-01 00:00:00+00'::timestamptz
                         ELSE '1970-01-01 00:00:00+00'::timestamptz END,
       next_retry_at = CASE WHEN next_retry_at IS NULL OR isfinite(next_retry_at)
                            THEN next_retry_at
                            WHEN next_retry_at > now() THEN '9999-01-01 00:00:00+00'::timestamptz
                            ELSE '1970-01-01 00:00:00+00'::timestamptz END
 WHERE NOT isfinite(created_at) OR NOT isfinite(updated_at) OR NOT isfinite(next_retry_at);

-- A NULL next_retry_at passes (CHECK lets NULL through): it means "due from created_at".
ALTER TABLE public.photo_jobs
    ADD CONSTRAINT photo_jobs_created_at_finite_check CHECK (isfinite(created_at)) NOT VALID,
    ADD CONSTRAINT photo_jobs_updated_at_finite_check CHECK (isfinite(updated_at)) NOT VALID,
    ADD CONSTRAINT photo_jobs_next_retry_at_finite_check CHECK (isfinite(next_retry_at)) NOT VALID;

ALTER TABLE public.photo_jobs
    VALIDATE CONSTRAINT photo_jobs_created_at_finite_check,
    VALIDATE CONSTRAINT photo_jobs_updated_at_finite_check,
    VALIDATE CONSTRAINT photo_jobs_next_retry_at_finite_check;
