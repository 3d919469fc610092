"""The reactor process: wait for a reason to work, then drain; survive every failure.

`Reactor.run()` repeats `Reactor.turn()` until a stop is requested. One turn:
1. takes the doorbell keys if the doorbell says so (`reactor.dispatcher.doorbell`; once armed, every
   writer that skipped NOTIFY has ended, so the turn drains every type);
2. waits for the first of {a notification, the next poll while the doorbell is not armed, the
   next sweep (interval ± 10 % jitter), the earliest future `next_retry_at` of a routed type,
   the full claim a type owes after bounded ones (`reactor.dispatcher.bounds`), the end of
   the short gap after a hinted drain found nothing, a stop request};
3. does the first of: a sweep, if it is due; a drain of every type (at start, after a
   reconnect or an arm, after a drain cut by its time slice, a row became due, or a full
   claim is owed); a drain
   of the notified types; a poll (a drain of every type, while the doorbell is not armed;
   after a poll that found nothing, only of the types a probe outside any transaction finds
   due rows of, `reactor.dispatcher.probe`, so an empty poll sends no BEGIN or COMMIT);
4. tells the doorbell how many rows the drain claimed, and gives the keys back if it says so;
and returns a `Turn`, which says what it did.

Notifications are read *before* draining, so a row committed during a drain sends a
notification that is still unread when the drain ends and causes one more drain: no lost
wake-up. On start and on every reconnect the listener LISTENs first and the reactor drains
at once, catching up on whatever was committed while nobody listened; it then polls until
the table is quiet and arms the doorbell again (a lost connection released it).

The parts: `reactor.dispatcher.sessions` owns the Postgres sessions and reopens them;
`reactor.dispatcher.wakeups` reads what the notifications ask; `reactor.dispatcher.drain`
claims by type, enqueues and commits (the only way a job reaches Redis);
`reactor.dispatcher.sweep` rescues; `reactor.dispatcher.liveness` keeps the routes live. The
`Reactor` makes them all and runs the turns. The loop's timer query (`queries.NEXT_DUE_IN`,
when the next row becomes due) runs here, on the work connection: it serves only the wait.

With retention on (`--prune-done-after`), a `reactor.dispatcher.retention.Pruner` thread deletes old
finished rows on a connection of its own, outside this loop.

Failure policy: at start-up a bad URL, an unreachable or unmigrated database, or a Redis that
refuses our credentials is a `ConfigError` (exit 2). At runtime nothing ends the loop but a
stop (and a route conflict found after a reconnect): whatever a turn raises — a lost
connection, a failed statement, Redis, or any exception a library, a payload or a row makes
it raise — rolls the turn's transaction back, is counted (`reactor_turn_failures_total`),
told to the health check and logged at most once a minute per event with how many were not,
and the loop pauses with exponential backoff and jitter (at most 2 s) and goes on, draining
every type at the next turn. Lost connections are reopened (forever); a batch Redis refused
is retried inside the drain with the same backoff until Redis answers (rows stay `pending`
meanwhile). A sweep whose statement fails on a healthy connection is logged (throttled) and
tried again at the next interval, and dispatch goes on meanwhile. Every Redis command waits
at most `--redis-timeout` (a hung Redis cannot keep a claim's row locks).
"""

from __future__ import annotations

import enum
import gc
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from redis.backoff import NoBackoff
from redis.retry import Retry

from reactor.dispatcher.doorbell import Action, ArmOutcome, Doorbell
from reactor.dispatcher.drain import DrainResult
from reactor.dispatcher.failures import TurnFailures
from reactor.dispatcher.liveness import RouteLiveness
from reactor.dispatcher.metrics import HealthCheck, Metrics
from reactor.dispatcher.probe import due_types
from reactor.dispatcher.root import Parts
from reactor.dispatcher.sessions import Sessions, backoff
from reactor.dispatcher.sweep import SweepResult, guarded_round
from reactor.dispatcher.wakeups import Wakeups
from reactor.errors import ConfigError, DatabaseError, RedisUnavailableError
from reactor.pg import db, queries
from reactor.routes import Route, format_route
from reactor.rq.redis_url import connect_redis
from reactor.settings import ReactorSettings
from reactor.signals import Stopper

__all__ = ["Reactor", "Turn", "Work"]

logger = logging.getLogger(__name__)

#: A drain returns to the loop after this long even if rows keep coming (and the loop drains
#: again at once), so that sweeps, rescues, timers and stop requests are never starved.
DRAIN_SLICE_SECONDS = 1.0
#: Look up the next due time before any wait that may last longer than this (not before
#: every 1 ms poll: a poll finds rows that became due anyway).
NEXT_DUE_LOOKUP_SECONDS = 0.05


def _jittered(seconds: float) -> float:
    # ± 10 %, so reactors started together do not sweep in lockstep.
    return seconds * random.uniform(0.9, 1.1)


def _next_due_at(conn: db.Connection, types: Iterable[str]) -> float | None:
    """Monotonic time at which the earliest not-yet-due pending row of `types` becomes due
    (None: no such row).

    Raises:
        DatabaseError: the query failed.
    """
    # Outside a transaction: one round trip, where BEGIN, the query and COMMIT were three.
    with db.outside_transaction(conn), db.translating("next-due query failed", conn):
        row = conn.execute(queries.NEXT_DUE_IN, {"types": list(types)}).fetchone()
    if row is None or row[0] is None:
        return None
    return time.monotonic() + max(0.0, float(row[0]))


class Work(str, enum.Enum):
    """The work a turn did after its wait."""

    #: A sweep round (it drains every type first).
    SWEEP = "sweep"
    #: A drain of every type: at start, after a reconnect or an arm, after a drain cut by its
    #: time slice, because a row became due, or a full claim is owed.
    DRAIN = "drain"
    #: A drain of the notified types.
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
    #: The sweep round's result (SWEEP only).
    sweep: SweepResult | None = None
    #: The doorbell keys were given back after the drain.
    released: bool = False


class Reactor:
    """`reactor run`: makes the parts (`reactor.dispatcher.root`), then runs the turns."""

    def __init__(self, settings: ReactorSettings, *, stopper: Stopper | None = None) -> None:
        self.settings = settings
        self.stopper = stopper or Stopper()
        #: Given, else recorded (filled in by `start()`); every part shares this mapping.
        self.routes: dict[str, Route] = dict(settings.routes)
        self._types = tuple(self.routes)
        # No retry inside redis-py: a failed batch is rolled back and the drain retried by
        # the loop, outside the transaction, so a retry never extends how long locks are held.
        self._redis = connect_redis(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_seconds,
            socket_connect_timeout=settings.redis_timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        self.metrics = Metrics()
        interval = settings.sweep_interval_seconds
        self.health = HealthCheck(settings.listen, max(2 * interval, interval + 10))
        self._liveness = RouteLiveness(self.routes, settings.database_url, interval)
        self._sessions = Sessions(settings, self._liveness, self.stopper, self.health, self.metrics)
        self._wakeups = Wakeups(self.routes)
        self._bell = Doorbell(
            settings.doorbell, poll_interval_seconds=settings.poll_interval_seconds
        )
        self._parts: Parts | None = None  # made by `start()`, once the routes are known
        # The loop's state between turns.
        self._next_sweep = 0.0  # set by `start()`
        self._next_due: float | None = None  # when the next row becomes due (monotonic)
        self._due_known = False  # _next_due was looked up after the last drain
        self._backlog = True  # drain every type at the next turn
        self._poll_empty = False  # the last poll claimed nothing: the next one probes first
        self._failures = TurnFailures(self.metrics, self.health, self.stopper)

    # -- start-up ----------------------------------------------------------------------------

    def start(self) -> None:
        """Connect everything once, failing fast (`Parts.start`).

        Raises:
            ConfigError: what a retry cannot fix (see `reactor.dispatcher.root`).
        """
        try:
            self._parts = Parts.start(
                self.settings,
                sessions=self._sessions,
                liveness=self._liveness,
                client=self._redis,
                metrics=self.metrics,
                health=self.health,
                stopper=self.stopper,
            )
        except BaseException:
            self._liveness.release(self._sessions.work)  # a reactor that never ran is not live
            raise
        self._types = tuple(self.routes)
        self._next_sweep = time.monotonic() + _jittered(self.settings.sweep_interval_seconds)

    def _started(self) -> Parts:
        if self._parts is None:
            raise RuntimeError("the reactor was not started")
        return self._parts

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
                if not self._sessions.ok():
                    self._reconnect()
                self.turn()
            except ConfigError:
                raise  # a reactor that started meanwhile routes our types differently
            except Exception as exc:
                # Whatever failed — Postgres, Redis, or anything a library, a row or a payload
                # made it raise — the turn's transaction is rolled back and the loop goes on.
                if self.stopper.requested:
                    break  # also a stop that interrupted the drain's retries
                if isinstance(exc, DatabaseError):
                    # Reopen all in one round: after a failover the other connections are on
                    # the old primary too (gone, or read-only), just not noticed yet.
                    self._drop()
                else:
                    self._sessions.rollback_work()
                self._sessions.listener_ok()
                self._backlog = True  # the next turn drains every type
                self._failures.failed(exc)

    def _reconnect(self) -> None:
        """Reopen the sessions (`Sessions.reconnect`); the doorbell then starts over and the
        next turn drains every type (rows committed meanwhile sent notifications to nobody)."""
        self._drop()
        self._sessions.reconnect()
        self._bell.lost()
        self.metrics.doorbell_armed.set(0)
        self._backlog = True

    def _drop(self) -> None:
        """Close the sessions; the dispatcher forgets its claims' low-water marks."""
        self._sessions.drop()
        if self._parts is not None:
            self._parts.dispatcher.bounds.reset()

    def turn(self) -> Turn:
        """One turn: arm if the doorbell says so, wait for a reason to work, do that work
        (see the module docstring). `start()` must have succeeded and the connections be up.

        Raises:
            DatabaseError: Postgres failed (the caller reconnects).
            RedisUnavailableError: Redis failed, and a stop was requested while the drain retried.
        """
        bell = self._bell
        # 1. The doorbell first: an arm calls for a drain of every type.
        arm: ArmOutcome | None = None
        now = time.monotonic()
        if not self._backlog and bell.should_arm(now):
            arm = self._sessions.arm_doorbell()
            if bell.arm_result(arm, now) is Action.DRAIN:
                self._backlog = True
            self.metrics.doorbell_armed.set(1 if bell.armed else 0)

        # 2. Wait for the first reason to work.
        now = time.monotonic()
        bell_in = 0.0 if self._backlog else bell.wait_seconds(now)
        if not self._due_known and (bell_in is None or bell_in > NEXT_DUE_LOOKUP_SECONDS):
            conn = self._sessions.work
            assert conn is not None
            self._next_due, self._due_known = _next_due_at(conn, self._types), True
        full_due = self._started().dispatcher.bounds.full_claim_due()
        deadline = min(
            t
            for t in (
                self._next_sweep,
                self._next_due,
                full_due,
                None if bell_in is None else now + bell_in,
                self._wakeups.gap_ends,
            )
            if t is not None
        )
        waiting = time.monotonic()
        payloads = self._wait(deadline - now)
        notifications = len(payloads)
        waited = time.monotonic() - waiting
        types = self._wakeups.to_drain(self._wakeups.parse(payloads))
        if types or (payloads and not self._wakeups.held):
            bell.rung(routed=bool(types), now=time.monotonic(), count=len(payloads))
        if self.stopper.requested:
            return Turn(waited=waited, notifications=len(payloads), arm=arm)

        # 3. The work, the first that is due.
        now = time.monotonic()
        if self._sessions.work is not None:
            self._liveness.keep_if_due(self._sessions.work)
        sweep: SweepResult | None = None
        result: DrainResult | SweepResult
        if now >= self._next_sweep:
            # Scheduled first: a sweep that fails is retried at the next interval.
            self._next_sweep = now + _jittered(self.settings.sweep_interval_seconds)
            work, drained = Work.SWEEP, self._types
            sweep = self._sweep()
            # A failed sweep may have failed before its drain: drain every type next turn.
            result = sweep or SweepResult(more=True)
        elif (
            self._backlog
            or (self._next_due is not None and now >= self._next_due)
            or (full_due is not None and now >= full_due)
        ):
            work, drained = Work.DRAIN, self._types
            result = self._drain(drained)
        elif types:
            work, drained = Work.HINTS, tuple(types)
            result = self._drain(drained)
            if not result.claimed:
                self._wakeups.found_nothing()
        elif bell.should_poll():
            self.metrics.polls.inc()
            work, drained = Work.POLL, self._types
            result = self._drain(drained, probe=self._poll_empty)
            self._poll_empty = not result.claimed
        else:
            return Turn(waited=waited, notifications=len(payloads), arm=arm)

        # 4. Tell the doorbell the rows dispatched.
        released = (
            bell.drained(result.claimed, started=now, every_type=work is not Work.HINTS)
            is Action.RELEASE
        )
        if released:
            self._sessions.disarm_doorbell()
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
            sweep=sweep,
            released=released,
        )

    # -- the steps of a turn -----------------------------------------------------------------

    def _wait(self, timeout: float) -> list[str]:
        self.health.turned()
        timeout = min(timeout, self.health.watchdog.max_wait())  # so a live loop keeps telling
        self.metrics.last_loop.set(time.time())
        listener = self._sessions.listener
        if listener is None:
            self.stopper.sleep(timeout)
            return []
        if self._wakeups.held:
            # Hints are held back until the gap ends: let notifications pile up meanwhile
            # rather than wake for each (the listener reads them all at once afterwards).
            self.stopper.sleep(timeout)
            timeout = 0.0
        payloads = listener.wait(timeout, self.stopper.fileno())
        if payloads:
            self.metrics.notifications.inc(len(payloads))
        return payloads

    def _drain(self, types: Iterable[str], *, probe: bool = False) -> DrainResult:
        """Drain `types` for up to one slice, retrying while Redis refuses; with `probe`, only
        the types that have due rows (`reactor.dispatcher.probe`)."""
        dispatcher = self._started().dispatcher
        conn = self._work()
        wanted = due_types(conn, list(types), dispatcher.bounds) if probe else list(types)

        def drain() -> DrainResult:
            stop, ahead = self.stopper.should_stop, self._sessions.claim_ahead()
            return dispatcher.drain(conn, wanted, stop, DRAIN_SLICE_SECONDS, ahead)

        try:
            # Directly first: a tenacity loop costs more than a drain that finds nothing.
            result = drain()
        except RedisUnavailableError:
            if self.stopper.requested:
                raise
            # Redis refused the batch (it was rolled back): retry with backoff, logging each.
            result = backoff(RedisUnavailableError, "drain", self.stopper, self.health)(drain)
        self._sessions.after_drain(result.full)
        return result

    def _work(self) -> db.Connection:
        """The work connection, which the reactor owns and hands to its parts per call."""
        conn = self._sessions.work
        assert conn is not None  # `start()` opened it; a failed reconnect raises first
        return conn

    def _sweep(self) -> SweepResult | None:
        parts = self._started()
        return guarded_round(
            parts.sweeper,
            self._work(),
            self.stopper.should_stop,
            DRAIN_SLICE_SECONDS,
            health=self.health,
            refresh_backlog=parts.http is not None,
        )

    def sweep_once(self) -> SweepResult:
        """One sweep round (`reactor sweep`); `start()` must have succeeded."""
        return self._started().sweeper.run_once(self._work(), self.stopper.should_stop)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._parts is not None:
            self._parts.close()
        self._liveness.release(self._sessions.work)
        self._sessions.drop()
        self._redis.close()
