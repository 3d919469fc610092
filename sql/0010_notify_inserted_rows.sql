-- 0010: an INSERT of a few rows names each row in its notification, so that a reactor can
-- enqueue their jobs before it claims them.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0010_notify_inserted_rows.sql
--
-- Payloads on channel photo_jobs, from now on:
--   'TYPE'           as before: rows of TYPE became pending; drain (claim) the type.
--   'TYPE PHOTO_ID'  this row was inserted pending, due, at attempt 0. A type has no spaces
--                    (photo_jobs_type_check), so the first space ends it; the photo id is the
--                    rest, whatever it holds.
-- Per statement and type: up to 8 such rows are named one by one; more rows, or any row that
-- is not due or not at attempt 0, and the statement sends the type alone, as before (a large
-- batch is cheaper to claim in one statement than to name row by row). Retries and requeues
-- (the UPDATE trigger) still send the type alone.
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
BEGIN
    -- A 0-row statement also fires a statement trigger; the query below sends nothing then.
    PERFORM pg_notify('photo_jobs', p.payload)
       FROM (SELECT n.type,
                    count(*) <= 8
                    AND bool_and(n.attempts = 0
                                 AND coalesce(n.next_retry_at, n.created_at) <= now())
                        AS by_row,
                    array_agg(n.photo_id) AS photo_ids
               FROM photo_jobs_new AS n
              WHERE n.state = 'pending'
              GROUP BY n.type) AS t
       CROSS JOIN LATERAL (
             SELECT t.type || ' ' || r.photo_id AS payload
               FROM unnest(t.photo_ids) AS r(photo_id)
              WHERE t.by_row
              UNION ALL
             SELECT t.type
              WHERE NOT t.by_row) AS p;
    RETURN NULL;
END;
$$;
