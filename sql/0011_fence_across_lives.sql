-- 0011: a fencing token that never repeats over a row's lives.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0011_fence_across_lives.sql
--
-- `attempts` counts the dispatches of the row's current life (for max_attempts) and is reset
-- to 0 when a done or failed row is armed again (requeue, submit()). `prior_attempts` adds up
-- the attempts of the earlier lives at each re-arm, so `prior_attempts + attempts` (the
-- token) grows by one with every dispatch over the row's whole history and never repeats.
-- Job ids and every fenced write use the token: a job of an earlier life can neither start
-- nor write an outcome, and a new life never takes an earlier life's job for its own.
--
-- Existing rows keep their tokens: prior_attempts is 0 and the token is `attempts`, the
-- number their queued and running jobs carry. The column comes with a constant default, so
-- adding it rewrites nothing; its CHECK is added NOT VALID (every existing row holds the
-- default, which passes) and Postgres enforces it on every write from now on.
--
-- Rows are named in their insert's notification only while their token is 0 (never
-- dispatched): a reactor enqueues token 1 for such a row before it claims it.

SELECT reactor_migration_begin(11, 'fence_across_lives');

SET LOCAL search_path = public, pg_temp;

ALTER TABLE public.photo_jobs
    ADD COLUMN prior_attempts bigint NOT NULL DEFAULT 0;
ALTER TABLE public.photo_jobs
    ADD CONSTRAINT photo_jobs_prior_attempts_check CHECK (prior_attempts >= 0) NOT VALID;

COMMENT ON TABLE public.photo_jobs IS
    'Outbox of photo jobs: pending -> active -> done | failed; prior_attempts + attempts is the '
    'fencing token.';
COMMENT ON COLUMN public.photo_jobs.prior_attempts IS
    'Attempts of the row''s earlier lives (added at each re-arm); prior_attempts + attempts is '
    'the fencing token and the number in job ids.';

CREATE OR REPLACE FUNCTION public.photo_jobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
DECLARE
    -- Rows this transaction has named so far (a setting local to the transaction).
    named integer := coalesce(nullif(current_setting('photo_jobs.rows_named', true), ''), '0');
    pending integer;
    by_row boolean;
BEGIN
    SELECT count(*),
           bool_and(n.attempts = 0 AND n.prior_attempts = 0
                    AND coalesce(n.next_retry_at, n.created_at) <= now())
      INTO pending, by_row
      FROM photo_jobs_new AS n
     WHERE n.state = 'pending';
    IF pending = 0 THEN
        RETURN NULL;  -- a 0-row statement (or one of rows not pending) also fires the trigger
    END IF;
    IF by_row AND named + pending <= 8 THEN
        PERFORM pg_notify('photo_jobs', n.type || ' ' || n.photo_id)
           FROM photo_jobs_new AS n
          WHERE n.state = 'pending';
        PERFORM set_config('photo_jobs.rows_named', (named + pending)::text, true);
    ELSE
        PERFORM pg_notify('photo_jobs', t.type)
           FROM (SELECT DISTINCT n.type FROM photo_jobs_new AS n WHERE n.state = 'pending') AS t;
    END IF;
    RETURN NULL;
END;
$$;
