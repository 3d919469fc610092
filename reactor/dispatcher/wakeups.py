"""What the notifications a reactor hears ask of it: the payloads parsed into routed types and
named rows, and the short gap that makes a flood of hints cost one drain, not one each.

A payload is a hint, never an order (anyone who can connect may NOTIFY): `TYPE` asks for a
drain of the type, `TYPE PHOTO_ID` names a row (its first attempt, at token 1). Names are kept
only up to the room the caller gives (the named-row budget, `reactor.dispatcher.named`); the
types of any more are drained instead. Payloads of types this reactor does not route are
ignored and logged a few times a minute at most, and at most `MAX_REMEMBERED_UNKNOWN` of them
are remembered, whatever a sender writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from reactor.jobs import JobRef
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

    def parse(self, payloads: list[str], room: int) -> tuple[set[str], list[JobRef]]:
        """The routed types named alone, and the routed rows named one by one (their first
        attempts, at most `room`; the types of any more count as named alone), in `payloads`
        (the forms are in sql/0010)."""
        types = set()
        rows: dict[tuple[str, str], JobRef] = {}
        for payload in payloads:
            job_type, by_row, photo_id = payload.partition(" ")
            if job_type in self._routes:
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
            self._ignored(payload, job_type if by_row and job_type not in self._routes else payload)
        return types, list(rows.values())

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
