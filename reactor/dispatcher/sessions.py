"""The reactor's Postgres sessions and the policy that keeps them up.

The reactor opens and owns them all: the listener's (`Listener`: LISTEN and the doorbell keys),
the work connection, which the loop hands to the dispatcher and the sweeper with each call (so
a reconnect replaces it everywhere at once), and the claim-ahead connection, on which a drain
claims its next batch while the current one is enqueued (`reactor.dispatcher.ahead`). That one
is optional: it is opened between drains, after one that met a full batch (a backlog), on a
direct session only, and closed after `AHEAD_IDLE_SECONDS` without one; while it cannot be
opened (a role's connection limit, `max_connections`) drains claim every batch on the work
connection, and it is tried again after `AHEAD_RETRY_SECONDS`. When the listener or the work
connection fails, both are reopened in one round (after a primary failover both point at the
old server; the claim-ahead one is closed, to open again at the next backlog), on a server
that takes writes (see `reactor.pg.db`), retrying with exponential backoff and jitter until
they are up or a stop is requested. A listening
reactor's work sessions end a transaction left idle for `IDLE_IN_TRANSACTION_REDIS_TIMEOUTS`
Redis timeouts (Postgres rolls it back): a second guard, after the Redis timeout itself,
against a claim whose row locks outlive a hung enqueue.
"""

from __future__ import annotations

import logging
import random
import time

import tenacity

from reactor.dispatcher.doorbell import ArmOutcome
from reactor.dispatcher.listener import Listener
from reactor.dispatcher.liveness import RouteLiveness
from reactor.dispatcher.metrics import HealthCheck, Metrics
from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.pg import db
from reactor.settings import ReactorSettings
from reactor.signals import Stopper

__all__ = [
    "AHEAD_IDLE_SECONDS",
    "AHEAD_RETRY_SECONDS",
    "BACKOFF_MAX_SECONDS",
    "BACKOFF_MULTIPLIER_SECONDS",
    "IDLE_IN_TRANSACTION_REDIS_TIMEOUTS",
    "Sessions",
    "backoff",
    "retry_pause",
]

logger = logging.getLogger(__name__)

#: Backoff between reconnects and between retries of a drain that Redis refused. The cap is
#: short because dispatch resumes only at the next try after a failover: one connection
#: attempt every 2 s per reactor costs a down server nothing.
BACKOFF_MULTIPLIER_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 2.0
#: After the claim-ahead connection could not be opened, drains go without it this long.
AHEAD_RETRY_SECONDS = 60.0
#: The claim-ahead connection is closed once no drain has met a full batch for this long.
AHEAD_IDLE_SECONDS = 60.0
#: A listening reactor's work connections end a transaction idle this many Redis timeouts
#: (`--redis-timeout`): the claim's enqueue may take a few commands, each bounded by the timeout.
IDLE_IN_TRANSACTION_REDIS_TIMEOUTS = 3


def retry_pause(failures: int) -> float:
    """The pause after `failures` failures in a row: the same exponential backoff with full
    jitter as `backoff`'s retries, for a failed turn of the loop."""
    ceiling = min(BACKOFF_MAX_SECONDS, BACKOFF_MULTIPLIER_SECONDS * 2 ** min(failures, 8))
    return random.uniform(0.0, ceiling)


def backoff(
    kind: type[Exception],
    what: str,
    stopper: Stopper,
    health: HealthCheck,
    *,
    attempts: int | None = None,
) -> tenacity.Retrying:
    """Retry on `kind` with backoff until it succeeds, a stop is requested or (when given)
    `attempts` tries have failed, logging each retry and telling the health check."""

    def log_retry(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        health.failed(f"{what}: {exc}")
        logger.warning(
            "%s_retry attempt=%d next_in=%.2fs error=%s",
            what,
            state.attempt_number,
            state.upcoming_sleep,
            exc,
        )

    def pause(seconds: float) -> None:
        stopper.sleep(seconds)  # a stop ends the pause, and `stop` then ends the retries

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(kind),
        wait=tenacity.wait_random_exponential(
            multiplier=BACKOFF_MULTIPLIER_SECONDS, max=BACKOFF_MAX_SECONDS
        ),
        stop=lambda state: (
            stopper.requested or (attempts is not None and state.attempt_number >= attempts)
        ),
        sleep=pause,
        before_sleep=log_retry,
        reraise=True,
    )


class Sessions:
    """Owns the work connections and the listener; reopens them all when one fails."""

    def __init__(
        self,
        settings: ReactorSettings,
        liveness: RouteLiveness,
        stopper: Stopper,
        health: HealthCheck,
        metrics: Metrics,
    ) -> None:
        self._url = settings.database_url
        self._liveness = liveness
        self._stopper = stopper
        self._health = health
        self._metrics = metrics
        # Only a listening reactor is sure to have sessions of its own (no pooler between).
        self._idle_in_transaction = (
            IDLE_IN_TRANSACTION_REDIS_TIMEOUTS * settings.redis_timeout_seconds
            if settings.listen
            else None
        )
        self.listener = Listener(settings.database_url) if settings.listen else None
        self.work: db.Connection | None = None
        self.ahead: db.Connection | None = None
        self._ahead_retry_at = 0.0
        self._ahead_wanted_at = 0.0
        self._ahead_off_said = False

    def open_work(self) -> db.Connection:
        """A new work connection, holding the routes' liveness lock if they are registered.

        Raises:
            ConfigError: the URL is malformed, or our routes conflict with a running reactor's.
            DatabaseError: the server could not be reached.
        """
        conn = db.connect(
            self._url, purpose="work", idle_in_transaction_seconds=self._idle_in_transaction
        )
        try:
            self._liveness.hold_again(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def open_ahead(self) -> db.Connection:
        """A new claim-ahead connection.

        Raises:
            ConfigError: the URL is malformed.
            DatabaseError: the server could not be reached.
        """
        return db.connect(
            self._url, purpose="claim-ahead", idle_in_transaction_seconds=self._idle_in_transaction
        )

    def ok(self) -> bool:
        return self.work_ok() and self.listener_ok()

    def work_ok(self) -> bool:
        conn = self.work
        return conn is not None and not conn.closed and not conn.broken

    def claim_ahead(self) -> db.Connection | None:
        """The claim-ahead connection if it is open (`after_drain` opens and closes it)."""
        conn = self.ahead
        return conn if conn is not None and not conn.closed and not conn.broken else None

    def after_drain(self, full: bool) -> None:
        """Between drains, outside any transaction: open the claim-ahead connection after a
        drain that met a full batch (a backlog), and close it once no drain has met one for
        `AHEAD_IDLE_SECONDS`. It is opened only on a direct session to Postgres (behind a
        transaction pooler, two server connections per reactor could wait on each other);
        one that cannot be opened is said once a try, and tried again
        `AHEAD_RETRY_SECONDS` later."""
        now = time.monotonic()
        if not full:
            if self.ahead is not None and now - self._ahead_wanted_at > AHEAD_IDLE_SECONDS:
                self.ahead.close()
                self.ahead = None
            return
        self._ahead_wanted_at = now
        if self.claim_ahead() is not None or now < self._ahead_retry_at:
            return
        work = self.work
        try:
            if work is None or not db.direct_session(work):
                self._ahead_retry_at = now + AHEAD_RETRY_SECONDS
                if not self._ahead_off_said:
                    self._ahead_off_said = True
                    logger.info("claim_ahead_off reason=pooler (drains claim each batch in turn)")
                return
            self.ahead = self.open_ahead()
        except (ConfigError, DatabaseError, StatementError) as exc:
            self._ahead_retry_at = time.monotonic() + AHEAD_RETRY_SECONDS
            logger.warning(
                "claim_ahead_unavailable error=%s (drains claim each batch in turn; "
                "tried again in %gs)",
                exc,
                AHEAD_RETRY_SECONDS,
            )

    def listener_ok(self) -> bool:
        """Whether the listener is up (or there is none); the gauge and health say so too."""
        connected = self.listener is not None and self.listener.connected
        self._metrics.listener_connected.set(1 if connected else 0)
        self._health.listener_connected = connected
        return self.listener is None or connected

    def rollback_work(self) -> None:
        """Roll back whatever transaction a failed turn left open on the work connections (a
        claim's row locks are never kept); a connection that cannot roll back is dropped."""
        for conn in (self.work, self.ahead):
            if conn is not None and not conn.closed:
                db.abandon(conn)

    def drop(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for conn in (self.work, self.ahead):
            if conn is not None:
                conn.close()

    def arm_doorbell(self) -> ArmOutcome:
        """Take the doorbell keys on the listener's session (`Listener.lock_doorbell`)."""
        assert self.listener is not None  # poll-only reactors never arm
        outcome = self.listener.lock_doorbell()
        self._metrics.doorbell_arms.labels(outcome.value).inc()
        logger.debug("doorbell_arm outcome=%s", outcome.value)
        return outcome

    def disarm_doorbell(self) -> None:
        assert self.listener is not None
        self._metrics.doorbell_armed.set(0)
        self.listener.unlock_doorbell()
        logger.debug("doorbell_disarmed")

    def reconnect(self) -> None:
        """Reopen the listener and the work connection in one round (the caller dropped them),
        retrying with backoff until they are up (the claim-ahead one opens when wanted).

        Raises:
            DatabaseError: a stop was requested before the connections were up.
            ConfigError: a reactor that started meanwhile routes one of our types differently.
        """

        def connect_missing() -> None:
            if not self.work_ok():
                old, self.work = self.work, self.open_work()
                if old is not None:
                    old.close()
            if self.listener is not None and not self.listener.connected:
                self.listener.connect()

        backoff(DatabaseError, "reconnect", self._stopper, self._health)(connect_missing)
        self.listener_ok()
        logger.info("reconnected")
