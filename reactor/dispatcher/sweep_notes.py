"""What the sweep tells the log once, not every round: unrouted types and unreadable Redis keys.

A pending row of a type no route covers is left alone, and a Redis key of the wrong type at a
job id or a queue (`SET rq:job:<id> junk`) leaves its row alone; both may stay so for many
sweeps. Each type or key is logged the first time it is seen, with bounded memory (names are
remembered up to `MAX_REMEMBERED`) and a bounded log (a few unrouted types by name per sweep,
the rest in one summary line at most every `UNROUTED_SUMMARY_SECONDS`): junk types or keys
cannot flood either.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Mapping, Sequence

from reactor.throttle import LogThrottle

__all__ = ["MAX_UNROUTED_REPORTED", "SweepNotes"]

logger = logging.getLogger("reactor.dispatcher.sweep")

#: Names remembered (so each is logged once), unrouted types logged by name per sweep, and
#: listed in a sweep's result.
MAX_REMEMBERED = 1000
MAX_UNROUTED_LOGGED = 10
MAX_UNROUTED_REPORTED = 100
#: The line about unrouted types not named is written at most this often.
UNROUTED_SUMMARY_SECONDS = 600.0


class SweepNotes:
    """The names already logged, per kind."""

    def __init__(self) -> None:
        self._unrouted: set[str] = set()
        self._unrouted_log = LogThrottle(burst=1, interval_seconds=UNROUTED_SUMMARY_SECONDS)
        self._keys: set[str] = set()

    def unrouted(self, pending_types: Sequence[str], routes: Container[str]) -> list[str]:
        """The types of `pending_types` with no route (the first `MAX_UNROUTED_REPORTED`);
        those not seen before are logged."""
        unrouted = [t for t in pending_types if t not in routes]
        new = [t for t in unrouted if t not in self._unrouted]
        room = max(0, MAX_REMEMBERED - len(self._unrouted))
        self._unrouted.update(new[:room])
        named = new[: min(room, MAX_UNROUTED_LOGGED)]
        for job_type in named:
            logger.warning("unrouted_type type=%s (its pending rows are left alone)", job_type)
        if len(new) > len(named) and self._unrouted_log.allow():
            logger.warning(
                "unrouted_types count=%d not_named=%d (their pending rows are left alone)",
                len(unrouted),
                len(new) - len(named),
            )
        return unrouted[:MAX_UNROUTED_REPORTED]

    def unreadable(self, keys: Mapping[str, str]) -> None:
        """Log the keys (key -> error) not logged before."""
        for key, error in keys.items():
            if key in self._keys:
                continue
            if len(self._keys) < MAX_REMEMBERED:
                self._keys.add(key)
            logger.error(
                "redis_key_unreadable key=%s error=%s (its row is left alone; the rest of the "
                "pass goes on)",
                key,
                error,
            )
