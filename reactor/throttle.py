"""Caps on what outside input can multiply.

`LogThrottle`: warnings that outside input can multiply (junk job types, hostile HTTP clients,
notifications naming rows that do not exist) must not flood the log. `allow()` says whether
the next record may be written: at most `burst` per `interval_seconds`; the records held back
are counted, and `suppressed()` hands the count to the next record that gets through, so the
log still says how many there were.

`Budget`: a token bucket whose spending can be paid back, for work that is cheap when the
input is honest and must stay bounded when it is not (jobs enqueued for rows named by
notifications: a row that turns out real pays its token back).
"""

from __future__ import annotations

import threading
import time

__all__ = ["Budget", "LogThrottle"]


class LogThrottle:
    """At most `burst` records per `interval_seconds` (thread-safe)."""

    def __init__(self, burst: int, interval_seconds: float) -> None:
        self._burst = burst
        self._interval = interval_seconds
        self._lock = threading.Lock()
        self._window_start = -interval_seconds
        self._in_window = 0
        self._held_back = 0

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self._interval:
                self._window_start = now
                self._in_window = 0
            if self._in_window < self._burst:
                self._in_window += 1
                return True
            self._held_back += 1
            return False

    def suppressed(self) -> int:
        """How many records were held back since the last call (and reset the count)."""
        with self._lock:
            held, self._held_back = self._held_back, 0
            return held


class Budget:
    """At most `capacity` units at once, refilled at `refill_per_second`; units spent on
    input that proved honest are given back with `refund` (not thread-safe: one owner)."""

    def __init__(self, capacity: float, refill_per_second: float) -> None:
        self._capacity = capacity
        self._rate = refill_per_second
        self._level = capacity
        self._at = time.monotonic()

    def available(self) -> int:
        """Whole units that may be spent now."""
        now = time.monotonic()
        self._level = min(self._capacity, self._level + (now - self._at) * self._rate)
        self._at = now
        return int(self._level)

    def spend(self, units: int) -> None:
        self.available()
        self._level -= units

    def refund(self, units: int) -> None:
        self._level = min(self._capacity, self._level + units)
