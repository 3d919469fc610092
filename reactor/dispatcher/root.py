"""The composition root of `reactor run`: what a reactor is made of, made once its routes are
known, and taken apart again at the end.

`Parts.start` connects everything once and fails fast: a bad URL, an unreachable or unmigrated
database, no route given nor recorded, a route that conflicts with a running reactor's, or a
Redis that refuses our credentials or scripting is a `ConfigError` (exit 2). A Redis that does
not answer yet is not: rows stay pending and drains retry until it does. Nor is a Postgres
session lost after the server first answered (a backend terminated, a server restarting): the
Postgres part of the start-up is tried again with backoff, `STARTUP_ATTEMPTS` times in all,
each retry logged as `startup_retry`; a stop asked for meanwhile ends the tries
(`StoppedError`: `reactor run` exits 0). The work connection
is opened first (it records the routes and holds their liveness lock), then the dispatcher
and the sweeper are made (the reactor hands them its connections with each call), the
listener connected, Redis checked, and, when asked for, the metrics server and the retention
thread started. A schema of the work session's search_path that roles other than the tables'
owner may create in is named once, a warning (`reactor.pg.trust`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import redis

from reactor.dispatcher.drain import Dispatcher
from reactor.dispatcher.liveness import RouteLiveness
from reactor.dispatcher.metrics import HealthCheck, Metrics, serve
from reactor.dispatcher.retention import Pruner
from reactor.dispatcher.sessions import Sessions, backoff
from reactor.dispatcher.sweep import Sweeper
from reactor.errors import ConfigError, DatabaseError, RedisUnavailableError, StatementError
from reactor.pg import db, trust
from reactor.routes import Route
from reactor.rq.enqueue import Enqueuer
from reactor.rq.state import RqState
from reactor.settings import ReactorSettings
from reactor.signals import StoppedError, Stopper

__all__ = ["Parts"]

logger = logging.getLogger(__name__)

#: Tries of the Postgres part of the start-up when a session is lost after the server answered
#: (a terminated backend, a server restarting), with the reconnects' backoff: at most about
#: five seconds of pauses in all.
STARTUP_ATTEMPTS = 6


@dataclass
class Parts:
    """What a started reactor runs with."""

    dispatcher: Dispatcher
    sweeper: Sweeper
    http: ThreadingHTTPServer | None = None
    pruner: Pruner | None = None

    @classmethod
    def start(
        cls,
        settings: ReactorSettings,
        *,
        sessions: Sessions,
        liveness: RouteLiveness,
        client: redis.Redis,
        metrics: Metrics,
        health: HealthCheck,
        stopper: Stopper,
    ) -> Parts:
        """Connect everything once (see the module docstring).

        Raises:
            ConfigError: what a retry cannot fix (see the module docstring).
            StoppedError: a stop was asked for while a lost session was being retried.
        """
        reached = False  # whether Postgres answered once: only then is a lost session retried
        checked = False  # whether the schemas others may write to were looked for (once)

        def connect() -> tuple[Parts, Enqueuer]:
            nonlocal reached, checked
            if reached and stopper.requested:
                raise StoppedError  # asked for during the pause before this try
            try:
                conn = sessions.open_work()  # holds the routes again if a try recorded them
            except DatabaseError as exc:
                if not reached:
                    raise ConfigError(str(exc)) from exc  # never answered: fail at once
                raise
            reached = True
            try:
                db.check_schema(conn)
                if not checked:
                    trust.warn_untrusted_writers(conn)
                    checked = True
                if not liveness.registered:
                    liveness.register(conn)  # fills `routes` in, when none was given
                enqueuer = Enqueuer(
                    client, liveness.routes, job_timeout_seconds=settings.job_timeout_seconds
                )
                parts = cls.made(
                    settings,
                    enqueuer,
                    routes=liveness.routes,
                    client=client,
                    metrics=metrics,
                    health=health,
                )
                parts.dispatcher.warm_up(conn)
                if sessions.listener is not None:
                    sessions.listener.connect()
            except BaseException:
                conn.close()
                if sessions.listener is not None:
                    sessions.listener.close()
                raise
            sessions.work = conn
            return parts, enqueuer

        retrying = backoff(DatabaseError, "startup", stopper, health, attempts=STARTUP_ATTEMPTS)
        try:
            parts, enqueuer = retrying(connect)
        except DatabaseError as exc:
            if stopper.requested:
                raise StoppedError from exc  # the retries ended on the stop, not on the error
            raise ConfigError(str(exc)) from exc
        except StatementError as exc:
            raise ConfigError(str(exc)) from exc
        try:
            enqueuer.prepare(settings.redis_url)
        except RedisUnavailableError as exc:
            # Not fatal: rows stay pending and drains retry until Redis answers.
            logger.warning(
                "redis_unavailable error=%s (rows stay pending until Redis answers)", exc
            )
        if settings.metrics_port is not None:
            try:
                parts.http = serve(
                    settings.metrics_port,
                    metrics,
                    health.problem,
                    host=settings.metrics_host,
                    note=health.note,
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on port {settings.metrics_port}: {exc}"
                ) from None
        retention = (
            settings.prune_done_after_seconds,
            settings.archive_after_seconds,
            settings.drop_history_after_seconds,
        )
        if any(age is not None for age in retention):
            # Its own thread and connection: DELETE batches never sit in the dispatch path.
            parts.pruner = Pruner(
                settings.database_url,
                done_after_seconds=settings.prune_done_after_seconds,
                failed_after_seconds=settings.prune_failed_after_seconds,
                archive_after_seconds=settings.archive_after_seconds,
                drop_history_after_seconds=settings.drop_history_after_seconds,
                batch_size=settings.prune_batch_size,
                metrics=metrics,
            )
            parts.pruner.start()
        sessions.listener_ok()
        return parts

    @classmethod
    def made(
        cls,
        settings: ReactorSettings,
        enqueuer: Enqueuer,
        *,
        routes: dict[str, Route],
        client: redis.Redis,
        metrics: Metrics,
        health: HealthCheck,
    ) -> Parts:
        """The dispatcher and the sweeper of these routes, their troubles told to `health`."""
        dispatcher = Dispatcher(enqueuer, routes, batch_size=settings.batch_size, metrics=metrics)
        quarantined = dispatcher.quarantined
        health.failing_types = lambda: [(t, q.error) for t, q in list(quarantined.items())]
        refused = dispatcher.refused
        health.refused_rows = lambda: [(r.type, r.photo_id, r.error) for r in refused.current()]
        sweeper = Sweeper(
            dispatcher,
            RqState(client, routes),
            routes,
            batch_size=settings.batch_size,
            stale_after_seconds=settings.stale_after_seconds,
            gone_after_seconds=settings.gone_after_seconds,
            metrics=metrics,
        )
        return cls(dispatcher, sweeper)

    def close(self) -> None:
        """Stop the retention thread and the metrics server (the sessions are the caller's)."""
        if self.pruner is not None:
            self.pruner.stop()
            self.pruner = None
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None
