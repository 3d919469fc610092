"""The adaptive doorbell: when the reactor asks writers to NOTIFY, and when it polls instead.

The triggers of sql/0004 notify only while some reactor holds (or is queued for) the doorbell
advisory keys in exclusive mode; a writer that finds its key free takes it in shared mode for
the rest of its transaction and sends nothing. Sending NOTIFY serialises committing writers
(a cluster-wide lock held through the commit's WAL flush), so under load the reactor keeps the
bell silent and polls; when the table goes quiet it arms the bell and sleeps. Modes:

- adaptive (default): after a wake-up, drain, then poll again every `POLL_PAUSE_SECONDS`
  while rows keep coming. After `QUIET_DRAINS` empty drains in a row, arm: take every key
  (waiting a little for writers in flight: every writer that skipped NOTIFY holds its key in
  shared mode until its transaction ends, so once all keys are granted their rows are
  committed and visible), drain once more, then wait for a notification. On a notification,
  drain the notified types and stay armed, unless notifications come fast (`BUSY_RINGS`
  within `BUSY_RING_WINDOW_SECONDS`: the rate at which NOTIFY's commit lock starts to cost
  writers): then drain, release the keys, and poll again. (Draining first keeps the
  release's round trip off the dispatch latency; writers that commit during that drain
  still notify, which costs them little because the drain is short.) A few notifications a
  second thus cost one round trip each, with no release, polls and re-arm between them.
- plain: take the keys and keep them; writers always notify (the behaviour of sql/0003).
- poll-only: no LISTEN connection, no keys; a drain of every type starts once per poll
  interval (counted from the start of the previous one, so a slow drain does not stretch the
  wait of the rows committed during it).

Guarantee (with the sweep disabled): a committed pending row is drained by a reactor without
waiting for the sweep. Either its writer notified (every listener hears it), or the writer held
a key in shared mode, and then every reactor is polling, or arms after that writer's commit
and drains after arming. A reactor that finds the keys held by another reactor only listens
and tries again every `RECHECK_SECONDS`, which bounds the extra delay if that reactor dies
silently while armed; any notification sends it back to polling, because the holder releases
the keys when it has drained.

This module only decides: `Doorbell` runs no SQL, records no metric and reads no clock. Its
methods take what happened (and the monotonic time `now`) and say what to do; the loop
(`reactor.dispatcher.loop`) does it on the LISTEN connection
(`reactor.dispatcher.listener.Listener` takes and releases the keys, in the LISTEN session,
so a lost listener connection releases them too) and reports back:

    should_arm(now)              take the keys now? then report arm_result(outcome, now),
                                 which says DRAIN (every type, now) after ARMED
    wait_seconds(now)            how long the loop may wait (None: until a notification)
    rung(routed, now, count)     `count` notifications arrived
    should_poll()                after the wait, with nothing else to do: drain every type?
    drained(claimed, ...)        a drain ended; says RELEASE when the keys must go back now
    lost()                       the LISTEN connection (and the keys with it) is gone

`arm_outcome()` reads the outcome of a failed arm from who holds the keys.
"""

from __future__ import annotations

import enum
from collections import deque

__all__ = [
    "ARM_BACKOFF_MAX_SECONDS",
    "ARM_BACKOFF_SECONDS",
    "BUSY_POLL_PAUSE_MAX_SECONDS",
    "BUSY_RINGS",
    "BUSY_RING_WINDOW_SECONDS",
    "POLL_PAUSE_SECONDS",
    "QUIET_DRAINS",
    "RECHECK_SECONDS",
    "Action",
    "ArmOutcome",
    "Doorbell",
    "DoorbellMode",
    "arm_outcome",
]

#: Pause between polls while rows keep coming (adaptive and plain-but-not-armed).
POLL_PAUSE_SECONDS = 0.001
#: Empty drains in a row before an adaptive reactor arms the bell.
QUIET_DRAINS = 3
#: How often a reactor that found the lock held by another reactor tries again.
RECHECK_SECONDS = 0.5
#: After failed arms in a row (writers in flight kept a key), the next arm waits, doubling
#: from the first to the last value, and polls slow down up to the poll cap meanwhile (a
#: session that holds a key for long must not keep the reactor arming and polling flat out).
ARM_BACKOFF_SECONDS = 0.01
ARM_BACKOFF_MAX_SECONDS = 1.0
BUSY_POLL_PAUSE_MAX_SECONDS = 0.01
#: An armed adaptive reactor gives the keys back (writers stop notifying, it polls) once it
#: has heard this many notifications within the window: about 400 a second.
BUSY_RINGS = 4
BUSY_RING_WINDOW_SECONDS = 0.01


class DoorbellMode(str, enum.Enum):
    """How the reactor gets woken up (`--doorbell`)."""

    ADAPTIVE = "adaptive"
    PLAIN = "plain"
    POLL_ONLY = "poll-only"


class ArmOutcome(str, enum.Enum):
    #: This session holds the lock: writers notify from now on.
    ARMED = "armed"
    #: Another session (another reactor) holds it in exclusive mode: writers notify already.
    HELD_ELSEWHERE = "held_elsewhere"
    #: Writers in flight kept it past the lock timeout: nobody is armed, keep polling.
    BUSY = "busy"


class Action(enum.Enum):
    """What the loop must do after reporting to the doorbell."""

    #: Nothing beyond what it was doing.
    NOTHING = "nothing"
    #: Drain every type now: the keys were just taken, so every writer that skipped NOTIFY
    #: has ended and its rows are visible.
    DRAIN = "drain"
    #: Give the keys back now (writers skip NOTIFY again).
    RELEASE = "release"


def arm_outcome(held_here: int, held_elsewhere: bool, stripes: int) -> ArmOutcome:
    """The outcome of an arm whose lock request timed out, from who holds the keys now:
    `held_here` keys of `stripes` by this session; `held_elsewhere`, all of them by one other
    session (an armed reactor; a session holding only some is a writer in flight, or any role
    squatting on a key, and polling goes on). (The timeout can fire just as the last key is
    granted: then this session holds them all.)"""
    if held_here == stripes:
        return ArmOutcome.ARMED
    return ArmOutcome.HELD_ELSEWHERE if held_elsewhere else ArmOutcome.BUSY


class Doorbell:
    """The state of one reactor's doorbell: armed, polling, or listening while another is armed."""

    def __init__(
        self, mode: DoorbellMode, *, poll_interval_seconds: float = POLL_PAUSE_SECONDS
    ) -> None:
        self.mode = mode
        self._pause = (
            poll_interval_seconds if mode is DoorbellMode.POLL_ONLY else POLL_PAUSE_SECONDS
        )
        #: This reactor holds the keys (writers notify).
        self.armed = False
        #: The loop drains every type when nothing else woke it (`should_poll`).
        self.polling = True
        self._empty = 0  # empty drains in a row
        self._recheck_at: float | None = None  # the keys are held elsewhere: try again then
        self._release_after_drain = False
        self._busy = 0  # failed arms in a row
        self._arm_after = 0.0
        self._last_full_drain: float | None = None  # start of the last drain of every type
        self._rings: deque[float] = deque(maxlen=BUSY_RINGS)  # when the last ones came, armed

    # -- what the loop asks --------------------------------------------------------------------

    def should_arm(self, now: float) -> bool:
        """Whether to take the keys now (then report the outcome to `arm_result`)."""
        if self.armed or self.mode is DoorbellMode.POLL_ONLY:
            return False
        if self._recheck_at is not None:
            return now >= self._recheck_at
        if now < self._arm_after:
            return False
        return self.mode is DoorbellMode.PLAIN or self._empty >= QUIET_DRAINS

    def wait_seconds(self, now: float) -> float | None:
        """How long the loop may wait before the doorbell needs it again (None: until a
        notification)."""
        if self.mode is DoorbellMode.POLL_ONLY:
            if self._last_full_drain is None:
                return 0.0
            return max(0.0, self._last_full_drain + self._pause - now)
        if self.polling:
            if self._busy:
                return min(BUSY_POLL_PAUSE_MAX_SECONDS, self._pause * (1 << min(self._busy, 16)))
            return self._pause
        if self._recheck_at is not None:
            return max(0.0, self._recheck_at - now)
        return None

    def should_poll(self) -> bool:
        """Whether a wait that ended with nothing else to do calls for a drain of every type."""
        return self.polling

    # -- what the loop reports -------------------------------------------------------------------

    def arm_result(self, outcome: ArmOutcome, now: float) -> Action:
        """An arm attempt that started at `now` ended with `outcome`. Returns DRAIN after
        ARMED, else NOTHING."""
        self._empty = 0
        if outcome is ArmOutcome.BUSY:
            self._busy += 1
            self._arm_after = now + min(
                ARM_BACKOFF_MAX_SECONDS, ARM_BACKOFF_SECONDS * 2 ** (self._busy - 1)
            )
        else:
            self._busy = 0
        if outcome is ArmOutcome.ARMED:
            self._rings.clear()
            self.armed = True
            self.polling = False
            self._recheck_at = None
            return Action.DRAIN
        if outcome is ArmOutcome.HELD_ELSEWHERE:
            self.polling = False
            self._recheck_at = now + RECHECK_SECONDS
        else:
            self.polling = True
            self._recheck_at = None
        return Action.NOTHING

    def rung(self, routed: bool, now: float, count: int = 1) -> None:
        """`count` notifications arrived at `now` (`routed`: one names a type this reactor
        dispatches)."""
        if self.armed:
            if routed and self.mode is DoorbellMode.ADAPTIVE:
                self._rings.extend([now] * min(count, BUSY_RINGS))
                busy = (
                    len(self._rings) == BUSY_RINGS
                    and now - self._rings[0] <= BUSY_RING_WINDOW_SECONDS
                )
                if busy:
                    # Release once drained: writers after that point skip NOTIFY, and the
                    # polling that follows sees their rows.
                    self._rings.clear()
                    self._release_after_drain = True
                    self.polling = True
                    self._empty = 0
            return
        if self._recheck_at is not None:
            # The holder is being woken too and will release the lock: poll until quiet.
            self._recheck_at = None
            self.polling = True
            self._empty = 0

    def drained(self, claimed: int, *, started: float, every_type: bool) -> Action:
        """A drain (of any kind) that started at `started` claimed `claimed` rows;
        `every_type`: it covered every routed type (not only notified ones). Returns RELEASE
        when the keys must go back now (this reactor is no longer armed), else NOTHING."""
        if every_type:
            self._last_full_drain = started
        if self._release_after_drain and claimed == 0 and self.armed:
            # The hint found nothing (another reactor took the rows, or a stray NOTIFY): no
            # load to spare writers from, so stay armed rather than poll and re-arm.
            self._release_after_drain = False
            self.polling = False
            return Action.NOTHING
        if claimed:
            self._busy = 0  # rows are coming: poll at full speed
        action = Action.NOTHING
        # Notifications came fast: stop ringing and poll. Rows found by a drain of every type
        # (right after arming, a full claim, a row come due) are no such sign: a writer every
        # few ms leaves one there, and releasing for it made the reactor poll and re-arm.
        if self._release_after_drain:
            self._release_after_drain = False
            self.armed = False
            self.polling = True
            action = Action.RELEASE
        self._empty = self._empty + 1 if claimed == 0 else 0
        return action

    def lost(self) -> None:
        """The LISTEN connection was lost (and the keys with its session): poll, re-arm later."""
        self.armed = False
        self.polling = True
        self._empty = 0
        self._recheck_at = None
        self._release_after_drain = False
        self._busy = 0
        self._arm_after = 0.0
        self._rings.clear()
