"""The worker classes `reactor.Worker` (fork) and `reactor.SimpleWorker` (in-process).

Every lifecycle guarantee runs against both (the outcomes and the fence against a plain `rq
worker` too), in real `rq worker -w ...` and `reactor worker` processes: the worker process does the fenced start, heartbeats and writes the outcome; the
job only runs the handler. Faults are real: SIGKILL of the horse or the worker,
pg_terminate_backend of the worker's connection, RQ's job timeout.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import redis
from psycopg import sql
from rq import Queue
from rq import Worker as RqWorker
from rq.job import Job

from reactor import submit
from reactor.jobs import ENTRY_POINT, job_id
from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.roles import as_role, throwaway_role
from tests.support.rows import states, unwritten_for
from tests.support.servers import RedisServer, free_port
from tests.support.waiting import wait_for

CLASSES = {"fork": "reactor.Worker", "simple": "reactor.SimpleWorker"}
#: The worker classes and a plain `rq worker`, which runs the lifecycle inside the job.
ALL_KINDS = pytest.mark.parametrize("kind", ["rq", *sorted(CLASSES)])


@pytest.fixture(params=sorted(CLASSES))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def route(handler: str) -> str:
    return f"photo.process=tests.handlers.{handler}"


def start_ours(
    spawn: Callable[..., Process],
    env: Env,
    kind: str,
    *,
    burst: bool = False,
    handler: str | None = None,
    **extra_env: str,
) -> Process:
    """`rq worker -w reactor.Worker|SimpleWorker photo-process`, or a plain `rq worker` for
    kind "rq" (routes from REACTOR_ROUTES)."""
    if handler is not None:
        extra_env.setdefault("REACTOR_ROUTES", route(handler))
    worker_class = ("--worker-class", CLASSES[kind]) if kind in CLASSES else ()  # "rq": plain
    worker = start_worker(spawn, env, burst=burst, extra_args=worker_class, **extra_env)
    if not burst:
        # Ready before rows come: a job that waited in the queue for longer than a test's
        # stale_after would be rescued before it ran.
        worker.wait_for_line("Listening on")
    return worker


def burst_ours(spawn: Callable[..., Process], env: Env, kind: str, **extra: str) -> Process:
    worker = start_ours(spawn, env, kind, burst=True, **extra)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    return worker


def sweep(env: Env, handler: str, *args: str) -> dict[str, Any]:
    return env.cli_json("sweep", "--route", route(handler), *args)


def runs(conn: psycopg.Connection[Any], photo_id: str) -> list[tuple[str, int, str]]:
    return [
        tuple(r)
        for r in conn.execute(
            "SELECT photo_id, attempt, outcome FROM handler_runs WHERE photo_id = %s ORDER BY at",
            [photo_id],
        )
    ]


def row_of(conn: psycopg.Connection[Any], photo_id: str) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT state, attempts, last_error, next_retry_at FROM photo_jobs WHERE photo_id = %s",
        [photo_id],
    ).fetchone()
    assert row is not None
    return tuple(row)


def worker_backends(conn: psycopg.Connection[Any]) -> list[int]:
    return [
        int(pid)
        for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'photo-reactor worker'"
        )
    ]


def sessions(conn: psycopg.Connection[Any], database: str) -> int:
    """Sessions ever opened on `database`, read once every other client backend on it has
    exited: a backend's session may reach the count only as it exits, after its client left."""
    wait_for(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                [database],
            ).fetchone()
            == (0,)
        ),
        timeout=10,
        what="the database's other backends to exit",
    )
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT sessions FROM pg_stat_database WHERE datname = %s", [database]
    ).fetchone()
    assert row is not None
    return int(row[0])


# -- outcomes --------------------------------------------------------------------------------


def test_success_marks_done_with_the_handler_run_once(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1")
    assert sweep(env, "ok")["enqueued"] == 1
    worker = burst_ours(spawn, env, kind, handler="ok")
    assert row_of(conn, "p1") == ("done", 1, None, None)
    assert runs(conn, "p1") == [("p1", 1, "ok")]
    assert "worker_ready" in worker.output()


def test_a_forked_attempt_is_done_before_its_horse_has_recorded_it_in_rq(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    # The worker writes `done` when the horse reports the handler returned, while the horse
    # still does RQ's bookkeeping (here held at a gate), not after the horse has exited.
    submit(conn, "p1")
    assert sweep(env, "ok")["enqueued"] == 1
    worker = start_worker(
        spawn,
        env,
        extra_args=("--worker-class", "tests.gated_worker.BookkeepingGatedWorker"),
        REACTOR_ROUTES=route("ok"),
    )
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, interval=0.05, what="done")
    job = Job.fetch(
        job_id("photo.process", "p1", 1), connection=redis.Redis.from_url(env.redis_url)
    )
    assert job.get_status() == "started", worker.output()  # the horse is still at the gate
    conn.execute("INSERT INTO gates VALUES ('bookkeeping')")
    wait_for(lambda: job.get_status() == "finished", timeout=20, interval=0.05, what="finished")
    assert row_of(conn, "p1") == ("done", 1, None, None)
    assert runs(conn, "p1") == [("p1", 1, "ok")]


@ALL_KINDS
def test_retries_follow_the_backoff_then_succeed(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    start_reactor(spawn, "--route", route("flaky_twice"), "--sweep-interval", "60")
    start_ours(spawn, env, kind, REACTOR_RETRY_BASE_SECONDS="0.5")
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="done")
    assert row_of(conn, "p1") == ("done", 3, None, None)
    assert [(a, o) for _, a, o in runs(conn, "p1")] == [(1, "error"), (2, "error"), (3, "ok")]
    times = [
        r[0] for r in conn.execute("SELECT at FROM handler_runs WHERE photo_id = 'p1' ORDER BY at")
    ]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    for n, gap in enumerate(gaps, start=1):
        step = 0.5 * 2 ** (n - 1)
        assert step / 2 <= gap <= step + 1.5, gaps
    retried = conn.execute(
        "SELECT last_error FROM transitions WHERE new_state = 'pending' ORDER BY at"
    ).fetchall()
    assert retried == [
        ("RuntimeError: transient failure 1",),
        ("RuntimeError: transient failure 2",),
    ]


def test_spent_attempts_fail_the_row(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    start_reactor(spawn, "--route", route("always_fails"), "--sweep-interval", "60")
    start_ours(spawn, env, kind, REACTOR_RETRY_BASE_SECONDS="0.05")
    submit(conn, "p1", max_attempts=3)
    wait_for(lambda: row_of(conn, "p1")[0] == "failed", timeout=30, interval=0.05, what="failed")
    state, attempts, error, _ = row_of(conn, "p1")
    assert (state, attempts, error) == ("failed", 3, "RuntimeError: boom 3")
    assert len(runs(conn, "p1")) == 3


@ALL_KINDS
def test_an_error_message_with_a_nul_is_recorded_escaped(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    # Postgres text refuses NUL: written as is, the outcome would be lost and the row left
    # active until the stale rescue, whose error (RQ's traceback) holds the NUL again.
    submit(conn, "p1", max_attempts=2)
    sweep(env, "binary_failure")
    burst_ours(spawn, env, kind)
    state, attempts, error, _ = row_of(conn, "p1")
    assert (state, attempts) == ("pending", 1)
    assert error == "ValueError: not an image: \x89PNG\\x00\\x00 (1)"


@ALL_KINDS
def test_permanent_error_fails_after_one_attempt(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1")
    sweep(env, "permanent")
    burst_ours(spawn, env, kind)
    state, attempts, error, _ = row_of(conn, "p1")
    assert (state, attempts, error) == ("failed", 1, "PermanentError: this photo is corrupt")
    assert len(runs(conn, "p1")) == 1


@ALL_KINDS
def test_a_handler_that_returns_a_coroutine_fails_for_good_without_running(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """Nothing awaits a coroutine: an async handler's attempt was counted `done` while its
    work never ran."""
    submit(conn, "p1")
    sweep(env, "async_callable")
    burst_ours(spawn, env, kind)
    state, attempts, error, _ = row_of(conn, "p1")
    assert (state, attempts) == ("failed", 1)
    assert error == (
        "PermanentError: the handler returned a coroutine that nothing awaits:"
        " handlers are plain functions"
    )
    assert runs(conn, "p1") == []


@ALL_KINDS
def test_a_handler_s_child_that_exits_ends_there_and_the_attempt_is_done(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """A child the handler forked came back through the handler's caller: it reported a second
    outcome (a forking worker read two and recorded WorkHorseLost) or ran on as a second worker
    on the parent's sockets (in-process)."""
    for photo in ("p1", "p2"):
        submit(conn, photo)
    sweep(env, "forks_a_child_that_exits")
    burst_ours(spawn, env, kind)
    for photo in ("p1", "p2"):
        assert row_of(conn, photo) == ("done", 1, None, None)
        assert runs(conn, photo) == [(photo, 1, "ok")]


def test_a_horse_that_exits_without_a_report_is_a_lost_attempt_that_says_how(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    submit(conn, "p1", max_attempts=1)
    sweep(env, "exits_quietly")
    burst_ours(spawn, env, "fork")
    assert row_of(conn, "p1")[:3] == (
        "failed",
        1,
        "WorkHorseLost: the work horse ended before the handler returned (exit code 0)",
    )


@pytest.mark.slow  # a fault test: a process killed
def test_a_horse_killed_while_its_child_holds_the_report_pipe_is_a_lost_attempt_at_once(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    # The worker waits for the report or the horse's end, not for the pipe's end, which a
    # child of the handler may hold for as long as it lives.
    submit(conn, "p1", max_attempts=1)
    sweep(env, "dies_leaving_a_child")
    worker = start_ours(spawn, env, "fork")
    wait_for(lambda: row_of(conn, "p1")[0] == "failed", timeout=20, interval=0.05, what="failed")
    assert row_of(conn, "p1")[2] == (
        "WorkHorseLost: the work horse ended before the handler returned (killed by SIGKILL)"
    ), worker.output()
    conn.execute("INSERT INTO gates VALUES ('child')")


@ALL_KINDS
def test_system_exit_in_a_handler_is_a_failed_attempt_recorded_at_once(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """A plain `rq worker` wrote no outcome for a BaseException: the row stayed `active` until
    the stale rescue spent the attempt."""
    submit(conn, "p1", max_attempts=2)
    sweep(env, "system_exit")
    burst_ours(spawn, env, kind)
    state, attempts, error, next_retry_at = row_of(conn, "p1")
    assert (state, attempts, error) == ("pending", 1, "SystemExit: 3")
    assert next_retry_at is not None


@ALL_KINDS
def test_job_timeout_is_a_failed_attempt(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1")
    sweep(env, "sleeps", "--job-timeout", "1")
    burst_ours(spawn, env, kind, REACTOR_TEST_WORK_SECONDS="30")
    state, attempts, error, next_retry_at = row_of(conn, "p1")
    assert (state, attempts) == ("pending", 1)
    assert error.startswith("JobTimeoutException") and next_retry_at is not None
    assert runs(conn, "p1") == [("p1", 1, "started")]


def test_a_job_timeout_while_the_fenced_start_waits_is_not_absorbed(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    # In-process, the start is awaited inside RQ's job timeout: when it fires there,
    # the handler must not run (it would run with no time limit left).
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts) VALUES"
        " ('p1', 'photo.process', 'active', 1)"
    )
    start_ours(spawn, env, "simple", handler="ok")  # ready: its start-up writes are done
    with env.connect() as locker, locker.transaction():
        locker.execute("LOCK TABLE photo_jobs IN ACCESS EXCLUSIVE MODE")  # the start waits
        job = Queue("photo-process", connection=env.redis()).enqueue_call(
            ENTRY_POINT,
            args=("photo.process", "p1", 1),
            kwargs={"handler": "tests.handlers.ok"},
            job_id=job_id("photo.process", "p1", 1),
            timeout=1,
        )
        wait_for(lambda: job.get_status(refresh=True) == "failed", timeout=30, what="timed out")
    result = job.latest_result()
    assert result is not None and "JobTimeoutException" in (result.exc_string or "")
    assert runs(conn, "p1") == []
    assert row_of(conn, "p1")[:2] == ("active", 1)  # no outcome: the sweep re-dispatches it


def test_a_job_whose_start_raises_fails_alone_and_the_worker_goes_on(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    # A LATIN1 session cannot send this photo id: the fenced start raises a statement error.
    submit(conn, "p-€")
    submit(conn, "p2")
    sweep(env, "ok")
    worker = burst_ours(spawn, env, kind, handler="ok", PGCLIENTENCODING="LATIN1")
    assert "attempt_unstarted" in worker.output()
    assert row_of(conn, "p2")[:2] == ("done", 1)
    assert row_of(conn, "p-€")[:2] == ("active", 1)  # no outcome: the sweep re-dispatches it
    assert runs(conn, "p-€") == []


def test_password_in_a_handler_error_is_masked_everywhere(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1", max_attempts=1)
    sweep(env, "leaks_password")
    worker = burst_ours(spawn, env, kind)
    error = row_of(conn, "p1")[2]
    assert error == "RuntimeError: cannot fetch https://svc:***@photos.example/p1"
    assert "svc:***@photos.example" in worker.output()  # RQ logged the traceback, masked
    assert "S3cretPW" not in worker.output()
    job = Job.fetch("photo_2eprocess-p1-1", connection=env.redis())
    result = job.latest_result()
    assert result is not None and result.exc_string is not None
    assert "svc:***@photos.example" in result.exc_string
    assert "S3cretPW" not in result.exc_string


def test_plain_worker_masks_the_password_too(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    submit(conn, "p1", max_attempts=1)
    sweep(env, "leaks_password")
    worker = start_worker(spawn, env, burst=True)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    assert row_of(conn, "p1")[2] == "RuntimeError: cannot fetch https://svc:***@photos.example/p1"
    assert "S3cretPW" not in worker.output()
    result = Job.fetch("photo_2eprocess-p1-1", connection=env.redis()).latest_result()
    assert result is not None and result.exc_string is not None
    assert "S3cretPW" not in result.exc_string and "HandlerError" in result.exc_string


# -- fencing and liveness --------------------------------------------------------------------


@ALL_KINDS
def test_superseded_attempt_changes_nothing(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1")
    sweep(env, "gated")
    first = start_ours(spawn, env, kind, REACTOR_HEARTBEAT_SECONDS="3600")
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="attempt 1")
    wait_for(
        lambda: sweep(env, "gated", "--stale-after", "0.2")["rescued"] == 1,
        timeout=10,
        interval=0.1,
        what="rescue of attempt 1",
    )
    assert row_of(conn, "p1")[:2] == ("active", 2)
    second = start_ours(spawn, env, kind)
    wait_for(lambda: ("p1", 2, "started") in runs(conn, "p1"), timeout=20, what="attempt 2")
    # The superseded attempt finishes first, while attempt 2 still runs: it changes nothing.
    conn.execute("INSERT INTO gates VALUES ('p1:1')")
    first.wait_for_line("completion_superseded")
    assert ("p1", 1, "ok") in runs(conn, "p1")
    assert row_of(conn, "p1")[:2] == ("active", 2)
    conn.execute("INSERT INTO gates VALUES ('p1:2')")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, what="attempt 2 done")
    assert row_of(conn, "p1")[:2] == ("done", 2)
    done = conn.execute("SELECT attempts FROM transitions WHERE new_state = 'done'").fetchall()
    assert done == [(2,)]
    second.stop()


@pytest.mark.slow  # a 3 s handler outliving three stale_after periods
def test_heartbeats_from_the_worker_process_keep_a_long_handler_alive(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    start_reactor(
        spawn,
        "--route",
        route("slow_first_attempt"),
        "--stale-after",
        "1",
        "--sweep-interval",
        "0.3",
    )
    start_ours(spawn, env, kind, REACTOR_HEARTBEAT_SECONDS="0.2", REACTOR_TEST_WORK_SECONDS="3")
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="done")
    assert row_of(conn, "p1")[:2] == ("done", 1)
    assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 1, "ok")]


@pytest.mark.slow  # a fault test: a process killed, a server made to fail
def test_work_horse_killed_mid_handler_is_a_failed_attempt(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, "--route", route("slow_first_attempt"), "--sweep-interval", "60")
    worker = start_ours(
        spawn, env, "fork", REACTOR_RETRY_BASE_SECONDS="0.2", REACTOR_TEST_WORK_SECONDS="60"
    )
    submit(conn, "p1")
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="attempt 1")
    horse = conn.execute("SELECT pid FROM handler_runs WHERE photo_id = 'p1'").fetchone()
    assert horse is not None and horse[0] != worker.proc.pid
    os.kill(horse[0], signal.SIGKILL)
    # Recorded at once by the worker process (no wait for stale_after), then retried.
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="done")
    assert row_of(conn, "p1")[:2] == ("done", 2)
    retried = conn.execute(
        "SELECT last_error FROM transitions WHERE new_state = 'pending'"
    ).fetchall()
    assert retried == [
        ("WorkHorseLost: the work horse ended before the handler returned (killed by SIGKILL)",)
    ]
    assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 2, "started"), ("p1", 2, "ok")]


@pytest.mark.slow  # a fault test: a process killed, a server made to fail
def test_worker_process_killed_mid_handler_is_rescued_after_stale_after(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    kind: str,
    reap: list[int],
) -> None:
    start_reactor(
        spawn,
        "--route",
        route("slow_first_attempt"),
        "--stale-after",
        "1",
        "--sweep-interval",
        "0.3",
    )
    doomed = start_ours(
        spawn, env, kind, REACTOR_HEARTBEAT_SECONDS="0.2", REACTOR_TEST_WORK_SECONDS="60"
    )
    submit(conn, "p1")
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="attempt 1")
    horse = conn.execute("SELECT pid FROM handler_runs WHERE photo_id = 'p1'").fetchone()
    assert horse is not None
    reap.append(horse[0])  # the fork class's horse outlives its parent: stopped at the end
    doomed.kill()  # the worker process only: its heartbeats stop
    start_ours(spawn, env, kind)
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="rescued")
    assert row_of(conn, "p1")[:2] == ("done", 2)
    assert ("p1", 2, "ok") in runs(conn, "p1")


@pytest.mark.slow  # a fault test: a process killed, a server made to fail
@pytest.mark.parametrize("prepared", ["0", "1"], ids=["unnamed", "prepared"])
def test_connection_terminated_between_jobs_and_mid_handler(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    kind: str,
    prepared: str,
) -> None:
    # With prepared statements, the new session must have them prepared again.
    start_reactor(spawn, "--route", route("gated"), "--sweep-interval", "60")
    start_ours(
        spawn,
        env,
        kind,
        handler="gated",
        REACTOR_HEARTBEAT_SECONDS="0.2",
        REACTOR_PREPARED_STATEMENTS=prepared,
    )
    conn.execute("INSERT INTO gates VALUES ('p1:1')")
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, what="p1 done")
    # Between jobs: the worker's idle connection is cut.
    (backend,) = worker_backends(conn)
    conn.execute("SELECT pg_terminate_backend(%s)", [backend])
    submit(conn, "p2")
    wait_for(lambda: runs(conn, "p2") == [("p2", 1, "started")], timeout=20, what="p2 runs")
    # Mid-handler: cut it again while the handler waits; heartbeats reconnect.
    wait_for(lambda: worker_backends(conn), timeout=10, what="worker reconnected")
    for pid in worker_backends(conn):
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_for(
        lambda: worker_backends(conn) and worker_backends(conn) != [backend],
        timeout=10,
        what="heartbeat reconnected",
    )
    conn.execute("INSERT INTO gates VALUES ('p2:1')")
    wait_for(lambda: row_of(conn, "p2")[0] == "done", timeout=20, what="p2 done")
    assert row_of(conn, "p2")[:2] == ("done", 1)
    assert runs(conn, "p2") == [("p2", 1, "started"), ("p2", 1, "ok")]


@pytest.mark.parametrize("then", ["resumes", "dies"])
def test_a_sweep_between_rq_s_end_of_a_job_and_its_outcome_does_not_run_it_again(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], then: str
) -> None:
    # The work horse has RQ record the job finished and exits; the worker process writes the
    # outcome after that. A worker stopped (SIGSTOP) in between holds a row that is active
    # while RQ says finished: a sweep then must leave it, until stale_after has passed. With
    # `--results-ttl 0` the job must still be there (a missing job is re-dispatched at once).
    worker = start_worker(
        spawn,
        env,
        extra_args=("--worker-class", CLASSES["fork"], "--results-ttl", "0"),
        REACTOR_ROUTES=route("gated"),
    )
    worker.wait_for_line("Listening on")
    submit(conn, "p1")
    assert sweep(env, "gated", "--stale-after", "30")["enqueued"] == 1
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="attempt 1")
    os.kill(worker.proc.pid, signal.SIGSTOP)
    conn.execute("INSERT INTO gates VALUES ('p1:1')")
    key = Job.key_for(job_id("photo.process", "p1", 1))
    wait_for(lambda: env.redis().hget(key, "status") == b"finished", timeout=20, what="finished")
    assert row_of(conn, "p1")[:2] == ("active", 1)  # the outcome is still to be written
    result = sweep(env, "gated", "--stale-after", "30")
    assert (result["lost"], result["rescued"], result["rescue_failed"]) == (0, 0, 0)
    assert row_of(conn, "p1")[:2] == ("active", 1)
    if then == "resumes":
        os.kill(worker.proc.pid, signal.SIGCONT)
        wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, what="done")
        assert row_of(conn, "p1")[:2] == ("done", 1)
        assert not env.redis().exists(Job.key_for(job_id("photo.process", "p1", 2)))
        assert runs(conn, "p1") == [("p1", 1, "started"), ("p1", 1, "ok")]
        return
    # The worker dies before writing the outcome: the row is rescued once stale_after passed.
    worker.kill()
    wait_for(lambda: unwritten_for(conn, 1), what="the row unwritten for 1 s")
    assert sweep(env, "gated", "--stale-after", "1")["lost"] == 1
    assert row_of(conn, "p1")[:2] == ("active", 2)
    conn.execute("INSERT INTO gates VALUES ('p1:2')")
    start_ours(spawn, env, "fork", handler="gated")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, what="done")
    assert row_of(conn, "p1")[:2] == ("done", 2)


@pytest.mark.parametrize("kind_", sorted(CLASSES))
def test_a_re_armed_row_never_takes_an_earlier_life_s_job(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind_: str
) -> None:
    # Attempt 1 of 1 runs on a worker that then stops (SIGSTOP): the sweep fails the row as
    # lost, and `reactor requeue` arms it again. The new life must get a job of its own (a
    # new token), and the old run, once resumed, must not complete the new life.
    worker = start_ours(spawn, env, kind_, handler="gated")
    submit(conn, "p1", max_attempts=1)
    assert sweep(env, "gated", "--stale-after", "30")["enqueued"] == 1
    wait_for(lambda: runs(conn, "p1") == [("p1", 1, "started")], timeout=20, what="token 1")
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: unwritten_for(conn, 1), what="the row unwritten for 1 s")
        assert sweep(env, "gated", "--stale-after", "1")["rescue_failed"] == 1
        assert row_of(conn, "p1")[0] == "failed"
        assert run_cli(env, "requeue", "p1").returncode == 0
        result = sweep(env, "gated", "--stale-after", "30")
        assert (result["claimed"], result["enqueued"]) == (1, 1), result
        assert row_of(conn, "p1")[:2] == ("active", 1)
        assert env.redis().exists(Job.key_for(job_id("photo.process", "p1", 2)))
        conn.execute("INSERT INTO gates VALUES ('p1:1'), ('p1:2')")
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    wait_for(lambda: ("p1", 2, "ok") in runs(conn, "p1"), timeout=30, what="the new life ran")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=20, what="done")
    tokens = conn.execute(
        "SELECT prior_attempts, attempts FROM photo_jobs WHERE photo_id = 'p1'"
    ).fetchone()
    assert tokens == (1, 1)


# -- deployment ------------------------------------------------------------------------------


def test_plain_rq_worker_and_reactor_worker_share_a_queue(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    start_reactor(spawn, "--route", route("fails_a_fifth_of_first_attempts"))
    plain = start_worker(spawn, env, REACTOR_RETRY_BASE_SECONDS="0.1")
    ours = start_ours(spawn, env, kind, REACTOR_RETRY_BASE_SECONDS="0.1")
    with conn.transaction():
        for i in range(100):
            submit(conn, f"photo-{i}")
    wait_for(lambda: states(conn) == {"done": 100}, timeout=180, interval=0.2, what="all done")
    successes = conn.execute(
        "SELECT r.photo_id, r.attempt, j.attempts FROM handler_runs r"
        " JOIN photo_jobs j USING (photo_id) WHERE r.outcome = 'ok'"
    ).fetchall()
    assert len(successes) == 100 and len({p for p, _, _ in successes}) == 100
    assert all(attempt == final for _, attempt, final in successes)
    assert "Job OK" in plain.output() and "Job OK" in ours.output()


@pytest.mark.slow  # a load: 81 jobs through both paths, then every session counted
def test_no_postgres_session_is_opened_per_job(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "warm")
    with conn.transaction():
        for i in range(60):
            submit(conn, f"p{i}")
    sweep(env, "noop")
    before = sessions(conn, env.database_name)
    burst_ours(spawn, env, kind, handler="noop")
    opened = sessions(conn, env.database_name) - before
    assert states(conn) == {"done": 61}
    # The worker's connections at start (one, at times two; three seen once on a loaded CI
    # run), never one per job (61 jobs); the plain path below opens one per forked job.
    assert opened <= 5, opened
    # What the plain `rq worker` path costs, measured the same way: the test can fail.
    with conn.transaction():
        for i in range(20):
            submit(conn, f"q{i}")
    sweep(env, "noop")
    before = sessions(conn, env.database_name)
    worker = start_worker(
        spawn,
        env,
        burst=True,
        extra_args=() if kind == "fork" else ("--worker-class", "rq.worker.SimpleWorker"),
    )
    assert worker.proc.wait(timeout=60) == 0
    assert sessions(conn, env.database_name) - before >= (20 if kind == "fork" else 1)


def test_the_fenced_start_stamps_only_a_row_whose_claim_is_old(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """A row claimed a moment ago is started without a write (the claim just stamped it); a
    row whose job waited in the queue for longer than a heartbeat interval is stamped at
    start, so the sweep cannot take it for a dead worker's before its first heartbeat."""
    submit(conn, "fresh")
    submit(conn, "old")
    sweep(env, "gated")  # both active at attempt 1, their jobs queued in this order
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep our updated_at
        conn.execute(
            "UPDATE photo_jobs SET updated_at = now() - interval '1 hour' WHERE photo_id = 'old'"
        )

    def version(photo_id: str) -> tuple[str, float]:
        row = conn.execute(
            "SELECT xmin::text,"
            " extract(epoch FROM now() - greatest(updated_at, heartbeat_at))::float8"
            " FROM photo_jobs WHERE photo_id = %s",
            [photo_id],
        ).fetchone()
        assert row is not None
        return str(row[0]), float(row[1])

    fresh_before, old_before = version("fresh"), version("old")
    start_ours(spawn, env, kind, handler="gated", REACTOR_HEARTBEAT_SECONDS="3600")
    wait_for(lambda: runs(conn, "fresh") == [("fresh", 1, "started")], timeout=30, what="start")
    assert version("fresh")[0] == fresh_before[0], "a fresh row was written at start"
    conn.execute("INSERT INTO gates VALUES ('fresh:1')")
    wait_for(lambda: runs(conn, "old") == [("old", 1, "started")], timeout=30, what="start")
    old_xmin, old_age = version("old")
    assert old_xmin != old_before[0] and old_age < 60, (old_before, old_xmin, old_age)
    conn.execute("INSERT INTO gates VALUES ('old:1')")
    wait_for(lambda: states(conn) == {"done": 2}, timeout=30, what="both done")


def test_a_row_only_read_at_start_has_its_first_beat_an_interval_after_its_claim(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """A row whose job waited in the queue for less than a heartbeat interval is not written
    at start, and its first heartbeat is due an interval after the claim's stamp, not after
    the start: the row's stamp is never more than 1.25 intervals old while the attempt runs."""
    interval, waited = 8.0, 6.0
    submit(conn, "blocker")
    submit(conn, "waited")
    sweep(env, "gated")  # both active at attempt 1, their jobs queued in this order
    start_ours(spawn, env, kind, handler="gated", REACTOR_HEARTBEAT_SECONDS=str(interval))
    wait_for(lambda: runs(conn, "blocker") == [("blocker", 1, "started")], timeout=30, what="1st")
    with conn.transaction():  # while the worker is busy: the second job has waited so long
        conn.execute("SET LOCAL session_replication_role = replica")  # keep our updated_at
        conn.execute(
            "UPDATE photo_jobs SET updated_at = now() - make_interval(secs => %s)"
            " WHERE photo_id = 'waited'",
            [waited],
        )

    def version() -> tuple[str, float]:
        row = conn.execute(
            "SELECT xmin::text, extract(epoch FROM greatest(updated_at, heartbeat_at))::float8"
            " FROM photo_jobs WHERE photo_id = 'waited'"
        ).fetchone()
        assert row is not None
        return str(row[0]), float(row[1])

    claimed_xmin, claimed_at = version()
    conn.execute("INSERT INTO gates VALUES ('blocker:1')")
    wait_for(lambda: runs(conn, "waited") == [("waited", 1, "started")], timeout=30, what="2nd")
    assert version()[0] == claimed_xmin, "a row claimed less than an interval ago was written"
    wait_for(lambda: version()[0] != claimed_xmin, timeout=30, what="the first heartbeat")
    beaten_at = version()[1]
    # Due an interval after the claim's stamp, seen within a quarter interval (the thread's
    # tick), with a second of slack; beating an interval after the start would take 14 s.
    assert beaten_at - claimed_at <= interval * 1.25 + 1.0, beaten_at - claimed_at
    conn.execute("INSERT INTO gates VALUES ('waited:1')")
    wait_for(lambda: states(conn) == {"done": 2}, timeout=30, what="both done")


def test_a_role_that_may_not_insert_rows_still_starts_and_works(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """The worker's start-up rehearsal inserts a throwaway row (rolled back); a role that may
    only read and update `photo_jobs` skips that part and works as any other."""
    with throwaway_role(env) as role:
        grants = (
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}",
            "GRANT UPDATE ON photo_jobs TO {role}",
            "GRANT INSERT ON handler_runs, transitions TO {role}",
        )
        for grant in grants:
            conn.execute(sql.SQL(grant).format(role=sql.Identifier(role)))
        submit(conn, "p1")
        sweep(env, "ok")
        worker = burst_ours(
            spawn, env, kind, handler="ok", DATABASE_URL=as_role(env.database_url, role)
        )
        assert "worker_ready" in worker.output()
        assert row_of(conn, "p1") == ("done", 1, None, None)
        assert runs(conn, "p1") == [("p1", 1, "ok")]


def test_reactor_worker_command_serves_the_routed_queues(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    submit(conn, "p1")
    sweep(env, "ok")
    simple = ("--simple",) if kind == "simple" else ()
    worker = spawn(
        "-m", "reactor", "worker", "--route", route("ok"), "--burst", *simple, name="worker"
    )
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    assert row_of(conn, "p1")[:2] == ("done", 1)
    assert "queues=photo-process" in worker.output()


@pytest.mark.parametrize("quiet", [("--log-level", "warning"), ("-q",)], ids=["warning", "quiet"])
def test_reactor_worker_logs_at_the_level_asked_rq_s_lines_too(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], quiet: tuple[str, ...]
) -> None:
    with conn.transaction():
        for i in range(20):
            submit(conn, f"p{i}")
    sweep(env, "ok")
    level, worker_args = (quiet, ()) if quiet[0] == "--log-level" else ((), quiet)
    worker = spawn(
        "-m",
        "reactor",
        *level,
        "worker",
        *worker_args,
        "--route",
        route("ok"),
        "--burst",
        "--simple",
        name="worker",
    )
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    assert states(conn) == {"done": 20}
    # RQ alone wrote about four lines a job at INFO.
    assert len(worker.output().splitlines()) < 10, worker.output()


def test_an_idle_reactor_worker_stops_on_sigterm(
    env: Env, spawn: Callable[..., Process], kind: str
) -> None:
    simple = ("--simple",) if kind == "simple" else ()
    worker = spawn("-m", "reactor", "worker", "--route", route("ok"), *simple, name="worker")
    client = env.redis()
    # Idle: registered, its signal handlers installed, blocked waiting for a job.
    wait_for(
        lambda: any(w.get_state() == "idle" for w in RqWorker.all(connection=client)),
        timeout=30,
        what="the worker idle in RQ's dequeue",
    )
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.exit_code(timeout=20) == 0, worker.output()
    assert "worker_restarting" not in worker.output()


def test_rq_worker_pool_runs_the_class_with_one_session_per_worker(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    kind: str,
    reap: list[int],
) -> None:
    start_reactor(spawn, "--route", route("ok"))
    pool = spawn(
        "-m", "rq.cli", "worker-pool", "photo-process", "--url", env.redis_url,
        "-w", CLASSES[kind], "-n", "2",
        name="worker-pool", extra_env={"REACTOR_ROUTES": route("ok")},
    )  # fmt: skip
    wait_for(lambda: pool.output().count("Listening on") == 2, timeout=60, what="2 pooled workers")
    # The pool's workers are its children: never leave them behind if the test fails.
    children = {int(p) for p in re.findall(r"started with PID (\d+)", pool.output())}
    reap.extend(children)
    ready = f"worker_ready class={CLASSES[kind].rsplit('.', 1)[1]} "
    assert pool.output().count(ready) == 2, pool.output()
    backends = sorted(worker_backends(conn))
    assert len(backends) == 2, backends
    with conn.transaction():
        for i in range(60):
            submit(conn, f"p{i}")
    wait_for(lambda: states(conn) == {"done": 60}, timeout=120, interval=0.1, what="all done")
    ran = conn.execute("SELECT photo_id, attempt FROM handler_runs WHERE outcome = 'ok'").fetchall()
    assert sorted(ran) == sorted((f"p{i}", 1) for i in range(60))
    # Every job went through the two sessions the workers opened at start.
    assert sorted(worker_backends(conn)) == backends
    pool.proc.send_signal(signal.SIGTERM)
    assert pool.exit_code(timeout=30) == 0, pool.output()
    assert not [pid for pid in children if _alive(pid)]


def test_the_worker_key_keeps_rq_s_ttl_between_jobs(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """The classes coalesce RQ's renewals of the worker's key (what `rq info` lists), but an
    idle worker's key still has RQ's TTL (`worker_ttl` + 60 s), not a job's shorter one."""
    start_reactor(spawn, "--route", route("ok"))
    start_ours(spawn, env, kind, handler="ok")
    client = env.redis()
    with conn.transaction():
        for i in range(30):
            submit(conn, f"p{i}")
    wait_for(lambda: states(conn) == {"done": 30}, timeout=60, interval=0.1, what="all done")
    # The row is `done` before RQ has finished with the job: read the worker's state afresh.
    wait_for(
        lambda: [w.get_state() for w in RqWorker.all(connection=client)] == ["idle"],
        timeout=20,
        what="the worker idle again",
    )
    [worker] = RqWorker.all(connection=client)
    # RQ's default worker_ttl is 420 s; a job's start sets min(job timeout, 30) + 60 s.
    assert client.ttl(worker.key) > 400


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- start-up checks -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["reactor", "rq"])
def test_unmigrated_database_exits_2_with_one_line(
    env: Env, spawn: Callable[..., Process], empty_database: str, command: str
) -> None:
    extra = {"DATABASE_URL": empty_database}
    if command == "reactor":
        proc = spawn("-m", "reactor", "worker", "--burst", name="worker", extra_env=extra)
    else:
        proc = start_ours(spawn, env, "fork", burst=True, **extra)
    assert proc.proc.wait(timeout=60) == 2, proc.output()
    proc._reader.join(timeout=5)
    lines = [line for line in proc.lines if line.strip()]
    assert len(lines) == 1, lines
    assert "database is not migrated" in lines[0]


def test_an_unimportable_handler_stops_the_start_and_spends_no_attempt(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    """A worker whose route names a handler it cannot import (a forgotten PYTHONPATH) exits
    2 in one line naming it, and the row's job stays queued, untouched, for a worker that can
    run it: no attempt is spent."""
    routes = [route("ok"), "photo.broken=myapp.photos.process@photo-process"]
    start_reactor(spawn, "--route", routes[0], "--route", routes[1], "--sweep-interval", "60")
    submit(conn, "p2", "photo.broken")
    wait_for(lambda: row_of(conn, "p2")[:2] == ("active", 1), timeout=20, what="dispatched")
    worker = start_worker(
        spawn,
        env,
        extra_args=("--worker-class", CLASSES[kind]),
        REACTOR_ROUTES=",".join(routes),
    )
    assert worker.exit_code(timeout=60) == 2, worker.output()
    errors = [line for line in worker.lines if "error" in line.lower()]
    assert len(errors) == 1, worker.output()
    assert (
        "type photo.broken: cannot import handler myapp.photos.process: No module named 'myapp'"
        " (its jobs stay queued, no attempt spent" in errors[0]
    )
    key = Job.key_for(job_id("photo.broken", "p2", 1))
    assert env.redis().hget(key, "status") == b"queued"
    assert row_of(conn, "p2") == ("active", 1, None, None)


def test_an_async_def_handler_stops_the_start(
    env: Env, spawn: Callable[..., Process], kind: str
) -> None:
    worker = start_worker(
        spawn,
        env,
        extra_args=("--worker-class", CLASSES[kind]),
        REACTOR_ROUTES=route("async_def"),
    )
    assert worker.exit_code(timeout=60) == 2, worker.output()
    errors = [line for line in worker.lines if "error" in line.lower()]
    assert len(errors) == 1, worker.output()
    assert (
        "cannot import handler tests.handlers.async_def:"
        " TypeError: async_def is an async def: handlers are plain functions" in errors[0]
    )


def test_a_worker_started_before_its_reactor_waits_for_the_routes_then_serves_them(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    # As a supervisor or compose starts them: the worker first, with no route recorded yet.
    worker = spawn(
        "-m",
        "reactor",
        "worker",
        *(("--simple",) if kind == "simple" else ()),
        name="worker",
        extra_env={"REACTOR_ROUTES": ""},
    )
    worker.wait_for_line("worker_waiting_for_routes")
    assert worker.proc.poll() is None
    # Not `default`, which it will not serve.
    waiting = next(x for x in worker.lines if "worker_waiting_for_routes" in x)
    assert "queues=(the routed ones: none yet) " in waiting
    start_reactor(spawn, "--route", route("ok"))
    worker.wait_for_line("worker_ready")
    # Given no queue, `reactor worker` serves the routed ones only, not RQ's `default`.
    assert "queues=photo-process " in next(x for x in worker.lines if "worker_ready" in x)
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, what="served")


def test_rq_worker_with_our_class_and_no_queue_serves_the_routed_queues(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    start_reactor(spawn, "--route", route("ok") + "@photos")
    # RQ's CLI listens on `default` when given no queue name.
    worker = spawn(
        "-m",
        "rq.cli",
        "worker",
        "--url",
        env.redis_url,
        "--worker-class",
        CLASSES[kind],
        name="worker",
        extra_env={"REACTOR_ROUTES": ""},
    )
    worker.wait_for_line("default, photos")  # RQ: "*** Listening on default, photos..."
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, what="served")


def burst_attempt(
    spawn: Callable[..., Process], env: Env, worker_class: str, attempt: int = 1
) -> Process:
    """Enqueue `attempt` of p1 as the reactor would, whatever its row says, and start a burst
    worker of `worker_class` on it."""
    Queue("photo-process", connection=env.redis()).enqueue(
        ENTRY_POINT,
        "photo.process",
        "p1",
        attempt,
        handler="tests.handlers.ok",
        job_id=job_id("photo.process", "p1", attempt),
        meta={"type": "photo.process", "photo_id": "p1", "token": attempt},
    )
    return start_worker(
        spawn,
        env,
        burst=True,
        extra_args=("--worker-class", worker_class),
        REACTOR_ROUTES=route("ok"),
    )


@pytest.mark.parametrize("worker_class", [*CLASSES.values(), "rq.worker.Worker"])
def test_a_job_whose_claim_commit_was_lost_is_refused_and_the_next_claim_replaces_it(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], worker_class: str
) -> None:
    """The reactor enqueued attempt 1 but its COMMIT was lost: the row is still pending at
    token 0. The job does not run (nothing claimed the row), and the next claim of the row
    finds the job ended and enqueues attempt 1 again, which runs."""
    submit(conn, "p1")
    worker = burst_attempt(spawn, env, worker_class)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    job = Job.fetch(job_id("photo.process", "p1", 1), connection=env.redis())
    assert job.return_value() == "skipped"
    assert runs(conn, "p1") == [] and row_of(conn, "p1")[:2] == ("pending", 0)
    swept = env.cli_json("sweep", "--route", route("ok"))
    assert (swept["claimed"], swept["enqueued"]) == (1, 1), swept
    worker = start_worker(
        spawn,
        env,
        burst=True,
        extra_args=("--worker-class", worker_class),
        REACTOR_ROUTES=route("ok"),
    )
    assert worker.exit_code(timeout=60) == 0, worker.output()
    assert row_of(conn, "p1") == ("done", 1, None, None)
    assert runs(conn, "p1") == [("p1", 1, "ok")]


def test_a_job_without_a_row_is_skipped_with_a_warning(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    # In practice a worker whose DATABASE_URL is not its reactor's: it must say so.
    worker = burst_attempt(spawn, env, CLASSES[kind])
    assert worker.exit_code(timeout=60) == 0, worker.output()
    worker.wait_for_line("attempt_skipped")
    (line,) = [line for line in worker.lines if "attempt_skipped" in line]
    assert "row missing: is DATABASE_URL the reactor's database?" in line
    assert runs(conn, "p1") == []


@pytest.mark.parametrize("worker_class", [*CLASSES.values(), "rq.worker.Worker"])
@pytest.mark.parametrize(
    "row",
    [("active", 2), ("pending", 1), ("pending", 2), ("done", 1)],
    ids=["superseded", "failed-back", "retrying", "done"],
)
def test_a_job_whose_attempt_is_not_the_row_s_does_not_run(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    worker_class: str,
    row: tuple[str, int],
) -> None:
    """A job dequeued late, after its row moved on (rescued as a new attempt, failed back to
    pending by this attempt, retried, or finished by another job), is refused at its fenced
    start: its handler does not run and the row keeps what the newer attempt wrote."""
    submit(conn, "p1")
    conn.execute("UPDATE photo_jobs SET state = %s, attempts = %s WHERE photo_id = 'p1'", list(row))
    worker = burst_attempt(spawn, env, worker_class)
    assert worker.exit_code(timeout=60) == 0, worker.output()
    job = Job.fetch(job_id("photo.process", "p1", 1), connection=env.redis())
    assert job.return_value() == "skipped"
    if worker_class in CLASSES.values():  # they log; a plain worker's job only returns
        worker.wait_for_line("attempt_skipped")
    assert runs(conn, "p1") == []
    assert row_of(conn, "p1")[:2] == row


@pytest.mark.parametrize("worker_class", [*CLASSES.values(), "rq.worker.Worker"])
@pytest.mark.parametrize("ends", ["commit", "rollback"])
def test_a_job_started_before_its_rescue_commits_waits_for_it(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    worker_class: str,
    ends: str,
) -> None:
    """The sweep's rescue moves a row from attempt 1 to 2 and enqueues job 2 before its
    COMMIT, so a worker can start job 2 while the rescue is still open. Its start waits:
    committed, attempt 2 runs; rolled back (the COMMIT lost), job 2 is refused and the row
    stays at attempt 1 for the next sweep (no attempt spent, nothing taken over)."""
    submit(conn, "p1")
    conn.execute("UPDATE photo_jobs SET state = 'active', attempts = 1 WHERE photo_id = 'p1'")
    with env.connect(autocommit=False) as rescue:
        rescue.execute("UPDATE photo_jobs SET attempts = 2 WHERE photo_id = 'p1'")
        worker = burst_attempt(spawn, env, worker_class, attempt=2)
        wait_for(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                ).fetchone()
                == (1,)
            ),
            timeout=30,
            what="the worker's start waiting on the rescue's row lock",
        )
        rescue.commit() if ends == "commit" else rescue.rollback()
    assert worker.exit_code(timeout=60) == 0, worker.output()
    if ends == "commit":
        assert runs(conn, "p1") == [("p1", 2, "ok")]
        assert row_of(conn, "p1")[:2] == ("done", 2)
    else:
        job = Job.fetch(job_id("photo.process", "p1", 2), connection=env.redis())
        assert job.return_value() == "skipped"
        assert runs(conn, "p1") == []
        assert row_of(conn, "p1")[:2] == ("active", 1)


def test_reactor_worker_says_at_once_that_redis_is_unreachable_and_waits_for_it(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    worker = spawn(
        "-m",
        "reactor",
        "worker",
        "--simple",
        "--route",
        route("ok"),
        "--redis-url",
        url,
        name="worker",
    )
    started = time.monotonic()
    worker.wait_for_line("worker_redis_unavailable", timeout=30)
    # Said at once (the refused connection), naming where; the process waits, it does not exit.
    assert time.monotonic() - started < 10
    (line,) = [line for line in worker.lines if "worker_redis_unavailable" in line]
    assert f"127.0.0.1:{port}" in line
    assert worker.proc.poll() is None
    server = RedisServer(port=port)
    try:
        worker.wait_for_line("worker_redis_available", timeout=30)
        submit(conn, "p1")
        assert env.cli_json("sweep", "--route", route("ok"), "--redis-url", url)["enqueued"] == 1
        wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, what="served")
    finally:
        worker.kill_all()
        server.close()


def _reactor_and_reactor_worker(
    spawn: Callable[..., Process], served: str, kind: str, redis_url: str
) -> Process:
    """A reactor and a `reactor worker` (`kind`: fork or simple) of route `served`, both on
    the Redis at `redis_url`; the worker."""
    start_reactor(spawn, "--route", served, REDIS_URL=redis_url)
    return _reactor_worker(spawn, served, kind, redis_url)


def _reactor_worker(
    spawn: Callable[..., Process], served: str, kind: str, redis_url: str
) -> Process:
    """A `reactor worker` (`kind`: fork or simple) of route `served` on the Redis at `redis_url`."""
    simple = ("--simple",) if kind == "simple" else ()
    return spawn(
        "-m",
        "reactor",
        "worker",
        "--route",
        served,
        *simple,
        name="worker",
        extra_env={"REDIS_URL": redis_url},
    )


@pytest.mark.parametrize("outage", [pytest.param(3.0, id="3s"), pytest.param(60.0, id="60s")])
@pytest.mark.slow  # a fault test: a process killed, a server made to fail
def test_reactor_worker_rides_out_a_redis_restart(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    private_redis: RedisServer,
    kind: str,
    outage: float,
) -> None:
    """Redis stopped (its data gone), started again on the same port: the worker keeps
    running, and rows committed after the restart are done, the outage shorter or longer than
    the worker's Redis retries (about 40 s)."""
    worker = _reactor_and_reactor_worker(spawn, route("ok"), kind, private_redis.url)
    submit(conn, "before")
    wait_for(lambda: row_of(conn, "before")[0] == "done", timeout=30, what="served before")
    private_redis.stop()
    # The outage itself: a duration, not a synchronisation.
    time.sleep(outage)
    assert worker.proc.poll() is None, worker.output()
    private_redis.start()
    for i in range(3):
        submit(conn, f"after-{i}")
    wait_for(
        lambda: [row_of(conn, f"after-{i}")[0] for i in range(3)] == ["done"] * 3,
        timeout=60,
        what="rows committed after the restart done",
    )
    assert worker.proc.poll() is None, worker.output()
    assert [r[2] for r in runs(conn, "after-0")] == ["ok"]


@pytest.mark.slow  # a fault test: a process killed, a server made to fail
def test_reactor_worker_rides_out_a_redis_refusing_writes_mid_job(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    private_redis: RedisServer,
    kind: str,
) -> None:
    """Redis full (maxmemory reached, noeviction) while a job runs: RQ's bookkeeping after the
    job and its teardown are refused (an error no retry helps). The worker starts RQ's loop
    again, once Redis takes writes it serves new rows, and it never exits."""
    worker = _reactor_and_reactor_worker(spawn, route("gated"), kind, private_redis.url)
    client = redis.Redis.from_url(private_redis.url)
    env.cleanups.append(client.close)
    submit(conn, "held")
    wait_for(lambda: runs(conn, "held") == [("held", 1, "started")], timeout=30, what="started")
    client.config_set("maxmemory", 1)
    try:
        conn.execute("INSERT INTO gates (name) VALUES ('held:1')")

        def refused() -> bool:
            return worker.proc.poll() is not None or "worker_restarting" in worker.output()

        wait_for(refused, timeout=60, what="RQ's loop refused by Redis")
        assert worker.proc.poll() is None, worker.output()
    finally:
        client.config_set("maxmemory", 0)
    for i in range(3):
        conn.execute("INSERT INTO gates (name) VALUES (%s)", [f"after-{i}:1"])
        submit(conn, f"after-{i}")
    wait_for(
        lambda: [row_of(conn, f"after-{i}")[0] for i in range(3)] == ["done"] * 3,
        timeout=60,
        what="rows served once Redis takes writes",
    )
    assert worker.proc.poll() is None, worker.output()


def test_reactor_worker_refused_by_redis_exits_2_in_one_line(
    env: Env, spawn: Callable[..., Process]
) -> None:
    server = RedisServer(password="right")
    try:
        wrong = f"redis://:wrong@127.0.0.1:{server.port}/0"
        worker = spawn(
            "-m",
            "reactor",
            "worker",
            "--simple",
            "--route",
            route("ok"),
            name="worker",
            extra_env={"REDIS_URL": wrong},
        )
        assert worker.exit_code(timeout=60) == 2, worker.output()
        lines = [line for line in worker.lines if line.strip()]
        assert len(lines) == 1 and "Redis refused the worker" in lines[0], lines
        assert "wrong" not in lines[0]
    finally:
        server.close()


@pytest.mark.slow  # waits out restarts of RQ's loop (1 + 2 + 4 s)
def test_reactor_worker_restarts_a_loop_that_keeps_failing_less_and_less_often(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """Every start of RQ's loop fails (the set of workers is a key of another type): the
    worker tries again after 1, 2, 4... s, not every second forever, and serves once the key
    is repaired."""
    client = redis.Redis.from_url(env.redis_url)
    env.cleanups.append(client.close)
    client.set("rq:workers", "not a set")
    worker = _reactor_and_reactor_worker(spawn, route("ok"), "simple", env.redis_url)

    def pauses() -> list[str]:
        return re.findall(r"worker_restarting in=(\d+)s \(Redis failed", worker.output())

    wait_for(lambda: len(pauses()) >= 3, timeout=30, what="three restarts")
    assert pauses()[:3] == ["1", "2", "4"], worker.output()
    client.delete("rq:workers")
    submit(conn, "p1")
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, interval=0.05, what="done")
    assert worker.proc.poll() is None, worker.output()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.exit_code(timeout=30) == 0, worker.output()
    # A SIGTERM during a pause stops the worker at once, cleanly.
    client.set("rq:workers", "not a set")
    again = _reactor_worker(spawn, route("ok"), "simple", env.redis_url)
    wait_for(lambda: "worker_restarting in=2s" in again.output(), timeout=30, what="a pause")
    again.proc.send_signal(signal.SIGTERM)
    assert again.exit_code(timeout=1.5) == 0, again.output()
    assert "worker_stopped" in again.output()
