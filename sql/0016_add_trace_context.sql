-- 0016: the W3C trace context of the producer that submitted a row (OpenTelemetry).
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0016_add_trace_context.sql
--
-- submit() stores the `traceparent` and `tracestate` of its PRODUCER span with the row, so the
-- reactor's batch span and the worker's `process` span can link to the request that submitted
-- the photo. Rows inserted by plain SQL have none (NULL). The values are a producer's input:
-- the checks only bound their lengths (readers validate the format and ignore a malformed one).
-- They are added NOT VALID, which still checks every row written from now on; every existing
-- row holds NULL in the new columns, so there is nothing to validate and no scan to pay for.

SELECT reactor_migration_begin(16, 'add_trace_context');

SET LOCAL search_path = public, pg_temp;

ALTER TABLE public.photo_jobs ADD COLUMN traceparent text, ADD COLUMN tracestate text;

ALTER TABLE public.photo_jobs
    ADD CONSTRAINT photo_jobs_traceparent_length CHECK (length(traceparent) <= 128) NOT VALID,
    ADD CONSTRAINT photo_jobs_tracestate_length CHECK (length(tracestate) <= 512) NOT VALID;

COMMENT ON COLUMN public.photo_jobs.traceparent IS
    'W3C traceparent of the submitting producer span (NULL: none).';
COMMENT ON COLUMN public.photo_jobs.tracestate IS
    'W3C tracestate of the submitting producer span (NULL: none).';
