"""The LISTEN connection: a dedicated autocommit session that waits for wake-up hints.

A notification is only a hint (its payload is a job type); the table is the truth, so the
listener never needs to be exact: it reports which types were named, and the caller drains.
Notifications that psycopg buffered while the connection was busy are returned first. An idle
connection is probed with `SELECT 1` every `LIVENESS_SECONDS`, and TCP keepalives (set in
`reactor.db.connect`) catch a peer that died silently. Any failure is a `DatabaseError`; the
caller reconnects, and must LISTEN again (a new session listens to nothing) and then drain,
because notifications sent while it was gone are lost for good.
"""

from __future__ import annotations

import select
import time

import psycopg

from reactor.db import Connection, connect, describe_error
from reactor.errors import DatabaseError

__all__ = ["CHANNEL", "LIVENESS_SECONDS", "Listener"]

#: The NOTIFY channel the triggers of sql/0003 use.
CHANNEL = "photo_jobs"
#: Probe an idle listener connection this often.
LIVENESS_SECONDS = 15.0


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
        conn = connect(self._url, autocommit=True, purpose="listener")
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseError(f"LISTEN failed: {describe_error(exc)}") from exc
        self._conn = conn
        self._last_traffic = time.monotonic()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def wait(self, timeout: float, wake_fd: int) -> list[str]:
        """Wait up to `timeout` seconds for notifications, or until `wake_fd` is readable.

        Returns:
            The payloads received (empty on timeout or wake-up).

        Raises:
            DatabaseError: the connection failed; it is closed.
        """
        conn = self._conn
        if conn is None:
            raise DatabaseError("listener is not connected")
        try:
            payloads = [n.payload for n in conn.notifies(timeout=0)]
            if not payloads:
                ready, _, _ = select.select([conn.fileno(), wake_fd], [], [], max(0.0, timeout))
                if conn.fileno() in ready:
                    payloads = [n.payload for n in conn.notifies(timeout=0)]
            now = time.monotonic()
            if payloads:
                self._last_traffic = now
            elif now - self._last_traffic >= LIVENESS_SECONDS:
                conn.execute("SELECT 1")
                self._last_traffic = now
        except psycopg.Error as exc:
            self.close()
            raise DatabaseError(f"listener connection lost: {describe_error(exc)}") from exc
        return payloads
