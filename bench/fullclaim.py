"""`python -m bench.fullclaim run …`: the `reactor` command with the claim of main before the
low-water marks (`reactor.dispatcher.bounds`): every claim over the whole range of its type's
pending index, and the outer `state = 'pending'` check with which the planner may read that
whole index once more for the UPDATE. The "before" side of `python -m bench pressure
--before`. Its statement matches the layout of `queries.sql` (the pressure benchmark finds it
in `pg_stat_statements` by the same text)."""

from __future__ import annotations

from reactor.cli import main
from reactor.dispatcher import bounds
from reactor.pg import queries

#: CLAIM_DUE as it was (it ignores the `window` parameter the drain passes).
CLAIM_DUE = """\
UPDATE photo_jobs AS j
   SET state = CASE WHEN j.attempts < j.max_attempts THEN 'active' ELSE 'failed' END,
       attempts = CASE WHEN j.attempts < j.max_attempts THEN j.attempts + 1 ELSE j.attempts END,
       last_error = CASE WHEN j.attempts < j.max_attempts THEN j.last_error
                    ELSE format('attempts spent before dispatch: attempt %%s of %%s',
                                j.attempts, j.max_attempts) END
 WHERE j.ctid = ANY (ARRAY(
         SELECT p.ctid
           FROM photo_jobs AS p
          WHERE p.type = %(type)s
            AND p.state = 'pending'
            AND coalesce(p.next_retry_at, p.created_at) <= now()
            AND NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = %(type)s)
            AND p.photo_id <> ALL (%(skip)s::text[])
          ORDER BY coalesce(p.next_retry_at, p.created_at)
          LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED))
   AND j.state = 'pending'
RETURNING j.type, j.photo_id, j.prior_attempts + j.attempts, j.state, j.traceparent, j.tracestate
"""


def _always_full(self: bounds.ClaimBounds, job_type: str, now: float) -> float | None:
    return None


setattr(bounds.ClaimBounds, "window", _always_full)  # noqa: B010 - the benchmark's switch
queries.CLAIM_DUE = CLAIM_DUE
main()
