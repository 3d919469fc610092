"""systemd's notify protocol, heard on a datagram socket the test binds (as systemd does):
`reactor run` and `reactor worker` say READY=1, then WATCHDOG=1 from their loops, and STOPPING=1
at SIGTERM; a loop stalled by a real cause (a table lock the reactor's claim waits for, a Redis
that stops answering the worker) goes silent for longer than the watchdog allows, and speaks
again once the cause is gone."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from reactor.sdnotify import Notifier
from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.doorbell import armed_by
from tests.support.env import Env
from tests.support.locks import lock_waiter
from tests.support.notify_socket import NotifySocket
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows, states
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for

#: The watchdog interval the tests give (WATCHDOG_USEC): short, so a stall shows in seconds.
WATCHDOG_SECONDS = 3.0
WATCHDOG_ENV = {"WATCHDOG_USEC": str(int(WATCHDOG_SECONDS * 1_000_000))}
SLOW_ROUTE = "photo.process=tests.handlers.sleeps"


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    listener = NotifySocket(str(tmp_path / "notify"))
    yield listener
    listener.close()


def notify_env(listener: NotifySocket) -> dict[str, str]:
    return {"NOTIFY_SOCKET": listener.sock.getsockname(), **WATCHDOG_ENV}


def assert_beats(listener: NotifySocket, since: float, until: float) -> None:
    """WATCHDOG=1 came between `since` and `until` with no gap of a whole interval."""
    beats = [since, *listener.times("WATCHDOG=1", since), until]
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert max(gaps) < WATCHDOG_SECONDS, f"gaps {gaps}"


def assert_silent(listener: NotifySocket, since: float, seconds: float) -> None:
    """No WATCHDOG=1 for `seconds` after `since`: what systemd would take for a hung service.
    Watching the silence for two whole intervals is the test itself (what systemd measures),
    not a wait for something to happen."""
    deadline = since + seconds
    while time.monotonic() < deadline:
        assert not listener.times("WATCHDOG=1", since), "a stalled loop still told the watchdog"
        time.sleep(0.05)
    assert not listener.times("WATCHDOG=1", since), "a stalled loop still told the watchdog"


def stop_and_hear_stopping(proc: Process, listener: NotifySocket) -> None:
    asked = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    listener.wait("STOPPING=1", since=asked)
    assert proc.exit_code(30) == 0, proc.output()


@pytest.mark.slow  # beats watched for two intervals
def test_an_idle_reactor_is_ready_beats_and_says_it_stops(
    env: Env, spawn: Callable[..., Process], notify: NotifySocket
) -> None:
    started = time.monotonic()
    reactor = start_reactor(spawn, **notify_env(notify))
    ready = notify.wait("READY=1\nSTATUS=running", since=started)
    assert all(at > ready for at in notify.times("WATCHDOG=1")), notify.messages
    # Armed and idle, the loop would sleep until the next sweep (30 s): it wakes to tell.
    conn = env.connect()
    wait_for(lambda: armed_by(conn), what="an idle reactor arming its doorbell")
    armed = time.monotonic()
    notify.wait("WATCHDOG=1", since=armed + 2 * WATCHDOG_SECONDS)
    assert_beats(notify, ready, time.monotonic())
    stop_and_hear_stopping(reactor, notify)


@pytest.mark.slow  # a fault held for seconds
def test_a_reactor_whose_claim_waits_on_a_lock_goes_silent(
    env: Env, spawn: Callable[..., Process], notify: NotifySocket
) -> None:
    reactor = start_reactor(
        spawn, "--doorbell", "poll-only", "--poll-interval", "0.1", **notify_env(notify)
    )
    ready = notify.wait("READY=1\nSTATUS=running")
    notify.wait("WATCHDOG=1", since=ready, count=2)

    # Stall the loop for real: a migration's lock on the table its next claim reads.
    blocker = psycopg.connect(env.database_url)
    env.cleanups.append(blocker.close)
    blocker.execute("LOCK TABLE photo_jobs IN ACCESS EXCLUSIVE MODE")
    watcher = env.connect()
    wait_for(
        lambda: lock_waiter(watcher, "photo-reactor%"),  # the work or the claim-ahead session
        what="the reactor's claim waiting on the lock",
    )
    blocked = time.monotonic()
    assert_silent(notify, blocked, 2 * WATCHDOG_SECONDS)

    blocker.rollback()  # the lock goes: the loop turns again, and says so
    released = time.monotonic()
    resumed = notify.wait("WATCHDOG=1", since=released)
    assert resumed - released < WATCHDOG_SECONDS
    stop_and_hear_stopping(reactor, notify)


def start_worker(
    spawn: Callable[..., Process], listener: NotifySocket, redis_url: str, *args: str
) -> Process:
    return spawn(
        "-m",
        "reactor",
        "worker",
        "photo-process",
        "--route",
        SLOW_ROUTE,
        *args,
        name="worker",
        extra_env={
            **notify_env(listener),
            "REDIS_URL": redis_url,
            # Two beats per half interval: the beats are what tells the watchdog mid-job.
            "REACTOR_HEARTBEAT_SECONDS": "0.5",
            "REACTOR_TEST_WORK_SECONDS": str(2 * WATCHDOG_SECONDS),
        },
    )


def run_one_long_job(env: Env, conn: psycopg.Connection[Any], redis_url: str) -> None:
    """A job twice the watchdog's interval, dispatched by `reactor sweep`, to its end."""
    conn.execute(SCHEMA)
    insert_rows(conn, 1)
    swept = run_cli(env, "sweep", "--route", SLOW_ROUTE, extra_env={"REDIS_URL": redis_url})
    assert swept.returncode == 0, swept.stderr
    wait_for(lambda: states(conn) == {"done": 1}, timeout=60, what="the long job done")


@pytest.mark.slow  # beats watched through a job of two intervals
@pytest.mark.parametrize("simple", [True, False], ids=["simple", "forking"])
def test_a_worker_is_ready_beats_through_a_long_job_and_says_it_stops(
    env: Env,
    spawn: Callable[..., Process],
    notify: NotifySocket,
    private_redis: RedisServer,
    simple: bool,
) -> None:
    started = time.monotonic()
    worker = start_worker(spawn, notify, private_redis.url, *(["--simple"] if simple else []))
    ready = notify.wait("READY=1\nSTATUS=running", since=started)
    assert all(at > ready for at in notify.times("WATCHDOG=1")), notify.messages
    notify.wait("WATCHDOG=1", since=ready, count=2)
    job_at = time.monotonic()
    run_one_long_job(env, env.connect(), private_redis.url)
    # Idle, then through a job longer than the interval: never a whole interval of silence.
    assert_beats(notify, ready, time.monotonic())
    assert notify.times("WATCHDOG=1", job_at)
    stop_and_hear_stopping(worker, notify)


@pytest.mark.slow  # a fault held for seconds
def test_a_worker_whose_redis_stops_answering_goes_silent(
    env: Env, spawn: Callable[..., Process], notify: NotifySocket, private_redis: RedisServer
) -> None:
    worker = start_worker(spawn, notify, private_redis.url, "--simple")
    ready = notify.wait("READY=1\nSTATUS=running")
    notify.wait("WATCHDOG=1", since=ready, count=2)
    pause = 3 * WATCHDOG_SECONDS
    admin = redis.Redis.from_url(private_redis.url)
    env.cleanups.append(admin.close)
    admin.client_pause(int(pause * 1000), all=True)
    paused = time.monotonic()
    # A renewal already answered may still be told (one second: its wait for a job).
    assert_silent(notify, paused + 1.0, 2 * WATCHDOG_SECONDS)
    resumed = notify.wait("WATCHDOG=1", since=paused + pause)
    assert resumed - (paused + pause) < WATCHDOG_SECONDS
    stop_and_hear_stopping(worker, notify)


def test_a_watchdog_shorter_than_two_heartbeats_is_refused(env: Env) -> None:
    out = run_cli(
        env,
        "worker",
        "photo-process",
        extra_env={"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "20000000"},
    )
    assert out.returncode == 2, out.stderr
    assert "watchdog (20 s) must be at least two heartbeats" in out.stderr


def test_the_abstract_namespace_and_another_pids_watchdog(tmp_path: Path) -> None:
    name = f"photo-reactor-test-{os.getpid()}"
    listener = NotifySocket(b"\0" + name.encode())
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000"})
        notifier.ready()
        notifier.alive()
        notifier.alive()  # within a quarter interval: not sent again
        notifier.stopping()
        listener.wait("STOPPING=1")
        assert [text for _, text in listener.messages] == [
            "READY=1\nSTATUS=running",
            "WATCHDOG=1",
            "STOPPING=1",
        ]
        assert notifier.max_wait() == 0.5
    finally:
        listener.close()
    other = Notifier.from_env(
        {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    )
    assert other.enabled and other.watchdog_seconds is None and other.max_wait() == float("inf")
    assert Notifier.from_env({}).enabled is False
