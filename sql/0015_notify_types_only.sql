-- 0015: notifications carry the type only again; no row is named.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0015_notify_types_only.sql
--
-- Since 0010 the rows of small inserts were named in their notifications ('TYPE PHOTO_ID'),
-- and a reactor enqueued their jobs before it claimed them. That path is gone: every job is
-- written to Redis by the transaction that claims its row (claim, enqueue, COMMIT), so a
-- notification only says which type to drain. The INSERT trigger sends each type of the
-- pending rows a statement inserted, once (Postgres folds identical notifications of one
-- transaction into one), as 0003 did.
--
-- A reactor of this release reads an old trigger's 'TYPE PHOTO_ID' as 'TYPE', and one of the
-- release before reads 'TYPE' as always: reactors of either release may run across this
-- migration and nothing waits for a poll.

SELECT reactor_migration_begin(15, 'notify_types_only');

SET LOCAL search_path = public, pg_temp;

CREATE OR REPLACE FUNCTION public.photo_jobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    -- A 0-row statement (or one of rows not pending) also fires the trigger: no type, no NOTIFY.
    PERFORM pg_notify('photo_jobs', t.type)
       FROM (SELECT DISTINCT n.type FROM photo_jobs_new AS n WHERE n.state = 'pending') AS t;
    RETURN NULL;
END;
$$;
