"""How far back each claim reads its type's pending index: a low-water mark per type.

The claim (`queries.CLAIM_DUE`) walks the pending index of one type up to `now()`. Every row
that was ever `pending` leaves an entry there that only vacuum (or a scan that finds the row
dead to every session) clears, and neither can while some session holds a snapshot older than
the row's claim (a report, `pg_dump`, a session idle in a `REPEATABLE READ` transaction).
A claim over the whole range would then visit every entry left since that snapshot, and a
polling reactor's empty claims would cost more with every row dispatched.

So each type keeps a mark: the start of its latest claim that came back short (fewer rows
than the batch). Such a claim took every row of its type it could see that was due by its
start, but for rows another transaction had locked (`SKIP LOCKED`), rows refused (`skip`) and
every row of a paused type. The claims that follow (*bounded*) read only rows due from
`MARGIN_SECONDS` before that mark on (`window`: seconds back from the claim's own `now()`),
which leaves only the entries of the last moments to walk. A claim over the whole range
(*full*) runs right after a full claim that came back full (more rows may be waiting that only
it reads), and whenever the type's last full claim is `FULL_EVERY_SECONDS` old: the interval
stretches to `FULL_SHARE` times the last full claim's duration while that walk is slow (an
old snapshot held), at most `FULL_EVERY_MAX_SECONDS`, so full claims take about 1 % of the
reactor's time. The loop wakes for it (`full_claim_due`) when it would sleep past it.

Which rows a bounded claim can miss: a due row whose due time (`coalesce(next_retry_at,
created_at)`) is more than `MARGIN_SECONDS` older than the start of the type's latest short
claim before it, and which that claim did not take. Those are:
- rows committed after that claim began by a transaction whose `now()` (the `created_at` of
  an insert, the `next_retry_at` of a re-arm or a requeue) was more than `MARGIN_SECONDS`
  older than the claim: a writer transaction open that long before its commit;
- rows submitted with a `run_at` that far in the past, and retries whose worker transaction
  lasted longer than the backoff plus the margin;
- rows that claim saw but skipped: locked by another transaction (another reactor's claim
  that then rolled back, a `submit()` of a photo whose row was pending, holding its lock),
  refused, or of a type paused then.
Each of them is claimed by the type's next full claims (one batch after another, with no
interval between them while they come back full): at most `FULL_EVERY_SECONDS` (1 s)
after the type's previous full claim, up to `FULL_EVERY_MAX_SECONDS` (10 s) while full claims
are slow, once the reactor is dispatching (a drain that fails forgets every mark: the
claims after it are full). Every other guarantee of the claim stands: a bounded claim is the
same statement with a lower bound on the due time.

Used by the reactor's loop thread alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = [
    "FULL_EVERY_MAX_SECONDS",
    "FULL_EVERY_SECONDS",
    "FULL_SHARE",
    "MARGIN_SECONDS",
    "ClaimBounds",
]

#: A bounded claim reads rows due from this long before the type's mark on.
MARGIN_SECONDS = 1.0
#: A full claim of a type runs when its last one is this old...
FULL_EVERY_SECONDS = 1.0
#: ... or this many times its duration, while full claims are slow ...
FULL_SHARE = 100.0
#: ... but never further apart than this.
FULL_EVERY_MAX_SECONDS = 10.0


@dataclass
class _Type:
    #: Monotonic start of the latest claim that came back short (None: none since a reset).
    mark: float | None = None
    #: Monotonic start of the latest full claim, and how long it took.
    full_at: float = 0.0
    full_seconds: float = 0.0
    #: A bounded claim ran since the latest full claim (a full one is owed).
    owed: bool = False


class ClaimBounds:
    """The low-water marks of the types a dispatcher claims, and when full claims are due."""

    def __init__(self) -> None:
        self._types: dict[str, _Type] = {}

    def window(self, job_type: str, now: float) -> float | None:
        """The `window` of a claim of `job_type` starting at monotonic `now`: seconds back
        from the claim's `now()` that it reads, or None for a full claim."""
        state = self._types.get(job_type)
        if state is None or state.mark is None:
            return None
        if now >= state.full_at + _interval(state.full_seconds):
            return None
        state.owed = True
        return max(0.0, now - state.mark) + MARGIN_SECONDS

    def claimed(
        self,
        job_type: str,
        started: float,
        window: float | None,
        short: bool,
        seconds: float | None = None,
    ) -> None:
        """A claim of `job_type` with `window` (None: full) that began at monotonic `started`
        came back now, `short`: with fewer rows than its batch (its start is then the mark;
        when it retried without refused rows, its first try's start, which is earlier).
        `seconds` is what the claim cost the reactor, when that is not the time since
        `started` (a claim sent ahead: only the wait for its rows)."""
        if seconds is None:
            seconds = time.monotonic() - started
        state = self._types.setdefault(job_type, _Type())
        if window is None:
            # A full claim that came back full may have left more rows only a full claim
            # reads (a bulk insert committed late): the type's next claim is full too.
            state.full_at = started if short else -math.inf
            state.full_seconds, state.owed = seconds, False
        if short and (state.mark is None or started > state.mark):
            state.mark = started

    def forget(self, job_type: str) -> None:
        """Forget the mark of `job_type` (quarantined: it owes no full claim meanwhile)."""
        self._types.pop(job_type, None)

    def reset(self) -> None:
        """Forget every mark (a drain failed: its rows may be pending again below them)."""
        self._types.clear()

    def full_claim_due(self) -> float | None:
        """Monotonic time by which some type owes a full claim (None: none is owed)."""
        owed = [s.full_at + _interval(s.full_seconds) for s in self._types.values() if s.owed]
        return min(owed, default=None)


def _interval(full_seconds: float) -> float:
    return min(FULL_EVERY_MAX_SECONDS, max(FULL_EVERY_SECONDS, FULL_SHARE * full_seconds))
