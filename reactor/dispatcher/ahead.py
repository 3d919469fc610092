"""A claim sent now and read later: the next batch of a drain, claimed during this one's enqueue.

While a drain works through a backlog, most of a batch's time is this process building RQ's
jobs and Redis running the enqueue script; the claim of the next batch would wait for both.
`ClaimAhead` sends that claim on a second connection in psycopg's pipeline mode (psycopg
waits for the `BEGIN`; the claiming UPDATE then goes out and nothing waits for it), so
Postgres claims on its own core meanwhile; `received` then reads the rows, usually already
there. No thread is involved. Reading them ends with one more round trip (`PING`): psycopg
leaves pipeline mode with a Flush after its Sync, which leaves the server's
`idle_in_transaction_session_timeout` unarmed; a statement arms it again for the rest of the
claim's transaction.

Guarantees:
- the claim is the same statement, with the same parameters, as a claim run in turn: its
  rows are locked (`FOR UPDATE SKIP LOCKED`, so it never takes the batch being enqueued) and
  stay `active` only if its own transaction commits, after their jobs are in Redis;
- whatever fails, the connection leaves pipeline mode and its transaction is rolled back
  (`abandon`), or it is closed: a claim sent ahead is never left open for a later COMMIT;
- a statement error, whether raised at the send or the read, reaches the caller from
  `received`, with the claim rolled back and the connection kept, so the caller's own
  handling of a failing claim (the refused-row search) runs as for a claim in turn; a
  connection that failed is closed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from reactor.dispatcher.metrics import Metrics
from reactor.errors import DatabaseError, StatementError
from reactor.pg import db, queries
from reactor.pg.db import Connection

__all__ = ["ClaimAhead", "Row", "lose", "require_idle"]

logger = logging.getLogger("reactor.dispatcher.drain")

#: A claimed row: type, photo id, token, state, traceparent, tracestate.
Row = tuple[str, str, int, str, str | None, str | None]


def require_idle(conn: Connection) -> None:
    """Refuse to claim on a connection whose transaction is open: another claim's, which would
    be committed with ours whether or not its jobs were enqueued. Its rows are given back."""
    if conn.info.transaction_status is not TransactionStatus.IDLE:
        db.abandon(conn)
        raise DatabaseError("claim refused: the connection was inside a transaction")


def lose(conn: Connection, exc: DatabaseError) -> None:
    """Close a claim-ahead connection that failed (its claim rolled back with it): the drain
    goes on without it, each batch claimed in turn."""
    conn.close()
    logger.warning("claim_ahead_lost error=%s (the drain goes on without it)", exc)


class ClaimAhead:
    """One `CLAIM_DUE` of `job_type` sent on `conn` and not yet read."""

    def __init__(
        self,
        conn: Connection,
        job_type: str,
        window: float | None,
        params: Mapping[str, Any],
        metrics: Metrics,
    ) -> None:
        """Send the claim.

        Raises:
            DatabaseError: the connection was busy or failed (it is rolled back or closed).
        """
        self.conn = conn
        self.job_type = job_type
        self.window = window
        #: Monotonic time the claim was sent (the start of its transaction's `now()`, or after).
        self.started = time.monotonic()
        self._metrics = metrics
        self._pipeline = contextlib.ExitStack()
        self._cursor: psycopg.Cursor[Any] | None = None
        self._error: StatementError | None = None
        require_idle(conn)
        try:
            with db.translating("claim failed", conn):
                self._pipeline.enter_context(conn.pipeline())
                self._cursor = conn.execute(queries.CLAIM_DUE, params)
        except StatementError as exc:
            self._error = exc  # raised by `received`, where a claim's failure is handled
        except BaseException:
            self.abandon()
            raise

    def received(self) -> tuple[list[Row], float]:
        """The claimed rows (their transaction open on `conn`), and how long this call waited
        for them: a claim's cost to the drain.

        Raises:
            StatementError: the claim failed (rolled back).
            DatabaseError: the connection failed (rolled back or closed).
        """
        waited = time.perf_counter()
        try:
            if self._error is not None:
                raise self._error
            assert self._cursor is not None
            with db.translating("claim failed", self.conn):
                rows = self._cursor.fetchall()
                self._pipeline.close()  # one Sync; the transaction stays open
                self.conn.execute(queries.PING)  # arms the idle-in-transaction timeout
        except BaseException:
            self.abandon()
            raise
        seconds = time.perf_counter() - waited
        self._metrics.claim_seconds.observe(seconds)
        return rows, seconds

    def abandon(self) -> None:
        """Leave pipeline mode and roll the claim back; a connection that failed is closed."""
        try:
            with db.translating("claim failed", self.conn):
                self._pipeline.close()
        except StatementError:
            pass  # the claim's own error, read at the Sync: the rollback below ends it
        except DatabaseError:
            self.conn.close()
        db.abandon(self.conn)
