"""Claim rows and hand them to RQ, never a row `active` without its job: claim, enqueue, COMMIT.

`Dispatcher.drain()` claims the due pending rows of the given types batch by batch; the sweep
re-dispatches rows whose job is lost or whose worker died (`redispatch`) through the same
unit: it is the only way a job reaches Redis. The work
connection is its owner's, handed in with each call (`reactor.dispatcher.sessions` opens it
and reopens it after a failure); the dispatcher opens no connection of its own.

Guarantees:
- A row is never `active` without its job in Redis: the enqueue happens inside the claiming
  transaction, before COMMIT; if it fails (whatever it raises), the
  transaction rolls back and the rows stay as they were (`pending`, or `active` at the old
  attempt for a rescue).
- One row cannot stop its type: a claim that fails with a statement error is tried again
  without the rows whose claim fails alone (`reactor.dispatcher.refused`); only a type whose
  claims fail without such a row is quarantined, and other types keep flowing either way.
- No double dispatch of one attempt: rows are claimed with `FOR UPDATE SKIP LOCKED`, and if the
  COMMIT is lost after the enqueue, the next claim of the same attempt finds the job alive in
  Redis and does not enqueue it again (see `reactor.rq.enqueue`).
- A claim's work does not grow with the rows dispatched while an old snapshot is held: most
  claims read only the rows due since shortly before their type's latest short claim, and a
  claim over the whole range runs at least every 1 s (10 s while such claims are slow), so a
  row committed late with an old due time waits at most that long
  (`reactor.dispatcher.bounds` says which rows those are).

Every failure of a drain rolls back the claim it holds open, and a claim refuses to run on a
connection whose transaction is not idle, so a claim can never be committed by the next one
without its jobs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reactor import tracing
from reactor.dispatcher.ahead import ClaimAhead, Row, lose, require_idle
from reactor.dispatcher.bounds import ClaimBounds
from reactor.dispatcher.metrics import Metrics
from reactor.dispatcher.quarantine import Quarantines
from reactor.dispatcher.refused import RefusedRows
from reactor.errors import DatabaseError, RedisDataError, RedisUnavailableError, StatementError
from reactor.jobs import JobRef, warm_up_ref
from reactor.pg import db, queries
from reactor.pg.db import Connection
from reactor.routes import Route
from reactor.rq.enqueue import BadKeysError, Enqueuer

__all__ = ["BatchResult", "Dispatcher", "DrainResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchResult:
    """One transaction of the dispatcher."""

    #: Rows this transaction claimed (made `active`, or failed with their attempts spent).
    claimed: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    failed: int = 0

    def __add__(self, other: BatchResult) -> BatchResult:
        return BatchResult(
            self.claimed + other.claimed,
            self.enqueued + other.enqueued,
            self.already_enqueued + other.already_enqueued,
            self.failed + other.failed,
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
    #: A batch came back full: a backlog, where a claim-ahead connection pays.
    full: bool = False

    def add(self, batch: BatchResult, full: bool) -> DrainResult:
        return DrainResult(
            self.claimed + batch.claimed,
            self.enqueued + batch.enqueued,
            self.already_enqueued + batch.already_enqueued,
            self.batches + 1,
            self.more,
            self.full or full,
        )


class Dispatcher:
    """Runs the claim → enqueue → COMMIT unit on the connection it is handed."""

    def __init__(
        self,
        enqueuer: Enqueuer,
        routes: Mapping[str, Route],
        *,
        batch_size: int,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._enqueuer = enqueuer
        self._routes = routes
        self._batch_size = batch_size
        #: Types whose claim failed with a statement error, and until when they are skipped.
        self.quarantined = Quarantines()
        #: Rows whose claim failed alone, left out of their type's claims for a while.
        self.refused = RefusedRows()
        #: How far back each type's claims read (`reactor.dispatcher.bounds`).
        self.bounds = ClaimBounds()

    # -- one transaction, in two halves ----------------------------------------------------

    def _claim(self, conn: Connection, query: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the claiming UPDATE; its transaction stays open (locks held) until `_deliver`."""
        require_idle(conn)
        started = time.perf_counter()
        try:
            with db.translating("claim failed", conn):
                rows = conn.execute(query, params).fetchall()
        except (DatabaseError, StatementError):
            db.abandon(conn)
            raise
        self._metrics.claim_seconds.observe(time.perf_counter() - started)
        return rows

    def _deliver(self, conn: Connection, rows: list[Row]) -> BatchResult:
        """Enqueue the claimed rows left `active`, then COMMIT; roll back if the enqueue fails.
        One span (`reactor.tracing.publishing`), linked to the rows' stored contexts, which
        their jobs carry."""
        metrics = self._metrics
        refs = [
            JobRef(t, p, a, *tracing.stored_context(tp, ts))
            for t, p, a, state, tp, ts in rows
            if state == "active"
        ]
        with tracing.publishing(refs):
            started = time.perf_counter()
            try:
                result = self._enqueuer.enqueue(refs)
            except RedisUnavailableError:
                metrics.enqueue_failures.inc()
                db.abandon(conn)
                raise
            except BaseException:
                db.abandon(conn)
                raise
            if refs:
                metrics.enqueue_seconds.observe(time.perf_counter() - started)
            try:
                with db.translating("COMMIT failed", conn):
                    conn.commit()
            except (DatabaseError, StatementError):
                db.abandon(conn)
                raise
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

    def _dispatch(self, conn: Connection, query: str, params: Mapping[str, Any]) -> BatchResult:
        """Run one claiming UPDATE (returning type, photo_id, token, state and the stored trace
        context), enqueue the rows it left `active`, and COMMIT; roll back everything if the
        enqueue fails.

        Raises:
            RedisUnavailableError: Redis failed (the claim was rolled back).
            DatabaseError: Postgres failed (the claim was rolled back or its COMMIT was lost).
        """
        return self._deliver(conn, self._claim(conn, query, params))

    def _claim_type(
        self, conn: Connection, job_type: str, ahead: ClaimAhead | None = None
    ) -> list[Row] | None:
        """Claim a batch of `job_type` (or take the claim `ahead` sent on `conn`). After a
        statement error, the rows whose claim fails alone are found and left out
        (`reactor.dispatcher.refused`) and the batch is claimed without them; when that fails
        too, the type is quarantined (logged once) and None is returned, so a type the claim
        cannot handle does not stop the others. A quarantine or a refusal ends only once a
        batch of the type is delivered (`drain`)."""
        started = time.monotonic() if ahead is None else ahead.started
        window = self.bounds.window(job_type, started) if ahead is None else ahead.window
        seconds: float | None = None
        try:
            try:
                if ahead is None:
                    rows = self._claim(
                        conn, queries.CLAIM_DUE, self._claim_params(job_type, window)
                    )
                else:
                    rows, seconds = ahead.received()
            except StatementError:
                if ahead is not None and window is not None:
                    # Read from the same due time on, now that the claim's `now()` is later.
                    window += time.monotonic() - ahead.started
                if not self.refused.search(conn, job_type, self._batch_size, window):
                    raise
                rows = self._claim(conn, queries.CLAIM_DUE, self._claim_params(job_type, window))
                seconds = None
            short = len(rows) < self._batch_size
            self.bounds.claimed(job_type, started, window, short, seconds)
        except StatementError as exc:
            self.quarantined.failed(job_type, str(exc))
            self.bounds.forget(job_type)
            return None
        return rows

    def warm_up(self, conn: Connection) -> None:
        """Rehearse a claim on a throwaway row, rolled back (`db.rehearse`), so the first real
        claim of this session does not pay for its first write.

        Raises:
            DatabaseError: the connection failed.
        """
        ref = warm_up_ref()
        row = {"type": ref.type, "photo_id": ref.photo_id, "state": "pending", "attempts": 0}
        params = self._claim_params(ref.type)
        db.rehearse(conn, row, lambda work: work.execute(queries.CLAIM_DUE, params))

    def _claim_params(self, job_type: str, window: float | None = None) -> dict[str, Any]:
        skip = self.refused.skipped(job_type)
        return {"type": job_type, "limit": self._batch_size, "skip": skip, "window": window}

    # -- re-dispatching (the sweep's rescues) ------------------------------------------------

    def redispatch(
        self,
        conn: Connection,
        refs: Sequence[JobRef],
        why: str,
        *,
        error: str | None = None,
        stale_after_seconds: float | None = None,
    ) -> BatchResult:
        """Re-dispatch `refs`, rows whose job is gone from Redis, ended in RQ without an
        outcome, or was started by a worker that died, as a new attempt each, if they are still
        `active` at that attempt (and, when `stale_after_seconds` is given, still without a
        write for that long: a late heartbeat keeps its attempt), re-checked under the lock. A
        row whose attempts are spent is failed with `why` in `last_error` (`failed` counts
        them); a re-dispatched row keeps its `last_error`, or takes `error` when given.

        Raises:
            RedisUnavailableError: Redis failed (the rows were left as they were).
            RedisDataError: a key the jobs write holds another kind of value (likewise).
            DatabaseError: Postgres failed (likewise, unless the COMMIT was lost).
        """
        if not refs:
            return BatchResult()
        return self._dispatch(
            conn,
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
        conn: Connection,
        types: Iterable[str],
        should_stop: Callable[[], bool] = lambda: False,
        slice_seconds: float | None = None,
        ahead: Connection | None = None,
    ) -> DrainResult:
        """Claim batches until each type comes back short, taking the types in turn (one
        batch each per round, so a busy type cannot starve the others), until a stop is
        requested (checked between batches: a batch, once claimed, is always finished) or
        `slice_seconds` have passed (then `more` is set and the caller drains again later).

        With `ahead`, an idle second connection, the next batch's claim runs on it while a
        full batch is enqueued and committed on the other, and the two then swap
        (`reactor.dispatcher.ahead`); if it fails, it is closed and the drain goes on."""
        started = time.monotonic()
        quarantined = self.quarantined
        rotation = deque(
            t
            for t in dict.fromkeys(types)
            if t in self._routes and (t not in quarantined or quarantined[t].until <= started)
        )
        total = DrainResult()
        sent: ClaimAhead | None = None
        spare = ahead
        tried = 0  # batches claimed, delivered or not
        try:
            while sent is not None or (rotation and not should_stop()):
                if sent is None:
                    # Out of time after at least one batch: a drain always makes progress.
                    elapsed = time.monotonic() - started
                    if tried and slice_seconds is not None and elapsed > slice_seconds:
                        total = replace(total, more=True)
                        break
                    job_type = rotation.popleft()
                    rows = self._claim_type(conn, job_type)
                else:
                    claim, sent = sent, None
                    job_type = claim.job_type
                    try:
                        rows = self._claim_type(claim.conn, job_type, claim)
                    except DatabaseError as exc:
                        if claim.conn is not ahead:
                            raise
                        lose(claim.conn, exc)
                        ahead = spare = None
                        rotation.appendleft(job_type)
                        continue
                    conn, spare = claim.conn, conn
                if rows is None:
                    continue  # quarantined
                tried += 1
                full = len(rows) == self._batch_size
                if full:
                    rotation.append(job_type)  # a full batch: this type may have more
                    # The drain goes on after this batch: claim the next one meanwhile.
                    elapsed = time.monotonic() - started
                    on_time = slice_seconds is None or elapsed <= slice_seconds
                    if spare is not None and on_time and not should_stop():
                        try:
                            sent = self._send_ahead(spare, rotation)
                        except DatabaseError as exc:
                            if spare is not ahead:
                                raise
                            lose(spare, exc)
                            ahead = spare = None
                try:
                    total = total.add(self._deliver(conn, rows), full)
                except RedisDataError as exc:
                    _left_out(self, conn, job_type, exc, rotation=rotation, sent=sent)
                    sent = None
                    continue
                self.refused.claimed(job_type, rows)
                self.quarantined.recovered(job_type)
        except BaseException:
            # Whatever failed, no claim stays open (an open claim would be committed by the
            # next one, with no job behind its rows), and the claims rolled back put rows
            # below the marks again.
            if sent is not None:
                sent.abandon()
            for each in (conn, spare):
                if each is not None:
                    db.abandon(each)
            self.bounds.reset()
            raise
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

    def _send_ahead(self, conn: Connection, rotation: deque[str]) -> ClaimAhead:
        """Send the claim of the next type in `rotation` on `conn` (or raise `DatabaseError`,
        with the type back at the front of `rotation`)."""
        job_type = rotation.popleft()
        window = self.bounds.window(job_type, time.monotonic())
        params = self._claim_params(job_type, window)
        try:
            return ClaimAhead(conn, job_type, window, params, self._metrics)
        except DatabaseError:
            rotation.appendleft(job_type)
            raise


def _left_out(
    dispatcher: Dispatcher,
    conn: Connection,
    job_type: str,
    exc: RedisDataError,
    *,
    rotation: deque[str],
    sent: ClaimAhead | None,
) -> None:
    """A batch of `job_type` was refused for keys of the wrong kind (and rolled back). The
    claim `sent` ahead is rolled back first (its rows may be those the notes below write) and
    its type put back at the front of `rotation`. Then every row whose job key is one is left
    out of its type's claims for a while (all at once: one failed batch per bad key would let
    a few thousand planted keys hold up the type), and the type claimed again; a key of the
    type's queue quarantines the type, and it leaves `rotation`.

    Raises:
        DatabaseError: the connection failed.
    """
    if sent is not None:
        sent.abandon()
        rotation.appendleft(sent.job_type)
    dispatcher.bounds.forget(job_type)  # the batch's rows are due again, however old
    if isinstance(exc, BadKeysError):
        rows = [(ref.photo_id, why) for ref, why in exc.rows if ref.type == job_type]
    else:
        rows = [] if exc.photo_id is None else [(exc.photo_id, str(exc))]
    dispatcher.refused.refuse(conn, job_type, rows)
    if exc.photo_id is not None:
        if job_type not in rotation:
            rotation.append(job_type)  # its other rows go on
        return
    dispatcher.quarantined.failed(job_type, str(exc))
    for _ in range(rotation.count(job_type)):
        rotation.remove(job_type)
