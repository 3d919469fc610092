-- 0002: partial indexes that keep the dispatcher's queries O(due rows), not O(table).
--
-- Runnable as-is: psql -X -v ON_ERROR_STOP=1 -1 -f sql/0002_create_dispatch_indexes.sql
--
-- Pending rows are claimed in due order per type: a row is due at
-- coalesce(next_retry_at, created_at) (NULL next_retry_at = deliverable now). Ordering by
-- that expression, not by "next_retry_at NULLS FIRST", keeps retries from starving behind
-- a steady stream of fresh rows, and lets the claim be one index range scan that stops at
-- LIMIT whatever the number of done/failed rows or of rows scheduled for later.

SELECT reactor_migration_begin(2, 'create_dispatch_indexes');

CREATE INDEX photo_jobs_pending_due_idx
    ON photo_jobs (type, (coalesce(next_retry_at, created_at)))
    WHERE state = 'pending';

-- Stale rescue and the "job lost from Redis" check read only active rows.
CREATE INDEX photo_jobs_active_updated_idx
    ON photo_jobs (updated_at)
    WHERE state = 'active';

-- Operator commands (requeue --failed, prune) read finished rows by age; without this index
-- each of their batches would scan the whole table.
CREATE INDEX photo_jobs_finished_updated_idx
    ON photo_jobs (state, updated_at)
    WHERE state IN ('done', 'failed');
