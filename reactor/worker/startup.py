"""What a worker class does once, before its first job: check its settings, Postgres, the
schema and its routes, import the handlers it serves, and mask passwords in every log line.

`check_startup` (also run by `bootstrap`, so `rq worker -w` gets it too) fails with one line
and exit 2 on what a restart cannot fix: bad settings, an unreachable or unmigrated database,
an invalid recorded route, or a served handler that is outside the allow-list or cannot be
imported (its jobs stay queued and no attempt is spent). A session lost after the server
answered (a terminated backend) is reopened and the check retried, as every statement of the
worker is. A worker that finds no route for its queues (started beside its reactor, before the
reactor recorded them) waits for them, saying so once a minute; one started with no queue name
(RQ's CLI then listens on `default`) serves its routes' queues too.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

from rq.worker.base import BaseWorker

from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.jobs import warm_up_ref
from reactor.pg import db
from reactor.redact import redact
from reactor.routes import Route
from reactor.worker import lifecycle
from reactor.worker.entry import HandlerImportError, load_handler
from reactor.worker.inflight import DONE, START, InFlight
from reactor.worker.own_routes import HandlerRefusedError, OwnRoutes

__all__ = ["RQ_DEFAULT_QUEUE", "StartupChecks"]

logger = logging.getLogger(__name__)

#: A worker with no route for its queues yet reads the recorded routes again this often, and
#: says it is waiting at most once per `ROUTES_WAIT_LOG_SECONDS`.
ROUTES_WAIT_POLL_SECONDS = 1.0
ROUTES_WAIT_LOG_SECONDS = 60.0
#: The queue RQ's CLI listens on when given none.
RQ_DEFAULT_QUEUE = "default"


class _RedactingFilter(logging.Filter):
    """Masks passwords in a record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_REDACTING = _RedactingFilter()


def _redact_logs() -> None:
    """Route our loggers to RQ's handlers when nothing else is set up (plain `rq worker -w`),
    and mask passwords on every handler in use."""
    root, ours, rq_logger = (logging.getLogger(n) for n in ("", "reactor", "rq.worker"))
    if not root.handlers and not ours.handlers and rq_logger.handlers:
        for handler in rq_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(rq_logger.getEffectiveLevel())
        ours.propagate = False
    for name in ("", "reactor", "rq.worker", "rq.job"):
        for handler in logging.getLogger(name).handlers:
            if _REDACTING not in handler.filters:
                handler.addFilter(_REDACTING)


class StartupChecks(BaseWorker):
    """Put before RQ's worker class in the bases; the class sets the attributes below."""

    _checked: bool
    _settings_error: ConfigError | None
    _store: lifecycle.Store
    _own: OwnRoutes
    _inflight: InFlight
    _heartbeat: lifecycle.Heartbeater
    #: What a worker given `default` alone serves once routes are known: `default` and the
    #: routes' queues (RQ's CLI names `default` when given no queue, so either may be meant);
    #: `reactor worker` knows: the routes' queues when it was given none, else `default`.
    default_queue_serves: Literal["default+routed", "routed", "default"] = "default+routed"

    def _attempt_params(self, ref: Any) -> dict[str, Any]:
        raise NotImplementedError

    def check_startup(self) -> None:
        """Connect, check the schema, import the served routes' handlers (once).

        A served handler outside the allow-list or that cannot be imported stops the start
        (`bootstrap` exits 2, one line).

        Raises:
            ConfigError: bad settings, Postgres unreachable, the database not migrated, an
                invalid recorded route, or a served handler refused or not importable.
        """
        if self._checked:
            return
        if self._settings_error is not None:
            raise self._settings_error
        try:
            self._store.conn  # noqa: B018 - a server that does not answer fails the start at once
            self._store.run(db.check_schema)  # a session lost after it answered is retried
            lifecycle.warm_up(self._store)
            self._warm_up_inflight()
            served = self._wait_for_routes()
        except (DatabaseError, StatementError) as exc:
            raise ConfigError(str(exc)) from exc
        for route in served:
            try:
                self._own.check(route.type, route.handler)
                load_handler(route.handler, self._own.prefixes)
            except HandlerRefusedError as exc:
                raise ConfigError(
                    f"type {route.type}: {exc} (its jobs stay queued, no attempt spent: fix "
                    "the route or the allow-list, then start the worker again)"
                ) from None
            except HandlerImportError as exc:
                raise ConfigError(
                    f"type {route.type}: {exc} (its jobs stay queued, no attempt spent: fix "
                    "the route or PYTHONPATH, then start the worker again)"
                ) from None
        self._heartbeat.start()
        self._checked = True
        # What is loaded now lives as long as the process: keep the collector from walking it
        # again and again (a full pass over it stalls a job by tens of ms; a forked horse
        # would also copy the pages it touches).
        gc.collect()
        gc.freeze()
        logger.info(
            "worker_ready class=%s queues=%s routes=%s",
            type(self).__name__,
            ",".join(self.queue_names()),
            ",".join(f"{r.type}={r.handler}" for r in served) or "-",
        )

    def _wait_for_routes(self) -> list[Route]:
        """The served routes, once there are any: a worker started beside its reactor (as
        supervisors and compose do) may come up before the reactor recorded its routes; it
        waits for them rather than exit and be restarted in a loop. A worker given no queue
        name (RQ's CLI then listens on `default`) serves its routes' queues too.

        Raises:
            ConfigError: a recorded route is invalid.
            DatabaseError: the recorded routes could not be read.
        """
        said = -ROUTES_WAIT_LOG_SECONDS
        while True:
            routes = self._own.refresh()
            self._serve_routed_queues(routes)
            queues = set(self.queue_names())
            served = [route for route in routes.values() if route.queue in queues]
            if served or self._own.given is not None:
                return served
            now = time.monotonic()
            if now - said >= ROUTES_WAIT_LOG_SECONDS:
                said = now
                shown = ",".join(sorted(queues))
                if self._serves_routed_only():
                    shown = "(the routed ones: none yet)"
                logger.warning(
                    "worker_waiting_for_routes queues=%s (no route for them is recorded yet: "
                    "start a reactor with --route, or give this worker its routes)",
                    shown,
                )
            time.sleep(ROUTES_WAIT_POLL_SECONDS)

    def _serves_routed_only(self) -> bool:
        """Whether RQ's `default`, the worker's only queue, stands for the routed queues."""
        return self.queue_names() == [RQ_DEFAULT_QUEUE] and self.default_queue_serves == "routed"

    def _serve_routed_queues(self, routes: Mapping[str, Route]) -> None:
        """Listen on the routes' queues too when the worker was given `default` alone (what
        RQ's CLI gives when no queue is named; one named on purpose is still served), before
        the worker registers itself with its queues (`default_queue_serves`)."""
        if self.queue_names() != [RQ_DEFAULT_QUEUE] or self.default_queue_serves == "default":
            return
        routed = sorted({r.queue for r in routes.values()})
        names = routed if self.default_queue_serves == "routed" else [RQ_DEFAULT_QUEUE, *routed]
        names = list(dict.fromkeys(names))
        if not routed or names == [RQ_DEFAULT_QUEUE]:
            return
        self.queues = [
            self.queue_class(
                name,
                connection=self.connection,
                job_class=self.job_class,
                serializer=self.serializer,
            )
            for name in names
        ]
        self._ordered_queues = self.queues[:]
        logger.info("worker_queues_from_routes queues=%s", ",".join(names))

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        _redact_logs()
        try:
            self.check_startup()
        except ConfigError as exc:
            # One line and exit 2, also under `rq worker -w`, whose CLI would print a
            # traceback for an exception.
            self.log.error("reactor worker: error: %s", redact(str(exc)))
            raise SystemExit(exc.exit_code) from None
        super().bootstrap(*args, **kwargs)
        _redact_logs()

    def _warm_up_inflight(self) -> None:
        """Prepare and plan the overlapped statements on a row that does not exist, so the
        first job pays for neither (they change nothing)."""
        params = self._attempt_params(warm_up_ref())
        for statement in (START, DONE):
            if self._inflight.send(statement, params):
                self._inflight.receive()
