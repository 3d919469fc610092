"""One turn of the reactor's loop (`Reactor.turn()`, reactor/dispatcher/loop.py) against real servers:
what a turn waits for, what it does, and the `Turn` it returns.

The reactor runs in this process; a watchdog requests a stop after a minute, so a turn that
waits for something that never comes ends the test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis

from reactor.dispatcher import named
from reactor.dispatcher.doorbell import RECHECK_SECONDS, ArmOutcome, DoorbellMode
from reactor.dispatcher.listener import Listener
from reactor.dispatcher.loop import Reactor, Turn, Work
from reactor.jobs import job_id
from reactor.routes import parse_routes
from reactor.settings import ReactorSettings
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
INSERT = "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')"
WATCHDOG_SECONDS = 60.0


@pytest.fixture
def make_reactor(env: Env) -> Iterator[Callable[..., Reactor]]:
    """Started reactors on this test's servers (no sweep unless asked); closed at the end."""
    made: list[tuple[Reactor, threading.Timer]] = []

    def make(redis_url: str | None = None, **settings: Any) -> Reactor:
        settings.setdefault("sweep_interval_seconds", 3600.0)
        reactor = Reactor(
            ReactorSettings(env.database_url, redis_url or env.redis_url, ROUTES, **settings)
        )
        reactor.start()
        watchdog = threading.Timer(WATCHDOG_SECONDS, reactor.stopper.request)
        watchdog.daemon = True
        watchdog.start()
        made.append((reactor, watchdog))
        return reactor

    yield make
    for reactor, watchdog in made:
        watchdog.cancel()
        reactor.close()


def state_of(conn: psycopg.Connection[Any], photo_id: str) -> tuple[str, int] | None:
    row = conn.execute(
        "SELECT state, attempts FROM photo_jobs WHERE photo_id = %s", [photo_id]
    ).fetchone()
    return None if row is None else (row[0], row[1])


def queued(env: Env, client: redis.Redis | None = None) -> list[str]:
    """Job ids waiting in the photo-process queue (of this test's Redis, or of `client`)."""
    ids = (client or env.redis()).lrange("rq:queue:photo-process", 0, -1)
    return [i.decode() if isinstance(i, bytes) else i for i in ids]


def withdrawn(reactor: Reactor) -> float:
    """Jobs the reactor enqueued for named rows and withdrawn: no row could use them."""
    value = reactor.metrics.registry.get_sample_value("reactor_named_withdrawn_total")
    assert value is not None, "no such series"
    return value


def turn_until(reactor: Reactor, done: Callable[[Turn], bool], turns: int = 20) -> Turn:
    for _ in range(turns):
        turn = reactor.turn()
        assert not reactor.stopper.requested, "the watchdog stopped the reactor"
        if done(turn):
            return turn
    raise AssertionError(f"no such turn in {turns}")


def test_the_first_turn_drains_every_type_and_an_armed_reactor_drains_a_row_in_one_turn(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    conn.execute(INSERT, ["before"])
    reactor = make_reactor()

    first = reactor.turn()
    assert (first.work, first.drained, first.claimed) == (Work.DRAIN, ("photo.process",), 1)
    # No wait: a turn that waited would wait for a reason to work, the hour's sweep.
    assert first.waited < 10.0 and first.arm is None and not first.released
    assert state_of(conn, "before") == ("active", 1)

    # Quiet polls, then the doorbell arms, and that turn drains every type once more.
    armed = turn_until(reactor, lambda t: t.arm is not None)
    assert (armed.arm, armed.work, armed.claimed) == (ArmOutcome.ARMED, Work.DRAIN, 0)
    probe = Listener(env.database_url)  # another session, to see who holds the keys
    probe.connect()
    try:
        assert probe.lock_doorbell() is ArmOutcome.HELD_ELSEWHERE

        conn.execute(INSERT, ["after"])  # an armed reactor: the writer notifies
        turn = reactor.turn()
        assert turn.notifications == 1
        assert (turn.work, turn.drained, turn.claimed) == (Work.HINTS, ("photo.process",), 1)
        assert turn.named == 0, "claimed, not merely named"
        assert turn.released, "rows are coming: the keys go back after the drain"
        assert state_of(conn, "after") == ("active", 1)
        assert job_id("photo.process", "after", 1) in queued(env)
        assert probe.lock_doorbell() is ArmOutcome.ARMED  # the reactor gave them back
    finally:
        probe.close()


def test_a_polling_turn_finds_a_row_of_a_writer_that_did_not_notify(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    reactor = make_reactor()
    reactor.turn()  # the drain at start
    conn.execute(INSERT, ["silent"])  # nobody is armed: no NOTIFY
    turn = reactor.turn()
    assert (turn.notifications, turn.work, turn.claimed) == (0, Work.POLL, 1)
    assert state_of(conn, "silent") == ("active", 1)


def test_an_idle_turn_waits_and_does_nothing_while_another_reactor_holds_the_doorbell(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    holder = Listener(env.database_url)
    holder.connect()
    try:
        assert holder.lock_doorbell() is ArmOutcome.ARMED
        reactor = make_reactor()
        turn = turn_until(reactor, lambda t: t.arm is not None)
        # Nothing is due and the keys are held elsewhere: listen until the recheck.
        assert turn.arm is ArmOutcome.HELD_ELSEWHERE
        assert (turn.work, turn.drained, turn.claimed, turn.released) == (None, (), 0, False)
        assert turn.notifications == 0
        assert turn.waited == pytest.approx(RECHECK_SECONDS, abs=0.2)
    finally:
        holder.close()


def test_a_sweep_turn_drains_and_rescues(env: Env, make_reactor: Callable[..., Reactor]) -> None:
    conn = env.connect()
    reactor = make_reactor(
        doorbell=DoorbellMode.POLL_ONLY, poll_interval_seconds=3600.0, sweep_interval_seconds=0.5
    )
    assert reactor.turn().work is Work.DRAIN  # at start
    conn.execute(INSERT, ["missed"])
    # A row whose job vanished from Redis: the sweep re-dispatches it as attempt 2.
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " VALUES ('vanished', 'photo.process', 'active', 1)"
    )
    turn = reactor.turn()
    assert turn.work is Work.SWEEP and turn.sweep is not None
    assert turn.waited > 0.3, "a poll-only reactor with nothing due waits for the sweep"
    assert (turn.sweep.claimed, turn.sweep.lost, turn.claimed) == (1, 1, 1)
    assert state_of(conn, "missed") == ("active", 1)
    assert state_of(conn, "vanished") == ("active", 2)


def armed_reactor(make_reactor: Callable[..., Reactor], **settings: Any) -> Reactor:
    """A reactor past its start-up drain, armed and waiting for notifications."""
    reactor = make_reactor(**settings)
    turn_until(reactor, lambda t: t.arm is ArmOutcome.ARMED)
    return reactor


def test_a_notified_row_is_enqueued_before_it_is_claimed(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn, locker = env.connect(), env.connect(autocommit=False)
    reactor = armed_reactor(make_reactor)
    conn.execute(INSERT, ["locked"])
    # Another session holds the row: the claim skips it, so what the turn did first shows.
    locker.execute("SELECT FROM photo_jobs WHERE photo_id = 'locked' FOR UPDATE")
    turn = reactor.turn()
    # Its job enqueued, the row itself not claimed (locked): named, not claimed.
    assert (turn.notifications, turn.work, turn.claimed, turn.named) == (1, Work.HINTS, 0, 1)
    locker.rollback()
    expected = job_id("photo.process", "locked", 1)
    assert queued(env) == [expected]
    # Queued, not yet claimed: the job's fenced start may take such a row over, and any
    # claim of attempt 1 finds the job alive and does not enqueue it again.
    assert state_of(conn, "locked") == ("pending", 0)
    turn = turn_until(reactor, lambda t: t.claimed > 0)
    assert turn.work in (Work.POLL, Work.DRAIN)
    assert state_of(conn, "locked") == ("active", 1)
    assert queued(env) == [expected]


def test_rows_named_while_the_claim_waits_are_enqueued_at_once_and_claimed_together(
    env: Env, make_reactor: Callable[..., Reactor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim of named rows waits a few ms (here stretched to a minute), so that it does not
    compete with the job's pick-up; rows named meanwhile are enqueued at once, and a type
    notified alone ends the wait."""
    monkeypatch.setattr(named, "CLAIM_NAMED_AFTER_SECONDS", WATCHDOG_SECONDS)
    conn, writer = env.connect(), env.connect()
    reactor = armed_reactor(make_reactor)
    first, second = (job_id("photo.process", p, 1) for p in ("first", "second"))

    errors: list[BaseException] = []

    def write() -> None:
        try:
            write_during_the_wait()
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
            reactor.stopper.request()

    def write_during_the_wait() -> None:
        wait_for(lambda: queued(env) == [first], what="the first row's job queued")
        writer.execute(INSERT, ["second"])
        wait_for(lambda: queued(env) == [first, second], what="the second row's job queued")
        # Both queued, neither claimed yet.
        assert [state_of(writer, p) for p in ("first", "second")] == [("pending", 0)] * 2
        # Nine rows in one transaction: notified by their type alone.
        writer.execute(
            "INSERT INTO photo_jobs (photo_id, type)"
            " SELECT 'many-' || i, 'photo.process' FROM generate_series(1, 9) i"
        )

    conn.execute(INSERT, ["first"])
    writing = threading.Thread(target=write)
    writing.start()
    started = time.monotonic()
    turn = reactor.turn()
    writing.join()
    assert not errors, errors
    assert time.monotonic() - started < WATCHDOG_SECONDS / 2, "the type's notification ended it"
    assert (turn.notifications, turn.work, turn.claimed, turn.named) == (3, Work.HINTS, 11, 0)
    states = conn.execute("SELECT DISTINCT state, attempts FROM photo_jobs").fetchall()
    assert states == [("active", 1)]
    assert len(queued(env)) == 11


@pytest.mark.parametrize(
    ("how", "status"),
    [("requeued", "finished"), ("requeued", "started"), ("inserted-anew", "finished")],
    ids=["requeued", "requeued-before-rq-records-the-end", "inserted-anew"],
)
def test_a_row_armed_again_before_its_delayed_claim_is_not_claimed_for_its_ended_job(
    env: Env,
    make_reactor: Callable[..., Reactor],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    status: str,
) -> None:
    """During the claim's wait the job runs, and the row is armed again: the claim must not
    make that new life `active` with the ended job. A requeued row's new life has a token of
    its own (2), and the drain that the re-arm's notification brings enqueues its job, even
    while RQ still says `started` (an in-process worker writes `done` before RQ records the
    job's end); a row deleted and inserted anew starts again at token 0, and the drain
    replaces the ended job."""
    monkeypatch.setattr(named, "CLAIM_NAMED_AFTER_SECONDS", WATCHDOG_SECONDS)
    conn, writer, client = env.connect(), env.connect(), env.redis()
    reactor = armed_reactor(make_reactor)
    first = job_id("photo.process", "again", 1)
    key = "rq:job:" + first
    errors: list[BaseException] = []

    def run_and_arm_again() -> None:
        try:
            wait_for(lambda: client.hget(key, "status") == b"queued", what="the job queued")
            # What a worker does with the job (RQ's status, the row's states), then a re-arm.
            client.lrem("rq:queue:photo-process", 0, first)
            client.hset(key, "status", status)
            for change in ("state = 'active', attempts = 1", "state = 'done'"):
                writer.execute(f"UPDATE photo_jobs SET {change} WHERE photo_id = 'again'")
            if how == "requeued":
                assert run_cli(env, "requeue", "again").returncode == 0
            else:
                writer.execute("DELETE FROM photo_jobs WHERE photo_id = 'again'")
                writer.execute(INSERT, ["again"])
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
            reactor.stopper.request()

    conn.execute(INSERT, ["again"])
    arming = threading.Thread(target=run_and_arm_again)
    arming.start()
    turn = reactor.turn()
    arming.join()
    assert not errors, errors
    assert turn.work is Work.HINTS and turn.notifications == 2
    assert state_of(conn, "again") == ("active", 1)
    if how == "requeued":
        assert client.hget(key, "status") == status.encode(), "the ended job is left as it was"
        assert queued(env) == [job_id("photo.process", "again", 2)]
    else:
        assert client.hget(key, "status") == b"queued", "the drain replaced the ended job"
        assert queued(env) == [first]


def test_two_reactors_hearing_one_notification_enqueue_its_job_once(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    first = armed_reactor(make_reactor)
    second = make_reactor()
    turn_until(second, lambda t: t.arm is ArmOutcome.HELD_ELSEWHERE)
    conn.execute(INSERT, ["both"])
    turns = [first.turn(), second.turn()]
    assert [t.notifications for t in turns] == [1, 1]
    assert sorted(t.claimed for t in turns) == [0, 1], "one of them wrote the job"
    assert queued(env) == [job_id("photo.process", "both", 1)]
    assert state_of(conn, "both") == ("active", 1)


def test_a_notified_row_whose_enqueue_fails_is_drained_once_redis_takes_it(
    env: Env,
    make_reactor: Callable[..., Reactor],
    private_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    conn, client = env.connect(), redis.Redis.from_url(private_redis.url)
    reactor = armed_reactor(make_reactor, redis_url=private_redis.url)
    # Redis is full (noeviction, as RQ asks): it refuses every write until memory is freed
    # (a server of the test's own: maxmemory is server-wide).
    client.config_set("maxmemory", 1)
    try:
        conn.execute(INSERT, ["refused"])
        fixed = threading.Timer(0.5, client.config_set, ["maxmemory", 0])
        fixed.start()
        try:
            turn = reactor.turn()
        finally:
            fixed.join()
    finally:
        client.config_set("maxmemory", 0)
    # The row's type was drained instead, retried with backoff until Redis took the batch.
    assert "notified_enqueue_failed rows=1" in caplog.text
    assert (turn.work, turn.claimed) == (Work.HINTS, 1)
    assert state_of(conn, "refused") == ("active", 1)
    assert queued(env, client) == [job_id("photo.process", "refused", 1)]


def test_jobs_of_rows_named_by_a_stray_notification_are_withdrawn(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """Anyone may NOTIFY: a row named that is not pending at token 0 (here: done), or that
    does not exist, gets a job that is withdrawn at the claim, and nothing counts as claimed."""
    conn = env.connect()
    reactor = armed_reactor(make_reactor)
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " VALUES ('finished', 'photo.process', 'done', 1)"
    )
    conn.execute("SELECT pg_notify('photo_jobs', 'photo.process finished')")
    conn.execute("SELECT pg_notify('photo_jobs', 'photo.process ' || repeat('x', 256))")
    turn = reactor.turn()
    assert (turn.notifications, turn.claimed, turn.named) == (2, 0, 0)
    assert state_of(conn, "finished") == ("done", 1)
    assert queued(env) == []
    assert not env.redis().exists("rq:job:" + job_id("photo.process", "finished", 1))
    assert withdrawn(reactor) == 2
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (1,)


def test_a_named_row_whose_job_id_is_held_by_an_ended_job_is_claimed_by_the_drain(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """A job of an earlier life of the row (deleted and inserted again while RQ still keeps
    the finished job) holds attempt 1's id: the named path does not replace it, the drain
    does."""
    conn, client = env.connect(), env.redis()
    reactor = armed_reactor(make_reactor)
    key = "rq:job:" + job_id("photo.process", "again", 1)
    client.hset(key, mapping={"status": "finished"})
    conn.execute(INSERT, ["again"])
    turn = reactor.turn()
    assert (turn.work, turn.claimed) == (Work.HINTS, 1)
    assert state_of(conn, "again") == ("active", 1)
    assert queued(env) == [job_id("photo.process", "again", 1)]
    assert client.hget(key, "status") == b"queued"


def test_a_flood_of_named_rows_costs_at_most_the_budget_and_real_rows_still_go(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """Names of rows that do not exist spend the named rows' budget (a job each, withdrawn at
    the claim); once it is spent, named rows are drained by type, which costs no job for a
    row that is not there, and a real row is still dispatched."""
    conn = env.connect()
    reactor = armed_reactor(make_reactor)
    flood = (
        "SELECT pg_notify('photo_jobs', 'photo.process fake-' || i) FROM generate_series(1, %s) i"
    )
    conn.execute(flood, [named.NAMED_ROWS_BUDGET + 50])
    turn = reactor.turn()
    assert (turn.work, turn.claimed) == (Work.HINTS, 0)
    assert withdrawn(reactor) == named.NAMED_ROWS_BUDGET
    assert queued(env) == []
    with conn.transaction():
        conn.execute(flood, [named.NAMED_ROWS_BUDGET])
        conn.execute(INSERT, ["real"])
    turn_until(reactor, lambda t: state_of(conn, "real") == ("active", 1))
    assert queued(env) == [job_id("photo.process", "real", 1)]
    # The refill over the test's few seconds, at most.
    assert withdrawn(reactor) < named.NAMED_ROWS_BUDGET + 50
