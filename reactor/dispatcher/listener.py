"""The LISTEN connection: a dedicated autocommit session that waits for wake-up hints.

A notification is only a hint (its payload names a job type); the table is
the truth, so the listener never needs to be exact: it reports the payloads, and the caller
dispatches what they name.
Notifications that psycopg buffered while the connection was busy are returned first. An idle
connection is probed with `SELECT 1` every `LIVENESS_SECONDS`, and TCP keepalives (set in
`reactor.pg.db.connect`) catch a peer that died silently. Any failure is a `DatabaseError`; the
caller reconnects, and must LISTEN again (a new session listens to nothing) and then drain,
because notifications sent while it was gone are lost for good.

The same session takes and releases the doorbell keys when the loop says so (what they mean
and when to take them: `reactor.dispatcher.doorbell`), so the keys never outlive the connection that
hears the notifications they ask for.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from contextlib import contextmanager

from reactor.dispatcher.doorbell import ArmOutcome, arm_outcome
from reactor.errors import DatabaseError, LockBusyError, StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, connect, translating

__all__ = ["ARM_LOCK_TIMEOUT_MS", "LIVENESS_SECONDS", "Listener"]

#: Probe an idle listener connection this often.
LIVENESS_SECONDS = 15.0
#: How long an arming reactor waits for writers in flight (their shared doorbell locks) before
#: it gives up and polls on. While it waits, new writers notify, and the loop is blocked, so
#: this bounds the extra delay an arm attempt can add.
ARM_LOCK_TIMEOUT_MS = 10


class Listener:
    """Owns the LISTEN connection."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._conn: Connection | None = None
        self._last_traffic = 0.0

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def backend_pid(self) -> int | None:
        return self._conn.info.backend_pid if self.connected and self._conn else None

    def connect(self) -> None:
        """Open the connection and LISTEN.

        Raises:
            ConfigError: the URL is malformed.
            DatabaseError: the server could not be reached.
        """
        self.close()
        self._conn = connect(self._url, autocommit=True, purpose="listener")
        with self._closing_on_error("LISTEN failed"):
            self._conn.execute(queries.LISTEN)
            self._conn.execute(queries.SET_LOCK_TIMEOUT, {"timeout": f"{ARM_LOCK_TIMEOUT_MS}ms"})
        self._last_traffic = time.monotonic()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @contextmanager
    def _closing_on_error(self, what: str) -> Iterator[None]:
        """Any failure of the block closes the connection (which releases the doorbell keys)
        and leaves as `DatabaseError`: the caller reconnects, whatever the statement was."""
        try:
            with translating(what, self._conn):
                yield
        except (DatabaseError, StatementError) as exc:
            self.close()
            raise DatabaseError(str(exc)) from exc

    def lock_doorbell(self) -> ArmOutcome:
        """Take every doorbell key in exclusive mode, waiting at most `ARM_LOCK_TIMEOUT_MS`
        for each; unless the outcome is ARMED, hold none of them.

        Raises:
            DatabaseError: the connection failed; it is closed (which releases the keys too).
        """
        conn = self._require()
        try:
            with self._closing_on_error("listener connection lost"):
                row = conn.execute(queries.DOORBELL_TRY_ARM).fetchone()
                if row is not None and row[0]:
                    return ArmOutcome.ARMED
                try:
                    # Queue behind the writers in flight (new writers notify while we wait).
                    with translating("doorbell arm"):
                        conn.execute(queries.DOORBELL_ARM)
                    return ArmOutcome.ARMED
                except LockBusyError:
                    pass
                # Timed out: who holds the keys now decides the outcome.
                held_here, held_elsewhere, stripes = conn.execute(
                    queries.DOORBELL_HOLDERS
                ).fetchone() or (0, False, 1)
                outcome = arm_outcome(held_here, held_elsewhere, stripes)
                if outcome is not ArmOutcome.ARMED:
                    conn.execute(queries.DOORBELL_RELEASE)  # a partial arm: give back the rest
        finally:
            self._last_traffic = time.monotonic()
        return outcome

    def unlock_doorbell(self) -> None:
        """Release the doorbell lock.

        Raises:
            DatabaseError: the connection failed; it is closed (which releases the lock too).
        """
        conn = self._require()
        with self._closing_on_error("listener connection lost"):
            conn.execute(queries.DOORBELL_RELEASE)
        self._last_traffic = time.monotonic()

    def _require(self) -> Connection:
        if self._conn is None:
            raise DatabaseError("listener is not connected")
        return self._conn

    def wait(self, timeout: float, wake_fd: int) -> list[str]:
        """Wait up to `timeout` seconds for notifications, or until `wake_fd` is readable.

        Returns:
            The payloads received (empty on timeout or wake-up).

        Raises:
            DatabaseError: the connection failed; it is closed.
        """
        conn = self._require()
        with self._closing_on_error("listener connection lost"):
            payloads = [n.payload for n in conn.notifies(timeout=0)]
            if not payloads:
                ready, _, _ = select.select([conn.fileno(), wake_fd], [], [], max(0.0, timeout))
                if conn.fileno() in ready:
                    payloads = [n.payload for n in conn.notifies(timeout=0)]
            now = time.monotonic()
            if payloads:
                self._last_traffic = now
            elif now - self._last_traffic >= LIVENESS_SECONDS:
                conn.execute(queries.PING)
                self._last_traffic = now
        return payloads
