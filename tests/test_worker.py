"""The worker side: fenced lifecycle, heartbeats, retries, permanent failures; requeue/prune.

Jobs run in real `rq worker` processes (burst or long-running), dispatched by the real reactor
or by one sweep round.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from reactor import submit
from reactor.jobs import JobRef
from reactor.worker.lifecycle import Heartbeater, Store
from tests.handlers import SCHEMA
from tests.support.env import Env
from tests.support.locks import lock_waiter
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.rows import insert_rows, rows, states
from tests.support.rq_state import queue_ids
from tests.support.waiting import wait_for


def route(handler: str) -> str:
    return f"photo.process=tests.handlers.{handler}"


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def runs(conn: psycopg.Connection[Any], photo_id: str | None = None) -> list[tuple[str, int, str]]:
    query = "SELECT photo_id, attempt, outcome FROM handler_runs"
    if photo_id is None:
        return [tuple(r) for r in conn.execute(query + " ORDER BY at")]
    return [tuple(r) for r in conn.execute(query + " WHERE photo_id = %s ORDER BY at", [photo_id])]


def sweep(env: Env, handler: str, *args: str) -> dict[str, Any]:
    return env.cli_json("sweep", "--route", route(handler), *args)


def burst(spawn: Callable[..., Process], env: Env, **extra: str) -> Process:
    worker = start_worker(spawn, env, burst=True, extra_args=(), redis_url=None, **extra)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    return worker


def row_of(conn: psycopg.Connection[Any], photo_id: str) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT state, attempts, last_error, next_retry_at FROM photo_jobs WHERE photo_id = %s",
        [photo_id],
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_success_marks_done_and_runs_the_handler_once(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    submit(conn, "p1")
    assert sweep(env, "ok")["enqueued"] == 1
    burst(spawn, env)
    assert row_of(conn, "p1") == ("done", 1, None, None)
    assert runs(conn) == [("p1", 1, "ok")]


def test_spent_attempts_and_permanent_errors_fail_the_row(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, "--route", route("always_fails"), "--sweep-interval", "60")
    start_worker(spawn, env, REACTOR_RETRY_BASE_SECONDS="0.05")
    submit(conn, "p1", max_attempts=3)
    wait_for(lambda: row_of(conn, "p1")[0] == "failed", timeout=30, interval=0.05, what="failed")
    state, attempts, error, _ = row_of(conn, "p1")
    assert (state, attempts) == ("failed", 3)
    assert error == "RuntimeError: boom 3"
    assert len(runs(conn, "p1")) == 3


def test_missing_handler_is_a_retried_failure_not_a_stuck_row(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    submit(conn, "p1")
    sweep(env, "no_such_handler")
    burst(spawn, env)
    state, attempts, error, next_retry_at = row_of(conn, "p1")
    assert (state, attempts) == ("pending", 1)
    assert "no_such_handler" in error and next_retry_at is not None


def start_fast_rescue_reactor(spawn: Callable[..., Process], handler: str) -> Process:
    """A reactor that sweeps every 0.3 s and rescues after 1 s without heartbeat."""
    return start_reactor(
        spawn, "--route", route(handler), "--stale-after", "1", "--sweep-interval", "0.3"
    )


@pytest.mark.slow  # a 3 s handler outliving three stale_after periods
def test_heartbeat_keeps_a_long_handler_alive(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    start_fast_rescue_reactor(spawn, "slow_first_attempt")
    start_worker(
        spawn, env, REACTOR_HEARTBEAT_SECONDS="0.2", REACTOR_TEST_WORK_SECONDS="3"
    ).wait_for_line("Listening on")  # the handler works 3x stale_after
    # (a job waiting in the queue for longer than stale_after would be rescued before it ran)
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="done")
    assert row_of(conn, "p1")[:2] == ("done", 1)
    assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 1, "ok")]


@pytest.mark.slow  # a fault test: a process killed, a server made to fail
def test_worker_killed_mid_handler_is_rescued_and_completed_elsewhere(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    start_fast_rescue_reactor(spawn, "slow_first_attempt")
    doomed = start_worker(
        spawn, env, REACTOR_HEARTBEAT_SECONDS="0.2", REACTOR_TEST_WORK_SECONDS="60"
    )
    doomed.wait_for_line("Listening on")
    submit(conn, "p1")
    wait_for(
        lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="attempt 1 running"
    )
    horse = conn.execute("SELECT pid FROM handler_runs WHERE photo_id = 'p1'").fetchone()
    assert horse is not None
    # RQ runs the job in a forked work horse in its own session: kill it and its parent.
    os.kill(horse[0], signal.SIGKILL)
    doomed.kill()
    start_worker(spawn, env)
    wait_for(
        lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="rescued and done"
    )
    assert row_of(conn, "p1")[:2] == ("done", 2)
    assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 2, "started"), ("p1", 2, "ok")]


@pytest.mark.slow
def test_end_to_end_thousand_photos_with_failing_first_attempts(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, "--route", route("fails_a_fifth_of_first_attempts"))
    for _ in range(2):
        start_worker(
            spawn,
            env,
            REACTOR_RETRY_BASE_SECONDS="0.2",
            extra_args=("--worker-class", "rq.worker.SimpleWorker"),
        )
    started = time.monotonic()
    with conn.transaction():
        for i in range(1000):
            submit(conn, f"photo-{i}")
    wait_for(
        lambda: states(conn) == {"done": 1000}, timeout=240, interval=0.5, what="1000 photos done"
    )
    elapsed = time.monotonic() - started
    successes = conn.execute(
        "SELECT r.photo_id, r.attempt, j.attempts FROM handler_runs r"
        " JOIN photo_jobs j USING (photo_id) WHERE r.outcome = 'ok'"
    ).fetchall()
    assert len(successes) == 1000
    assert len({p for p, _, _ in successes}) == 1000
    assert all(attempt == final for _, attempt, final in successes)
    failed_first = conn.execute(
        "SELECT count(*) FROM handler_runs WHERE outcome = 'error'"
    ).fetchone()
    assert failed_first is not None and 150 <= failed_first[0] <= 250
    assert elapsed < 240


def commits(conn: psycopg.Connection[Any], database: str) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [database]
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
def test_requeue_in_batches_and_dispatch_at_once(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    insert_rows(conn, 100_000, state="failed", attempts=5, last_error="boom")
    start_reactor(spawn, "--sweep-interval", "600")
    before = commits(conn, env.database_name)
    assert env.cli_json("requeue", "--failed") == {"requeued": 100_000, "not_found": []}
    wait_for(
        lambda: commits(conn, env.database_name) - before >= 20, timeout=30, what="batch commits"
    )
    # Margins for a loaded two-core machine (alone on a quiet one: about 30 s).
    wait_for(
        lambda: states(conn) == {"active": 100_000},
        timeout=300,
        interval=0.2,
        what="requeued rows dispatched by NOTIFY",
    )
    assert conn.execute(
        "SELECT max(attempts), min(prior_attempts), count(last_error) FROM photo_jobs"
    ).fetchone() == (1, 5, 0)
    assert len(queue_ids(env.redis())) == 100_000


def test_requeue_named_photos(env: Env, conn: psycopg.Connection[Any]) -> None:
    insert_rows(conn, 3, state="done", attempts=1, created_at="2020-01-01")
    # (ids with no row: tests/test_cli_errors.py)
    assert env.cli_json("requeue", "p1", "p3") == {"requeued": 2, "not_found": []}
    assert [s for _, _, s, _ in rows(conn)] == ["pending", "done", "pending"]
    # Due from the requeue, not from the row's creation years ago.
    status = env.cli_json("status", "--json")
    (age,) = [t["oldest_due_age_seconds"] for t in status["types"]]
    assert age is not None and age < 3600, age


def test_prune_deletes_old_finished_rows_in_batches(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep our updated_at
        insert_rows(conn, 100_000, prefix="old", state="done", updated_at="2020-01-01")
        insert_rows(conn, 10, prefix="oldfail", state="failed", updated_at="2020-01-01")
    insert_rows(conn, 10, prefix="new", state="done")
    insert_rows(conn, 5, prefix="pend")
    result = env.cli_json("prune", "--done-older-than", "7d", "--failed-older-than", "30d")
    assert result == {"deleted_done": 100_000, "deleted_failed": 10, "deleted_cancelled": 0}
    assert states(conn) == {"done": 10, "pending": 5}


def test_the_heartbeat_thread_survives_a_statement_error(
    env: Env, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
        " VALUES ('p1', 'photo.process', 'active', 1, now() - interval '1 hour')"
    )
    store = Store(env.database_url)
    beats = Heartbeater(store, 0.2)

    def stamped() -> bool:
        row = conn.execute(
            "SELECT heartbeat_at > now() - interval '1 minute' FROM photo_jobs"
            " WHERE photo_id = 'p1'"
        ).fetchone()
        return bool(row and row[0])

    try:
        conn.execute("ALTER TABLE photo_jobs RENAME TO photo_jobs_away")
        with caplog.at_level(logging.WARNING, logger="reactor.worker.lifecycle"):
            beats.beat_for(JobRef("photo.process", "p1", 1))
            wait_for(lambda: "does not exist" in caplog.text, timeout=10, what="a failed beat")
        conn.execute("ALTER TABLE photo_jobs_away RENAME TO photo_jobs")
        wait_for(stamped, timeout=10, what="a beat after the failed one")
    finally:
        beats.pause()
        store.close()


@pytest.mark.parametrize("worker_class", ["reactor.SimpleWorker", "reactor.Worker"])
@pytest.mark.parametrize(
    ("handler", "outcome"), [("gated", "done"), ("gated_failure", "pending")], ids=["ok", "error"]
)
def test_a_stop_asked_for_while_the_outcome_is_written_waits_for_it(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    worker_class: str,
    handler: str,
    outcome: str,
) -> None:
    """RQ marks the worker idle when its part of a job ends, and a stop asked for while idle
    raises where the worker is: here, in the outcome's write. The outcome is written, then
    the worker stops."""
    insert_rows(conn, 1)
    worker = start_worker(
        spawn, env, extra_args=("--worker-class", worker_class), REACTOR_ROUTES=route(handler)
    )
    sweep(env, handler)
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], what="the handler running")
    blocker = psycopg.connect(env.database_url)
    env.cleanups.append(blocker.close)
    blocker.execute("SELECT FROM photo_jobs WHERE photo_id = 'p1' FOR UPDATE")
    conn.execute("INSERT INTO gates VALUES ('p1:1')")

    wait_for(
        lambda: lock_waiter(conn, "photo-reactor worker"),
        timeout=30,
        what="the outcome's write waiting on the row's lock",
    )
    worker.proc.send_signal(signal.SIGTERM)
    worker.wait_for_line("warm shut down requested")
    blocker.rollback()
    assert worker.exit_code(timeout=30) == 0, worker.output()
    assert "outcome_lost" not in worker.output()
    assert row_of(conn, "p1")[:2] == (outcome, 1)
    assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 1, "ok")]
