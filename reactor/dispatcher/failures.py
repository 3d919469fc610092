"""What the loop does with a turn that failed, whatever failed: count it, tell the health check,
log it at most once a minute per event (with how many were held back), and pause with backoff.

Guarantee: a failure that repeats every turn costs one log record a minute and a pause of up to
`BACKOFF_MAX_SECONDS` between tries (the backoff of `reactor.dispatcher.sessions`), never a
spinning loop or a flooded log. Rolling the turn back is the caller's (it owns the sessions).
"""

from __future__ import annotations

import logging

from reactor.dispatcher.metrics import HealthCheck, Metrics
from reactor.dispatcher.sessions import retry_pause
from reactor.errors import DatabaseError, RedisUnavailableError, StatementError
from reactor.redact import redact
from reactor.signals import Stopper
from reactor.throttle import LogThrottle

__all__ = ["FAILURE_LOG_SECONDS", "TurnFailures"]

logger = logging.getLogger("reactor.dispatcher.loop")

#: A failed turn is logged at most once this often (per event), with how many were not.
FAILURE_LOG_SECONDS = 60.0
#: The metric's kind and the log's event of the project's own errors.
_KINDS: dict[type[BaseException], tuple[str, str]] = {
    DatabaseError: ("connection", "connection_lost"),
    StatementError: ("statement", "loop_failed"),
    RedisUnavailableError: ("redis", "turn_failed"),
}


class TurnFailures:
    """Counts, reports and paces the loop's failed turns."""

    def __init__(self, metrics: Metrics, health: HealthCheck, stopper: Stopper) -> None:
        self._metrics = metrics
        self._health = health
        self._stopper = stopper
        self._logs: dict[str, LogThrottle] = {}

    def failed(self, exc: BaseException) -> None:
        """A turn failed with `exc`; returns after the pause. The metric's kind and the log's
        event: `connection`/`connection_lost` (Postgres unavailable), `statement`/
        `loop_failed`, `redis`/`turn_failed`, else the exception's class/`turn_failed`."""
        kind, event = next(
            (named for cls, named in _KINDS.items() if isinstance(exc, cls)),
            (type(exc).__name__, "turn_failed"),
        )
        self._metrics.turn_failures.labels(kind).inc()
        ours = isinstance(exc, (DatabaseError, StatementError))
        text = str(exc) if ours else f"{type(exc).__name__}: {redact(str(exc))}"
        self._health.failed(text)
        throttle = self._logs.setdefault(event, LogThrottle(1, FAILURE_LOG_SECONDS))
        if throttle.allow():
            logger.log(
                logging.WARNING if event == "connection_lost" else logging.ERROR,
                "%s error=%s repeated=%d (rolled back; retried with backoff)",
                event,
                text,
                throttle.suppressed(),
                exc_info=exc if logger.isEnabledFor(logging.DEBUG) else None,
            )
        self._stopper.sleep(retry_pause(self._health.failures))
