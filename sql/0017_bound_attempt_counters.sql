-- 0017: bounds on the attempt counters, so the fencing token `prior_attempts + attempts`
-- cannot overflow; a new life is started by a trigger, so producers write neither counter.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0017_bound_attempt_counters.sql
--
-- Until now a row whose prior_attempts was near the bigint limit (9223372036854775807) made
-- every claim of its type fail with "bigint out of range", so one row held up its whole type.
-- The bounds: max_attempts at most 1,000,000 (attempts stays within it since 0007) and
-- prior_attempts at most 10^18, so the token stays below 10^18 + 10^6, far inside bigint. A
-- re-arm adds at most 10^6 to prior_attempts: at a million dispatches a second, a row reaches
-- the bound after 30,000 years.
--
-- A done, failed or cancelled row made `pending` starts a new life: the trigger
-- photo_jobs_new_life adds
-- its attempts to prior_attempts and sets attempts to 0, whatever the UPDATE wrote in them.
-- The re-arm of submit() and `reactor requeue` is then only `state = 'pending'`, so producers
-- need no grant on either column (README's grants), and no hand-written re-arm can make a
-- token repeat.
--
-- Existing rows out of bounds are kept, with their state:
--   max_attempts over 10^6   -> 10^6; attempts over 10^6 -> 10^6, the rest moved into
--                               prior_attempts (the token stays what it was);
--   prior_attempts over 10^18 -> 10^18 (the token changes: a job such a row holds can no
--                               longer start or write an outcome, and the sweep dispatches
--                               an `active` one again as a lost job).
-- The constraints are added NOT VALID (no scan under the ADD's lock) and validated by the next
-- migration, which repairs again any row written meanwhile.

SELECT reactor_migration_begin(17, 'bound_attempt_counters');

SET LOCAL search_path = public, pg_temp;

-- numeric: prior_attempts + attempts itself may overflow here.
UPDATE public.photo_jobs
   SET prior_attempts = least(prior_attempts::numeric + greatest(attempts - 1000000, 0),
                              1000000000000000000)::bigint,
       attempts = least(attempts, 1000000),
       max_attempts = least(max_attempts, 1000000)
 WHERE prior_attempts > 1000000000000000000 OR max_attempts > 1000000;

ALTER TABLE public.photo_jobs
    ADD CONSTRAINT photo_jobs_prior_attempts_bound_check
        CHECK (prior_attempts <= 1000000000000000000) NOT VALID,
    ADD CONSTRAINT photo_jobs_max_attempts_bound_check CHECK (max_attempts <= 1000000) NOT VALID;

CREATE FUNCTION public.photo_jobs_new_life() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    NEW.prior_attempts := OLD.prior_attempts + OLD.attempts;
    NEW.attempts := 0;
    RETURN NEW;
END;
$$;

-- The WHEN is checked without calling the function: heartbeats and outcomes pay nothing.
CREATE TRIGGER photo_jobs_new_life BEFORE UPDATE OF state ON public.photo_jobs
    FOR EACH ROW
    WHEN (OLD.state IN ('done', 'failed', 'cancelled') AND NEW.state = 'pending')
    EXECUTE FUNCTION public.photo_jobs_new_life();
