-- 0007: bounds that keep one row from breaking the dispatcher; search_path pinned in functions.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0007_bound_photo_jobs.sql
-- Existing rows: attempts above max_attempts are repaired first (max_attempts raised to
-- attempts: the row keeps its meaning, its attempts are spent); photo ids over 255 bytes are
-- keys and are not changed: the migration stops, saying how many, until they are dealt with.

SELECT reactor_migration_begin(7, 'bound_photo_jobs');

-- Names in this file resolve in pg_catalog (searched first when not listed), then public, and
-- objects are created in public, whatever the session's search_path was.
SET LOCAL search_path = public, pg_temp;

DO $$
DECLARE
    too_long bigint;
BEGIN
    SELECT count(*) INTO too_long FROM public.photo_jobs WHERE octet_length(photo_id) > 255;
    IF too_long > 0 THEN
        RAISE EXCEPTION '% photo_jobs rows have a photo_id over 255 bytes: delete or shorten '
            'them, then run this migration again', too_long
            USING ERRCODE = 'check_violation';
    END IF;
END;
$$;

UPDATE public.photo_jobs SET max_attempts = attempts WHERE attempts > max_attempts;

-- attempts stays within max_attempts, so the claim's `attempts + 1` can never overflow; photo
-- ids stay small enough for RQ job keys (the type is bounded to 128 ASCII characters by
-- photo_jobs_type_check since 0001).
ALTER TABLE public.photo_jobs
    ADD CONSTRAINT photo_jobs_attempts_max_check CHECK (attempts <= max_attempts),
    ADD CONSTRAINT photo_jobs_photo_id_length_check CHECK (octet_length(photo_id) <= 255);

-- Functions run with the search_path they were made for, not the caller's: a role that can
-- create objects in a schema on the caller's path cannot shadow what they call.
ALTER FUNCTION public.reactor_migration_begin(integer, text)
    SET search_path = public, pg_temp;
ALTER FUNCTION public.photo_jobs_touch_updated_at() SET search_path = public, pg_temp;
ALTER FUNCTION public.photo_jobs_notify_inserted() SET search_path = public, pg_temp;
ALTER FUNCTION public.photo_jobs_notify_pending() SET search_path = public, pg_temp;
ALTER FUNCTION public.photo_jobs_doorbell_key() SET search_path = public, pg_temp;
ALTER FUNCTION public.photo_jobs_doorbell_stripes() SET search_path = public, pg_temp;
ALTER FUNCTION public.reactor_routes_lock_class() SET search_path = public, pg_temp;
ALTER FUNCTION public.reactor_routes_live(integer) SET search_path = public, pg_temp;
ALTER FUNCTION public.reactor_paused_types_notify_resumed() SET search_path = public, pg_temp;
