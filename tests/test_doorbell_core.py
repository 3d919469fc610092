"""The doorbell's decisions (reactor/dispatcher/doorbell.py), without servers: what `Doorbell` says to
do after each thing the loop reports. Times are plain numbers: the core reads no clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reactor.dispatcher.doorbell import (
    ARM_BACKOFF_MAX_SECONDS,
    ARM_BACKOFF_SECONDS,
    BUSY_POLL_PAUSE_MAX_SECONDS,
    BUSY_RING_WINDOW_SECONDS,
    BUSY_RINGS,
    POLL_PAUSE_SECONDS,
    QUIET_DRAINS,
    RECHECK_SECONDS,
    Action,
    ArmOutcome,
    Doorbell,
    DoorbellMode,
    arm_outcome,
)


def quiet(bell: Doorbell, now: float, drains: int = QUIET_DRAINS) -> None:
    """Report `drains` drains of every type that found nothing."""
    for _ in range(drains):
        assert bell.drained(0, started=now, every_type=True) is Action.NOTHING


def ring_fast(bell: Doorbell, now: float) -> None:
    """Report notifications coming as fast as the bell gives its keys back for: `BUSY_RINGS`
    within the window, the last at `now`."""
    step = BUSY_RING_WINDOW_SECONDS / BUSY_RINGS
    for i in range(BUSY_RINGS):
        bell.rung(routed=True, now=now - (BUSY_RINGS - 1 - i) * step)


def armed(mode: DoorbellMode = DoorbellMode.ADAPTIVE, now: float = 0.0) -> Doorbell:
    """A doorbell that has armed, and whose drain after arming found nothing."""
    bell = Doorbell(mode)
    quiet(bell, now)
    assert bell.should_arm(now)
    assert bell.arm_result(ArmOutcome.ARMED, now) is Action.DRAIN
    assert bell.drained(0, started=now, every_type=True) is Action.NOTHING
    return bell


def test_quiet_drains_arm_the_adaptive_bell_and_a_drain_that_finds_rows_starts_over() -> None:
    bell = Doorbell(DoorbellMode.ADAPTIVE)
    assert bell.polling and not bell.armed
    assert bell.wait_seconds(0.0) == POLL_PAUSE_SECONDS
    quiet(bell, 0.0, QUIET_DRAINS - 1)
    assert not bell.should_arm(0.0)
    assert bell.drained(5, started=0.0, every_type=True) is Action.NOTHING  # rows are coming
    quiet(bell, 0.0, QUIET_DRAINS - 1)
    assert not bell.should_arm(0.0)
    quiet(bell, 0.0, 1)
    assert bell.should_arm(0.0)


def test_an_arm_calls_for_a_drain_then_the_bell_waits_for_a_notification() -> None:
    bell = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(bell, 0.0)
    assert bell.arm_result(ArmOutcome.ARMED, 0.0) is Action.DRAIN
    assert bell.armed and not bell.polling
    assert bell.drained(0, started=0.0, every_type=True) is Action.NOTHING
    assert bell.wait_seconds(100.0) is None  # indefinitely
    assert not bell.should_poll()
    assert not bell.should_arm(100.0)


def test_rows_found_by_a_drain_of_every_type_keep_the_bell_armed() -> None:
    # Right after arming, or by a full claim or a row come due: only the notifications' rate
    # sends an armed adaptive reactor back to polling.
    adaptive = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(adaptive, 0.0)
    adaptive.arm_result(ArmOutcome.ARMED, 0.0)
    assert adaptive.drained(3, started=0.0, every_type=True) is Action.NOTHING
    assert adaptive.drained(1, started=1.0, every_type=True) is Action.NOTHING
    assert adaptive.armed and not adaptive.polling

    plain = Doorbell(DoorbellMode.PLAIN)
    assert plain.should_arm(0.0)  # no quiet drains needed
    plain.arm_result(ArmOutcome.ARMED, 0.0)
    assert plain.drained(3, started=0.0, every_type=True) is Action.NOTHING
    assert plain.armed


def test_notifications_a_few_ms_apart_keep_the_bell_armed_and_need_no_poll() -> None:
    bell = armed()
    apart = BUSY_RING_WINDOW_SECONDS / (BUSY_RINGS - 1) * 1.01  # just slower than "fast"
    for i in range(20):
        now = 1.0 + i * apart
        bell.rung(routed=True, now=now)
        assert not bell.should_poll()
        assert bell.drained(1, started=now, every_type=False) is Action.NOTHING
        assert bell.armed and bell.wait_seconds(now) is None
    # Several in one read count as several.
    bell.rung(routed=True, now=5.0, count=BUSY_RINGS)
    assert bell.drained(4, started=5.0, every_type=False) is Action.RELEASE


def test_notifications_coming_fast_while_armed_mean_drain_then_release_then_poll() -> None:
    bell = armed()
    ring_fast(bell, 1.0)
    assert bell.armed, "the keys are given back after the drain, not before"
    assert bell.should_poll()
    assert bell.drained(1, started=1.0, every_type=False) is Action.RELEASE
    assert not bell.armed and bell.polling
    assert bell.wait_seconds(1.0) == POLL_PAUSE_SECONDS
    # Polling until the table is quiet again, then it re-arms.
    quiet(bell, 1.0, QUIET_DRAINS - 1)
    assert not bell.should_arm(1.0)
    quiet(bell, 1.0, 1)
    assert bell.should_arm(1.0)


def test_a_notification_whose_drain_finds_nothing_keeps_the_bell_armed() -> None:
    bell = armed()
    ring_fast(bell, 1.0)
    assert bell.drained(0, started=1.0, every_type=False) is Action.NOTHING
    assert bell.armed and not bell.polling
    assert bell.wait_seconds(1.0) is None


def test_an_unrouted_notification_changes_nothing_and_a_plain_bell_stays_armed() -> None:
    bell = armed()
    bell.rung(routed=False, now=1.0)
    assert bell.armed and not bell.should_poll()
    plain = armed(DoorbellMode.PLAIN)
    ring_fast(plain, 1.0)
    assert not plain.should_poll()
    assert plain.drained(4, started=1.0, every_type=False) is Action.NOTHING
    assert plain.armed


def test_poll_only_starts_a_drain_of_every_type_once_per_interval_from_the_last_start() -> None:
    bell = Doorbell(DoorbellMode.POLL_ONLY, poll_interval_seconds=1.0)
    assert bell.wait_seconds(0.0) == 0.0  # no drain yet: now
    assert bell.should_poll()
    assert not bell.should_arm(0.0)
    # A slow drain: started at 10.0, reported at 10.9. The next starts at 11.0, not 11.9.
    bell.drained(0, started=10.0, every_type=True)
    assert bell.wait_seconds(10.9) == pytest.approx(0.1)
    assert bell.wait_seconds(11.5) == 0.0  # overdue: at once
    # A drain of some types only does not move the cadence.
    bell.drained(7, started=10.5, every_type=False)
    assert bell.wait_seconds(10.9) == pytest.approx(0.1)
    # Any drain of every type does (a sweep's, a due row's).
    bell.drained(0, started=10.6, every_type=True)
    assert bell.wait_seconds(10.9) == pytest.approx(0.7)
    # It never arms, and always polls.
    quiet(bell, 12.0, QUIET_DRAINS * 2)
    assert not bell.should_arm(12.0) and bell.should_poll() and not bell.armed


def test_busy_arms_back_off_doubling_up_to_the_cap_and_rows_reset_the_backoff() -> None:
    bell = Doorbell(DoorbellMode.PLAIN)  # arms whenever allowed: only the backoff holds it
    now, expected_waits = 0.0, []
    for busy in range(1, 10):
        assert bell.should_arm(now)
        assert bell.arm_result(ArmOutcome.BUSY, now) is Action.NOTHING
        assert bell.polling and not bell.armed
        backoff = min(ARM_BACKOFF_MAX_SECONDS, ARM_BACKOFF_SECONDS * 2 ** (busy - 1))
        expected_waits.append(backoff)
        assert not bell.should_arm(now + backoff - 1e-6)
        # Meanwhile polls slow down, up to their cap.
        assert bell.wait_seconds(now) == min(
            BUSY_POLL_PAUSE_MAX_SECONDS, POLL_PAUSE_SECONDS * 2**busy
        )
        now += backoff
    assert expected_waits[-1] == ARM_BACKOFF_MAX_SECONDS
    # Rows are coming: poll at full speed again (the arm backoff already ran out).
    bell.drained(2, started=now, every_type=True)
    assert bell.wait_seconds(now) == POLL_PAUSE_SECONDS
    # Any other outcome resets the backoff too.
    bell.arm_result(ArmOutcome.BUSY, now)
    assert bell.wait_seconds(now) == 2 * POLL_PAUSE_SECONDS
    bell.arm_result(ArmOutcome.HELD_ELSEWHERE, now)
    bell.rung(routed=True, now=1.0)
    assert bell.wait_seconds(now) == POLL_PAUSE_SECONDS


def test_an_adaptive_bell_needs_quiet_drains_again_after_a_busy_arm() -> None:
    bell = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(bell, 0.0)
    bell.arm_result(ArmOutcome.BUSY, 0.0)
    quiet(bell, 0.0, QUIET_DRAINS)
    assert not bell.should_arm(ARM_BACKOFF_SECONDS - 1e-6)
    assert bell.should_arm(ARM_BACKOFF_SECONDS)


def test_keys_held_elsewhere_mean_listen_and_recheck_and_a_notification_means_poll() -> None:
    bell = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(bell, 0.0)
    assert bell.arm_result(ArmOutcome.HELD_ELSEWHERE, 5.0) is Action.NOTHING
    assert not bell.armed and not bell.should_poll()
    assert bell.wait_seconds(5.0) == RECHECK_SECONDS
    assert bell.wait_seconds(5.0 + RECHECK_SECONDS / 2) == pytest.approx(RECHECK_SECONDS / 2)
    assert not bell.should_arm(5.0 + RECHECK_SECONDS - 1e-6)
    assert bell.should_arm(5.0 + RECHECK_SECONDS)  # no quiet drains needed to recheck
    bell.arm_result(ArmOutcome.HELD_ELSEWHERE, 5.0 + RECHECK_SECONDS)
    # The holder is woken too and will release: poll until quiet, then arm.
    bell.rung(routed=False, now=1.0)
    assert bell.should_poll()
    assert bell.wait_seconds(6.0) == POLL_PAUSE_SECONDS
    assert not bell.should_arm(100.0)
    quiet(bell, 6.0)
    assert bell.should_arm(6.0)


def test_a_lost_connection_resets_everything_to_polling() -> None:
    bell = armed()
    ring_fast(bell, 1.0)  # a release was due after the drain
    bell.lost()
    assert not bell.armed and bell.polling
    assert bell.drained(1, started=1.0, every_type=True) is Action.NOTHING  # nothing to release
    assert not bell.should_arm(1.0)
    quiet(bell, 1.0)
    assert bell.should_arm(1.0)

    busy = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(busy, 0.0)
    busy.arm_result(ArmOutcome.BUSY, 0.0)
    busy.lost()
    assert busy.wait_seconds(0.0) == POLL_PAUSE_SECONDS  # no slower polls
    quiet(busy, 0.0)
    assert busy.should_arm(0.0)  # no arm backoff

    held = Doorbell(DoorbellMode.ADAPTIVE)
    quiet(held, 0.0)
    held.arm_result(ArmOutcome.HELD_ELSEWHERE, 0.0)
    held.lost()
    assert held.should_poll() and held.wait_seconds(0.0) == POLL_PAUSE_SECONDS  # no recheck


def test_the_outcome_of_a_timed_out_arm_is_read_from_who_holds_the_keys() -> None:
    assert arm_outcome(16, False, 16) is ArmOutcome.ARMED  # the last key came just in time
    assert arm_outcome(3, True, 16) is ArmOutcome.HELD_ELSEWHERE
    assert arm_outcome(0, True, 16) is ArmOutcome.HELD_ELSEWHERE
    assert arm_outcome(5, False, 16) is ArmOutcome.BUSY  # writers in flight kept the rest
    assert arm_outcome(0, False, 1) is ArmOutcome.BUSY


def test_the_core_imports_no_driver_and_no_metrics() -> None:
    # Loaded as a file, outside the package (whose __init__ imports the producer's driver).
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('doorbell_core', sys.argv[1])\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = {'psycopg', 'redis', 'rq', 'prometheus_client', 'reactor'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    core = Path(__file__).resolve().parent.parent / "reactor" / "dispatcher" / "doorbell.py"
    subprocess.run([sys.executable, "-c", code, str(core)], check=True, timeout=60)
