"""The named-row protocol: the jobs of rows named by their notification are enqueued before
the rows are claimed, a Postgres round trip sooner in the queue than through a drain.

A notification that names a row (`TYPE PHOTO_ID`, sent by the INSERT trigger for a row at
token 0) costs the reactor no claim before its job is queued: `enqueue` writes the token-1
jobs that do not exist yet, and `claim` claims their rows afterwards in one statement. Until
that claim commits, a row is `pending` at token 0 with its job queued, which is safe: the job's
fenced start takes such a row over on the claim's own terms (due, attempts left, type not
paused), and a drain's claim of the same token finds the job alive and does not enqueue it
again. Anyone who can connect may NOTIFY, so a name guarantees nothing: the claim withdraws
every still-queued job whose row does not exist, is not at token 0 or is in a later life, and
jobs for names are drawn from a budget (`NAMED_ROWS_BUDGET`, refilled at
`NAMED_ROWS_REFILL_PER_SECOND`) that only rows found real pay back. A flood of names of absent
rows therefore costs at most the budget plus its refill in jobs, each withdrawn at its claim;
once the budget is spent, named rows are drained by type, which costs nothing for a row that is
not there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from reactor.dispatcher.drain import BatchResult, Dispatcher, DrainResult, require_idle
from reactor.dispatcher.metrics import Metrics
from reactor.errors import DatabaseError, EnqueueError, ReactorError, StatementError
from reactor.jobs import JobRef, short_id
from reactor.pg import db, queries
from reactor.routes import Route
from reactor.rq.enqueue import Enqueuer
from reactor.rq.state import ALIVE_STATUSES
from reactor.throttle import Budget, LogThrottle

__all__ = [
    "CLAIM_NAMED_AFTER_SECONDS",
    "NAMED_ROWS_BUDGET",
    "NAMED_ROWS_MAX",
    "NAMED_ROWS_REFILL_PER_SECOND",
    "NamedRows",
]

logger = logging.getLogger(__name__)

#: How long after enqueuing the rows named by notifications the reactor claims them, enqueuing
#: rows named meanwhile at once. RQ's worker picks a job up within a few ms; until then the
#: reactor and its Postgres session stay off the CPUs that the pick-up needs (on a machine whose
#: cores they share, a claim made at once slows the job's start down). The job's fenced start
#: takes its row over if it comes first.
CLAIM_NAMED_AFTER_SECONDS = 0.005
#: Rows named by notifications that one turn enqueues before claiming them; the types of any
#: more are drained (claimed first) instead.
NAMED_ROWS_MAX = 100
#: Jobs enqueued for named rows before their claim are drawn from a budget of this many,
#: refilled at `NAMED_ROWS_REFILL_PER_SECOND`; a row the claim finds real pays its job back.
NAMED_ROWS_BUDGET = 100
NAMED_ROWS_REFILL_PER_SECOND = 5.0


class NamedRows:
    """Enqueues the jobs of named rows, then claims the rows, on the dispatcher's connection."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        enqueuer: Enqueuer,
        routes: Mapping[str, Route],
        metrics: Metrics,
    ) -> None:
        self._dispatcher = dispatcher
        self._enqueuer = enqueuer
        self._routes = routes
        self._metrics = metrics
        self._budget = Budget(NAMED_ROWS_BUDGET, NAMED_ROWS_REFILL_PER_SECOND)
        self._claim_failed_log = LogThrottle(burst=10, interval_seconds=60.0)
        self._strays_log = LogThrottle(burst=5, interval_seconds=60.0)

    def room(self, wanted: int = NAMED_ROWS_MAX) -> int:
        """How many named rows may be enqueued now (at most `wanted`)."""
        return min(wanted, self._budget.available())

    def dispatch(
        self,
        refs: list[JobRef],
        types: set[str],
        *,
        listen: Callable[[float, int], tuple[set[str], list[JobRef], int]],
        drain: Callable[[Iterable[str]], DrainResult],
        stopped: Callable[[], bool],
    ) -> tuple[DrainResult, int, tuple[str, ...]]:
        """Dispatch the rows named by their notifications: enqueue their jobs at once, keep
        listening for `CLAIM_NAMED_AFTER_SECONDS` (`listen(seconds, room)`: the types to
        drain, the rows named meanwhile, how many notifications came) and enqueue the rows
        named meanwhile at once too, then claim them all in one statement. Then drain the types
        to drain: those named alone, and those of the rows whose jobs were not written (they
        existed, or Redis refused them: the drain retries until Redis answers). A type to
        drain, or a stop, ends the wait.

        Returns:
            What was done, how many notifications the wait read, and the types drained.
        """
        drained = dict.fromkeys([*types, *(ref.type for ref in refs)])
        written: list[JobRef] = []
        already = notifications = 0
        deadline = time.monotonic() + CLAIM_NAMED_AFTER_SECONDS
        while True:
            if refs:
                try:
                    enqueued, existing = self.enqueue(refs)
                except EnqueueError as exc:
                    logger.warning("notified_enqueue_failed rows=%d error=%s", len(refs), exc)
                    enqueued, existing = [], refs
                written += enqueued
                already += len(existing)
                # A job that exists already (another reactor's, or of an earlier life of the
                # row) was not written, nor will its row be claimed here: the drain claims it,
                # replacing a job that ended, finding another reactor's alive.
                types |= {ref.type for ref in existing}
            left = deadline - time.monotonic()
            if types or not written or left <= 0 or stopped():
                break
            types, refs, heard = listen(left, NAMED_ROWS_MAX - len(written))
            notifications += heard
            drained.update(dict.fromkeys([*types, *(ref.type for ref in refs)]))
        early, dropped = self.claim(written, already)
        types |= dropped
        drained.update(dict.fromkeys(dropped))
        result = drain(types) if types else DrainResult()
        if written or already:
            result = result.add(early)
        return result, notifications, tuple(drained)

    def enqueue(self, refs: Sequence[JobRef]) -> tuple[list[JobRef], list[JobRef]]:
        """Enqueue the jobs of rows named by their insert's notification (`refs`: token 1 of
        each) that do not exist yet; `claim` claims those rows afterwards. Each job written
        spends one unit of the budget (`room`).

        The job is in the queue one Postgres round trip sooner than through a claim. Until the
        claim commits the row is `pending` at token 0 with its job queued, which is safe: the
        job's fenced start takes such a row over on the claim's terms (due, attempts left, type
        not paused), and a drain's claim of the same token finds the job alive and does not
        enqueue it again. Refs of quarantined types are left to later drains.

        Returns:
            The refs whose jobs were written, and those whose job existed already (not written,
            not to be claimed here: the caller drains their types).

        Raises:
            EnqueueError: Redis failed (the caller drains the types instead).
        """
        quarantined = self._dispatcher.quarantined
        refs = [r for r in refs if r.type in self._routes and r.type not in quarantined]
        if not refs:
            return [], []
        started = time.perf_counter()
        try:
            written = self._enqueuer.enqueue_new(refs)
        except EnqueueError:
            self._metrics.enqueue_failures.inc()
            raise
        if written:
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
        self._budget.spend(len(written))
        kept = set(written)
        return written, [ref for ref in refs if ref not in kept]

    def claim(
        self, written: Sequence[JobRef], already_enqueued: int = 0
    ) -> tuple[BatchResult, set[str]]:
        """`_claim` (below); the rows it counts pay their jobs back to the budget, so names of
        absent rows spend it for good."""
        batch, dropped = self._claim(written, already_enqueued)
        self._budget.refund(batch.claimed + batch.named)
        return batch, dropped

    def _claim(
        self, written: Sequence[JobRef], already_enqueued: int = 0
    ) -> tuple[BatchResult, set[str]]:
        """Claim the rows whose jobs `enqueue` wrote (`CLAIM_NOTIFIED`), and withdraw
        the jobs that no row can use: a notification names whatever its sender wrote (anyone
        who can connect may NOTIFY), so a named row may not exist, or be in a later life.

        Returns the batch, whose `claimed` counts the rows this claim took, and `named` the
        other named rows whose jobs these are (taken over by their job's fenced start, run
        already, locked by another session, or waiting for a resume or their due time, when a
        claim of token 1 will find the job), and the types to drain now (see below).

        A job may have run already, and its row been inserted anew (deleted first), before
        this claim: the claim would then make the new row `active` with an ended job. So the
        claim reads the jobs' statuses while it holds the rows' locks (a job's fenced start
        waits for them, so no job can run meanwhile), and rolls back if any claimed row's job
        is no longer alive: those rows' types are returned, for a drain that replaces an ended
        job. (A row armed again by a requeue or `submit()` is never claimed here: its token is
        past 0.)

        Raises:
            DatabaseError: the connection failed (the jobs written are taken over by their
                workers, or found alive by the next claim).
        """
        if not written:
            return BatchResult(already_enqueued=already_enqueued), set()
        named = self._claim_rows(written)
        if named is None:
            # The claim was skipped: the jobs stay, for their fenced starts to judge.
            skipped = BatchResult(
                enqueued=len(written), already_enqueued=already_enqueued, named=len(written)
            )
            return skipped, set()
        rows, dropped = named
        keep = {key for key, (_, kept) in rows.items() if kept}
        claimed_here = sum(1 for here, _ in rows.values() if here)
        # Names of absent rows, or of rows in a later life: their jobs are nobody's.
        absent = [ref for ref in written if (ref.type, ref.photo_id) not in rows]
        # First-life rows past token 0: a job still queued is a spare (a name sent again after
        # RQ let the row's own job expire); a job taken is the row's own, run within the wait.
        ran = [
            r for r in written if (r.type, r.photo_id) in rows and (r.type, r.photo_id) not in keep
        ]
        withdrawn_absent = self._withdraw(absent)
        withdrawn_ran = self._withdraw(ran)
        ours = len(written) - len(absent) - withdrawn_ran
        by_type = Counter(r.type for r in written if (r.type, r.photo_id) in keep)
        for job_type, count in by_type.items():
            self._metrics.dispatched.labels(job_type).inc(count)
        if ours:
            logger.info(
                "batch_dispatched claimed=%d taken_over=%d enqueued=%d already_enqueued=%d "
                "notified=true",
                claimed_here,
                len(keep) - claimed_here,
                len(written) - withdrawn_absent - withdrawn_ran,
                already_enqueued,
            )
        batch = BatchResult(
            claimed=claimed_here,
            enqueued=len(written) - withdrawn_absent - withdrawn_ran,
            already_enqueued=already_enqueued,
            named=ours - claimed_here,
        )
        return batch, dropped

    def _claim_rows(
        self, refs: Sequence[JobRef]
    ) -> tuple[dict[tuple[str, str], tuple[bool, bool]], set[str]] | None:
        """Claim the rows of `refs`, whose jobs are queued (`CLAIM_NOTIFIED`), if every job of
        a row it claims is still alive. Returns the first-life rows among them, each with
        (claimed here, token-1 job still the row's to run), and the types of the rows left to
        a drain (the claim rolled back); None when the claim was skipped (logged)."""
        conn = self._dispatcher.connection
        require_idle(conn)
        params = {"photo_ids": [r.photo_id for r in refs], "types": [r.type for r in refs]}
        started = time.perf_counter()
        try:
            with db.translating("claim of notified rows failed", conn), conn.pipeline():
                rows = conn.execute(queries.CLAIM_NOTIFIED, params).fetchall()
            found = {(t, p): (bool(here), bool(keep)) for t, p, here, keep in rows}
            claimed = [JobRef(t, p, 1) for (t, p), (here, _) in found.items() if here]
            statuses = self._enqueuer.statuses(claimed) if claimed else []
            ended = [
                ref
                for ref, status in zip(claimed, statuses, strict=True)
                if status not in ALIVE_STATUSES
            ]
            if ended:
                with db.translating("rollback failed", conn):
                    conn.rollback()
                logger.info(
                    "notified_claim_dropped rows=%d ended=%s (jobs ended before the claim, "
                    "their rows inserted anew: left to the drains)",
                    len(claimed),
                    ",".join(ref.job_id[:80] for ref in ended[:5]),
                )
                # Rolled back: the claimed rows are pending at token 0 again, and still keep.
                unclaimed = {key: (False, keep) for key, (_, keep) in found.items()}
                return unclaimed, {ref.type for ref in claimed}
            with db.translating("COMMIT of notified rows failed", conn):
                conn.commit()
        except EnqueueError as exc:
            db.abandon(conn)
            self._claim_skipped(refs, exc)
            return None
        except StatementError as exc:
            db.abandon(conn)
            self._claim_skipped(refs, exc)
            return None
        except DatabaseError:
            db.abandon(conn)
            raise
        self._metrics.claim_seconds.observe(time.perf_counter() - started)
        return found, set()

    def _withdraw(self, refs: Sequence[JobRef]) -> int:
        """Withdraw the jobs of named rows that do not exist or are in a later life, if still
        queued; how many. A job already taken is left to its worker, whose fenced start
        refuses it; a Redis error leaves them all, likewise."""
        if not refs:
            return 0
        try:
            withdrawn = self._enqueuer.withdraw(refs)
        except EnqueueError as exc:
            if self._strays_log.allow():
                logger.warning(
                    "notified_withdraw_failed rows=%d error=%s suppressed=%d",
                    len(refs),
                    exc,
                    self._strays_log.suppressed(),
                )
            return 0
        if withdrawn:
            self._metrics.named_withdrawn.inc(withdrawn)
            if self._strays_log.allow():
                logger.warning(
                    "notified_jobs_withdrawn jobs=%d first=%s:%s suppressed=%d (rows named by "
                    "notifications that are not startable: no such row, or not pending at "
                    "token 0)",
                    withdrawn,
                    refs[0].type,
                    short_id(refs[0].photo_id),
                    self._strays_log.suppressed(),
                )
        return withdrawn

    def _claim_skipped(self, refs: Sequence[JobRef], error: ReactorError) -> None:
        """Only an optimisation failed (a statement error, or Redis unreadable): the jobs are
        queued and their workers take the rows over (or fail on the same row, as a claim
        would)."""
        if self._claim_failed_log.allow():
            logger.warning(
                "notified_claim_failed rows=%d error=%s suppressed=%d",
                len(refs),
                error,
                self._claim_failed_log.suppressed(),
            )
