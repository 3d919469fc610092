"""Claim rows and hand them to RQ, never a row `active` without its job: claim, enqueue, COMMIT.

`Dispatcher.drain()` claims the due pending rows of the given types batch by batch;
`enqueue_notified()` enqueues the jobs of rows named by their notification and
`claim_notified()` claims them afterwards (a round trip sooner in the queue; why that is safe
is in the former's docstring); the sweep
re-dispatches rows whose job is lost (`redispatch_lost`) or whose worker died
(`redispatch_stale`) through the same unit. The work connection is its owner's (the reactor
opens it, hands it in, and hands in a new one with `replace_connection` after a reconnect);
the dispatcher opens only the prefetch connection below, and closes it in `close()`.

Guarantees:
- A row is never `active` without its job in Redis: the enqueue happens inside the claiming
  transaction, before COMMIT (or before the claim, for notified rows); if it fails, the
  transaction rolls back and the rows stay as they were (`pending`, or `active` at the old
  attempt for a rescue).
- No double dispatch of one attempt: rows are claimed with `FOR UPDATE SKIP LOCKED`, and if the
  COMMIT is lost after the enqueue, the next claim of the same attempt finds the job alive in
  Redis and does not enqueue it again (see `reactor.rq.enqueue`).

Throughput: building RQ jobs is Python work and claiming is Postgres work, so a drain of a
backlog overlaps them. While batch N is enqueued and committed on the work connection, a
helper thread already claims batch N+1 on a second connection (opened only when a drain finds
a full batch; when it cannot be opened, a connection limit say, the drain goes on one batch at
a time). Each batch is still its own claim → enqueue → COMMIT transaction; the two
transactions never see each other's rows (`SKIP LOCKED`). Every failure of a drain rolls back
the claims it holds open, and a claim refuses to run on a connection whose transaction is not
idle, so a claim can never be committed by the next one without its jobs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from reactor.dispatcher.metrics import Metrics
from reactor.errors import DatabaseError, EnqueueError, ReactorError, StatementError
from reactor.jobs import JobRef, short_id, warm_up_ref
from reactor.pg import db, queries
from reactor.pg.db import Connection
from reactor.routes import Route
from reactor.rq.enqueue import Enqueuer
from reactor.rq.state import ALIVE_STATUSES
from reactor.throttle import LogThrottle

__all__ = ["BatchResult", "Dispatcher", "DrainResult", "Quarantine"]

logger = logging.getLogger(__name__)

Row = tuple[str, str, int, str]

#: After the prefetch connection of a backlog drain could not be opened, drain on one
#: connection for this long before trying again.
PREFETCH_RETRY_SECONDS = 30.0
#: A type whose claim fails with a statement error is left out of drains for this long,
#: doubling on each further failure up to the maximum.
QUARANTINE_BASE_SECONDS = 1.0
QUARANTINE_MAX_SECONDS = 60.0


@dataclass(frozen=True)
class Quarantine:
    """A type left out of drains because its claim fails (a row the claim cannot handle)."""

    failures: int
    until: float
    error: str


@dataclass(frozen=True)
class BatchResult:
    """One transaction of the dispatcher."""

    #: Rows this transaction claimed (made `active`, or failed with their attempts spent).
    claimed: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    failed: int = 0
    #: Rows named by notifications whose jobs were enqueued and are theirs, but that this
    #: claim did not take (locked, not due, paused, taken over by their job's fenced start,
    #: or the claim was skipped): dispatched, not claimed here.
    named: int = 0

    def __add__(self, other: BatchResult) -> BatchResult:
        return BatchResult(
            self.claimed + other.claimed,
            self.enqueued + other.enqueued,
            self.already_enqueued + other.already_enqueued,
            self.failed + other.failed,
            self.named + other.named,
        )


@dataclass(frozen=True)
class DrainResult:
    """A drain: batches claimed until every type came back short, a stop was requested, or
    the drain's time slice ran out (`more`: rows may be left; drain again soon)."""

    claimed: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    batches: int = 0
    more: bool = False
    #: See `BatchResult.named`.
    named: int = 0

    def add(self, batch: BatchResult) -> DrainResult:
        return DrainResult(
            self.claimed + batch.claimed,
            self.enqueued + batch.enqueued,
            self.already_enqueued + batch.already_enqueued,
            self.batches + 1,
            self.more,
            self.named + batch.named,
        )


class Dispatcher:
    """Runs the claim → enqueue → COMMIT unit on the work connection (and a prefetch one)."""

    def __init__(
        self,
        conn: Connection,
        enqueuer: Enqueuer,
        routes: Mapping[str, Route],
        *,
        batch_size: int,
        before_commit: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
        database_url: str | None = None,
        idle_in_transaction_seconds: float | None = None,
    ) -> None:
        self._conn = conn
        self._metrics = metrics or Metrics()
        self._enqueuer = enqueuer
        self._routes = routes
        self._batch_size = batch_size
        # Test hook: runs after the enqueue, before COMMIT (to lose a COMMIT on purpose).
        self._before_commit = before_commit
        # The prefetch connection of backlog drains; without a URL, drains do not overlap.
        self._database_url = database_url
        # The prefetch connection's guard against a claim left open (as the work connection's).
        self._idle_in_transaction = idle_in_transaction_seconds
        self._prefetch_conn: Connection | None = None
        self._prefetch_retry_at = 0.0
        #: Types whose claim failed with a statement error, and until when they are skipped.
        self.quarantined: dict[str, Quarantine] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._confirm_log = LogThrottle(burst=10, interval_seconds=60.0)
        self._strays_log = LogThrottle(burst=5, interval_seconds=60.0)

    def replace_connection(self, conn: Connection) -> None:
        """Work on `conn` from now on (after a reconnect; the old one is the caller's to close)."""
        self._conn = conn

    # -- one transaction, in two halves ----------------------------------------------------

    def _claim(self, conn: Connection, query: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the claiming UPDATE; its transaction stays open (locks held) until `_deliver`."""
        _require_idle(conn)
        started = time.perf_counter()
        try:
            # Pipeline mode sends the BEGIN together with the claim: one round trip, not two.
            with conn.pipeline():
                cursor = conn.execute(query, params)
            rows = cursor.fetchall()
        except psycopg.Error as exc:
            error = db.translate_error(exc, "claim failed", conn)
            _abandon(conn)
            raise error from exc
        self._metrics.claim_seconds.observe(time.perf_counter() - started)
        return rows

    def _deliver(self, conn: Connection, rows: list[Row]) -> BatchResult:
        """Enqueue the claimed rows left `active`, then COMMIT; roll back if the enqueue fails."""
        metrics = self._metrics
        refs = [JobRef(t, p, a) for t, p, a, state in rows if state == "active"]
        started = time.perf_counter()
        try:
            result = self._enqueuer.enqueue(refs)
        except EnqueueError:
            metrics.enqueue_failures.inc()
            _abandon(conn)
            raise
        except BaseException:
            _abandon(conn)
            raise
        if refs:
            metrics.enqueue_seconds.observe(time.perf_counter() - started)
        try:
            if self._before_commit is not None:
                self._before_commit()
            conn.commit()
        except psycopg.Error as exc:
            error = db.translate_error(exc, "COMMIT failed", conn)
            _abandon(conn)
            raise error from exc
        for job_type, count in result.by_type.items():
            metrics.dispatched.labels(job_type).inc(count)
        if result.already_enqueued:
            metrics.already_enqueued.inc(result.already_enqueued)
        return BatchResult(
            claimed=len(refs),
            enqueued=result.enqueued,
            already_enqueued=result.already_enqueued,
            failed=len(rows) - len(refs),
        )

    def _dispatch(self, query: str, params: Mapping[str, Any]) -> BatchResult:
        """Run one claiming UPDATE (returning type, photo_id, token, state), enqueue the rows
        it left `active`, and COMMIT; roll back everything if the enqueue fails.

        Raises:
            EnqueueError: Redis failed (the claim was rolled back).
            DatabaseError: Postgres failed (the claim was rolled back or its COMMIT was lost).
        """
        return self._deliver(self._conn, self._claim(self._conn, query, params))

    def _claim_type(self, conn: Connection, job_type: str) -> list[Row]:
        """Claim a batch of `job_type`; a statement error quarantines the type (logged once)
        and claims nothing, so one row the claim cannot handle does not stop the others."""
        try:
            rows = self._claim(conn, queries.CLAIM_DUE, self._claim_params(job_type))
        except StatementError as exc:
            previous = self.quarantined.get(job_type)
            failures = 1 if previous is None else previous.failures + 1
            pause = min(QUARANTINE_MAX_SECONDS, QUARANTINE_BASE_SECONDS * 2 ** (failures - 1))
            self.quarantined[job_type] = Quarantine(failures, time.monotonic() + pause, str(exc))
            if previous is None:
                logger.error(
                    "type_quarantined type=%s error=%s (other types go on; retried with "
                    "backoff up to %gs)",
                    job_type,
                    exc,
                    QUARANTINE_MAX_SECONDS,
                )
            return []
        if job_type in self.quarantined:
            del self.quarantined[job_type]
            logger.info("type_recovered type=%s", job_type)
        return rows

    def warm_up(self) -> None:
        """Rehearse a claim on a throwaway row, rolled back (`db.rehearse`), so the first real
        claim of this session does not pay for its first write.

        Raises:
            DatabaseError: the connection failed.
        """
        ref = warm_up_ref()
        row = {"type": ref.type, "photo_id": ref.photo_id, "state": "pending", "attempts": 0}
        params = self._claim_params(ref.type)
        db.rehearse(self._conn, row, lambda conn: conn.execute(queries.CLAIM_DUE, params))

    def claim_batch(self, job_type: str) -> BatchResult:
        """Claim and dispatch up to one batch of due pending rows of `job_type`.

        Raises:
            EnqueueError: Redis failed (the claim was rolled back).
            DatabaseError: Postgres failed (the claim was rolled back or its COMMIT was lost).
        """
        return self._dispatch(queries.CLAIM_DUE, self._claim_params(job_type))

    def _claim_params(self, job_type: str) -> dict[str, Any]:
        return {"type": job_type, "limit": self._batch_size}

    # -- notified rows: enqueue first, claim after --------------------------------------------

    def enqueue_notified(self, refs: Sequence[JobRef]) -> tuple[list[JobRef], list[JobRef]]:
        """Enqueue the jobs of rows named by their insert's notification (`refs`: token 1 of
        each) that do not exist yet; `claim_notified` claims those rows afterwards.

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
        quarantined = self.quarantined
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
        kept = set(written)
        return written, [ref for ref in refs if ref not in kept]

    def claim_notified(
        self, written: Sequence[JobRef], already_enqueued: int = 0
    ) -> tuple[BatchResult, set[str]]:
        """Claim the rows whose jobs `enqueue_notified` wrote (`CLAIM_NOTIFIED`), and withdraw
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
        named = self._claim_named(written)
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

    def _claim_named(
        self, refs: Sequence[JobRef]
    ) -> tuple[dict[tuple[str, str], tuple[bool, bool]], set[str]] | None:
        """Claim the rows of `refs`, whose jobs are queued (`CLAIM_NOTIFIED`), if every job of
        a row it claims is still alive. Returns the first-life rows among them, each with
        (claimed here, token-1 job still the row's to run), and the types of the rows left to
        a drain (the claim rolled back); None when the claim was skipped (logged)."""
        conn = self._conn
        _require_idle(conn)
        params = {"photo_ids": [r.photo_id for r in refs], "types": [r.type for r in refs]}
        started = time.perf_counter()
        try:
            with conn.pipeline():
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
            conn.commit()
        except EnqueueError as exc:
            _abandon(conn)
            self._claim_skipped(refs, exc)
            return None
        except psycopg.Error as exc:
            error = db.translate_error(exc, "claim of notified rows failed", conn)
            _abandon(conn)
            if not isinstance(error, StatementError):
                raise error from exc
            self._claim_skipped(refs, error)
            return None
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
        if self._confirm_log.allow():
            logger.warning(
                "notified_claim_failed rows=%d error=%s suppressed=%d",
                len(refs),
                error,
                self._confirm_log.suppressed(),
            )

    # -- re-dispatching (the sweep's rescues) ------------------------------------------------

    def redispatch_lost(
        self,
        refs: Sequence[JobRef],
        why: str,
        *,
        error: str | None = None,
        stale_after_seconds: float | None = None,
    ) -> BatchResult:
        """Re-dispatch `refs`, rows whose job is gone from Redis or ended in RQ without an
        outcome, as a new attempt each, if they are still `active` at that attempt (and, when
        `stale_after_seconds` is given, still without a write for that long), re-checked under
        the lock. A row whose attempts are spent is failed with `why` in `last_error` (`failed`
        counts them); a re-dispatched row keeps its `last_error`, or takes `error` when given.

        Raises:
            EnqueueError: Redis failed (the rows were left as they were).
            DatabaseError: Postgres failed (likewise, unless the COMMIT was lost).
        """
        return self._redispatch(refs, stale_after_seconds, why, error)

    def redispatch_stale(
        self, refs: Sequence[JobRef], stale_after_seconds: float, why: str
    ) -> BatchResult:
        """Re-dispatch `refs`, rows whose job was started but whose worker died, as
        `redispatch_lost` does, only if the row still has had no heartbeat for
        `stale_after_seconds` (re-checked under the lock: a late heartbeat keeps it).

        Raises:
            EnqueueError: Redis failed (the rows were left as they were).
            DatabaseError: Postgres failed (likewise, unless the COMMIT was lost).
        """
        return self._redispatch(refs, stale_after_seconds, why, None)

    def _redispatch(
        self,
        refs: Sequence[JobRef],
        stale_after_seconds: float | None,
        why: str,
        error: str | None,
    ) -> BatchResult:
        if not refs:
            return BatchResult()
        return self._dispatch(
            queries.REDISPATCH,
            {
                "types": [r.type for r in refs],
                "photo_ids": [r.photo_id for r in refs],
                "tokens": [r.token for r in refs],
                "stale_after": stale_after_seconds,
                "why": why,
                "error": error,
            },
        )

    # -- draining ----------------------------------------------------------------------------

    def drain(
        self,
        types: Iterable[str],
        should_stop: Callable[[], bool] = lambda: False,
        slice_seconds: float | None = None,
    ) -> DrainResult:
        """Claim batches until each type comes back short, taking the types in turn (one
        batch each per round, so a busy type cannot starve the others), until a stop is
        requested (checked between batches: a batch, once claimed, is always finished) or
        `slice_seconds` have passed (then `more` is set and the caller drains again later)."""
        started = time.monotonic()
        quarantined = self.quarantined
        rotation = deque(
            t
            for t in dict.fromkeys(types)
            if t in self._routes and (t not in quarantined or quarantined[t].until <= started)
        )
        total = DrainResult()
        if rotation and not should_stop():
            total = self._drain_rotation(rotation, should_stop, started, slice_seconds)
        if total.claimed:
            logger.info(
                "batch_dispatched claimed=%d enqueued=%d already_enqueued=%d batches=%d "
                "seconds=%.3f",
                total.claimed,
                total.enqueued,
                total.already_enqueued,
                total.batches,
                time.monotonic() - started,
            )
        return total

    def _drain_rotation(
        self,
        rotation: deque[str],
        should_stop: Callable[[], bool],
        started: float,
        slice_seconds: float | None,
    ) -> DrainResult:
        total = DrainResult()
        conn = self._conn
        job_type = rotation.popleft()
        rows = self._claim_type(conn, job_type)
        ahead: Future[list[Row]] | None = None
        other: Connection | None = None
        try:
            while True:
                if len(rows) == self._batch_size:
                    rotation.append(job_type)  # a full batch: this type may have more
                out_of_time = (
                    slice_seconds is not None and time.monotonic() - started > slice_seconds
                )
                next_type = rotation.popleft() if rotation and not should_stop() else None
                if out_of_time and next_type is not None:
                    next_type = None
                    total = replace(total, more=True)
                ahead, other = None, None
                if next_type is not None and len(rows) == self._batch_size:
                    # A backlog: claim the next batch on the other connection meanwhile.
                    other = self._other_connection(conn)
                    if other is not None:
                        ahead = self._pool().submit(self._claim_type, other, next_type)
                total = total.add(self._deliver(conn, rows))
                if next_type is None:
                    return total
                if ahead is not None and other is not None:
                    rows, conn = ahead.result(), other
                    ahead = None
                else:
                    rows = self._claim_type(conn, next_type)
                job_type = next_type
        except BaseException:
            # Whatever failed, no claim of this drain stays open: an open claim would be
            # committed by the next one, with no job behind its rows.
            _abandon(conn)
            if ahead is not None and other is not None:
                # Let the claim ahead finish, then give its rows back; the first failure is
                # the one reported.
                with contextlib.suppress(BaseException):
                    ahead.result()
                _abandon(other)
            raise

    def _other_connection(self, current: Connection) -> Connection | None:
        """The connection that is not `current` (opening the prefetch one if needed), or None
        when there is none: then the drain goes on, one batch at a time, on `current`."""
        if self._database_url is None:
            return None
        if current is not self._conn:
            return self._conn
        prefetch = self._prefetch_conn
        if prefetch is None or prefetch.closed or prefetch.broken:
            if prefetch is not None:
                prefetch.close()
            self._prefetch_conn = None
            now = time.monotonic()
            if now < self._prefetch_retry_at:
                return None
            try:
                self._prefetch_conn = db.connect(
                    self._database_url,
                    purpose="work-prefetch",
                    idle_in_transaction_seconds=self._idle_in_transaction,
                )
            except ReactorError as exc:
                # A connection limit, say: draining on one connection is slower, not wrong.
                self._prefetch_retry_at = now + PREFETCH_RETRY_SECONDS
                logger.warning(
                    "prefetch_unavailable error=%s (draining on one connection; retry in %gs)",
                    exc,
                    PREFETCH_RETRY_SECONDS,
                )
                return None
        return self._prefetch_conn

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="reactor-prefetch")
        return self._executor

    def close(self) -> None:
        """Close the prefetch connection and thread (the work connection is the caller's)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._prefetch_conn is not None:
            self._prefetch_conn.close()
            self._prefetch_conn = None


def _require_idle(conn: Connection) -> None:
    """Refuse to claim on a connection whose transaction is open: another claim's, which would
    be committed with ours whether or not its jobs were enqueued. Its rows are given back."""
    if conn.info.transaction_status is not TransactionStatus.IDLE:
        _abandon(conn)
        raise DatabaseError("claim refused: the connection was inside a transaction")


def _abandon(conn: Connection) -> None:
    """Roll back the open transaction, if the connection still allows it."""
    if conn.closed or conn.broken:
        return
    try:
        conn.rollback()
    except psycopg.Error:
        conn.close()
