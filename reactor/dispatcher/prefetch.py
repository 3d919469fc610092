"""The second connection of backlog drains: while one batch is enqueued and committed on the
work connection, a thread claims the next on this one (`reactor.dispatcher.drain`).

It is opened on first use; when it cannot be opened (a connection limit, say) the drain goes
on one batch at a time, and opening is tried again `PREFETCH_RETRY_SECONDS` later. Without a
database URL there is none, and drains do not overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from reactor.errors import ReactorError
from reactor.pg import db
from reactor.pg.db import Connection

__all__ = ["PREFETCH_RETRY_SECONDS", "Prefetch", "Row"]

logger = logging.getLogger(__name__)

#: A claimed row: type, photo id, token, state, traceparent, tracestate.
Row = tuple[str, str, int, str, str | None, str | None]

#: After the prefetch connection of a backlog drain could not be opened, drain on one
#: connection for this long before trying again.
PREFETCH_RETRY_SECONDS = 30.0


class Prefetch:
    """The second connection of backlog drains and the thread that claims on it, both opened
    on first use; without a URL there is none (drains do not overlap)."""

    def __init__(self, database_url: str | None, idle_in_transaction_seconds: float | None) -> None:
        self._database_url = database_url
        # The prefetch connection's guard against a claim left open (as the work connection's).
        self._idle_in_transaction = idle_in_transaction_seconds
        self._conn: Connection | None = None
        self._retry_at = 0.0
        self._executor: ThreadPoolExecutor | None = None

    def other(self, current: Connection, work: Connection) -> Connection | None:
        """The connection that is not `current` (opening the prefetch one if needed), or None
        when there is none: then the drain goes on, one batch at a time, on `current`."""
        if self._database_url is None:
            return None
        if current is not work:
            return work
        prefetch = self._conn
        if prefetch is None or prefetch.closed or prefetch.broken:
            if prefetch is not None:
                prefetch.close()
            self._conn = None
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                self._conn = db.connect(
                    self._database_url,
                    purpose="work-prefetch",
                    idle_in_transaction_seconds=self._idle_in_transaction,
                )
            except ReactorError as exc:
                # A connection limit, say: draining on one connection is slower, not wrong.
                self._retry_at = now + PREFETCH_RETRY_SECONDS
                logger.warning(
                    "prefetch_unavailable error=%s (draining on one connection; retry in %gs)",
                    exc,
                    PREFETCH_RETRY_SECONDS,
                )
                return None
        return self._conn

    def submit(
        self, claim: Callable[[Connection, str], list[Row]], conn: Connection, job_type: str
    ) -> Future[list[Row]]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="reactor-prefetch")
        return self._executor.submit(claim, conn, job_type)

    def close(self) -> None:
        """Close the prefetch connection and thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
