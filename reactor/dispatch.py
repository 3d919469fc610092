"""Claim rows and hand them to RQ as one unit: claim, enqueue, COMMIT.

Guarantees (SPEC §1):
- A row is never `active` without its job in Redis: the enqueue happens inside the claiming
  transaction, before COMMIT; if it fails, the transaction rolls back and the rows stay as they
  were (`pending`, or `active` at the old attempt for a rescue).
- No double dispatch of one attempt: rows are claimed with `FOR UPDATE SKIP LOCKED`, and if the
  COMMIT is lost after the enqueue, the next claim of the same attempt finds the job alive in
  Redis and does not enqueue it again (see `reactor.enqueue`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from reactor import queries
from reactor.db import Connection, describe_error
from reactor.enqueue import Enqueuer
from reactor.errors import DatabaseError, EnqueueError
from reactor.jobs import JobRef
from reactor.metrics import Metrics
from reactor.routes import Route

__all__ = ["BatchResult", "Dispatcher", "DrainResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchResult:
    """One transaction of the dispatcher."""

    claimed: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    failed: int = 0


@dataclass(frozen=True)
class DrainResult:
    """A drain: batches claimed until one came back short (or a stop was requested)."""

    claimed: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    batches: int = 0

    def add(self, batch: BatchResult) -> DrainResult:
        return DrainResult(
            self.claimed + batch.claimed,
            self.enqueued + batch.enqueued,
            self.already_enqueued + batch.already_enqueued,
            self.batches + 1,
        )


class Dispatcher:
    """Runs the claim → enqueue → COMMIT unit on one work connection."""

    def __init__(
        self,
        conn: Connection,
        enqueuer: Enqueuer,
        routes: Mapping[str, Route],
        *,
        batch_size: int,
        before_commit: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.conn = conn
        self.metrics = metrics or Metrics()
        self._enqueuer = enqueuer
        self._routes = routes
        self._batch_size = batch_size
        # Test hook: runs after the enqueue, before COMMIT (to lose a COMMIT on purpose).
        self._before_commit = before_commit

    def dispatch(self, query: str, params: Mapping[str, Any]) -> BatchResult:
        """Run one claiming UPDATE (returning type, photo_id, attempts, state), enqueue the rows
        it left `active`, and COMMIT; roll back everything if the enqueue fails.

        Raises:
            EnqueueError: Redis failed (the claim was rolled back).
            DatabaseError: Postgres failed (the claim was rolled back or its COMMIT was lost).
        """
        metrics = self.metrics
        try:
            with self.conn.transaction():
                started = time.perf_counter()
                rows = self.conn.execute(query, params).fetchall()
                claimed = time.perf_counter()
                metrics.claim_seconds.observe(claimed - started)
                refs = [JobRef(t, p, a) for t, p, a, state in rows if state == "active"]
                try:
                    result = self._enqueuer.enqueue(refs)
                except EnqueueError:
                    metrics.enqueue_failures.inc()
                    raise
                if refs:
                    metrics.enqueue_seconds.observe(time.perf_counter() - claimed)
                if self._before_commit is not None:
                    self._before_commit()
        except psycopg.Error as exc:
            raise DatabaseError(f"dispatch failed: {describe_error(exc)}") from exc
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

    def claim_batch(self, job_type: str) -> BatchResult:
        """Claim and dispatch up to one batch of due pending rows of `job_type`."""
        return self.dispatch(queries.CLAIM_DUE, {"type": job_type, "limit": self._batch_size})

    def drain(
        self, types: Iterable[str], should_stop: Callable[[], bool] = lambda: False
    ) -> DrainResult:
        """Claim batches of each type until one comes back short, or a stop is requested
        (checked between batches: a batch, once claimed, is always finished)."""
        total = DrainResult()
        started = time.monotonic()
        for job_type in types:
            if job_type not in self._routes:
                continue
            while not should_stop():
                batch = self.claim_batch(job_type)
                total = total.add(batch)
                if batch.claimed < self._batch_size:
                    break
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

    def seconds_until_next_due(self) -> float | None:
        """Seconds until the earliest not-yet-due pending row of a routed type becomes due."""
        try:
            with self.conn.transaction():
                row = self.conn.execute(
                    queries.NEXT_DUE_IN, {"types": list(self._routes)}
                ).fetchone()
        except psycopg.Error as exc:
            raise DatabaseError(f"next-due query failed: {describe_error(exc)}") from exc
        return None if row is None or row[0] is None else max(0.0, float(row[0]))
