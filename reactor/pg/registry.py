"""The routes recorded in the database (`reactor_routes`): one routing truth for every process.

A process that dispatches with routes it was given (`--route`, `REACTOR_ROUTES`) records them
at start (`RouteRegistration.register`) and keeps them *live* by holding a session-level
advisory lock of its own: a route is live while the reactor that uses it has not marked it
stopped (`release`, when it stops) and its lock is held by the backend recorded with the route
(the session that took it: any session could take the same key, which is visible in
`pg_locks`, and that hold does not count). Connected straight to Postgres, the lock goes with
the reactor's session, so a reactor killed outright stops being live at once.
Behind a transaction pooler the lock stays with the server session that took it: a clean
stop still ends liveness at once (the mark), a reactor killed outright stays live until the
pooler closes that server session, and a running reactor takes its lock again at its next
check if the pooler closed it, recording the new session as the holder (`keep`); if another
session holds its key, it records its routes again under a new key. A reactor that registers
again after a reconnect while its old session still holds the lock takes a new key and forgets
its rows under the old one.

Registration refuses a route that differs from one a live reactor uses for the same type (one
`ConfigError` line), so two running reactors never route a type differently. Routes of
reactors that stopped stay recorded as the last routes used, until a reactor records another
route for the type: that is how an operator changes a route on purpose (stop the reactors of
the type, start one with the new route).

A process given no routes (`reactor sweep`, a second `reactor run`, `reactor status`, the
worker side) reads them with `routes_in_use`, which checks each as a `--route` flag is checked.
Nothing here falls back to a built-in handler:
no route recorded and none given is a `ConfigError` that says how to route.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.routes import Route, format_route, recorded_route

__all__ = [
    "NO_ROUTE_HINT",
    "RecordedRoute",
    "RouteRegistration",
    "read_recorded_routes",
    "routes_in_use",
]

logger = logging.getLogger(__name__)

#: The error when a dispatching process has no route from anywhere.
NO_ROUTE_HINT = "no route: pass --route TYPE=module.func or set REACTOR_ROUTES"

_LOCK_KEY_MAX = 2**31 - 1


@dataclass(frozen=True)
class RecordedRoute:
    """One route of `reactor_routes`, with the live reactors that use it."""

    route: Route
    registered_at: datetime
    live_reactors: int
    live_by: str


def read_recorded_routes(conn: Connection) -> list[RecordedRoute]:
    """Every recorded route, per type the newest first (one read-only transaction).

    Raises:
        DatabaseError: the query failed.
    """
    with translating("cannot read the routes"), conn.transaction():
        rows = conn.execute(queries.RECORDED_ROUTES).fetchall()
    return [
        RecordedRoute(Route(t, h, q), at, int(live), by or "") for t, h, q, at, live, by in rows
    ]


def routes_in_use(conn: Connection) -> dict[str, Route]:
    """The routes a process given none uses: per type, the route of the live reactors, else
    the last one recorded. Empty when no reactor ever recorded a route.

    Raises:
        ConfigError: a route used is not valid as a `--route` would be.
        DatabaseError: the query failed.
    """
    routes: dict[str, Route] = {}
    recorded = read_recorded_routes(conn)
    for entry in sorted(recorded, key=lambda r: r.live_reactors == 0):
        routes.setdefault(entry.route.type, entry.route)
    # Checked as flags are: the table is data, and a process given no routes runs on it.
    return {t: recorded_route(r.type, r.handler, r.queue) for t, r in sorted(routes.items())}


class RouteRegistration:
    """This process's routes, recorded in `reactor_routes` and kept live on one connection."""

    def __init__(self, routes: Mapping[str, Route], *, registered_by: str | None = None) -> None:
        self.routes = dict(routes)
        self.registered_by = registered_by or f"{socket.gethostname()} pid {os.getpid()}"
        self.lock_key = random.randint(1, _LOCK_KEY_MAX)
        # The keys this process may still have rows under: after a reconnect behind a pooler,
        # the old key's lock may still be held by the server session that took it.
        self._own_keys = [self.lock_key]

    def _params(self) -> dict[str, Any]:
        return {"lock_key": self.lock_key, "own_keys": self._own_keys}

    def register(self, conn: Connection) -> None:
        """Record the routes and hold their liveness lock on `conn` (a non-autocommit
        connection that stays open while the routes are used; call again after a reconnect).

        Raises:
            ConfigError: a live reactor routes one of the types differently.
            DatabaseError: Postgres failed.
        """
        routes = list(self.routes.values())
        params = {
            "types": [r.type for r in routes],
            "handlers": [r.handler for r in routes],
            "queues": [r.queue for r in routes],
            "registered_by": self.registered_by,
            **self._params(),
        }
        with translating("cannot record the routes"), conn.transaction():
            conn.execute(queries.LOCK_ROUTES)
            conflicts = conn.execute(queries.LIVE_ROUTE_CONFLICTS, params).fetchall()
            if not conflicts:
                row = conn.execute(queries.ROUTES_LOCK_TRY, params).fetchone()
                if not (row and row[0]):
                    # Another session holds this key (a random one's, or our own old
                    # session's behind a pooler): take another; our old rows go below.
                    self.lock_key = random.randint(1, _LOCK_KEY_MAX)
                    self._own_keys.append(self.lock_key)
                    params.update(self._params())
                    conn.execute(queries.ROUTES_LOCK_TRY, params)
                conn.execute(queries.FORGET_DEAD_ROUTES, params)
                conn.execute(queries.RECORD_ROUTE, params)
        if not conflicts:
            self._own_keys = [self.lock_key]  # the rows under older keys are gone now
            return
        job_type, handler, queue, by, _ = conflicts[0]
        mine = format_route(self.routes[job_type])
        theirs = format_route(Route(job_type, handler, queue))
        raise ConfigError(
            f"route {mine} conflicts with {theirs} of the running reactor {by}: "
            f"use the same route, or stop the reactors of {job_type!r} to change it"
        )

    def keep(self, conn: Connection) -> None:
        """Keep the routes live (the reactor calls this every 5 s or sweep): one read when all
        is in order. Otherwise hold the lock again if no session holds it (behind a
        transaction pooler, when the server session that took it is closed), and record the
        routes again if they were marked stopped or forgotten by a reactor that took this one
        for stopped.

        Raises:
            ConfigError: meanwhile, a reactor recorded another route for one of our types.
            StatementError: the routes' table stayed locked (by someone else) for 2 s.
            DatabaseError: Postgres failed.
        """
        params = self._params()
        with translating("cannot keep the routes live", conn), conn.transaction():
            row = conn.execute(queries.ROUTES_KEPT, params).fetchone()
            if row == (len(self.routes), True):
                return
            conn.execute(queries.ROUTES_LOCK_TIMEOUT)
            conn.execute(queries.LOCK_ROUTES)  # no registration judges us meanwhile
            row = conn.execute(queries.ROUTES_KEPT, params).fetchone()
            recorded = row is not None and row[0] == len(self.routes)
            lock = None
            if recorded:
                kept = conn.execute(queries.ROUTES_LOCK_KEEP, params).fetchone()
                lock = kept[0] if kept else None
                if lock == "taken":
                    # Behind a pooler this is another server session than the one that
                    # took the lock before: only the recorded backend's hold counts.
                    conn.execute(queries.ROUTES_LOCK_OWNER, params)
        if not recorded or lock == "refused":
            # Refused: another session holds our key; `register` takes a new one.
            logger.warning("routes_recorded_again lock_key=%d", self.lock_key)
            self.register(conn)

    def release(self, conn: Connection) -> bool:
        """Mark the routes stopped and release the liveness lock (the routes stay recorded as
        the last ones used); whether the mark was written."""
        params = self._params()
        try:
            with translating("route release failed"), conn.transaction():
                conn.execute(queries.ROUTES_STOPPED, params)
                conn.execute(queries.ROUTES_UNLOCK, params)
        except (DatabaseError, StatementError):
            return False
        return True
