-- 0004: the adaptive doorbell. The NOTIFY triggers ring only while a reactor listens for them.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0004_adaptive_doorbell.sql
--
-- The doorbell is 16 advisory lock keys from photo_jobs_doorbell_key() on. An idle reactor
-- "arms" by holding all of them in exclusive mode; a writer's trigger asks for one key (by its
-- backend pid) in shared mode without waiting. Granted: no reactor is armed; the writer sends
-- nothing and holds the key until its transaction ends, so a reactor that arms later waits for
-- that transaction and then drains, and a reactor that is not armed is polling. Refused: a
-- reactor is armed (or arming): NOTIFY as in 0003. Invariant: a committed pending row is
-- either notified or seen by a poll or by the drain that follows arming.

SELECT reactor_migration_begin(4, 'adaptive_doorbell');

-- The first key: 'phdrbell' in ASCII (pg_locks: classid 1885889650, objid 1650814060 + 0..15).
CREATE FUNCTION photo_jobs_doorbell_key() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 8099834372265700460::bigint $$;

-- How many keys: writers pick theirs by backend pid, so concurrent writers rarely share one.
CREATE FUNCTION photo_jobs_doorbell_stripes() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 16 $$;

-- The triggers of 0003 again, with the check in their WHEN clauses, the key spelled with
-- literals (a WHEN clause is planned for every statement; tests/test_doorbell.py checks the
-- literals against the functions). An INSERT asks before it knows whether it inserted pending
-- rows; the function then sends nothing for rows that are not pending.
DROP TRIGGER photo_jobs_notify_inserted ON photo_jobs;
CREATE TRIGGER photo_jobs_notify_inserted
    AFTER INSERT ON photo_jobs
    REFERENCING NEW TABLE AS photo_jobs_new
    FOR EACH STATEMENT
    WHEN (NOT pg_try_advisory_xact_lock_shared(8099834372265700460 + pg_backend_pid() % 16))
    EXECUTE FUNCTION photo_jobs_notify_inserted();

-- (0008 makes the UPDATE check ask for the key only for rows moving into pending.)
DROP TRIGGER photo_jobs_notify_pending ON photo_jobs;
CREATE TRIGGER photo_jobs_notify_pending
    AFTER UPDATE OF state ON photo_jobs
    FOR EACH ROW
    WHEN (NEW.state = 'pending' AND OLD.state IS DISTINCT FROM 'pending'
          AND NOT pg_try_advisory_xact_lock_shared(8099834372265700460 + pg_backend_pid() % 16))
    EXECUTE FUNCTION photo_jobs_notify_pending();
