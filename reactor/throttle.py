"""A cap on what outside input can multiply: log records.

`LogThrottle`: warnings that outside input can multiply (junk job types, hostile HTTP
clients, notifications of unknown types, the errors of a failing loop) must not flood the log.
`allow()` says whether the next record may be written: at most `burst` per
`interval_seconds`; the records held back are counted, and `suppressed()` hands the count to
the next record that gets through, so the log still says how many there were.
"""

from __future__ import annotations

import threading
import time

__all__ = ["LogThrottle"]


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
