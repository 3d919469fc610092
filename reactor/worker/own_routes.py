"""Which handlers a worker runs: its own routes, inside its handler allow-list.

A job names its handler (a dotted path, written by whoever enqueued it). A worker runs it only
if that path is exactly the handler of the worker's own route for the job's type, and lies
inside the allowed module prefixes (`REACTOR_HANDLER_PREFIXES`, `reactor worker
--handler-prefix`; none set: no prefix limit). Otherwise the job is refused
(`HandlerRefusedError`) before anything is imported.

A worker's own routes are the ones it was given (`reactor worker --route`, `REACTOR_ROUTES`),
or, given none, the routes the reactors recorded (`reactor_routes`, checked as a flag is,
`reactor.pg.registry.routes_in_use`): read at the first job (or at start), and read again when a
job names a handler they do not route (at most once a second for the same type and handler),
so a route changed on purpose (its reactors stopped, one started with the new route) is
followed without a restart. Given routes never change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.routes import Route, handler_allowed

__all__ = ["REFRESH_SECONDS", "HandlerRefusedError", "OwnRoutes"]

logger = logging.getLogger(__name__)

#: The least time between two reads of the recorded routes for jobs of one type and handler
#: they do not route (a queue full of such jobs must not cost a query each).
REFRESH_SECONDS = 1.0
#: Type and handler pairs remembered for that; beyond, the memory starts again.
MAX_REMEMBERED = 1000
#: How much of a job's handler text an error shows (it comes from Redis: anything at all).
MAX_SHOWN = 200


class HandlerRefusedError(Exception):
    """A job names a handler this worker does not run (a failed attempt; nothing imported)."""


def _shown(text: str) -> str:
    return repr(text[:MAX_SHOWN]) + ("..." if len(text) > MAX_SHOWN else "")


class OwnRoutes:
    """A worker's own routes and allow-list, and the check every job passes before its
    handler is imported."""

    def __init__(
        self,
        given: Mapping[str, Route] | None,
        prefixes: tuple[str, ...],
        read_recorded: Callable[[], Mapping[str, Route]],
    ) -> None:
        self.given = dict(given) if given else None
        self.prefixes = prefixes
        self._read_recorded = read_recorded
        self._routes = self.given
        self._refused_at: dict[tuple[str, str], float] = {}

    def routes(self) -> dict[str, Route]:
        """The own routes now (the recorded ones are read the first time).

        Raises:
            ConfigError: a recorded route is invalid.
            DatabaseError: the recorded routes could not be read.
        """
        if self._routes is None:
            self._read()
        assert self._routes is not None
        return self._routes

    def _read(self) -> None:
        self._routes = dict(self._read_recorded())

    def refresh(self) -> dict[str, Route]:
        """The own routes, the recorded ones read again now (given ones stay as given).

        Raises:
            ConfigError: a recorded route is invalid.
            DatabaseError: the recorded routes could not be read.
        """
        if self.given is None:
            self._read()
        return self.routes()

    def _read_again(self, job_type: str, handler: str) -> bool:
        """Read the recorded routes again, unless they are given or were read for this type and
        handler less than `REFRESH_SECONDS` ago; whether they were read. A failed read keeps
        the routes known (logged): refusing a job is never worse."""
        if self.given is not None:
            return False
        now = time.monotonic()
        last = self._refused_at.get((job_type, handler))
        if last is not None and now - last < REFRESH_SECONDS:
            return False
        if len(self._refused_at) >= MAX_REMEMBERED:
            self._refused_at.clear()
        self._refused_at[job_type, handler] = now
        try:
            self._read()
        except (ConfigError, DatabaseError, StatementError) as exc:
            logger.error("routes_unreadable error=%s", exc)
            return False
        return True

    def check(self, job_type: str, handler: object) -> None:
        """Refuse a job whose handler is outside the allow-list or not this worker's route
        for its type (`handler` is what the job in Redis holds: anything at all).

        Raises:
            HandlerRefusedError: one line saying why.
            ConfigError, DatabaseError: the recorded routes could not be read the first time.
        """
        if not isinstance(handler, str):
            raise HandlerRefusedError(
                f"handler {_shown(repr(handler))} refused for type {_shown(job_type)}: not a "
                "dotted path"
            )
        if not handler_allowed(handler, self.prefixes):
            raise HandlerRefusedError(
                f"handler {_shown(handler)} refused for type {_shown(job_type)}: outside the "
                f"allowed handler prefixes ({','.join(self.prefixes)})"
            )
        own = self.routes().get(job_type)
        if (own is None or own.handler != handler) and self._read_again(job_type, handler):
            own = self.routes().get(job_type)
        if own is None:
            raise HandlerRefusedError(
                f"handler {_shown(handler)} refused for type {_shown(job_type)}: this worker "
                "has no route for the type"
            )
        if own.handler != handler:
            raise HandlerRefusedError(
                f"handler {_shown(handler)} refused for type {_shown(job_type)}: this "
                f"worker's route runs {own.handler}"
            )
