-- 0005: reactor_routes, the routes the reactors dispatch with: one truth for every process.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0005_create_reactor_routes.sql
--
-- A reactor started with routes (`--route`, REACTOR_ROUTES) records one row per routed type
-- here, under a lock key of its own; a process started without routes (`reactor sweep`,
-- `reactor status`, a second `reactor run`) reads them. A row is live while its reactor's
-- session holds the session-level advisory lock (reactor_routes_lock_class(), lock_key): it
-- dies with the session, so a reactor killed with SIGKILL stops being live at once. A route
-- that conflicts with a live row is refused at start; rows of stopped reactors stay as the
-- last routes used, until a reactor records another route for the type.

SELECT reactor_migration_begin(5, 'create_reactor_routes');

CREATE TABLE reactor_routes (
    type          text NOT NULL,
    handler       text NOT NULL,
    queue         text NOT NULL,
    lock_key      integer NOT NULL,
    registered_by text NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT reactor_routes_pkey PRIMARY KEY (type, lock_key),
    CONSTRAINT reactor_routes_lock_key_check CHECK (lock_key > 0)
);

COMMENT ON TABLE reactor_routes IS
    'Routes recorded by the reactors (type -> handler, queue); live while lock_key is held.';

-- The first key of the two-key advisory lock a reactor holds while its routes are live.
CREATE FUNCTION reactor_routes_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS 'SELECT 1885892468';

-- Whether the reactor that recorded a row with this lock key is still connected.
CREATE FUNCTION reactor_routes_live(p_lock_key integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
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
