"""A `reactor worker` SIGKILLed mid-job: RQ's record of its workers tells the sweep and
`reactor status` that the job's worker is gone, and the row comes back within seconds of the
worker key's expiry instead of after `stale_after`.

Real processes only: `reactor worker` (forking and `--simple`), `reactor run`/`sweep`/`status`,
Postgres and Redis. The fast tests shrink every interval by the same factor (15) through the
real settings: heartbeat 15 → 1 s, `--gone-after` 30 → 2 s, `--sweep-interval` 30 → 2 s,
`--stale-after` 300 → 20 s. The slow test uses the true defaults.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from rq import Worker as RqWorker

from reactor import submit
from reactor.settings import (
    DEFAULT_GONE_AFTER_SECONDS,
    DEFAULT_HEARTBEAT_SECONDS,
    DEFAULT_STALE_AFTER_SECONDS,
    DEFAULT_SWEEP_INTERVAL_SECONDS,
)
from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process
from tests.support.waiting import wait_for

ROUTE = "photo.process=tests.handlers.slow_first_attempt"
#: The fast tests' intervals: the defaults divided by this.
SHRINK = 15
HEARTBEAT = DEFAULT_HEARTBEAT_SECONDS / SHRINK
GONE_AFTER = DEFAULT_GONE_AFTER_SECONDS / SHRINK
STALE_AFTER = DEFAULT_STALE_AFTER_SECONDS / SHRINK
SWEEP_INTERVAL = DEFAULT_SWEEP_INTERVAL_SECONDS / SHRINK
#: With the defaults, a killed worker's row is re-dispatched and done within this long.
DEFAULTS_TARGET_SECONDS = 150.0


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect(autocommit=True)
    connection.execute(SCHEMA)
    return connection


def start_worker(spawn: Callable[..., Process], kind: str, **extra_env: str) -> Process:
    args = ["-m", "reactor", "worker", "photo-process", "--route", ROUTE]
    worker = spawn(
        *args,
        *(["--simple"] if kind == "simple" else []),
        name=f"worker-{kind}",
        extra_env=extra_env,
    )
    worker.wait_for_line("worker_ready", timeout=60)
    return worker


def started(conn: psycopg.Connection[Any], photo_id: str, attempt: int) -> Any:
    """The pid and time of the attempt's handler start (None: not yet)."""
    return conn.execute(
        "SELECT pid, at FROM handler_runs WHERE photo_id = %s AND attempt = %s"
        " AND outcome = 'started'",
        [photo_id, attempt],
    ).fetchone()


def row(conn: psycopg.Connection[Any], photo_id: str) -> tuple[str, int]:
    found = conn.execute(
        "SELECT state, prior_attempts + attempts FROM photo_jobs WHERE photo_id = %s", [photo_id]
    ).fetchone()
    assert found is not None
    return str(found[0]), int(found[1])


def gone(env: Env, *options: str) -> int:
    """`reactor status --json`'s count of active rows whose RQ worker is gone."""
    status = env.cli_json("status", "--json", *options)
    assert status["redis_error"] is None, status
    return sum(t["worker_gone"] or 0 for t in status["types"])


@pytest.mark.slow  # a worker killed with SIGKILL, and its key left to expire
@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_a_killed_worker_s_row_is_shown_gone_then_rescued_long_before_stale_after(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    kind: str,
    reap: list[int],
) -> None:
    options = ("--gone-after", f"{GONE_AFTER:g}", "--stale-after", f"{STALE_AFTER:g}")
    doomed = start_worker(
        spawn, kind, REACTOR_HEARTBEAT_SECONDS=f"{HEARTBEAT:g}", REACTOR_TEST_WORK_SECONDS="600"
    )
    submit(conn, "p1")
    assert env.cli_json("sweep", "--route", ROUTE, *options)["enqueued"] == 1
    first = wait_for(lambda: started(conn, "p1", 1), timeout=30, what="attempt 1 started")
    reap.append(first[0])
    # Alive and beating: not gone, whatever the status says about the row's age.
    assert gone(env, *options) == 0
    doomed.kill()  # the worker process alone (a forking worker's horse sleeps on)
    killed = time.monotonic()
    wait_for(lambda: gone(env, *options) == 1, timeout=60, interval=0.2, what="worker gone")
    known = time.monotonic() - killed
    status = env.cli_json("status", "--json", *options)
    (types,) = status["types"]
    assert (types["worker_gone"], types["stale_active"]) == (1, 0)
    assert row(conn, "p1") == ("active", 1)
    # The sweep rescues exactly what the status showed, long before stale_after.
    result = env.cli_json("sweep", "--route", ROUTE, *options)
    assert (result["rescued"], result["lost"]) == (1, 0), result
    assert row(conn, "p1") == ("active", 2)
    assert time.monotonic() - killed < STALE_AFTER
    start_worker(spawn, kind, REACTOR_HEARTBEAT_SECONDS=f"{HEARTBEAT:g}")
    wait_for(lambda: row(conn, "p1") == ("done", 2), timeout=60, interval=0.1, what="done")
    print(f"\nworker gone in status {known:.1f} s after the kill ({kind})")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_a_slow_handler_on_a_live_worker_is_never_shown_gone_nor_rescued(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    kind: str,
) -> None:
    """A handler that works for three key TTLs (4 heartbeats) on a live worker: its key and its
    row are renewed at every beat, so RQ lists the worker busy throughout (`rq info`), and
    neither the status nor the reactor's sweeps take the row."""
    reactor = spawn(
        "-m",
        "reactor",
        "run",
        "--route",
        ROUTE,
        "--sweep-interval",
        f"{SWEEP_INTERVAL:g}",
        "--gone-after",
        f"{GONE_AFTER:g}",
        "--stale-after",
        f"{STALE_AFTER:g}",
        name="reactor",
        extra_env={},
    )
    reactor.wait_for_line("reactor_started")
    start_worker(
        spawn, kind, REACTOR_HEARTBEAT_SECONDS=f"{HEARTBEAT:g}", REACTOR_TEST_WORK_SECONDS="12"
    )
    submit(conn, "p1")
    wait_for(lambda: started(conn, "p1", 1), timeout=30, what="attempt 1 started")
    client = env.redis()
    seen: list[int] = []
    listed: list[list[str]] = []  # the workers RQ lists, by state, at each look

    def done() -> bool:
        listed.append([w.get_state() for w in RqWorker.all(connection=client)])
        seen.append(gone(env, "--gone-after", f"{GONE_AFTER:g}"))
        return row(conn, "p1")[0] == "done"

    wait_for(done, timeout=60, interval=0.2, what="done")
    assert row(conn, "p1") == ("done", 1)
    assert not any(seen), seen
    # Busy until the end (the last looks may find it idle again), never missing.
    assert all(states in (["busy"], ["idle"]) for states in listed), listed
    assert listed.count(["busy"]) >= 5, listed
    assert "rows_rescued" not in reactor.output()


@pytest.mark.slow
def test_a_paused_worker_is_rescued_once_its_key_lapsed_and_its_late_outcome_is_fenced(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """SIGSTOP looks like death to RQ (the key lapses): the row is rescued. When the worker
    resumes, its handler finishes but its outcome changes nothing (the fence), and the rescued
    attempt runs and completes the row."""
    options = ("--gone-after", f"{GONE_AFTER:g}", "--stale-after", f"{STALE_AFTER:g}")
    paused = start_worker(
        spawn, "simple", REACTOR_HEARTBEAT_SECONDS=f"{HEARTBEAT:g}", REACTOR_TEST_WORK_SECONDS="15"
    )
    submit(conn, "p1")
    assert env.cli_json("sweep", "--route", ROUTE, *options)["enqueued"] == 1
    wait_for(lambda: started(conn, "p1", 1), timeout=30, what="attempt 1 started")
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: gone(env, *options) == 1, timeout=60, interval=0.2, what="worker gone")
        assert env.cli_json("sweep", "--route", ROUTE, *options)["rescued"] == 1
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    wait_for(lambda: row(conn, "p1") == ("done", 2), timeout=60, interval=0.1, what="done")
    paused.wait_for_line("completion_superseded", timeout=30)
    outcomes = conn.execute(
        "SELECT attempt, outcome FROM handler_runs WHERE photo_id = 'p1' ORDER BY attempt, at"
    ).fetchall()
    assert outcomes == [(1, "started"), (1, "ok"), (2, "started"), (2, "ok")]
    assert row(conn, "p1") == ("done", 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_the_defaults_killed_workers_rows_are_done_within_150_s(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    reap: list[int],
) -> None:
    """Both kinds of `reactor worker` SIGKILLed mid-job, every setting at its default: each
    row is re-dispatched and done within `DEFAULTS_TARGET_SECONDS` of the kill, by the sweep's
    worker-gone rescue (not `stale_after`'s). That `reactor status` shows such a row gone
    before the sweep takes it is the fast tests' to show: with the defaults the gap between
    the two is anywhere from 0 to one sweep interval."""
    reactor = spawn("-m", "reactor", "run", "--route", ROUTE, name="reactor", extra_env={})
    reactor.wait_for_line("reactor_started")
    doomed = {
        kind: start_worker(spawn, kind, REACTOR_TEST_WORK_SECONDS="900")
        for kind in ("fork", "simple")
    }
    submit(conn, "p1")
    first = wait_for(lambda: started(conn, "p1", 1), timeout=30, what="p1 started")
    submit(conn, "p2")
    second = wait_for(lambda: started(conn, "p2", 1), timeout=30, what="p2 started")
    reap.extend([first[0], second[0]])
    for worker in doomed.values():
        worker.kill()
    killed = time.monotonic()
    start_worker(spawn, "simple")
    finished: dict[str, float] = {}  # photo → seconds from the kill to `done`

    def done() -> bool:
        for p in ("p1", "p2"):
            if row(conn, p) == ("done", 2):
                finished.setdefault(p, round(time.monotonic() - killed, 1))
        return len(finished) == 2

    wait_for(done, timeout=DEFAULTS_TARGET_SECONDS + 60, interval=0.5, what="both rows done")
    elapsed = time.monotonic() - killed
    print(f"\ndefaults: seconds from the kill to done {finished}")
    assert elapsed < DEFAULTS_TARGET_SECONDS
    rescues = re.findall(r"rows_rescued stale=(\d+) worker_gone=(\d+)", reactor.output())
    stale = sum(int(count) for count, _ in rescues)
    worker_gone = sum(int(count) for _, count in rescues)
    assert (stale, worker_gone) == (0, 2), rescues


def test_status_without_redis_still_answers_and_says_liveness_is_unknown(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    submit(conn, "p1")
    # An active row without a write for a minute (past gone_after, not stale yet): its job's
    # worker is looked up in Redis.
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep updated_at as given
        conn.execute(
            "UPDATE photo_jobs SET state = 'active', attempts = 1,"
            " updated_at = now() - interval '1 minute'"
        )
    unreachable = {"REDIS_URL": "redis://127.0.0.1:1/0"}
    text = run_cli(env, "status", extra_env=unreachable)
    assert text.returncode == 0, text.stderr
    assert "workers' liveness unknown (Redis: " in text.stdout, text.stdout
    status = json.loads(run_cli(env, "status", "--json", extra_env=unreachable).stdout)
    assert status["redis_error"] and status["types"][0]["worker_gone"] is None, status
    assert env.cli_json("status", "--json")["types"][0]["worker_gone"] == 0
