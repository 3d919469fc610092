"""The reactor process: wait for a reason to work, then drain; survive every failure.

`Reactor.run()` repeats `Reactor.turn()` until a stop is requested. One turn:
1. takes the doorbell keys if the doorbell says so (`reactor.dispatcher.doorbell`; once armed, every
   writer that skipped NOTIFY has ended, so the turn drains every type);
2. waits for the first of {a notification, the next poll while the doorbell is not armed, the
   next sweep (interval ± 10 % jitter), the earliest future `next_retry_at` of a routed type,
   the end of the short gap after a hinted drain found nothing, a stop request};
3. does the first of: a sweep, if it is due; a drain of every type (at start, after a
   reconnect or an arm, after a drain cut by its time slice, or a row became due); the
   notified rows (their jobs enqueued at once, and those of rows named during the next few
   ms, then the rows claimed) and a drain of the notified types; a poll (a drain of every
   type, while the doorbell is not armed);
4. tells the doorbell how many rows the drain claimed, and gives the keys back if it says so;
and returns a `Turn`, which says what it did.

Notifications are read *before* draining, so a row committed during a drain sends a
notification that is still unread when the drain ends and causes one more drain: no lost
wake-up. On start and on every reconnect the listener LISTENs first and the reactor drains
at once, catching up on whatever was committed while nobody listened; it then polls until
the table is quiet and arms the doorbell again (a lost connection released it).

Connections: the reactor opens and owns both. The listener's session (LISTEN, the doorbell
keys) is `reactor.dispatcher.listener.Listener`. The work connection is handed to the `Dispatcher`
(claims, re-dispatches) and the `Sweeper` (the sweep's reads) and replaced in both after a
reconnect. When either connection fails, both are reopened in one round (after a primary
failover both point at the old server), on a server that takes writes (see `reactor.pg.db`).
The loop's timer query (`queries.NEXT_DUE_IN`, when the next row becomes due) runs here, on
the work connection: it serves only the loop's wait, so it lives with the wait.

With retention on (`--prune-done-after`), a `reactor.dispatcher.retention.Pruner` thread deletes old
finished rows on a connection of its own, outside this loop.

Failure policy: at start-up a bad URL, an unreachable or unmigrated database, or a Redis that
refuses our credentials is a `ConfigError` (exit 2). At runtime, Postgres failures reconnect
with exponential backoff and jitter, forever; Redis failures roll the batch back (rows stay
`pending`) and the drain is retried with backoff until Redis answers again. A sweep whose
statement fails on a healthy connection is logged (throttled) and tried again at the next
interval, and dispatch goes on meanwhile: only lost connections pause the loop. Every Redis
command waits at most `--redis-timeout` (a hung Redis cannot keep a claim's row locks), and a
listening reactor's work sessions end a transaction left idle for
`IDLE_IN_TRANSACTION_REDIS_TIMEOUTS` times that (Postgres rolls it back): the second guard.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import psycopg
import redis
import tenacity
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from reactor.dispatcher.doorbell import Action, ArmOutcome, Doorbell
from reactor.dispatcher.drain import Dispatcher, DrainResult
from reactor.dispatcher.listener import Listener
from reactor.dispatcher.metrics import HealthCheck, Metrics, serve
from reactor.dispatcher.retention import Pruner
from reactor.dispatcher.sweep import Sweeper, SweepResult
from reactor.errors import ConfigError, DatabaseError, EnqueueError, StatementError
from reactor.jobs import JobRef
from reactor.pg import db, queries
from reactor.pg.registry import NO_ROUTE_HINT, RouteRegistration, load_routes
from reactor.redact import redact
from reactor.routes import Route, format_route
from reactor.rq.enqueue import Enqueuer
from reactor.rq.redis_url import connect_redis, describe_master_not_found
from reactor.rq.state import RqState
from reactor.settings import ReactorSettings
from reactor.signals import Stopper
from reactor.throttle import Budget, LogThrottle

__all__ = ["Reactor", "Turn", "Work"]

logger = logging.getLogger(__name__)

#: Backoff between reconnects and between retries of a drain that Redis refused. The cap is
#: short because dispatch resumes only at the next try after a failover: one connection
#: attempt every 2 s per reactor costs a down server nothing.
BACKOFF_MULTIPLIER_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 2.0
#: Cap of the pause after a statement error (the same statement would fail again at once).
ERROR_PAUSE_MAX_SECONDS = 10.0
#: Pause after a failed turn before reconnecting.
ERROR_PAUSE_SECONDS = 0.2
#: A drain returns to the loop after this long even if rows keep coming (and the loop drains
#: again at once), so that sweeps, rescues, timers and stop requests are never starved.
DRAIN_SLICE_SECONDS = 1.0
#: After a drain for notified types found nothing, drain notified types again only this much
#: later (a row's notification waits at most this long, and only during a flood of hints).
HINT_DRAIN_GAP_SECONDS = 0.01
#: Look up the next due time before any wait that may last longer than this (not before
#: every 1 ms poll: a poll finds rows that became due anyway).
NEXT_DUE_LOOKUP_SECONDS = 0.05
#: How long after enqueuing the rows named by notifications the reactor claims them, enqueuing
#: rows named meanwhile at once. RQ's worker picks a job up within a few ms; until then the
#: reactor and its Postgres session stay off the CPUs that the pick-up needs (on a machine whose
#: cores they share, a claim made at once slows the job's start down). The job's fenced start
#: takes its row over if it comes first.
CLAIM_NAMED_AFTER_SECONDS = 0.005
#: Rows named by notifications that one turn enqueues before claiming them; the types of any
#: more are drained (claimed first) instead.
NAMED_ROWS_MAX = 100
#: Jobs enqueued for named rows before their claim are drawn from a budget of this many,
#: refilled at `NAMED_ROWS_REFILL_PER_SECOND`; a row the claim finds real pays its job back.
#: Anyone who can connect may NOTIFY: names of rows that do not exist cost at most the budget
#: plus the refill (a few hundred jobs in a minute-long flood, each withdrawn at its claim);
#: once it is spent, named rows are drained by type, which costs no job for a row that is not
#: there.
NAMED_ROWS_BUDGET = 100
NAMED_ROWS_REFILL_PER_SECOND = 5.0
#: Check at most this often (or every sweep, if sweeps come sooner) that the routes are still
#: recorded as this reactor's and their liveness lock held (behind a transaction pooler, the
#: server session holding it can be closed). The check rides on turns that wake anyway: a
#: polling reactor, the kind that runs behind a pooler, makes it every few seconds, and it
#: wakes nothing by itself (a poll-only reactor would poll at each such wake-up).
KEEP_ROUTES_SECONDS = 5.0
#: A listening reactor's work connections end a transaction idle this many Redis timeouts
#: (`--redis-timeout`): the claim's enqueue may take a few commands, each bounded by the timeout.
IDLE_IN_TRANSACTION_REDIS_TIMEOUTS = 3
#: Failed sweeps logged per `SWEEP_FAILED_LOG_SECONDS` (the rest are counted in the next line).
SWEEP_FAILED_LOG_BURST = 3
SWEEP_FAILED_LOG_SECONDS = 60.0


def _jittered(seconds: float) -> float:
    # ± 10 %, so reactors started together do not sweep in lockstep.
    return seconds * random.uniform(0.9, 1.1)


class Work(str, enum.Enum):
    """The work a turn did after its wait."""

    #: A sweep round (it drains every type first).
    SWEEP = "sweep"
    #: A drain of every type: at start, after a reconnect or an arm, after a drain cut by its
    #: time slice, or because a row became due.
    DRAIN = "drain"
    #: The notified rows and a drain of the notified types.
    HINTS = "hints"
    #: A drain of every type because the doorbell is not armed.
    POLL = "poll"


@dataclass(frozen=True)
class Turn:
    """What one turn of the loop did (`Reactor.turn()`)."""

    #: Seconds spent waiting for a reason to work.
    waited: float
    #: Notifications read during the wait.
    notifications: int = 0
    #: The outcome of the arm attempt made before the wait, if one was made.
    arm: ArmOutcome | None = None
    #: The work done after the wait (None: none, because of a stop or nothing was due).
    work: Work | None = None
    #: The types drained (every routed type, but for HINTS).
    drained: tuple[str, ...] = ()
    #: Rows claimed (by the sweep's drain too).
    claimed: int = 0
    #: Rows named by notifications whose jobs this turn enqueued but did not claim
    #: (`BatchResult.named`).
    named: int = 0
    #: The sweep round's result (SWEEP only).
    sweep: SweepResult | None = None
    #: The doorbell keys were given back after the drain.
    released: bool = False


class Reactor:
    """`reactor run`: owns the connections, and hands the work one to the dispatcher and the
    sweeper."""

    def __init__(
        self,
        settings: ReactorSettings,
        *,
        stopper: Stopper | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.stopper = stopper or Stopper()
        #: The routes this reactor dispatches with: the ones it was given, else (filled in by
        #: `start()`) the ones recorded in the database. The enqueuer, the RQ reader, the
        #: dispatcher and the sweeper share this mapping.
        self.routes: dict[str, Route] = dict(settings.routes)
        self._types = tuple(self.routes)
        self._registration: RouteRegistration | None = None
        # No retry inside redis-py: a failed batch is rolled back and the drain retried by
        # the loop, outside the transaction, so a retry never extends how long locks are held.
        self._redis = connect_redis(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_seconds,
            socket_connect_timeout=settings.redis_timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        # Only a listening reactor is sure to have sessions of its own (no pooler between).
        self._idle_in_transaction = (
            IDLE_IN_TRANSACTION_REDIS_TIMEOUTS * settings.redis_timeout_seconds
            if settings.listen
            else None
        )
        self._enqueuer = Enqueuer(
            self._redis, self.routes, job_timeout_seconds=settings.job_timeout_seconds
        )
        self._rq_state = RqState(self._redis, self.routes)
        self._listener = Listener(settings.database_url) if settings.listen else None
        # Made by `start()`, once the routes are known.
        self._work: db.Connection | None = None
        self._dispatcher: Dispatcher | None = None
        self._sweeper: Sweeper | None = None
        self._before_commit = before_commit
        self._warned_unknown: set[str] = set()
        self._ignored_log = LogThrottle(burst=10, interval_seconds=60.0)
        self._named_budget = Budget(NAMED_ROWS_BUDGET, NAMED_ROWS_REFILL_PER_SECOND)
        self._sweep_failed_log = LogThrottle(
            burst=SWEEP_FAILED_LOG_BURST, interval_seconds=SWEEP_FAILED_LOG_SECONDS
        )
        self.metrics = Metrics()
        self._bell = Doorbell(
            settings.doorbell, poll_interval_seconds=settings.poll_interval_seconds
        )
        interval = settings.sweep_interval_seconds
        self.health = HealthCheck(settings.listen, max(2 * interval, interval + 10))
        self._http: ThreadingHTTPServer | None = None
        self._pruner: Pruner | None = None
        # The loop's state between turns.
        self._next_sweep = 0.0  # set by `start()`
        self._next_keep = 0.0  # when to check the routes are still ours (`_keep_routes`)
        self._keep_interval = min(KEEP_ROUTES_SECONDS, settings.sweep_interval_seconds)
        self._next_due: float | None = None  # when the next row becomes due (monotonic)
        self._due_known = False  # _next_due was looked up after the last drain
        self._backlog = True  # drain every type at the next turn
        self._hinted: set[str] = set()  # notified types waiting for the gap to end
        self._hints_due = 0.0

    # -- start-up ----------------------------------------------------------------------------

    def start(self) -> None:
        """Connect everything once, failing fast.

        Raises:
            ConfigError: bad URL, unreachable or unmigrated database, no route given nor
                recorded, a route that conflicts with a running reactor's, Redis credentials
                or scripting (which the enqueue needs) refused.
        """
        try:
            self._start()
        except BaseException:
            self._release_routes()  # the routes of a reactor that never ran are not live
            raise
        self._next_keep = time.monotonic() + self._keep_interval

    def _start(self) -> None:
        try:
            conn = db.connect(
                self.settings.database_url,
                purpose="work",
                idle_in_transaction_seconds=self._idle_in_transaction,
            )
            try:
                db.check_schema(conn)
                self._register_routes(conn)
            except BaseException:
                conn.close()
                raise
            self._make_dispatcher_and_sweeper(conn)
            assert self._dispatcher is not None
            self._dispatcher.warm_up()
            if self._listener is not None:
                self._listener.connect()
        except DatabaseError as exc:
            raise ConfigError(str(exc)) from exc
        try:
            self._redis.ping()
            self._enqueuer.prepare()
            self._enqueuer.warm_up()
        except MasterNotFoundError as exc:
            # Sentinels all unreachable, or none knows the master's name: a set-up error.
            raise ConfigError(
                f"Redis Sentinel: {describe_master_not_found(self.settings.redis_url, exc)}"
            ) from None
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            raise ConfigError(f"Redis refused us: {redact(str(exc))}") from None
        except redis.RedisError as exc:
            # Not fatal: rows stay pending and drains retry until Redis answers.
            logger.warning("redis_unavailable error=%s (will retry)", redact(str(exc)))
        if self.settings.metrics_port is not None:
            try:
                self._http = serve(
                    self.settings.metrics_port,
                    self.metrics,
                    self.health.problem,
                    host=self.settings.metrics_host,
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on port {self.settings.metrics_port}: {exc}"
                ) from None
        if self.settings.prune_done_after_seconds is not None:
            # Its own thread and connection: DELETE batches never sit in the dispatch path.
            self._pruner = Pruner(
                self.settings.database_url,
                done_after_seconds=self.settings.prune_done_after_seconds,
                failed_after_seconds=self.settings.prune_failed_after_seconds,
                batch_size=self.settings.prune_batch_size,
                metrics=self.metrics,
            )
            self._pruner.start()
        self._listener_ok()
        self._next_sweep = time.monotonic() + _jittered(self.settings.sweep_interval_seconds)

    def _register_routes(self, conn: db.Connection) -> None:
        if not self.routes:
            self.routes.update(load_routes(conn))
        if not self.routes:
            raise ConfigError(NO_ROUTE_HINT)
        self._types = tuple(self.routes)
        self._registration = RouteRegistration(self.routes)
        self._registration.register(conn)

    def _make_dispatcher_and_sweeper(self, conn: db.Connection) -> None:
        """Make the dispatcher and the sweeper, on the first work connection `conn`."""
        self._work = conn
        self._dispatcher = Dispatcher(
            conn,
            self._enqueuer,
            self.routes,
            batch_size=self.settings.batch_size,
            before_commit=self._before_commit,
            metrics=self.metrics,
            database_url=self.settings.database_url,
            idle_in_transaction_seconds=self._idle_in_transaction,
        )
        quarantined = self._dispatcher.quarantined
        self.health.failing_types = lambda: [(t, q.error) for t, q in list(quarantined.items())]
        self._sweeper = Sweeper(
            conn,
            self._dispatcher,
            self._rq_state,
            self.routes,
            batch_size=self.settings.batch_size,
            stale_after_seconds=self.settings.stale_after_seconds,
            gone_after_seconds=self.settings.gone_after_seconds,
            metrics=self.metrics,
        )

    # -- connections -------------------------------------------------------------------------

    def _connections_ok(self) -> bool:
        return self._work_connection_ok() and self._listener_ok()

    def _work_connection_ok(self) -> bool:
        conn = self._work
        return conn is not None and not conn.closed and not conn.broken

    def _listener_ok(self) -> bool:
        connected = self._listener is not None and self._listener.connected
        self.metrics.listener_connected.set(1 if connected else 0)
        self.health.listener_connected = connected
        return self._listener is None or connected

    def _drop_connections(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._dispatcher is not None:
            self._dispatcher.close()
        if self._work is not None:
            self._work.close()

    def _reconnect(self) -> None:
        """Reopen both connections in one round (see the module docstring), retrying with
        backoff until they are up or a stop is requested; then the doorbell starts over and
        the next turn drains every type.

        Raises:
            DatabaseError: a stop was requested before the connections were up.
            ConfigError: a reactor that started meanwhile routes one of our types differently.
        """
        self._drop_connections()

        def connect_missing() -> None:
            if not self._work_connection_ok():
                self._replace_work_connection(self._connect_work())
            if self._listener is not None and not self._listener.connected:
                self._listener.connect()

        self._retrying(DatabaseError, "reconnect")(connect_missing)
        self._listener_ok()
        logger.info("reconnected")
        self._bell.lost()
        self.metrics.doorbell_armed.set(0)
        self._backlog = True

    def _connect_work(self) -> db.Connection:
        conn = db.connect(
            self.settings.database_url,
            purpose="work",
            idle_in_transaction_seconds=self._idle_in_transaction,
        )
        if self._registration is not None:
            # The routes' liveness lock went with the old session: hold it again.
            try:
                self._registration.register(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def _replace_work_connection(self, conn: db.Connection) -> None:
        """Hand `conn` to the dispatcher and the sweeper, and close the connection it replaces."""
        assert self._dispatcher is not None and self._sweeper is not None
        old, self._work = self._work, conn
        self._dispatcher.replace_connection(conn)
        self._sweeper.replace_connection(conn)
        if old is not None:
            old.close()

    def _backoff_sleep(self, seconds: float) -> None:
        self.stopper.sleep(seconds)

    def _retrying(self, kind: type[Exception], what: str) -> tenacity.Retrying:
        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self.health.failed(f"{what}: {exc}")
            logger.warning(
                "%s_retry attempt=%d next_in=%.2fs error=%s",
                what,
                state.attempt_number,
                state.upcoming_sleep,
                exc,
            )

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(kind),
            wait=tenacity.wait_random_exponential(
                multiplier=BACKOFF_MULTIPLIER_SECONDS, max=BACKOFF_MAX_SECONDS
            ),
            stop=lambda _state: self.stopper.requested,
            sleep=self._backoff_sleep,
            before_sleep=log_retry,
            reraise=True,
        )

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Run until a stop is requested. `start()` must have succeeded.

        Raises:
            ConfigError: after a reconnect, a reactor that started meanwhile routes one of our
                types differently (this one stops rather than dispatch against it).
        """
        logger.info(
            "reactor_started routes=%s doorbell=%s batch_size=%d sweep_interval=%.1fs",
            ",".join(format_route(r) for r in self.routes.values()),
            self.settings.doorbell.value,
            self.settings.batch_size,
            self.settings.sweep_interval_seconds,
        )
        # Everything loaded so far lives as long as the process: keep the collector's full
        # passes (which stall the loop by tens of ms) off it.
        gc.collect()
        gc.freeze()
        try:
            self._run()
        finally:
            self.close()
        logger.info("reactor_stopped")

    def _run(self) -> None:
        while not self.stopper.requested:
            try:
                if not self._connections_ok():
                    self._reconnect()
                self.turn()
            except DatabaseError as exc:
                if self.stopper.requested:
                    break
                if db.is_connection_failure(exc) or not self._connections_ok():
                    # Reopen both in one round: after a failover the other connection is
                    # on the old primary too (gone, or read-only), just not noticed yet.
                    self._drop_connections()
                self._listener_ok()
                self.health.failed(str(exc))
                pause = ERROR_PAUSE_SECONDS
                if isinstance(exc, StatementError):
                    # Not a lost connection: the same statement would fail again at once.
                    logger.error("loop_failed error=%s", exc)
                    pause = min(ERROR_PAUSE_MAX_SECONDS, pause * 2 ** min(self.health.failures, 8))
                else:
                    logger.warning("connection_lost error=%s", exc)
                # A pause, so an error that a reconnect cannot fix does not spin.
                self.stopper.sleep(_jittered(pause))
            except EnqueueError:
                # Only reached when a stop interrupted the retries.
                break

    def turn(self) -> Turn:
        """One turn: arm if the doorbell says so, wait for a reason to work, do that work
        (see the module docstring). `start()` must have succeeded and the connections be up.

        Raises:
            DatabaseError: Postgres failed (the caller reconnects).
            EnqueueError: Redis failed, and a stop was requested while the drain retried.
        """
        bell = self._bell
        # 1. The doorbell first: an arm calls for a drain of every type.
        arm: ArmOutcome | None = None
        now = time.monotonic()
        if not self._backlog and bell.should_arm(now):
            arm = self._lock_doorbell()
            if bell.arm_result(arm, now) is Action.DRAIN:
                self._backlog = True
            self.metrics.doorbell_armed.set(1 if bell.armed else 0)

        # 2. Wait for the first reason to work.
        now = time.monotonic()
        bell_in = 0.0 if self._backlog else bell.wait_seconds(now)
        if not self._due_known and (bell_in is None or bell_in > NEXT_DUE_LOOKUP_SECONDS):
            self._next_due, self._due_known = self._next_due_at(), True
        deadline = min(
            t
            for t in (
                self._next_sweep,
                self._next_due,
                None if bell_in is None else now + bell_in,
                self._hints_due if self._hinted else None,
            )
            if t is not None
        )
        waiting = time.monotonic()
        payloads = self._wait(deadline - now)
        notifications = len(payloads)
        waited = time.monotonic() - waiting
        hinted, notified = self._routed(payloads)
        types = self._hints(hinted)
        if types or notified or (payloads and not self._hinted):
            bell.rung(routed=bool(types or notified))
        if self.stopper.requested:
            return Turn(waited=waited, notifications=len(payloads), arm=arm)

        # 3. The work, the first that is due.
        now = time.monotonic()
        if self._registration is not None and now >= self._next_keep:
            self._next_keep = now + self._keep_interval
            self._keep_routes()
        sweep: SweepResult | None = None
        result: DrainResult | SweepResult
        if now >= self._next_sweep:
            # Scheduled first: a sweep that fails is retried at the next interval.
            self._next_sweep = now + _jittered(self.settings.sweep_interval_seconds)
            work, drained = Work.SWEEP, self._types
            sweep = self._sweep()
            # A failed sweep may have failed before its drain: drain every type next turn.
            result = sweep or SweepResult(more=True)
        elif self._backlog or (self._next_due is not None and now >= self._next_due):
            work, drained = Work.DRAIN, self._types
            result = self._drain(drained)
        elif types or notified:
            work = Work.HINTS
            result, more_notifications, drained = self._dispatch_notified(notified, types)
            notifications += more_notifications
            if not result.claimed and not result.named:
                # Hints that find nothing (a NOTIFY flood costs us a claim each): the next
                # ones wait a little and are drained together.
                self._hints_due = time.monotonic() + HINT_DRAIN_GAP_SECONDS
        elif bell.should_poll():
            self.metrics.polls.inc()
            work, drained = Work.POLL, self._types
            result = self._drain(drained)
        else:
            return Turn(waited=waited, notifications=len(payloads), arm=arm)

        # 4. Tell the doorbell.
        # Rows dispatched: claimed, or named rows whose jobs were enqueued for them.
        dispatched = result.claimed + (result.named if isinstance(result, DrainResult) else 0)
        released = (
            bell.drained(dispatched, started=now, every_type=work is not Work.HINTS)
            is Action.RELEASE
        )
        if released:
            self._unlock_doorbell()
        self._backlog = result.more
        self._due_known = False
        self.health.succeeded()
        return Turn(
            waited=waited,
            notifications=notifications,
            arm=arm,
            work=work,
            drained=drained,
            claimed=result.claimed,
            named=result.named if isinstance(result, DrainResult) else 0,
            sweep=sweep,
            released=released,
        )

    # -- the steps of a turn -----------------------------------------------------------------

    def _lock_doorbell(self) -> ArmOutcome:
        assert self._listener is not None  # poll-only reactors never arm
        outcome = self._listener.lock_doorbell()
        self.metrics.doorbell_arms.labels(outcome.value).inc()
        logger.debug("doorbell_arm outcome=%s", outcome.value)
        return outcome

    def _unlock_doorbell(self) -> None:
        assert self._listener is not None
        self.metrics.doorbell_armed.set(0)
        self._listener.unlock_doorbell()
        logger.debug("doorbell_disarmed")

    def _next_due_at(self) -> float | None:
        """Monotonic time at which the earliest not-yet-due pending row of a routed type
        becomes due (None: no such row)."""
        conn = self._work
        assert conn is not None
        try:
            with conn.transaction():
                row = conn.execute(queries.NEXT_DUE_IN, {"types": list(self.routes)}).fetchone()
        except psycopg.Error as exc:
            raise db.translate_error(exc, "next-due query failed", conn) from exc
        if row is None or row[0] is None:
            return None
        return time.monotonic() + max(0.0, float(row[0]))

    def _wait(self, timeout: float) -> list[str]:
        self.health.turned()
        self.metrics.last_loop.set(time.time())
        if self._listener is None:
            self.stopper.sleep(timeout)
            return []
        if self._hinted:
            # Hints are held back until the gap ends: let notifications pile up meanwhile
            # rather than wake for each (the listener reads them all at once afterwards).
            self.stopper.sleep(timeout)
            timeout = 0.0
        payloads = self._listener.wait(timeout, self.stopper.fileno())
        if payloads:
            self.metrics.notifications.inc(len(payloads))
        return payloads

    def _routed(
        self, payloads: list[str], room: int = NAMED_ROWS_MAX
    ) -> tuple[set[str], list[JobRef]]:
        """The routed types named alone, and the routed rows named one by one (their first
        attempts, at most `room`; the types of any more count as named alone), in `payloads`
        (the forms are in sql/0010)."""
        types = set()
        rows: dict[tuple[str, str], JobRef] = {}
        room = min(room, self._named_budget.available())
        for payload in payloads:
            job_type, by_row, photo_id = payload.partition(" ")
            if job_type in self.routes:
                if not by_row:
                    types.add(job_type)
                    continue
                if photo_id:
                    if len(rows) < room:
                        rows.setdefault((job_type, photo_id), JobRef(job_type, photo_id, 1))
                    else:
                        types.add(job_type)  # a flood, or the budget spent: claimed first
                    continue
            # Rows of a type routed elsewhere are reported by their type, once.
            unknown = job_type if by_row and job_type not in self.routes else payload
            if unknown not in self._warned_unknown and len(self._warned_unknown) < 1000:
                # A hint for a type we do not route (or garbage on the channel): ignore it,
                # saying so a few times a minute at most (anyone may NOTIFY).
                self._warned_unknown.add(unknown)
                if self._ignored_log.allow():
                    logger.warning(
                        "notification_ignored payload=%r (no route) suppressed=%d",
                        payload[:200],
                        self._ignored_log.suppressed(),
                    )
        return types, list(rows.values())

    def _hints(self, types: set[str]) -> set[str]:
        """The notified types to drain now: none while the gap after an empty hinted drain
        lasts (they are kept), all kept ones once it is over."""
        if time.monotonic() < self._hints_due:
            self._hinted |= types
            return set()
        types |= self._hinted
        self._hinted = set()
        return types

    def _dispatch_notified(
        self, refs: list[JobRef], types: set[str]
    ) -> tuple[DrainResult, int, tuple[str, ...]]:
        """Dispatch the rows named by their notifications: enqueue their jobs at once
        (`Dispatcher.enqueue_notified`), keep listening for `CLAIM_NAMED_AFTER_SECONDS` and
        enqueue the rows named meanwhile at once too, then claim them all in one statement
        (`Dispatcher.claim_notified`). Then drain the types to drain: those named alone, and
        those of the rows whose jobs were not written (they existed, or Redis refused them:
        the drain retries until Redis answers). A type to drain, or a stop, ends the wait.

        Returns:
            What was done, how many notifications the wait read, and the types drained.
        """
        assert self._dispatcher is not None
        dispatcher = self._dispatcher
        drained = dict.fromkeys([*types, *(ref.type for ref in refs)])
        written: list[JobRef] = []
        already = notifications = 0
        deadline = time.monotonic() + CLAIM_NAMED_AFTER_SECONDS
        while True:
            if refs:
                try:
                    enqueued, existing = dispatcher.enqueue_notified(refs)
                except EnqueueError as exc:
                    logger.warning("notified_enqueue_failed rows=%d error=%s", len(refs), exc)
                    enqueued, existing = [], refs
                self._named_budget.spend(len(enqueued))
                written += enqueued
                already += len(existing)
                # A job that exists already (another reactor's, or of an earlier life of the
                # row) was not written, nor will its row be claimed here: the drain claims it,
                # replacing a job that ended, finding another reactor's alive.
                types |= {ref.type for ref in existing}
            left = deadline - time.monotonic()
            if types or not written or left <= 0 or self.stopper.requested:
                break
            payloads = self._wait(left)
            notifications += len(payloads)
            hinted, refs = self._routed(payloads, NAMED_ROWS_MAX - len(written))
            types = self._hints(hinted)
            if types or refs:
                self._bell.rung(routed=True)
            drained.update(dict.fromkeys([*types, *(ref.type for ref in refs)]))
        early, dropped = dispatcher.claim_notified(written, already)
        # Only rows that exist pay their jobs back: names of absent rows spend the budget.
        self._named_budget.refund(early.claimed + early.named)
        types |= dropped
        drained.update(dict.fromkeys(dropped))
        result = self._drain(types) if types else DrainResult()
        if written or already:
            result = result.add(early)
        return result, notifications, tuple(drained)

    def _drain(self, types: Iterable[str]) -> DrainResult:
        """Drain `types` for up to one slice, retrying while Redis refuses."""
        assert self._dispatcher is not None
        dispatcher = self._dispatcher
        wanted = list(types)
        should_stop = self._should_stop
        try:
            # Called directly first: a tenacity loop costs more than a drain that finds
            # nothing, and a polling reactor drains up to a thousand times a second.
            return dispatcher.drain(wanted, should_stop, DRAIN_SLICE_SECONDS)
        except EnqueueError:
            if self.stopper.requested:
                raise
        # Redis refused the batch (it was rolled back): retry with backoff, logging each try.
        return self._retrying(EnqueueError, "drain")(
            dispatcher.drain, wanted, should_stop, DRAIN_SLICE_SECONDS
        )

    def _keep_routes(self) -> None:
        """Keep this reactor's routes live (`RouteRegistration.keep`).

        Raises:
            ConfigError: another reactor took one of our types over with another route.
            DatabaseError: the connection failed (the caller reconnects).
        """
        assert self._registration is not None and self._work is not None
        try:
            self._registration.keep(self._work)
        except StatementError as exc:
            # The routes' table stayed locked: try again at the next check, dispatch on.
            logger.warning("routes_keep_failed error=%s", exc)

    def _release_routes(self) -> None:
        """Mark our routes stopped: on the work connection, else on a new one. Behind a
        transaction pooler nothing else ends their liveness (the lock stays with a server
        session), so a failure is logged."""
        registration = self._registration
        if registration is None:
            return
        if self._work_connection_ok():
            assert self._work is not None
            if registration.release(self._work):
                return
        try:
            with contextlib.closing(db.connect(self.settings.database_url, purpose="work")) as conn:
                if registration.release(conn):
                    return
        except (DatabaseError, ConfigError):
            pass
        logger.warning(
            "routes_not_marked_stopped (they count as running until the session holding their"
            " lock ends)"
        )

    def _should_stop(self) -> bool:
        return self.stopper.requested

    def _sweep(self) -> SweepResult | None:
        """A sweep round (None: a statement of it failed, on a healthy connection).

        Raises:
            DatabaseError: the connection failed (the caller reconnects).
        """
        assert self._sweeper is not None
        try:
            result = self._sweeper.run_once(self._should_stop, DRAIN_SLICE_SECONDS)
            if self._http is not None:
                self._sweeper.refresh_backlog_metrics()
        except StatementError as exc:
            # A row or a statement the sweep cannot handle: the next interval tries again,
            # and meanwhile notifications and polls are dispatched without a pause.
            self.health.sweep_failed(str(exc))
            self.metrics.sweep_failures.inc()
            if self._sweep_failed_log.allow():
                logger.error(
                    "sweep_failed error=%s suppressed=%d", exc, self._sweep_failed_log.suppressed()
                )
            return None
        self.health.sweep_succeeded()
        return result

    def sweep_once(self) -> SweepResult:
        """One sweep round (`reactor sweep`); `start()` must have succeeded."""
        assert self._sweeper is not None
        return self._sweeper.run_once(self._should_stop)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.stop()
            self._pruner = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self._release_routes()
        self._drop_connections()
        self._redis.close()
