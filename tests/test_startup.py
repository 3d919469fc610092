"""A reactor's start-up: a Postgres session lost after the server answered (a backend
terminated while it records its routes, or after, while it rehearses a claim) is tried again;
the reactor starts, its routes recorded once, and dispatches."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
import redis

from tests.support.env import Env
from tests.support.processes import Process
from tests.support.rows import insert_rows, states
from tests.support.rq_state import queue_ids
from tests.support.waiting import wait_for


@pytest.mark.parametrize(
    "table", ["reactor_routes", "photo_jobs"], ids=["recording-routes", "routes-recorded"]
)
def test_a_session_terminated_during_the_start_is_tried_again(
    env: Env, spawn: Callable[..., Process], table: str
) -> None:
    admin = env.connect()
    blocker = psycopg.connect(env.database_url)
    env.cleanups.append(blocker.close)
    # Hold the start-up where it records its routes (reactor_routes) or where it rehearses a
    # claim once they are recorded (photo_jobs), then end its session there.
    blocker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    reactor = spawn("-m", "reactor", "run", name="reactor")

    def waiting_pid() -> int | None:
        row = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND application_name = 'photo-reactor work'"
        ).fetchone()
        return int(row[0]) if row else None

    pid = wait_for(waiting_pid, what=f"the reactor's start-up waiting on {table}")
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    blocker.rollback()

    reactor.wait_for_line("startup_retry attempt=1")
    reactor.wait_for_line("reactor_started")
    insert_rows(admin, 3)
    client = redis.Redis.from_url(env.redis_url)
    wait_for(lambda: len(queue_ids(client)) == 3, what="three jobs queued")
    assert states(admin) == {"active": 3}
    recorded = admin.execute(
        "SELECT type, reactor_routes_live(lock_key) FROM reactor_routes"
    ).fetchall()
    assert recorded == [("photo.process", True)]
