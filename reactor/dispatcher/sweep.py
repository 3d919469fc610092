"""The fallback sweep: one round of everything the LISTEN path cannot guarantee alone.

`Sweeper.run_once()` (every sweep interval inside `reactor run`, and `reactor sweep`):
1. drains every routed type through the normal claim path (rows whose NOTIFY was missed);
2. passes over the `active` rows, reading their jobs' RQ statuses in pipelined round trips,
   and re-dispatches as a new attempt (or fails, with a `last_error` that says why, when
   attempts are spent) the rows whose job vanished from Redis (Redis restarted without
   persistence, a failover to a stale replica), the rows whose job was started by an RQ worker
   that is gone (its key expired: `rq_state.workers_gone`) and that have had no write for
   `gone_after`, and the rows whose job was started but sent no heartbeat for `stale_after`
   (the worker died, and RQ could not tell). Rows whose job is still queued are waiting
   for a worker, not lost, and are left alone (rescuing them would only lengthen a queue that
   is already behind), unless the job sits in no queue at all (a worker took it and died
   before starting it): that one is lost too. A job that ended in RQ (finished, or `failed`:
   the worker could not import the handler or reach the database) while its row is still
   `active` is re-dispatched once the row has had no write for `stale_after`, a failed one
   with RQ's error in `last_error`: the worker classes record the outcome just after RQ
   records the job's end, and a rescue in between would run a finished attempt again (or,
   once the worker that ran it is gone, after `gone_after`: no outcome can come any more);
3. notes pending rows of types no route covers (left alone; warned about once per type, a few
   by name per sweep and the rest in one line).
After each round, when metrics are served, `guarded_round` refreshes the backlog gauges
(`reactor.dispatcher.backlog`) and the vacuum gauges (`reactor.pg.vacuum`): never on the
dispatch path.
RQ's keys are read one by one inside each round trip (`reactor.rq.state`): a key of the wrong
type leaves only its row alone, logged once (`reactor.dispatcher.sweep_notes`), and makes the
round's `rescue_error` (counted in `reactor_sweep_failures_total`, and in `/healthz` after a
few rounds in a row); a missing `status` reads as a job gone, an unknown one as a job ended.
Each step is safe with any number of reactors: every write goes through `FOR UPDATE SKIP
LOCKED` and re-checks the row's state and attempt under the lock.

Who does what: the sweep's own reads (active rows, pending types, backlog) run on the
connection its owner hands in with each round; every write goes
through the `Dispatcher`'s named methods (`drain`, `redispatch`), so
claim, enqueue and COMMIT stay one unit; what RQ holds is read through `reactor.rq.state`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from reactor.dispatcher.backlog import refresh_backlog_metrics
from reactor.dispatcher.drain import BatchResult, Dispatcher
from reactor.dispatcher.metrics import HealthCheck, Metrics
from reactor.dispatcher.sweep_notes import SweepNotes
from reactor.errors import RedisDataError, RedisUnavailableError, StatementError
from reactor.jobs import JobRef, short_id
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.vacuum import read_vacuum_health
from reactor.routes import Route
from reactor.rq.state import ALIVE_STATUSES, FAILED, QUEUED, STARTED, UNREADABLE, RqState
from reactor.settings import DEFAULT_GONE_AFTER_SECONDS
from reactor.throttle import LogThrottle
from reactor.validate import error_column

__all__ = ["SweepResult", "Sweeper", "guarded_round"]

logger = logging.getLogger(__name__)

#: Failed sweeps logged per `SWEEP_FAILED_LOG_SECONDS` (the rest are counted in the next line).
SWEEP_FAILED_LOG_BURST = 3
SWEEP_FAILED_LOG_SECONDS = 60.0

#: `last_error` of a row failed because its job vanished from Redis and its attempts are spent.
_JOB_LOST = "job lost: its RQ job vanished from Redis"
#: `last_error` of a row whose job ended failed in RQ before the lifecycle recorded an outcome
#: (followed by RQ's error).
_JOB_FAILED_IN_RQ = "job failed in RQ without recording an outcome"
#: `last_error` of a row failed because the RQ worker running its job is gone.
_WORKER_GONE = "worker lost: its RQ worker is gone (worker key expired)"
#: `last_error` of a row failed because its job ended otherwise in RQ (finished, stopped,
#: canceled) with no outcome recorded, and its attempts are spent.
_JOB_ENDED = "job ended in RQ without recording an outcome"


@dataclass(frozen=True)
class SweepResult:
    """What one sweep round did (`reactor sweep` prints it as JSON)."""

    claimed: int = 0
    enqueued: int = 0
    rescued: int = 0
    rescue_failed: int = 0
    lost: int = 0
    enqueue_failures: int = 0
    #: Types with pending rows and no route (the first `MAX_UNROUTED_REPORTED`).
    unrouted_types: tuple[str, ...] = field(default=())
    more: bool = False
    #: Rows whose re-dispatch failed alone (left as they were, for the next sweep).
    rescue_refused: int = 0
    #: Types whose claim fails (left out of drains with backoff) and rows whose claim fails
    #: alone (left out, their types flow): `reactor sweep` exits 1 when either is not 0.
    claim_failures: int = 0
    claim_refused: int = 0
    #: Redis keys the rescue step could not read (a job or queue key of the wrong type: only
    #: their rows are left alone), and why the rescue step failed (None: it did not).
    unreadable_keys: int = 0
    rescue_error: str | None = None
    #: Why the drain step's enqueue failed (None: it did not).
    enqueue_error: str | None = None


class Sweeper:
    """Runs sweep rounds: reads on `conn`, writes through `dispatcher`, RQ through `rq_state`."""

    #: The work connection of the round in progress (`run_once`).
    _conn: Connection

    def __init__(
        self,
        dispatcher: Dispatcher,
        rq_state: RqState,
        routes: Mapping[str, Route],
        *,
        batch_size: int,
        stale_after_seconds: float,
        gone_after_seconds: float = DEFAULT_GONE_AFTER_SECONDS,
        metrics: Metrics | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._rq = rq_state
        self.routes = routes
        self._types = list(routes)
        self._batch_size = batch_size
        self._stale_after = stale_after_seconds
        self._gone_after = min(gone_after_seconds, stale_after_seconds)
        self._notes = SweepNotes()
        self._refused = 0  # rows whose re-dispatch failed alone, this sweep
        self._refused_log = LogThrottle(burst=10, interval_seconds=60.0)
        self.metrics = metrics or Metrics()
        #: Failed sweeps are logged a few times a minute at most (`guarded_round`).
        self.failed_log = LogThrottle(SWEEP_FAILED_LOG_BURST, SWEEP_FAILED_LOG_SECONDS)

    def run_once(
        self,
        conn: Connection,
        should_stop: Callable[[], bool] = lambda: False,
        slice_seconds: float | None = None,
    ) -> SweepResult:
        """Run the three steps on `conn`; a Redis failure in one step is counted and the
        others go on. The drain step stops after `slice_seconds` (then `more` is set), so a
        backlog that keeps growing cannot keep the rescue step from running.

        Raises:
            DatabaseError: Postgres failed (the caller reconnects).
        """
        claimed = enqueued = rescued = rescue_failed = lost = failures = 0
        self._conn = conn
        self._refused = 0
        more = False
        rescue_error = enqueue_error = None
        try:
            drained = self._dispatcher.drain(conn, self._types, should_stop, slice_seconds)
            claimed, enqueued, more = drained.claimed, drained.enqueued, drained.more
        except RedisUnavailableError as exc:
            failures += exc.rows
            enqueue_error = str(exc)
            logger.warning("sweep_enqueue_failed step=drain error=%s", exc)
        try:
            rescued, lost, rescue_failed = self._rescue(should_stop)
        except RedisUnavailableError as exc:
            failures += exc.rows
            rescue_error = str(exc)
            logger.warning("sweep_enqueue_failed step=rescue error=%s", exc)
        unreadable = self._rq.take_unreadable()
        self._notes.unreadable(unreadable)
        if unreadable and rescue_error is None:
            key, error = next(iter(unreadable.items()))
            rescue_error = f"{len(unreadable)} Redis key(s) unreadable, e.g. {key}: {error}"
        unrouted = self._unrouted_types()
        metrics = self.metrics
        metrics.sweeps.inc()
        if rescue_error is not None:
            metrics.sweep_failures.inc()
        metrics.rescued.labels("stale").inc(rescued)
        metrics.rescued.labels("lost").inc(lost)
        metrics.rescue_failed.inc(rescue_failed)
        dispatcher = self._dispatcher
        result = SweepResult(
            claimed,
            enqueued,
            rescued,
            rescue_failed,
            lost,
            failures,
            tuple(unrouted),
            more,
            rescue_refused=self._refused,
            claim_failures=sum(t in dispatcher.quarantined for t in self._types),
            claim_refused=sum(r.type in self.routes for r in dispatcher.refused.current()),
            unreadable_keys=len(unreadable),
            rescue_error=rescue_error,
            enqueue_error=enqueue_error,
        )
        if claimed or rescued or rescue_failed or lost or failures or self._refused:
            logger.info(
                "sweep_done claimed=%d enqueued=%d rescued=%d rescue_failed=%d lost=%d "
                "rescue_refused=%d enqueue_failures=%d",
                claimed,
                enqueued,
                rescued,
                rescue_failed,
                lost,
                self._refused,
                failures,
            )
        return result

    def _rescue(self, should_stop: Callable[[], bool]) -> tuple[int, int, int]:
        """One pass over the active rows, a page at a time, reading each page's job statuses
        in one pipelined round trip. A row is re-dispatched when its job is gone from Redis,
        when its job ended in RQ (finished, failed, stopped) and the row has had no write for
        `stale_after` (the worker classes write the outcome just after RQ records the end: a
        rescue in that gap would run the attempt again), or when its job was started and the
        row has had no heartbeat for `stale_after` (the worker died). A row whose job is still
        queued is only waiting for a worker, however long: rescuing it would add work to a
        queue that is already behind.

        Returns (rescued, lost, failed) row counts.
        """
        conn = self._conn
        dead_rows = gone_rows = lost_rows = BatchResult()
        with translating("rescue pass failed", conn):
            with conn.transaction():
                row = conn.execute(queries.DATABASE_NOW).fetchone()
            until: datetime = row[0] if row else datetime.max
            after: tuple[str, str, str] = ("-infinity", "", "")  # updated_at as text
            waiting: list[JobRef] = []  # stale and still queued: maybe orphans
            while not should_stop():
                with conn.transaction():
                    page = conn.execute(
                        queries.LIST_ACTIVE,
                        {
                            "types": self._types,
                            "until": until,
                            "after_at": after[0],
                            "after_type": after[1],
                            "after_id": after[2],
                            "limit": self._batch_size,
                            "stale_after": self._stale_after,
                            "gone_after": self._gone_after,
                        },
                    ).fetchall()
                if not page:
                    break
                last, read = page[-1], len(page)
                page = [row for row in page if not row[4]]  # a paused type's rows wait
                refs = [JobRef(t, p, a) for t, p, a, *_ in page]
                statuses = self._rq.job_statuses(refs)
                gone: list[JobRef] = []
                ended: list[JobRef] = []
                dead: list[JobRef] = []
                failed_in_rq: list[JobRef] = []
                # Started or ended, quiet but not stale yet: rescued now if its worker is gone.
                unsure = [
                    (ref, status)
                    for ref, status, (*_, stale, quiet) in zip(refs, statuses, page, strict=True)
                    if quiet and not stale
                ]
                gone_workers = self._rq.worker_gone_rows(
                    [ref for ref, _ in unsure], [status for _, status in unsure]
                )
                worker_gone = {
                    ref for (ref, _), lost in zip(unsure, gone_workers, strict=True) if lost
                }
                dead_gone: list[JobRef] = []
                for ref, status, (*_, stale, _quiet) in zip(refs, statuses, page, strict=True):
                    if status == UNREADABLE:
                        continue  # its key is reported; the row waits until it can be read
                    if status is None:
                        gone.append(ref)
                    elif status not in ALIVE_STATUSES:
                        # RQ records a job's end before the worker classes write its outcome:
                        # only a row left without a write for stale_after is past that moment,
                        # or one whose worker is gone (no outcome can come from it any more).
                        if stale or ref in worker_gone:
                            (failed_in_rq if status == FAILED else ended).append(ref)
                    elif status == STARTED and stale:
                        dead.append(ref)
                    elif status == STARTED and ref in worker_gone:
                        dead_gone.append(ref)
                    elif status == QUEUED and stale:
                        waiting.append(ref)
                dispatcher = self._dispatcher
                lost_rows += self._row_by_row(dispatcher.redispatch, gone, _JOB_LOST)
                lost_rows += self._row_by_row(
                    dispatcher.redispatch,
                    ended,
                    _JOB_ENDED,
                    stale_after_seconds=self._gone_after,
                )
                lost_rows += self._redispatch_failed_in_rq(failed_in_rq)
                dead_rows += self._row_by_row(
                    dispatcher.redispatch,
                    dead,
                    f"worker lost: no heartbeat for {self._stale_after:g} s",
                    stale_after_seconds=self._stale_after,
                )
                # Re-checked under the lock: a worker that resumed and beat keeps its attempt.
                gone_rows += self._row_by_row(
                    dispatcher.redispatch,
                    dead_gone,
                    _WORKER_GONE,
                    stale_after_seconds=self._gone_after,
                )
                after = (last[3], last[0], last[1])
                if read < self._batch_size:
                    break
            # A long wait in the queue is normal; a job queued in no queue is an orphan. Checked
            # once for the whole pass: each check reads the queues whole.
            orphaned = self._rq.orphaned(waiting)
            gone = [ref for ref, orphan in zip(waiting, orphaned, strict=True) if orphan]
            for start in range(0, len(gone), self._batch_size):
                lost_rows += self._row_by_row(
                    self._dispatcher.redispatch,
                    gone[start : start + self._batch_size],
                    _JOB_LOST,
                )
        stale, lost = dead_rows.claimed, lost_rows.claimed
        rescued = stale + gone_rows.claimed
        failed = dead_rows.failed + gone_rows.failed + lost_rows.failed
        if rescued or lost or failed:
            logger.warning(
                "rows_rescued stale=%d worker_gone=%d lost=%d failed=%d",
                stale,
                gone_rows.claimed,
                lost,
                failed,
            )
        return rescued, lost, failed

    def _row_by_row(
        self, redispatch: Callable[..., BatchResult], refs: list[JobRef], *args: Any, **kwargs: Any
    ) -> BatchResult:
        """`redispatch(refs, *args, **kwargs)`; if the statement fails (a trigger of the user's
        refusing one row, say) or a Redis key the jobs write holds another kind of value, each
        row again on its own: rows that fail alone are left as they are until the next sweep
        (counted in `rescue_refused`, logged a few times a minute), so one row cannot hold up
        every rescue after it."""
        if not refs:
            return BatchResult()
        try:
            return redispatch(self._conn, refs, *args, **kwargs)
        except (StatementError, RedisDataError) as exc:
            if len(refs) == 1:
                self._refused += 1
                if self._refused_log.allow():
                    ref = refs[0]
                    logger.error(
                        "rescue_refused type=%s photo_id=%s token=%d error=%s suppressed=%d",
                        ref.type,
                        short_id(ref.photo_id),
                        ref.token,
                        exc,
                        self._refused_log.suppressed(),
                    )
                return BatchResult()
        return sum(
            (self._row_by_row(redispatch, [ref], *args, **kwargs) for ref in refs), BatchResult()
        )

    def _redispatch_failed_in_rq(self, refs: list[JobRef]) -> BatchResult:
        """Re-dispatch rows whose job failed in RQ without an outcome, each with RQ's error
        (one statement per distinct error: these are rare, and the errors differ)."""
        if not refs:
            return BatchResult()
        by_error: dict[str, list[JobRef]] = {}
        for ref, text in zip(refs, self._rq.failure_texts(refs), strict=True):
            why = error_column(f"{_JOB_FAILED_IN_RQ}: {text or 'RQ recorded no error'}")
            by_error.setdefault(why, []).append(ref)
        total = BatchResult()
        for why, group in by_error.items():
            total += self._row_by_row(
                self._dispatcher.redispatch,
                group,
                why,
                error=why,
                stale_after_seconds=self._gone_after,
            )
        return total

    def _unrouted_types(self) -> list[str]:
        conn = self._conn
        with translating("pending-types query failed", conn), conn.transaction():
            types = [row[0] for row in conn.execute(queries.PENDING_TYPES)]
        return self._notes.unrouted(types, self.routes)


def guarded_round(
    sweeper: Sweeper,
    conn: Connection,
    should_stop: Callable[[], bool],
    slice_seconds: float,
    *,
    health: HealthCheck,
    refresh_backlog: bool,
) -> SweepResult | None:
    """A sweep round inside `reactor run` (and the backlog gauges after it, when metrics are
    served); None when a statement of it failed on a healthy connection: logged (throttled),
    counted, and tried again at the next interval while dispatch goes on without a pause.

    Raises:
        DatabaseError: the connection failed (the caller reconnects).
    """
    try:
        result = sweeper.run_once(conn, should_stop, slice_seconds)
        if refresh_backlog:
            refresh_backlog_metrics(conn, sweeper.metrics, sweeper.routes)
            sweeper.metrics.record_vacuum(read_vacuum_health(conn))
    except StatementError as exc:
        health.sweep_failed(str(exc))
        sweeper.metrics.sweep_failures.inc()
        if sweeper.failed_log.allow():
            logger.error(
                "sweep_failed error=%s suppressed=%d", exc, sweeper.failed_log.suppressed()
            )
        return None
    health.sweep_succeeded()
    if result.rescue_error is None:
        health.rescue_succeeded()
    else:
        health.rescue_failed(result.rescue_error)
    return result
