"""Start-up: a Postgres session lost after the server answered is tried again. A reactor whose
backend is terminated while it records its routes, or after, while it rehearses a claim,
starts with its routes recorded once and dispatches; a stop asked for during those retries
ends them (exit 0). A worker whose backend is terminated while it checks the schema starts
and runs its jobs."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.locks import lock_waiter
from tests.support.notify_socket import NotifySocket
from tests.support.processes import Process, start_worker
from tests.support.rows import insert_rows, states
from tests.support.rq_state import queue_ids
from tests.support.waiting import wait_for


def locked(env: Env, table: str) -> psycopg.Connection[Any]:
    """A session of its own holding `table` locked (ACCESS EXCLUSIVE) until it rolls back."""
    blocker = psycopg.connect(env.database_url)
    env.cleanups.append(blocker.close)
    blocker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    return blocker


@pytest.mark.parametrize(
    "table", ["reactor_routes", "photo_jobs"], ids=["recording-routes", "routes-recorded"]
)
def test_a_session_terminated_during_the_start_is_tried_again(
    env: Env, spawn: Callable[..., Process], table: str
) -> None:
    admin = env.connect()
    # Hold the start-up where it records its routes (reactor_routes) or where it rehearses a
    # claim once they are recorded (photo_jobs), then end its session there.
    blocker = locked(env, table)
    reactor = spawn("-m", "reactor", "run", name="reactor")

    pid = wait_for(
        lambda: lock_waiter(admin, "photo-reactor work"),
        what=f"the reactor's start-up waiting on {table}",
    )
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    blocker.rollback()

    reactor.wait_for_line("startup_retry attempt=1")
    reactor.wait_for_line("reactor_started")
    insert_rows(admin, 3)
    client = redis.Redis.from_url(env.redis_url)
    wait_for(lambda: len(queue_ids(client)) == 3, what="three jobs queued")
    # The claims' COMMIT follows their jobs into the queue.
    wait_for(lambda: states(admin) == {"active": 3}, what="the claims committed")
    recorded = admin.execute(
        "SELECT type, reactor_routes_live(lock_key) FROM reactor_routes"
    ).fetchall()
    assert recorded == [("photo.process", True)]


def test_a_stop_during_the_start_s_retries_ends_them_and_exits_0(
    env: Env, spawn: Callable[..., Process], tmp_path: Path
) -> None:
    notify = NotifySocket(str(tmp_path / "notify"))
    env.cleanups.append(notify.close)
    admin = env.connect()
    locked(env, "reactor_routes")
    reactor = spawn(
        "-m",
        "reactor",
        "run",
        name="reactor",
        extra_env={"NOTIFY_SOCKET": notify.sock.getsockname()},
    )
    first = wait_for(
        lambda: lock_waiter(admin, "photo-reactor work"),
        what="the start-up waiting on reactor_routes",
    )
    admin.execute("SELECT pg_terminate_backend(%s)", [first])
    second = wait_for(
        lambda: lock_waiter(admin, "photo-reactor work", not_in={first}),
        what="the retry waiting on reactor_routes",
    )
    reactor.proc.send_signal(signal.SIGTERM)
    notify.wait("STOPPING=1")  # the stop is asked for; the try under way still waits
    admin.execute("SELECT pg_terminate_backend(%s)", [second])  # the try under way fails
    assert reactor.exit_code(timeout=20) == 0, reactor.output()
    assert "reactor_stopped during=start-up" in reactor.output()
    assert "reactor_started" not in reactor.output()


@pytest.mark.parametrize("worker_class", ["reactor.SimpleWorker", "reactor.Worker"])
def test_a_worker_s_session_terminated_while_it_checks_the_schema_is_reopened(
    env: Env, spawn: Callable[..., Process], worker_class: str
) -> None:
    admin = env.connect()
    admin.execute(SCHEMA)
    blocker = locked(env, "reactor_migrations")
    worker = start_worker(
        spawn,
        env,
        extra_args=("--worker-class", worker_class),
        REACTOR_ROUTES="photo.process=tests.handlers.ok",
    )

    pid = wait_for(
        lambda: lock_waiter(admin, "photo-reactor worker"),
        what="the worker's schema check waiting on reactor_migrations",
    )
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    blocker.rollback()
    worker.wait_for_line("worker_ready")
    insert_rows(admin, 1)
    swept = run_cli(env, "sweep", "--route", "photo.process=tests.handlers.ok")
    assert swept.returncode == 0, swept.stderr
    wait_for(lambda: states(admin) == {"done": 1}, timeout=30, what="the job done")
