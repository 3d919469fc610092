-- 0004: the adaptive doorbell. The NOTIFY triggers ring only while a reactor listens for them.
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0004_adaptive_doorbell.sql
--
-- Why: a transaction that sent NOTIFY takes a cluster-wide lock at commit and holds it through
-- its WAL flush, so every notifying writer commits one after another (measured: 16 writers of
-- single-row inserts fell to 0.28x of their throughput without the trigger). Under load the
-- reactor does not need the bell: it is polling anyway.
--
-- How: the doorbell is a set of advisory lock keys (photo_jobs_doorbell_stripes() of them,
-- from photo_jobs_doorbell_key() on). A reactor that waits idle for work "arms" by holding
-- every key in exclusive mode. A writer's trigger asks for one key (chosen by its backend pid)
-- in shared mode, without waiting:
--   * granted: no reactor is armed (none holds or is queued for that key). The writer sends
--     nothing and keeps the shared lock until its transaction ends. A reactor that arms later
--     has to wait for that transaction to end (commit or roll back) before it holds every
--     key, and drains right after, so it sees the row. A reactor that is not armed is
--     polling, and sees the row at its next poll.
--   * refused: a reactor holds or is queued for that key in exclusive mode: NOTIFY as before,
--     one notification per distinct type (payload = type, channel photo_jobs).
-- Advisory locks are not MVCC state, so this holds at every isolation level of the writer.
-- Shared requests of one transaction are re-entrant: a later statement of a transaction that
-- already holds its key is granted it again and sends nothing, which is right, because an
-- arming reactor waits for that transaction anyway.
--
-- Why several keys: so that concurrent writers rarely take and release the same lock (and
-- the same lock-manager partition). An early measurement credited one key with most of the
-- writers' cost, but it also paid for planning SQL-function calls in the WHEN clause (see the
-- triggers below), so what the 16 keys gain on their own is not measured; they cost the
-- reactor nothing but 16 locks when it arms.

-- The keys are per database (advisory locks are), so two databases on one server have
-- separate doorbells. The reactor side (arm, release on a notification, poll while rows keep
-- coming) is in reactor/doorbell.py and reactor/listener.py; `reactor run --doorbell plain`
-- keeps the keys all the time, which makes these triggers notify on every write, as 0003 did.

SELECT reactor_migration_begin(4, 'adaptive_doorbell');

-- The doorbell's first advisory lock key: the ASCII bytes 'phdrbell' as a bigint. In
-- pg_locks the keys appear as locktype 'advisory', classid 1885889650, objid 1650814060 to
-- 1650814075, objsubid 1.
CREATE FUNCTION photo_jobs_doorbell_key() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 8099834372265700460::bigint $$;

-- How many keys (16, the number of lock-manager partitions of a default build). Writers pick
-- theirs by backend pid, so concurrent writers mostly take different keys.
CREATE FUNCTION photo_jobs_doorbell_stripes() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 16 $$;

-- The triggers of 0003 again, with the doorbell in their WHEN clauses; their functions (notify
-- each distinct pending type of the statement; notify the row's type) are unchanged. The check
-- asks for key photo_jobs_doorbell_key() + pg_backend_pid() % photo_jobs_doorbell_stripes(),
-- written with literals on purpose: a WHEN clause is planned again for every statement, and
-- planning calls to SQL functions there (to inline or fold them) cost 16-writer single-row
-- inserts 0.79x of their throughput where the literal form costs 0.98x (measured with pgbench,
-- 13 alternating pairs). tests/test_doorbell.py checks the literals against the functions.
-- In a WHEN clause the check also costs no trigger-function call when the bell is silent.
-- The INSERT trigger asks for the key before it knows whether the statement inserted pending
-- rows (a statement-level WHEN cannot look at them): so any INSERT, even of 0 rows, takes the
-- shared lock when it is free. That only makes an arming reactor wait for the transaction; and
-- when the lock is refused, the function finds no pending rows in such a statement and sends
-- nothing.
DROP TRIGGER photo_jobs_notify_inserted ON photo_jobs;
CREATE TRIGGER photo_jobs_notify_inserted
    AFTER INSERT ON photo_jobs
    REFERENCING NEW TABLE AS photo_jobs_new
    FOR EACH STATEMENT
    WHEN (NOT pg_try_advisory_xact_lock_shared(8099834372265700460 + pg_backend_pid() % 16))
    EXECUTE FUNCTION photo_jobs_notify_inserted();

-- Moving into pending is checked first, so claims, heartbeats and completions never take
-- a key.
DROP TRIGGER photo_jobs_notify_pending ON photo_jobs;
CREATE TRIGGER photo_jobs_notify_pending
    AFTER UPDATE OF state ON photo_jobs
    FOR EACH ROW
    WHEN (NEW.state = 'pending' AND OLD.state IS DISTINCT FROM 'pending'
          AND NOT pg_try_advisory_xact_lock_shared(8099834372265700460 + pg_backend_pid() % 16))
    EXECUTE FUNCTION photo_jobs_notify_pending();
