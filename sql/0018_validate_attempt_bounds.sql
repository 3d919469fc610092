-- 0018: validate the bounds the previous migration added to photo_jobs' attempt counters.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0018_validate_attempt_bounds.sql
--
-- A row written out of bounds between the previous migration's repair and its constraints
-- (a concurrent writer) is repaired the same way first. Neither statement blocks claims:
-- the UPDATE locks only the rows it changes, and VALIDATE takes SHARE UPDATE EXCLUSIVE.

SELECT reactor_migration_begin(18, 'validate_attempt_bounds');

SET LOCAL search_path = public, pg_temp;

UPDATE public.photo_jobs
   SET prior_attempts = least(prior_attempts::numeric + greatest(attempts - 1000000, 0),
                              1000000000000000000)::bigint,
       attempts = least(attempts, 1000000),
       max_attempts = least(max_attempts, 1000000)
 WHERE prior_attempts > 1000000000000000000 OR max_attempts > 1000000;

ALTER TABLE public.photo_jobs
    VALIDATE CONSTRAINT photo_jobs_prior_attempts_bound_check,
    VALIDATE CONSTRAINT photo_jobs_max_attempts_bound_check;
