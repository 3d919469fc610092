-- 0010: a transaction's first few inserted rows are named in their notifications, so that a
-- reactor can enqueue their jobs before it claims them.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0010_notify_inserted_rows.sql
--
-- Payloads on channel photo_jobs, from now on:
--   'TYPE'           as before: rows of TYPE became pending; drain (claim) the type.
--   'TYPE PHOTO_ID'  this row was inserted pending, due, at attempt 0. A type has no spaces
--                    (photo_jobs_type_check), so the first space ends it; the photo id is the
--                    rest, whatever it holds.
-- An INSERT names its rows one by one when every pending row it inserted is due at attempt 0
-- and the transaction names no more than 8 rows in all; otherwise it sends their types alone,
-- as before (a large batch is cheaper to claim in one statement than to name row by row, and
-- a transaction's notifications are written under the commit lock). Retries and requeues
-- (the UPDATE trigger) still send the type alone. Pauses are not looked at here (writers need
-- no rights on reactor_paused_types): a row of a paused type may be named, and its job is then
-- skipped at its fenced start, the row left pending.
--
-- Reactors of earlier releases read 'TYPE PHOTO_ID' as an unknown type and ignore it; they
-- would dispatch such rows only when polling or sweeping. Stop them before applying this
-- migration (a reactor refuses to start on a schema it does not know).

SELECT reactor_migration_begin(10, 'notify_inserted_rows');

SET LOCAL search_path = public, pg_temp;

CREATE OR REPLACE FUNCTION public.photo_jobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
DECLARE
    -- Rows this transaction has named so far (a setting local to the transaction).
    named integer := coalesce(nullif(current_setting('photo_jobs.rows_named', true), ''), '0');
    pending integer;
    by_row boolean;
BEGIN
    SELECT count(*),
           bool_and(n.attempts = 0 AND coalesce(n.next_retry_at, n.created_at) <= now())
      INTO pending, by_row
      FROM photo_jobs_new AS n
     WHERE n.state = 'pending';
    IF pending = 0 THEN
        RETURN NULL;  -- a 0-row statement (or one of rows not pending) also fires the trigger
    END IF;
    IF by_row AND named + pending <= 8 THEN
        PERFORM pg_notify('photo_jobs', n.type || ' ' || n.photo_id)
           FROM photo_jobs_new AS n
          WHERE n.state = 'pending';
        PERFORM set_config('photo_jobs.rows_named', (named + pending)::text, true);
    ELSE
        PERFORM pg_notify('photo_jobs', t.type)
           FROM (SELECT DISTINCT n.type FROM photo_jobs_new AS n WHERE n.state = 'pending') AS t;
    END IF;
    RETURN NULL;
END;
$$;
