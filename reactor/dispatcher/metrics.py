"""Prometheus metrics and the health check of `reactor run`, served over HTTP.

`Metrics` owns its own registry (so several reactors can live in one test process) and is
passed to the dispatcher, the sweeper and the loop, which record into it. `serve()` starts a
small threaded HTTP server (loopback by default; clients time out, connections are capped,
client errors are one log record each, rate-limited): `/metrics` in the Prometheus text
format, `/healthz` answering 200 only while the listener is connected (or the reactor polls
only), the loop has turned recently and drains succeed, 503 with the reason otherwise.
`HealthCheck.turned()`, the loop's record of a turn, is also what systemd's watchdog hears
(`HealthCheck.watchdog`, a `reactor.sdnotify.Notifier`: off unless `reactor run` sets it).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from reactor.http_server import BoundedHTTPServer
from reactor.pg.prune import PRUNED_STATES
from reactor.pg.vacuum import HOLDER_KINDS, VacuumHealth
from reactor.sdnotify import Notifier
from reactor.throttle import LogThrottle

__all__ = [
    "CLIENT_TIMEOUT_SECONDS",
    "DEFAULT_HOST",
    "HealthCheck",
    "Metrics",
    "serve",
]

logger = logging.getLogger(__name__)

#: The metrics server listens on loopback unless told otherwise (`--metrics-host`).
DEFAULT_HOST = "127.0.0.1"
#: A client that sends nothing (or reads nothing) for this long is disconnected.
CLIENT_TIMEOUT_SECONDS = 5.0
_client_errors = LogThrottle(burst=5, interval_seconds=60.0)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Every metric the reactor exports (names start with `reactor_`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.dispatched = Counter(
            "reactor_dispatched", "Jobs enqueued to RQ, by type.", ["type"], registry=r
        )
        self.already_enqueued = Counter(
            "reactor_already_enqueued",
            "Claimed attempts whose job was already alive in Redis (after a lost COMMIT).",
            registry=r,
        )
        self.turn_failures = Counter(
            "reactor_turn_failures",
            "Turns of the loop that failed and were rolled back, by kind (connection, "
            "statement, redis, or the class of an unexpected exception).",
            ["kind"],
            registry=r,
        )
        for kind in ("connection", "statement", "redis"):  # exported at 0 from the start
            self.turn_failures.labels(kind)
        self.claim_seconds = Histogram(
            "reactor_claim_seconds",
            "Latency of one claim query (of a claim sent ahead, the wait for its rows).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.enqueue_seconds = Histogram(
            "reactor_enqueue_seconds",
            "Latency of enqueueing one batch to Redis (status check + pipeline).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.enqueue_failures = Counter(
            "reactor_enqueue_failures", "Batches rolled back because Redis failed.", registry=r
        )
        self.pruned = Counter(
            "reactor_pruned",
            "Finished rows deleted by retention (run --prune-*-after), by state.",
            ["state"],
            registry=r,
        )
        self.archived = Counter(
            "reactor_archived",
            "Finished rows moved to photo_jobs_history (run --archive-after), by state.",
            ["state"],
            registry=r,
        )
        for state in PRUNED_STATES:  # at 0 from the start, so a rate() sees the first rows
            self.pruned.labels(state)
            self.archived.labels(state)
        self.archive_rows_left = Gauge(
            "reactor_archive_rows_left",
            "Rows due for the history that the last archive round left (it failed, or stopped at "
            "its month bound); 0 after a complete round, 1 when they could not be counted.",
            registry=r,
        )
        self.history_months_dropped = Counter(
            "reactor_history_months_dropped",
            "Monthly partitions of photo_jobs_history dropped (run --drop-history-after).",
            registry=r,
        )
        self.rescued = Counter(
            "reactor_rescued",
            "Active rows re-dispatched by the sweep, by reason (stale, lost).",
            ["reason"],
            registry=r,
        )
        self.rescue_failed = Counter(
            "reactor_rescue_failed",
            "Active rows failed by the sweep because their attempts were spent.",
            registry=r,
        )
        self.notifications = Counter(
            "reactor_notifications", "NOTIFY wake-ups received (any payload).", registry=r
        )
        self.sweeps = Counter("reactor_sweeps", "Sweep rounds completed.", registry=r)
        self.sweep_failures = Counter(
            "reactor_sweep_failures",
            "Sweep rounds a statement error ended (dispatch went on).",
            registry=r,
        )
        self.polls = Counter(
            "reactor_polls",
            "Drains run because the reactor was polling (doorbell not armed), not because of "
            "a notification, a timer or a sweep.",
            registry=r,
        )
        self.doorbell_armed = Gauge(
            "reactor_doorbell_armed",
            "1 while this reactor holds the doorbell lock (writers notify), else 0.",
            registry=r,
        )
        self.doorbell_arms = Counter(
            "reactor_doorbell_arm_attempts",
            "Attempts to take the doorbell lock, by outcome (armed, held_elsewhere, busy).",
            ["outcome"],
            registry=r,
        )
        self.backlog = Gauge(
            "reactor_backlog",
            "Rows pending or active, by type and state (refreshed after every sweep).",
            ["type", "state"],
            registry=r,
        )
        self.cancelled_rows = Gauge(
            "reactor_cancelled_rows",
            "Rows cancelled and not pruned yet, by type (refreshed after every sweep).",
            ["type"],
            registry=r,
        )
        self.recently_failed = Gauge(
            "reactor_recently_failed_rows",
            "Rows that went to failed (attempts spent, a PermanentError, failed by the sweep) "
            "in the last 5 minutes, by type (refreshed after every sweep).",
            ["type"],
            registry=r,
        )
        self.oldest_due_age = Gauge(
            "reactor_oldest_due_age_seconds",
            "Age of the oldest due pending row, by type (0 if none; refreshed after every sweep).",
            ["type"],
            registry=r,
        )
        self.horizon_age = Gauge(
            "reactor_xmin_horizon_age_seconds",
            "Age of the oldest transaction holding back vacuum of photo_jobs (a session of its "
            "database, from xact_start, or a prepared transaction), 0 if none; a lower bound "
            "while reactor_xmin_horizon_hidden_sessions > 0 (refreshed after every sweep).",
            registry=r,
        )
        self.horizon_xids = Gauge(
            "reactor_xmin_horizon_age_xids",
            "Age in transactions of the oldest xmin of each kind of holder (backend, "
            "prepared_xact, replication_slot, replication_slot_catalog: the last holds back "
            "only the catalogs), 0 if none (refreshed after every sweep).",
            ["holder"],
            registry=r,
        )
        self.horizon_hidden = Gauge(
            "reactor_xmin_horizon_hidden_sessions",
            "Sessions of other roles whose snapshot the reactor's role cannot see (grant it "
            "pg_monitor), refreshed after every sweep.",
            registry=r,
        )
        self.dead_tuple_ratio = Gauge(
            "reactor_table_dead_tuple_ratio",
            "photo_jobs' dead tuples over live and dead (pg_stat_user_tables), 0 if none "
            "counted (refreshed after every sweep).",
            registry=r,
        )
        self.dead_tuples = Gauge(
            "reactor_table_dead_tuples", "photo_jobs' dead tuples (n_dead_tup).", registry=r
        )
        self.last_autovacuum = Gauge(
            "reactor_table_last_autovacuum_timestamp_seconds",
            "Unix time of the last autovacuum of photo_jobs (0: none since the statistics "
            "were reset).",
            registry=r,
        )
        self.autovacuum_enabled = Gauge(
            "reactor_table_autovacuum_enabled",
            "1 when autovacuum can run on photo_jobs (the server's autovacuum and track_counts "
            "on, the table's autovacuum_enabled not off), else 0.",
            registry=r,
        )
        self.notify_queue_usage = Gauge(
            "reactor_notify_queue_usage_ratio",
            "Share of the server's NOTIFY queue in use (pg_notification_queue_usage(), 0 to 1; "
            "full: every transaction that notifies fails), refreshed after every sweep.",
            registry=r,
        )
        self.listener_connected = Gauge(
            "reactor_listener_connected", "1 while the LISTEN connection is up.", registry=r
        )
        self.last_loop = Gauge(
            "reactor_loop_last_turn_timestamp_seconds",
            "Unix time of the last turn of the main loop.",
            registry=r,
        )

    def record_vacuum(self, health: VacuumHealth) -> None:
        """Set the horizon and vacuum gauges from one read (`reactor.pg.vacuum`)."""
        self.horizon_age.set(health.horizon_age_seconds)
        oldest = {h.kind: h.age_xids for h in health.holders}
        for kind in HOLDER_KINDS:
            self.horizon_xids.labels(kind).set(oldest.get(kind, 0))
        self.horizon_hidden.set(health.hidden_sessions)
        self.dead_tuple_ratio.set(health.dead_share or 0.0)
        self.dead_tuples.set(health.dead_tuples)
        vacuumed = health.last_autovacuum
        self.last_autovacuum.set(0 if vacuumed is None else vacuumed.timestamp())
        self.autovacuum_enabled.set(1 if health.autovacuum_enabled else 0)
        self.notify_queue_usage.set(health.notify_queue_usage)


#: `/healthz` turns 503 after this many failed drains or sweeps in a row.
FAILURES_BEFORE_UNHEALTHY = 3


class HealthCheck:
    """Decides what `/healthz` answers."""

    def __init__(self, listening: bool, max_loop_age_seconds: float) -> None:
        self._listening = listening
        self._max_age = max_loop_age_seconds
        self.listener_connected = False
        self.last_turn = time.monotonic()
        self.failures = 0
        self.last_error = ""
        self.sweep_failures = 0
        self.last_sweep_error = ""
        #: Job types whose claims fail (set by the loop): (type, error) pairs.
        self.failing_types: Callable[[], list[tuple[str, str]]] = list
        #: Told of every turn; the loop waits at most its `max_wait()` between turns.
        self.watchdog = Notifier(None, None)
        #: Rows left out of claims because theirs fails (set by the loop): (type, photo id,
        #: error) triples. Their types flow: said in the 200 answer, not a 503.
        self.refused_rows: Callable[[], list[tuple[str, str, str]]] = list
        #: Sweeps in a row whose rescue step failed (a Redis read of the active rows' jobs).
        self.rescue_failures = 0
        self.last_rescue_error = ""

    def turned(self) -> None:
        self.last_turn = time.monotonic()
        self.watchdog.alive()

    def failed(self, error: str) -> None:
        """A drain or a sweep failed (any cause)."""
        self.failures += 1
        self.last_error = error

    def succeeded(self) -> None:
        self.failures = 0

    def sweep_failed(self, error: str) -> None:
        """A sweep's statement failed on a healthy connection (dispatch goes on)."""
        self.sweep_failures += 1
        self.last_sweep_error = error

    def sweep_succeeded(self) -> None:
        self.sweep_failures = 0

    def rescue_failed(self, error: str) -> None:
        """A sweep's rescue step failed (its other steps went on)."""
        self.rescue_failures += 1
        self.last_rescue_error = error

    def rescue_succeeded(self) -> None:
        self.rescue_failures = 0

    def note(self) -> str | None:
        """What is wrong without making the reactor unhealthy (None: nothing)."""
        refused = self.refused_rows()
        if not refused:
            return None
        job_type, photo_id, error = refused[0]
        return (
            f"{len(refused)} row(s) left out of claims (their types flow), e.g. type {job_type}"
            f" photo_id {photo_id[:64]!r}: {error}"
        )

    def problem(self) -> str | None:
        """None when healthy, else the reason."""
        if self._listening and not self.listener_connected:
            return "listener disconnected"
        if self.failures >= FAILURES_BEFORE_UNHEALTHY:
            return f"{self.failures} failed drains or sweeps in a row: {self.last_error}"
        for count, what, error in (
            (self.sweep_failures, "failed sweeps", self.last_sweep_error),
            (self.rescue_failures, "sweeps whose rescue step failed", self.last_rescue_error),
        ):
            if count >= FAILURES_BEFORE_UNHEALTHY:
                return f"{count} {what} in a row: {error}"
        failing = self.failing_types()
        if failing:
            names = ",".join(sorted(t for t, _ in failing)[:5])
            return f"claims failing for type {names}: {failing[0][1]}"
        age = time.monotonic() - self.last_turn
        if age > self._max_age:
            return f"main loop stalled for {age:.0f}s"
        return None


class _MetricsServer(BoundedHTTPServer):
    """The bounded HTTP server (`reactor.http_server`: a fresh probe is served however many
    idle clients hold connections), logging client errors."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        # One record through the logging set-up, not a traceback on stderr.
        if _client_errors.allow():
            exc = sys.exc_info()[1]
            logger.warning(
                "metrics_client_error client=%s error=%s suppressed=%d",
                client_address[0] if client_address else "?",
                f"{type(exc).__name__}: {exc}" if exc else "unknown",
                _client_errors.suppressed(),
            )


def serve(
    port: int,
    metrics: Metrics,
    health: Callable[[], str | None],
    host: str = DEFAULT_HOST,
    note: Callable[[], str | None] = lambda: None,
) -> ThreadingHTTPServer:
    """Serve `/metrics` and `/healthz` on `host:port` in a daemon thread; returns the server.
    `/healthz` answers 503 with `health()`'s reason, else 200 `ok` (and `note()`, if any)."""

    class Handler(BaseHTTPRequestHandler):
        # A socket timeout: a client idle or slow for this long (reading or writing) is dropped.
        timeout = CLIENT_TIMEOUT_SECONDS

        def do_GET(self) -> None:
            server.request_read(self.request)
            if self.path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                problem = health()
                if problem is None:
                    said = note()
                    body = "ok\n" if said is None else f"ok; {said}\n"
                    self._send(200, body.encode(errors="backslashreplace"), "text/plain")
                else:
                    self._send(503, f"unhealthy: {problem}\n".encode(), "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_error(self, format: str, *args: object) -> None:  # noqa: A002
            # Timeouts and malformed requests: expected from scanners, not worth a line each.
            logger.debug("metrics_request_error " + format, *args)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # scrapes every few seconds would drown the log

    server = _MetricsServer((host, port), Handler, CLIENT_TIMEOUT_SECONDS)
    threading.Thread(target=server.serve_forever, name="reactor-metrics", daemon=True).start()
    return server
