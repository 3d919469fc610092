-- 0020: a history table for finished rows, one partition per calendar month (UTC), so old
-- history leaves by dropping a partition and the queue table holds only recent rows.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0020_create_photo_jobs_history.sql
--
-- `reactor archive` and `reactor run --archive-after` move done, failed and cancelled rows
-- older than a given age from photo_jobs into photo_jobs_history, batch by batch (one DELETE …
-- RETURNING feeding one INSERT), and drop the months older than `--drop-history-after`.
-- A row keeps its columns; its last update (`updated_at`) becomes `finished_at`, the partition
-- key. A photo may have several history rows: one per life archived. `reactor requeue` of an
-- archived photo brings its latest life back into photo_jobs, its token going on from it.
--
-- Partitions are made on demand by photo_jobs_history_add_months (the archive calls it for
-- the months of the rows it is about to move), so only a role that owns photo_jobs_history
-- archives: a role that may not create tables gets "must be owner" and moves nothing.
-- There is no default partition: a row whose month has no partition fails its batch, which is
-- rolled back, rather than landing where no drop would ever reach it.
--
-- Locks: photo_jobs is not touched. Safe to run while old reactors run.

SELECT reactor_migration_begin(20, 'create_photo_jobs_history');

SET LOCAL search_path = public, pg_temp;

CREATE TABLE public.photo_jobs_history (
    photo_id text NOT NULL,
    type text NOT NULL,
    state text NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    prior_attempts bigint NOT NULL,
    last_error text,
    created_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    traceparent text,
    tracestate text,
    CONSTRAINT photo_jobs_history_state_check
        CHECK (state IN ('done', 'failed', 'cancelled'))
) PARTITION BY RANGE (finished_at);

COMMENT ON TABLE public.photo_jobs_history IS
    'Finished photo_jobs rows moved out of the queue table, one partition per UTC month of finished_at (photo_jobs.updated_at when moved).';

-- requeue and the lookups of a photo's rows; each partition gets its own.
CREATE INDEX photo_jobs_history_photo_id_idx ON public.photo_jobs_history (photo_id);

-- Create the missing monthly partitions from p_from's month through p_to's (at most 1,200).
-- Returns how many it created. A partition that exists is not locked or touched. Creating or
-- dropping one locks photo_jobs_history (not photo_jobs) for a moment: waited for at most 5 s,
-- so a long reader of the history fails the call rather than queueing every archive behind it.
CREATE FUNCTION public.photo_jobs_history_add_months(p_from timestamptz, p_to timestamptz)
RETURNS integer
LANGUAGE plpgsql
SET search_path = public, pg_temp
SET lock_timeout = '5s'
AS $$
DECLARE
    month timestamp := date_trunc('month', p_from AT TIME ZONE 'UTC');
    last timestamp := date_trunc('month', p_to AT TIME ZONE 'UTC');
    name text;
    created integer := 0;
BEGIN
    IF last - month > interval '100 years' THEN
        RAISE EXCEPTION 'history months from % to %: more than 1,200', p_from, p_to;
    END IF;
    WHILE month <= last LOOP
        name := 'photo_jobs_history_' || to_char(month, 'YYYY_MM');
        IF to_regclass('public.' || name) IS NULL THEN
            EXECUTE format(
                'CREATE TABLE public.%I PARTITION OF public.photo_jobs_history'
                ' FOR VALUES FROM (%L) TO (%L)',
                name,
                to_char(month, 'YYYY-MM-DD') || ' 00:00:00+00',
                to_char(month + interval '1 month', 'YYYY-MM-DD') || ' 00:00:00+00');
            created := created + 1;
        END IF;
        month := month + interval '1 month';
    END LOOP;
    RETURN created;
END;
$$;

-- The monthly partitions whose every row finished before p_before: (name, estimated rows,
-- end of the month), oldest first. Only partitions named as photo_jobs_history_add_months
-- names them.
CREATE FUNCTION public.photo_jobs_history_months_before(p_before timestamptz)
RETURNS TABLE (name text, estimated_rows bigint, ends timestamptz)
LANGUAGE sql STABLE
SET search_path = public, pg_temp
AS $$
    SELECT m.name, greatest(m.reltuples, 0)::bigint, m.ends
      FROM (SELECT c.relname::text AS name, c.reltuples,
                   (to_date(substr(c.relname, 20), 'YYYY_MM')::timestamp + interval '1 month')
                       AT TIME ZONE 'UTC' AS ends
              FROM pg_inherits AS i
              JOIN pg_class AS c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'public.photo_jobs_history'::regclass
               AND c.relname ~ '^photo_jobs_history_[0-9]{4}_[0-9]{2}$') AS m
     WHERE m.ends <= p_before
     ORDER BY m.ends
$$;

-- Drop the monthly partitions whose every row finished before p_before; returns their names.
CREATE FUNCTION public.photo_jobs_history_drop_before(p_before timestamptz)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path = public, pg_temp
SET lock_timeout = '5s'
AS $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT m.name FROM photo_jobs_history_months_before(p_before) AS m LOOP
        EXECUTE format('DROP TABLE public.%I', name);
        RETURN NEXT name;
    END LOOP;
END;
$$;
