"""A running reactor's routes in the database: recorded and held live while it runs, marked
stopped when it ends.

At start the reactor takes the routes it was given, else those recorded (`routes_in_use`), and
records them with their liveness lock on the work connection (`RouteRegistration`); a reactor
that routes one of the same types differently is refused. After a reconnect the lock is taken
again on the new session. Every `KEEP_ROUTES_SECONDS` (or every sweep interval, if shorter) a
turn checks that the routes are still recorded as this reactor's and the lock held: behind a
transaction pooler the server session holding it can be closed. The check rides on turns that
wake anyway and wakes nothing by itself (a poll-only reactor would poll at each such wake-up).
"""

from __future__ import annotations

import contextlib
import logging
import time

from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.pg import db
from reactor.pg.registry import NO_ROUTE_HINT, RouteRegistration, routes_in_use
from reactor.routes import Route

__all__ = ["KEEP_ROUTES_SECONDS", "RouteLiveness"]

logger = logging.getLogger(__name__)

#: Check at most this often that the routes are still recorded as this reactor's.
KEEP_ROUTES_SECONDS = 5.0


class RouteLiveness:
    """Records a reactor's routes, keeps them live, and marks them stopped."""

    def __init__(self, routes: dict[str, Route], database_url: str, interval: float) -> None:
        #: Filled in by `register` when the reactor was given no route.
        self.routes = routes
        self._database_url = database_url
        self._interval = min(KEEP_ROUTES_SECONDS, interval)
        self._registration: RouteRegistration | None = None
        self._next_check = 0.0

    def register(self, conn: db.Connection) -> None:
        """Take the recorded routes if none was given, record them and hold their lock.

        Raises:
            ConfigError: no route given nor recorded, or a running reactor routes one of the
                types differently.
            DatabaseError: the connection failed.
        """
        if not self.routes:
            self.routes.update(routes_in_use(conn))
        if not self.routes:
            raise ConfigError(NO_ROUTE_HINT)
        registration = RouteRegistration(self.routes)
        registration.register(conn)
        self._registration = registration  # only once recorded: `hold_again` takes it up
        self._next_check = time.monotonic() + self._interval

    @property
    def registered(self) -> bool:
        """Whether the routes were recorded (then a new session holds them with `hold_again`)."""
        return self._registration is not None

    def hold_again(self, conn: db.Connection) -> None:
        """After a reconnect: the lock went with the old session; take it on `conn`."""
        if self._registration is not None:
            self._registration.register(conn)

    def keep_if_due(self, conn: db.Connection) -> None:
        """Check the routes are still ours, if the last check is `interval` old.

        Raises:
            ConfigError: another reactor took one of our types over with another route.
            DatabaseError: the connection failed (the caller reconnects).
        """
        now = time.monotonic()
        if self._registration is None or now < self._next_check:
            return
        self._next_check = now + self._interval
        try:
            self._registration.keep(conn)
        except StatementError as exc:
            # The routes' table stayed locked: try again at the next check, dispatch on.
            logger.warning("routes_keep_failed error=%s", exc)

    def release(self, conn: db.Connection | None) -> None:
        """Mark our routes stopped: on `conn` if it is usable, else on a new connection.
        Behind a transaction pooler nothing else ends their liveness (the lock stays with a
        server session), so a failure is logged."""
        registration = self._registration
        if registration is None:
            return
        if conn is not None and not conn.closed and not conn.broken and registration.release(conn):
            return
        try:
            with contextlib.closing(db.connect(self._database_url, purpose="work")) as fresh:
                if registration.release(fresh):
                    return
        except (DatabaseError, StatementError, ConfigError):
            pass
        logger.warning(
            "routes_not_marked_stopped (they count as running until the session holding their"
            " lock ends)"
        )
