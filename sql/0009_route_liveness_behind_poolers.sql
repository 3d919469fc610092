-- 0009: a reactor's routes stop being live when it stops, also behind a transaction pooler.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0009_route_liveness_behind_poolers.sql
--
-- Behind a pooler in transaction mode (PgBouncer), the session-level lock of 0005 is taken by
-- whichever server session ran the registration, and stays with that session: closing the
-- reactor's own connection does not release it. So a stopping reactor also marks its rows
-- stopped (stopped_at), and a row is live only while it is not stopped and its lock is held.
-- A running reactor takes its lock again if no session holds it any more (the pooler closed
-- the server session that held it): reactor_routes_lock_held says whether one does.

SELECT reactor_migration_begin(9, 'route_liveness_behind_poolers');

SET LOCAL search_path = public, pg_temp;

ALTER TABLE public.reactor_routes ADD COLUMN stopped_at timestamptz;

COMMENT ON COLUMN public.reactor_routes.stopped_at IS
    'When the reactor that recorded the row stopped; NULL while it may be running.';

-- Whether some session holds the liveness lock with this key.
CREATE FUNCTION public.reactor_routes_lock_held(p_lock_key integer) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = public, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pg_locks AS l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = reactor_routes_lock_class()::oid
           AND l.objid = p_lock_key::oid
           AND l.objsubid = 2
           AND l.granted)
$$;

-- Whether the reactor that recorded rows with this lock key is still running: it has not
-- marked them stopped, and its lock is held.
CREATE OR REPLACE FUNCTION public.reactor_routes_live(p_lock_key integer) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = public, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1
                         FROM reactor_routes AS r
                        WHERE r.lock_key = p_lock_key AND r.stopped_at IS NOT NULL)
       AND reactor_routes_lock_held(p_lock_key)
$$;
