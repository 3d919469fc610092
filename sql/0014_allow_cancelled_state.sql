-- 0014: photo_jobs rows may be `cancelled`, a terminal state beside `done` and `failed`.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0014_allow_cancelled_state.sql
--
-- `reactor cancel` and `reactor.cancel()` move a pending or active row there; `requeue` and
-- `submit()` re-arm it as they do a failed one. No trigger changes: the NOTIFY triggers fire
-- only for rows moving into `pending`, and the updated_at trigger stamps every UPDATE.
--
-- Locks: the widened check is added NOT VALID (no scan) and then validated, in this file's
-- one transaction, so the ADD's ACCESS EXCLUSIVE lock is held through the validating scan.
-- On a very large table, run this file without the VALIDATE and then run
-- `ALTER TABLE photo_jobs VALIDATE CONSTRAINT photo_jobs_state_check` in a transaction of its
-- own (reads and writes go on); until then the check holds for every row written. The new
-- index is partial and small (cancelled rows only), but building it reads the table once.

SELECT reactor_migration_begin(14, 'allow_cancelled_state');

SET LOCAL search_path = public, pg_temp;

ALTER TABLE public.photo_jobs DROP CONSTRAINT photo_jobs_state_check;
ALTER TABLE public.photo_jobs ADD CONSTRAINT photo_jobs_state_check
    CHECK (state IN ('pending', 'active', 'done', 'failed', 'cancelled')) NOT VALID;

-- Cancelled rows by age: `reactor failures`, `status`, the metrics' count and the prune of
-- cancelled rows read one range of it, never the table.
CREATE INDEX photo_jobs_cancelled_updated_idx
    ON public.photo_jobs (updated_at) WHERE state = 'cancelled';

ALTER TABLE public.photo_jobs VALIDATE CONSTRAINT photo_jobs_state_check;
