-- 0003: NOTIFY photo_jobs, payload = type, when rows become pending.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0003_create_notify_triggers.sql
--
-- The notification is a wake-up hint, never data: the table is the truth. Postgres folds
-- identical (channel, payload) pairs within a transaction, so a transaction sends at most
-- one notification per type. Rolled-back transactions send nothing.
--
-- INSERT (also INSERT ... SELECT and COPY): one statement-level call per statement, reading
-- the transition table, so a multi-row insert costs one trigger call, not one per row.
-- UPDATE: a row-level trigger whose WHEN clause is evaluated by the executor without
-- calling any function, so claims, heartbeats and completions (which never move a row into
-- pending) pay nothing; only retries and requeues fire it.

SELECT reactor_migration_begin(3, 'create_notify_triggers');

CREATE FUNCTION photo_jobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A 0-row statement also fires a statement trigger; the query below sends nothing then.
    PERFORM pg_notify('photo_jobs', t.type)
       FROM (SELECT DISTINCT n.type FROM photo_jobs_new n WHERE n.state = 'pending') AS t;
    RETURN NULL;
END;
$$;

CREATE TRIGGER photo_jobs_notify_inserted
    AFTER INSERT ON photo_jobs
    REFERENCING NEW TABLE AS photo_jobs_new
    FOR EACH STATEMENT EXECUTE FUNCTION photo_jobs_notify_inserted();

CREATE FUNCTION photo_jobs_notify_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('photo_jobs', NEW.type);
    RETURN NULL;
END;
$$;

CREATE TRIGGER photo_jobs_notify_pending
    AFTER UPDATE OF state ON photo_jobs
    FOR EACH ROW
    WHEN (NEW.state = 'pending' AND OLD.state IS DISTINCT FROM 'pending')
    EXECUTE FUNCTION photo_jobs_notify_pending();
