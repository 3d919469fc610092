-- 0021: the schema's functions resolve every name they do not qualify in pg_catalog alone.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0021_pin_function_search_paths.sql
--
-- Postgres resolves a call to the function or operator whose argument types match best, in
-- every schema of the search_path: an exact match wins over pg_catalog's polymorphic one
-- (format(text, VARIADIC "any")) or one the arguments reach only through a cast
-- (substr(text, integer) given a name, oid = oid given a regclass), wherever the schemas stand
-- in the path. The functions ran with search_path = public, pg_temp, so whoever may CREATE in
-- public (every role before PostgreSQL 15, and on clusters upgraded from one) could plant a
-- format(text, text) there that photo_jobs_history_drop_before would run with the rights of
-- the role archiving, the tables' owner or a superuser.
--
-- Every function now runs with search_path = pg_catalog, pg_temp and names its own objects
-- public.*: a built-in it calls can only be pg_catalog's. The three history functions are
-- made again with the calls that could be taken over written to match exactly (format named
-- pg_catalog.format, relname cast to text, the regclass to oid); so are the two route
-- liveness functions, with their tables and functions named public.*. The others name
-- nothing in public (the triggers' transition table is no schema's) and only get the setting.
-- Each takes and returns what it did.
--
-- Locks: none on the tables (CREATE OR REPLACE FUNCTION and ALTER FUNCTION change the
-- catalogs only). Reactors, workers and producers of the release before keep working beside
-- it.

SELECT reactor_migration_begin(21, 'pin_function_search_paths');

SET LOCAL search_path = public, pg_temp;

ALTER FUNCTION public.photo_jobs_doorbell_key() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.photo_jobs_doorbell_stripes() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.photo_jobs_new_life() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.photo_jobs_notify_inserted() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.photo_jobs_notify_pending() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.photo_jobs_touch_updated_at() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.reactor_migration_begin(integer, text)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.reactor_paused_types_notify_resumed()
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION public.reactor_routes_lock_class() SET search_path = pg_catalog, pg_temp;

-- Whether the backend recorded with this lock key holds the liveness lock (any other
-- session's hold of the same key does not count).
CREATE OR REPLACE FUNCTION public.reactor_routes_lock_held(p_lock_key integer) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pg_locks AS l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = public.reactor_routes_lock_class()::oid
           AND l.objid = p_lock_key::oid
           AND l.objsubid = 2
           AND l.granted
           AND l.pid IN (SELECT r.backend_pid
                           FROM public.reactor_routes AS r
                          WHERE r.lock_key = p_lock_key))
$$;

-- Whether a lock key's routes are live: not marked stopped, and its lock held by the backend
-- recorded with them.
CREATE OR REPLACE FUNCTION public.reactor_routes_live(p_lock_key integer) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1
                         FROM public.reactor_routes AS r
                        WHERE r.lock_key = p_lock_key AND r.stopped_at IS NOT NULL)
       AND public.reactor_routes_lock_held(p_lock_key)
$$;

-- Create the missing monthly partitions from p_from's month through p_to's (at most 1,200).
-- Returns how many it created. A partition that exists is not locked or touched. Creating or
-- dropping one locks photo_jobs_history (not photo_jobs) for a moment: waited for at most 5 s,
-- so a long reader of the history fails the call rather than queueing every archive behind it.
CREATE OR REPLACE FUNCTION public.photo_jobs_history_add_months(p_from timestamptz,
                                                                p_to timestamptz)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
DECLARE
    month timestamp := date_trunc('month', p_from AT TIME ZONE 'UTC');
    last timestamp := date_trunc('month', p_to AT TIME ZONE 'UTC');
    name text;
    created integer := 0;
BEGIN
    IF last - month > interval '100 years' THEN
        RAISE EXCEPTION 'history months from % to %: more than 1,200', p_from, p_to;
    END IF;
    WHILE month <= last LOOP
        name := 'photo_jobs_history_' || to_char(month, 'YYYY_MM');
        IF to_regclass('public.' || name) IS NULL THEN
            EXECUTE pg_catalog.format(
                'CREATE TABLE public.%I PARTITION OF public.photo_jobs_history'
                ' FOR VALUES FROM (%L) TO (%L)',
                name,
                to_char(month, 'YYYY-MM-DD') || ' 00:00:00+00',
                to_char(month + interval '1 month', 'YYYY-MM-DD') || ' 00:00:00+00');
            created := created + 1;
        END IF;
        month := month + interval '1 month';
    END LOOP;
    RETURN created;
END;
$$;

-- The monthly partitions whose every row finished before p_before: (name, estimated rows,
-- end of the month), oldest first. Only partitions named as photo_jobs_history_add_months
-- names them.
CREATE OR REPLACE FUNCTION public.photo_jobs_history_months_before(p_before timestamptz)
RETURNS TABLE (name text, estimated_rows bigint, ends timestamptz)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.name, greatest(m.reltuples, 0)::bigint, m.ends
      FROM (SELECT c.relname::text AS name, c.reltuples,
                   (to_date(substr(c.relname::text, 20), 'YYYY_MM')::timestamp
                    + interval '1 month') AT TIME ZONE 'UTC' AS ends
              FROM pg_inherits AS i
              JOIN pg_class AS c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'public.photo_jobs_history'::regclass::oid
               AND c.relname::text ~ '^photo_jobs_history_[0-9]{4}_[0-9]{2}$') AS m
     WHERE m.ends <= p_before
     ORDER BY m.ends
$$;

-- Drop the monthly partitions whose every row finished before p_before; returns their names.
CREATE OR REPLACE FUNCTION public.photo_jobs_history_drop_before(p_before timestamptz)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT m.name FROM public.photo_jobs_history_months_before(p_before) AS m LOOP
        EXECUTE pg_catalog.format('DROP TABLE public.%I', name);
        RETURN NEXT name;
    END LOOP;
END;
$$;
