-- 0013: a reactor's routes are live only while the session it recorded holds their lock.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0013_route_liveness_by_backend.sql
--
-- Until now any session of the database could keep a stopped reactor's routes live, and so
-- have a new route for their types refused: the lock key is visible in pg_locks, and taking
-- an advisory lock needs no privilege. A reactor now records, with its routes, the backend
-- (pid) of the session that took their lock (backend_pid), and a lock counts only while that
-- backend holds it. Behind a transaction pooler the lock stays with the server session that
-- ran the registration (its pid is recorded in the same transaction); when a running reactor
-- takes its lock again because that session was closed, it records the new session's pid in
-- the same transaction. A row with no pid (recorded before this migration, whose lock no
-- session held then) is not live. Reactors of earlier releases record no pid when they
-- register again (after a reconnect): their routes then count as stopped. Stop them before
-- applying this migration (a reactor refuses to start on a schema it does not know).

SELECT reactor_migration_begin(13, 'route_liveness_by_backend');

SET LOCAL search_path = public, pg_temp;

ALTER TABLE public.reactor_routes ADD COLUMN backend_pid integer;

COMMENT ON COLUMN public.reactor_routes.backend_pid IS
    'The backend (pid) that holds the liveness lock for this row''s reactor.';

-- Rows of reactors running now keep their liveness: their lock's holder is recorded.
UPDATE public.reactor_routes AS r
   SET backend_pid = (SELECT l.pid
                        FROM pg_catalog.pg_locks AS l
                       WHERE l.locktype = 'advisory'
                         AND l.database = (SELECT oid FROM pg_catalog.pg_database
                                            WHERE datname = pg_catalog.current_database())
                         AND l.classid = public.reactor_routes_lock_class()::oid
                         AND l.objid = r.lock_key::oid
                         AND l.objsubid = 2
                         AND l.granted
                       LIMIT 1);

-- Whether the backend recorded with this lock key holds the liveness lock (any other
-- session's hold of the same key does not count).
CREATE OR REPLACE FUNCTION public.reactor_routes_lock_held(p_lock_key integer) RETURNS boolean
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
           AND l.granted
           AND l.pid IN (SELECT r.backend_pid
                           FROM reactor_routes AS r
                          WHERE r.lock_key = p_lock_key))
$$;
