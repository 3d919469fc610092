-- 0008: the UPDATE trigger of the doorbell asks for its key only for rows moving into pending.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0008_order_pending_trigger_checks.sql
--
-- 0004 wrote the check as `moving into pending AND NOT pg_try_advisory_xact_lock_shared(...)`;
-- PostgreSQL does not promise to evaluate AND from left to right, so a claim, heartbeat or
-- completion could take a doorbell key (making an arming reactor wait for it). CASE fixes the
-- order: the key is asked for only when the row moves into pending.

SELECT reactor_migration_begin(8, 'order_pending_trigger_checks');

SET LOCAL search_path = public, pg_temp;

DROP TRIGGER photo_jobs_notify_pending ON public.photo_jobs;
CREATE TRIGGER photo_jobs_notify_pending
    AFTER UPDATE OF state ON public.photo_jobs
    FOR EACH ROW
    WHEN (CASE WHEN NEW.state = 'pending' AND OLD.state IS DISTINCT FROM 'pending'
               THEN NOT pg_try_advisory_xact_lock_shared(8099834372265700460 + pg_backend_pid() % 16)
               ELSE false END)
    EXECUTE FUNCTION public.photo_jobs_notify_pending();
