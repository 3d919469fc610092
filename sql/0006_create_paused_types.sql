-- 0006: paused job types. Rows of a paused type stay pending: no reactor claims them, and the
-- sweep neither claims nor rescues them, until the type is resumed.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0006_create_paused_types.sql
--
-- The claim reads this table inside its own statement (one primary-key probe, evaluated once
-- per claim, not per row), so a pause takes effect at every reactor's next claim and costs no
-- extra round trip. `reactor pause TYPE` inserts a row, `reactor resume TYPE` deletes it;
-- a plain INSERT or DELETE in psql does the same.

SELECT reactor_migration_begin(6, 'create_paused_types');

CREATE TABLE reactor_paused_types (
    type      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL DEFAULT current_user,
    -- Same rule as photo_jobs_type_check.
    CONSTRAINT reactor_paused_types_type_check CHECK (type ~ '^[A-Za-z0-9_.-]{1,128}$')
);

COMMENT ON TABLE reactor_paused_types IS
    'Job types no reactor dispatches: their rows stay pending until the type is resumed.';

-- Resuming rings every listening reactor (payload = the type, as a writer's notification
-- would), whatever the doorbell's state: the type's rows are dispatched at once, not at the
-- next poll or sweep. Resumes are rare, so the NOTIFY commit lock costs nothing here.
CREATE FUNCTION reactor_paused_types_notify_resumed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('photo_jobs', OLD.type);
    RETURN NULL;
END;
$$;

CREATE TRIGGER reactor_paused_types_notify_resumed
    AFTER DELETE ON reactor_paused_types
    FOR EACH ROW EXECUTE FUNCTION reactor_paused_types_notify_resumed();
