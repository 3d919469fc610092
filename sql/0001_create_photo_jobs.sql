-- 0001: the photo_jobs table, the migrations ledger, the updated_at trigger.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0001_create_photo_jobs.sql
-- Self-recording: the ledger row is inserted first, so a second run (by psql or by
-- `reactor migrate`, or two at once) is refused before it changes anything.

-- Names in this file resolve in pg_catalog (searched first when not listed), then public, and
-- objects are created in public, whatever the session's search_path was.
SET LOCAL search_path = public, pg_temp;

-- Migrations insert into the ledger with the rights of the role running them, often a
-- superuser: a ledger someone else made (another owner, a trigger, a rule, a policy, extra
-- columns, defaults or indexes) could run their code then. Refuse to adopt it.
DO $check$
DECLARE
    problem text;
BEGIN
    WITH t AS (SELECT c.oid, c.relkind, c.relowner, c.relrowsecurity
                 FROM pg_catalog.pg_class AS c
                WHERE c.oid = pg_catalog.to_regclass('public.reactor_migrations')),
         f AS (SELECT p.proowner
                 FROM pg_catalog.pg_proc AS p
                WHERE p.oid = pg_catalog.to_regprocedure(
                          'public.reactor_migration_begin(integer, text)'))
    SELECT CASE
      WHEN (SELECT relkind FROM t) <> 'r' THEN 'is not a plain table'
      WHEN (SELECT relowner FROM t) <> (SELECT oid FROM pg_catalog.pg_roles
                                         WHERE rolname = current_user)
        THEN pg_catalog.format('is owned by role %I, not by %I (the role running the migrations)',
                               (SELECT relowner FROM t)::regrole, current_user)
      WHEN (SELECT proowner FROM f) <> (SELECT oid FROM pg_catalog.pg_roles
                                         WHERE rolname = current_user)
        THEN pg_catalog.format('has a function reactor_migration_begin owned by role %I, not by %I',
                               (SELECT proowner FROM f)::regrole, current_user)
      WHEN NOT EXISTS (SELECT 1 FROM t) THEN NULL
      WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = (SELECT oid FROM t))
        THEN 'has triggers'
      WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite WHERE ev_class = (SELECT oid FROM t))
        THEN 'has rules'
      WHEN (SELECT relrowsecurity FROM t)
           OR EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = (SELECT oid FROM t))
        THEN 'has row-level security policies'
      WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_inherits
                    WHERE (SELECT oid FROM t) IN (inhrelid, inhparent))
        THEN 'is part of an inheritance tree'
      WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
                    WHERE conrelid = (SELECT oid FROM t) AND contype NOT IN ('p', 'n'))
           OR EXISTS (SELECT 1 FROM pg_catalog.pg_index
                       WHERE indrelid = (SELECT oid FROM t) AND NOT indisprimary)
        THEN 'has constraints or indexes that sql/0001 does not make'
      WHEN (SELECT pg_catalog.array_agg(a.attname::text || ' ' || a.atttypid::regtype::text
                                        || ' ' || coalesce(pg_catalog.pg_get_expr(d.adbin, d.adrelid),
                                                           '')
                                        ORDER BY a.attnum)
              FROM pg_catalog.pg_attribute AS a
              LEFT JOIN pg_catalog.pg_attrdef AS d ON (d.adrelid, d.adnum) = (a.attrelid, a.attnum)
             WHERE a.attrelid = (SELECT oid FROM t) AND a.attnum > 0 AND NOT a.attisdropped)
           IS DISTINCT FROM ARRAY['version integer ', 'name text ',
                                  'applied_at timestamp with time zone now()']
        THEN 'has columns, types or defaults that sql/0001 does not make'
    END
    INTO problem;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'refusing to migrate: public.reactor_migrations %', problem
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END;
$check$;

CREATE TABLE IF NOT EXISTS public.reactor_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- Every migration starts by calling this: it refuses, with a clear message, a migration
-- that is already applied or whose predecessor is missing, then records the version. The
-- ledger row is written before any change, so two concurrent runs collide on its primary
-- key and one of them rolls back whole.
CREATE OR REPLACE FUNCTION public.reactor_migration_begin(p_version integer, p_name text)
RETURNS void
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM public.reactor_migrations WHERE version = p_version) THEN
        RAISE EXCEPTION 'migration % (%) is already applied', p_version, p_name
            USING ERRCODE = 'unique_violation';
    END IF;
    IF p_version > 1
       AND NOT EXISTS (SELECT 1 FROM public.reactor_migrations WHERE version = p_version - 1) THEN
        RAISE EXCEPTION 'migration % (%) needs migration % first', p_version, p_name,
            p_version - 1;
    END IF;
    INSERT INTO public.reactor_migrations (version, name) VALUES (p_version, p_name);
END;
$$;

SELECT reactor_migration_begin(1, 'create_photo_jobs');

CREATE TABLE public.photo_jobs (
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

CREATE FUNCTION public.photo_jobs_touch_updated_at() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER photo_jobs_touch_updated_at
    BEFORE UPDATE ON photo_jobs
    FOR EACH ROW EXECUTE FUNCTION photo_jobs_touch_updated_at();
