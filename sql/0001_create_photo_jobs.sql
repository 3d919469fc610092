-- 0001: the photo_jobs table, the migrations ledger, the updated_at trigger.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0001_create_photo_jobs.sql
-- Self-recording: the ledger row is inserted first, so a second run (by psql or by
-- `reactor migrate`, or two at once) is refused before it changes anything.

CREATE TABLE IF NOT EXISTS reactor_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- Every migration starts by calling this: it refuses, with a clear message, a migration
-- that is already applied or whose predecessor is missing, then records the version. The
-- ledger row is written before any change, so two concurrent runs collide on its primary
-- key and one of them rolls back whole.
CREATE OR REPLACE FUNCTION reactor_migration_begin(p_version integer, p_name text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM reactor_migrations WHERE version = p_version) THEN
        RAISE EXCEPTION 'migration % (%) is already applied', p_version, p_name
            USING ERRCODE = 'unique_violation';
    END IF;
    IF p_version > 1
       AND NOT EXISTS (SELECT 1 FROM reactor_migrations WHERE version = p_version - 1) THEN
        RAISE EXCEPTION 'migration % (%) needs migration % first', p_version, p_name,
            p_version - 1;
    END IF;
    INSERT INTO reactor_migrations (version, name) VALUES (p_version, p_name);
END;
$$;

SELECT reactor_migration_begin(1, 'create_photo_jobs');

CREATE TABLE photo_jobs (
    photo_id      text NOT NULL,
    type          text NOT NULL,
    state         text NOT NULL DEFAULT 'pending',
    attempts      integer NOT NULL DEFAULT 0,
    max_attempts  integer NOT NULL DEFAULT 5,
    next_retry_at timestamptz,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT photo_jobs_pkey PRIMARY KEY (photo_id, type),
    CONSTRAINT photo_jobs_state_check
        CHECK (state IN ('pending', 'active', 'done', 'failed')),
    CONSTRAINT photo_jobs_attempts_check CHECK (attempts >= 0),
    CONSTRAINT photo_jobs_max_attempts_check CHECK (max_attempts >= 1),
    CONSTRAINT photo_jobs_photo_id_check CHECK (photo_id <> ''),
    -- The type is the NOTIFY payload and names an RQ queue: keep it short and plain so
    -- a bad value fails here, at the writer, and never later in a trigger or in RQ.
    CONSTRAINT photo_jobs_type_check CHECK (type ~ '^[A-Za-z0-9_.-]{1,128}$')
);

COMMENT ON TABLE photo_jobs IS
    'Outbox of photo jobs: pending -> active -> done | failed; attempts is the fencing token.';

CREATE FUNCTION photo_jobs_touch_updated_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER photo_jobs_touch_updated_at
    BEFORE UPDATE ON photo_jobs
    FOR EACH ROW EXECUTE FUNCTION photo_jobs_touch_updated_at();
