"""What the notifications a reactor hears ask of it: the routed types to drain, and the short
gap that makes a flood of hints cost one drain, not one each.

A payload is a hint, never an order (anyone who can connect may NOTIFY): `TYPE` asks for a
drain of the type, and nothing else. The triggers of earlier releases sent `TYPE PHOTO_ID` for
the rows of small inserts; such a payload is read as `TYPE` (a row is only ever dispatched by
the claim of a drain, so a name of a row that does not exist costs one claim that finds
nothing). Payloads of types this reactor does not route are ignored and logged a few times a
minute at most, and at most `MAX_REMEMBERED_UNKNOWN` of them are remembered, whatever a sender
writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from reactor.routes import Route
from reactor.throttle import LogThrottle

__all__ = ["HINT_DRAIN_GAP_SECONDS", "MAX_REMEMBERED_UNKNOWN", "Wakeups"]

logger = logging.getLogger(__name__)

#: After a drain for notified types found nothing, drain notified types again only this much
#: later (a row's notification waits at most this long, and only during a flood of hints).
HINT_DRAIN_GAP_SECONDS = 0.01
#: Payloads of unrouted types (or garbage) remembered, so each is logged once.
MAX_REMEMBERED_UNKNOWN = 1000
#: Characters of an ignored payload shown in the log.
_SHOWN_PAYLOAD_CHARS = 200


class Wakeups:
    """Parses payloads for one reactor's routes and holds notified types during the gap."""

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self._routes = routes
        self._warned_unknown: set[str] = set()
        self._ignored_log = LogThrottle(burst=10, interval_seconds=60.0)
        #: Notified types held until the gap ends, and when it ends.
        self.held: set[str] = set()
        self._gap_ends = 0.0

    def parse(self, payloads: list[str]) -> set[str]:
        """The routed types that `payloads` ask to drain (`TYPE`, or an old trigger's
        `TYPE PHOTO_ID`: a type has no spaces, so the first space ends it)."""
        types = set()
        for payload in payloads:
            job_type = payload.partition(" ")[0]
            if job_type in self._routes:
                types.add(job_type)
            else:
                # Old payloads of a type routed elsewhere are reported by their type, once.
                self._ignored(payload, job_type if " " in payload else payload)
        return types

    def _ignored(self, payload: str, unknown: str) -> None:
        if unknown in self._warned_unknown or len(self._warned_unknown) >= MAX_REMEMBERED_UNKNOWN:
            return
        self._warned_unknown.add(unknown)
        if self._ignored_log.allow():
            logger.warning(
                "notification_ignored payload=%r (no route) suppressed=%d",
                payload[:_SHOWN_PAYLOAD_CHARS],
                self._ignored_log.suppressed(),
            )

    def to_drain(self, types: set[str]) -> set[str]:
        """The notified types to drain now: none while the gap lasts (they are held), all
        held ones once it is over."""
        if time.monotonic() < self._gap_ends:
            self.held |= types
            return set()
        types |= self.held
        self.held = set()
        return types

    def found_nothing(self) -> None:
        """A hinted drain claimed nothing (a NOTIFY flood costs a claim each): the next hints
        wait for the gap and are drained together."""
        self._gap_ends = time.monotonic() + HINT_DRAIN_GAP_SECONDS

    @property
    def gap_ends(self) -> float | None:
        """When held types are due (None: none held)."""
        return self._gap_ends if self.held else None
