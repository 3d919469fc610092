"""One turn of the reactor's loop (`Reactor.turn()`, reactor/dispatcher/loop.py) against real servers:
what a turn waits for, what it does, and the `Turn` it returns.

The reactor runs in this process; a watchdog requests a stop after a minute, so a turn that
waits for something that never comes ends the test instead of hanging it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from reactor.dispatcher import sessions as sessions_module
from reactor.dispatcher.doorbell import BUSY_RINGS, RECHECK_SECONDS, ArmOutcome, DoorbellMode
from reactor.dispatcher.listener import Listener
from reactor.dispatcher.loop import Reactor, Turn, Work
from reactor.jobs import job_id
from reactor.pg import queries
from reactor.routes import parse_routes
from reactor.settings import ReactorSettings
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
        assert not turn.released, "one notification: the reactor stays armed"
        assert state_of(conn, "after") == ("active", 1)
        assert job_id("photo.process", "after", 1) in queued(env)
        assert probe.lock_doorbell() is ArmOutcome.HELD_ELSEWHERE

        # Notifications coming fast (all read in one turn): drain, then give the keys back.
        for i in range(BUSY_RINGS):
            conn.execute(INSERT, [f"burst{i}"])
        # A notification reaches the listener's socket a moment after the COMMIT; a server
        # sends those pending before it answers a statement, so one round trip brings all.
        listener = reactor._sessions.listener
        assert listener is not None and listener._conn is not None
        listener._conn.execute("SELECT 1")
        turn = reactor.turn()
        assert turn.notifications == BUSY_RINGS
        assert (turn.work, turn.claimed) == (Work.HINTS, BUSY_RINGS)
        assert turn.released, "rows are coming fast: the keys go back after the drain"
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


def test_an_empty_poll_after_an_empty_poll_sends_one_statement_and_no_transaction(
    env: Env, make_reactor: Callable[..., Reactor], tmp_path: Path
) -> None:
    conn = env.connect()
    reactor = make_reactor(doorbell=DoorbellMode.POLL_ONLY, poll_interval_seconds=0.01)
    reactor.turn()  # the drain at start: full claims, which set the types' marks
    assert reactor.turn().work is Work.POLL  # claims, finds nothing
    work = reactor._sessions.work
    assert work is not None
    trace = tmp_path / "work.trace"
    with trace.open("w") as out:
        work.pgconn.trace(out.fileno())
        work.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        turn = reactor.turn()
        work.pgconn.untrace()
    assert (turn.work, turn.claimed) == (Work.POLL, 0)
    sent = [line for line in trace.read_text().splitlines() if line.startswith("F")]
    statements = [line for line in sent if "\tQuery\t" in line or "\tParse\t" in line]
    assert len(statements) == 1, sent
    assert queries.DUE_TYPES.splitlines()[0] in statements[0]
    assert not [line for line in sent if "BEGIN" in line or "COMMIT" in line], sent
    # The probe hides no row: the next poll claims a row a silent writer committed.
    conn.execute(INSERT, ["after-empty-polls"])
    turn = reactor.turn()
    assert (turn.work, turn.claimed) == (Work.POLL, 1)
    assert state_of(conn, "after-empty-polls") == ("active", 1)


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


def test_a_notification_naming_an_absent_or_paused_row_creates_no_job(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """Anyone may NOTIFY: names of rows that do not exist, of a finished row or of a row of a
    paused type (an old trigger's `TYPE PHOTO_ID` form, read as `TYPE`) make the turn drain
    the type, whose claim finds nothing to dispatch: no job is written."""
    conn = env.connect()
    reactor = armed_reactor(make_reactor)
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " VALUES ('finished', 'photo.process', 'done', 1)"
    )
    env.cli_json("pause", "--route", "photo.process=reactor.demo.process_photo", "photo.process")
    with conn.transaction():
        conn.execute(INSERT, ["paused"])
        conn.execute("SELECT pg_notify('photo_jobs', 'photo.process paused')")
    conn.execute("SELECT pg_notify('photo_jobs', 'photo.process finished')")
    conn.execute("SELECT pg_notify('photo_jobs', 'photo.process ' || repeat('x', 256))")
    # The turn that reads them drains the type: a drain of the notified types, or of every
    # type when a full claim came due meanwhile (the CLI above can take a second when loaded).
    turn = turn_until(reactor, lambda t: t.notifications > 0)
    assert turn.work in (Work.HINTS, Work.DRAIN)
    assert (turn.drained, turn.claimed) == (("photo.process",), 0)
    assert state_of(conn, "finished") == ("done", 1)
    assert state_of(conn, "paused") == ("pending", 0)
    assert queued(env) == []
    assert env.redis().keys("rq:job:*") == []
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (2,)


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
    # The batch was rolled back and the drain retried with backoff until Redis took it.
    assert "drain_retry" in caplog.text
    assert (turn.work, turn.claimed) == (Work.HINTS, 1)
    assert state_of(conn, "refused") == ("active", 1)
    assert queued(env, client) == [job_id("photo.process", "refused", 1)]


def test_a_row_whose_job_id_is_held_by_an_ended_job_gets_its_job_replaced(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """A job of an earlier life of the row (deleted and inserted again while RQ still keeps
    the finished job) holds attempt 1's id: the drain replaces it."""
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


def test_a_flood_of_names_of_absent_rows_costs_no_job_and_a_real_row_still_goes(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    reactor = armed_reactor(make_reactor)
    flood = (
        "SELECT pg_notify('photo_jobs', 'photo.process fake-' || i) FROM generate_series(1, %s) i"
    )
    conn.execute(flood, [500])
    turn = reactor.turn()
    assert turn.notifications > 0 and (turn.work, turn.claimed) == (Work.HINTS, 0)
    with conn.transaction():
        conn.execute(flood, [500])
        conn.execute(INSERT, ["real"])
    turn_until(reactor, lambda t: state_of(conn, "real") == ("active", 1))
    assert queued(env) == [job_id("photo.process", "real", 1)]
    assert env.redis().keys("rq:job:*fake*") == []


def _claim_ahead_sessions(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'photo-reactor claim-ahead'"
    ).fetchone()
    return int(row[0]) if row else 0


def test_the_claim_ahead_session_opens_after_a_backlog_and_closes_once_it_is_over(
    env: Env, make_reactor: Callable[..., Reactor], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = env.connect()
    reactor = make_reactor(batch_size=5)
    reactor.turn()
    assert _claim_ahead_sessions(conn) == 0  # no backlog yet: no third session
    for i in range(12):
        conn.execute(INSERT, [f"b{i}"])
    turn_until(reactor, lambda t: t.claimed > 0)  # full batches: opened after the drain
    assert _claim_ahead_sessions(conn) == 1
    monkeypatch.setattr(sessions_module, "AHEAD_IDLE_SECONDS", 0.0)
    conn.execute(INSERT, ["one"])
    turn_until(reactor, lambda t: t.claimed > 0)  # a short batch, past the idle time
    wait_for(lambda: _claim_ahead_sessions(conn) == 0, what="the claim-ahead session closed")
