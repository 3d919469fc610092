"""One routing truth: routes recorded by the reactors, no fallback to the demo handler.

Real reactors, sweeps and `rq worker` processes on real Postgres and Redis. Every process here
starts with REACTOR_ROUTES empty unless a test names a route, as on a user's machine.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from reactor import submit
from reactor.demo import DEMO_RUNS_KEY
from reactor.jobs import job_id
from reactor.pg import queries
from reactor.pg.registry import NO_ROUTE_HINT, RouteRegistration, routes_in_use
from reactor.routes import Route, parse_route
from tests.handlers import SCHEMA
from tests.support.cli import NO_ROUTES, cli_without_routes, one_line
from tests.support.env import Env
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.roles import as_role, throwaway_role
from tests.support.rows import states, unwritten_for
from tests.support.rq_state import queue_ids
from tests.support.waiting import wait_for

OK = "photo.process=tests.handlers.ok"
FAILS = "photo.process=tests.handlers.always_fails"
NO_SWEEP = ("--sweep-interval", "600")


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def reactor(spawn: Callable[..., Process], *args: str, name: str = "reactor") -> Process:
    return start_reactor(spawn, *args, *NO_SWEEP, name=name, **NO_ROUTES)


def handler_runs(conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    return [tuple(r) for r in conn.execute("SELECT photo_id, attempt FROM handler_runs ORDER BY 1")]


def test_with_no_route_anywhere_run_and_sweep_refuse_and_dispatch_nothing(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    for i in range(3):
        submit(conn, f"p{i}")
    for command in ("sweep", "run"):
        out = one_line(cli_without_routes(env, command), 2)
        assert out == f"reactor: error: {NO_ROUTE_HINT}"
    assert states(conn) == {"pending": 3}
    assert queue_ids(env.redis()) == []
    assert routes_in_use(conn) == {}


def test_a_sweep_without_routes_uses_the_recorded_route_never_the_demo(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    # The scenario: a reactor routed photo.process to the user's handler and stopped;
    # a later `reactor sweep` started without routes finds pending rows.
    first = reactor(spawn, "--route", OK)
    assert first.stop() == 0
    for i in range(3):
        submit(conn, f"p{i}")
    result = cli_without_routes(env, "sweep")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["enqueued"] == 3
    assert "reactor_started" not in result.stderr
    worker = start_worker(spawn, env, burst=True)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    assert states(conn) == {"done": 3}
    assert handler_runs(conn) == [("p0", 1), ("p1", 1), ("p2", 1)]
    assert env.redis().llen(DEMO_RUNS_KEY) == 0
    assert routes_in_use(conn) == {
        "photo.process": Route("photo.process", "tests.handlers.ok", "photo-process")
    }


def test_a_conflicting_route_is_refused_while_its_reactor_runs(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    first = reactor(spawn, "--route", OK, name="first")
    expected = (
        "reactor: error: route photo.process=tests.handlers.always_fails@photo-process "
        "conflicts with photo.process=tests.handlers.ok@photo-process of the running reactor "
    )
    for command in ("run", "sweep"):
        out = one_line(cli_without_routes(env, command, "--route", FAILS), 2)
        assert out.startswith(expected), out
        assert out.endswith("to change it"), out
    # Same route by flag, and no route at all (the recorded one): both join the first.
    second = reactor(spawn, "--route", OK, name="second")
    third = reactor(spawn, name="third")
    assert "routes=photo.process=tests.handlers.ok@photo-process" in third.output()

    status = cli_without_routes(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    routes = json.loads(status.stdout)["routes"]
    assert [(r["type"], r["handler"], r["queue"], r["running_reactors"]) for r in routes] == [
        ("photo.process", "tests.handlers.ok", "photo-process", 3)
    ]
    table = cli_without_routes(env, "status").stdout
    assert "photo.process=tests.handlers.ok@photo-process  used by 3 running reactors" in table
    assert "NO ROUTE" not in table

    # A reactor killed outright stops holding its route at once (its session ends); the
    # route changes on purpose once every reactor of the type has stopped.
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=10)
    assert second.stop() == 0
    one_line(cli_without_routes(env, "sweep", "--route", FAILS), 2)  # the third still runs
    assert third.stop() == 0
    changed = cli_without_routes(env, "sweep", "--route", FAILS)
    assert changed.returncode == 0, changed.stderr
    assert routes_in_use(conn)["photo.process"].handler == "tests.handlers.always_fails"
    after = cli_without_routes(env, "status").stdout
    assert "photo.process=tests.handlers.always_fails@photo-process  no running reactor" in after


def test_a_reactor_whose_routes_were_taken_over_stops_with_the_conflict(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """A running reactor checks its routes at every sweep (and every 5 s while polling). If
    another reactor took it for stopped (behind a pooler, its lock can vanish for a moment),
    forgot its rows and recorded another route for its type, it stops (exit 2, one line)
    rather than dispatch against it; a reactor whose rows were only marked stopped records
    them again and runs on."""
    first = start_reactor(
        spawn, "--route", OK, "--sweep-interval", "0.3", name="first", **NO_ROUTES
    )
    conn.execute("UPDATE reactor_routes SET stopped_at = now()")
    wait_for(
        lambda: live_reactors(conn) == 1, timeout=30, what="the first recording its routes again"
    )
    # What a second reactor's registration does when it finds the first not live.
    with conn.transaction():
        conn.execute(queries.LOCK_ROUTES)
        conn.execute("DELETE FROM reactor_routes")
        conn.execute("SELECT pg_advisory_lock(reactor_routes_lock_class(), 4242)")
        conn.execute(
            "INSERT INTO reactor_routes"
            " (type, handler, queue, lock_key, registered_by, backend_pid)"
            " VALUES ('photo.process', 'tests.handlers.always_fails', 'photo-process', 4242,"
            " 'the second', pg_backend_pid())"
        )
    assert first.exit_code(timeout=30) == 2
    expected = (
        "reactor: error: route photo.process=tests.handlers.ok@photo-process conflicts with "
        "photo.process=tests.handlers.always_fails@photo-process of the running reactor "
        "the second"
    )
    assert any(line.startswith(expected) for line in first.lines), first.output()
    assert "Traceback" not in first.output()
    assert routes_in_use(conn)["photo.process"].handler == "tests.handlers.always_fails"


def test_a_registration_again_on_a_new_session_leaves_no_live_rows_behind(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    """After a reconnect behind a pooler, the old server session may still hold the lock: the
    registration then takes a new key, and its rows under the old key must not stay live."""
    registration = RouteRegistration({"photo.process": parse_route(OK)})
    kept = env.connect(autocommit=False)  # the old session, which the pooler keeps
    registration.register(kept)
    assert live_reactors(conn) == 1
    registration.register(env.connect(autocommit=False))  # the reconnect
    assert live_reactors(conn) == 1
    assert registration.release(env.connect(autocommit=False))
    assert live_reactors(conn) == 0
    RouteRegistration({"photo.process": parse_route(FAILS)}).register(env.connect(autocommit=False))
    assert routes_in_use(conn)["photo.process"].handler == "tests.handlers.always_fails"


def test_a_reactor_that_fails_to_start_marks_its_routes_stopped(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    """A start that fails after the routes were recorded (here: the metrics port is taken)
    marks them stopped, so behind a pooler they do not stay live with a leftover lock."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = one_line(
            cli_without_routes(env, "run", "--route", OK, "--metrics-port", str(port)), 2
        )
    assert "cannot serve metrics" in out, out
    rows = conn.execute("SELECT stopped_at IS NOT NULL FROM reactor_routes").fetchall()
    assert rows == [(True,)]


def test_a_reactor_stopping_with_a_broken_work_connection_marks_its_routes_stopped(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    proc = reactor(spawn, "--route", OK)
    (pid,) = conn.execute(
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'photo-reactor work'"
    ).fetchone() or (None,)
    conn.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert proc.stop() == 0
    rows = conn.execute("SELECT stopped_at IS NOT NULL FROM reactor_routes").fetchall()
    assert rows == [(True,)], proc.output()


def live_reactors(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM reactor_routes WHERE reactor_routes_live(lock_key)"
    ).fetchone()
    return int(row[0]) if row else 0


def test_status_without_any_route_says_no_route(env: Env, conn: psycopg.Connection[Any]) -> None:
    submit(conn, "p1")
    table = cli_without_routes(env, "status")
    assert table.returncode == 0, table.stderr
    assert "NO ROUTE" in table.stdout
    assert "unrouted types with pending rows (left alone): photo.process" in table.stdout
    assert json.loads(cli_without_routes(env, "status", "--json").stdout)["routes"] == []


def test_a_job_that_failed_in_rq_without_an_outcome_gets_rqs_error(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    empty_database: str,
) -> None:
    # The worker reaches a database without photo_jobs: the lifecycle cannot record anything
    # and the RQ job ends `failed` with psycopg's error; the sweep must say so.
    # Re-dispatched only once the row has had no write for stale_after (1 s here).
    submit(conn, "p1", max_attempts=2)
    for attempt in (1, 2):
        if attempt > 1:
            wait_for(lambda: unwritten_for(conn, 1), what="the row unwritten for 1 s")
        dispatched = cli_without_routes(env, "sweep", "--route", OK, "--stale-after", "1")
        assert dispatched.returncode == 0, dispatched.stderr
        row = conn.execute("SELECT state, attempts FROM photo_jobs").fetchone()
        assert row == ("active", attempt)
        worker = start_worker(spawn, env, burst=True, DATABASE_URL=empty_database)
        worker.proc.wait(timeout=60)
        status = env.redis().hget(f"rq:job:{job_id('photo.process', 'p1', attempt)}", "status")
        assert status == b"failed", worker.output()
    wait_for(lambda: unwritten_for(conn, 1), what="the row unwritten for 1 s")
    final = cli_without_routes(env, "sweep", "--route", OK, "--stale-after", "1")
    assert final.returncode == 0, final.stderr
    assert json.loads(final.stdout)["rescue_failed"] == 1
    row = conn.execute("SELECT state, last_error FROM photo_jobs").fetchone()
    assert row is not None
    state, last_error = row
    assert state == "failed"
    assert last_error == (
        "job failed in RQ without recording an outcome: reactor.errors.StatementError: "
        "worker query failed: "
        'relation "photo_jobs" does not exist: attempt 2 of 2'
    )
    assert "vanished" not in last_error


def test_the_sweep_records_rqs_error_on_a_re_dispatch(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], empty_database: str
) -> None:
    submit(conn, "p1", max_attempts=3)
    assert cli_without_routes(env, "sweep", "--route", OK).returncode == 0
    worker = start_worker(spawn, env, burst=True, DATABASE_URL=empty_database)
    worker.proc.wait(timeout=60)
    wait_for(lambda: unwritten_for(conn, 1), what="the row unwritten for 1 s")
    again = cli_without_routes(env, "sweep", "--route", OK, "--stale-after", "1")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["lost"] == 1
    assert job_id("photo.process", "p1", 2) in queue_ids(env.redis())
    row = conn.execute("SELECT state, attempts, last_error FROM photo_jobs").fetchone()
    assert row == (
        "active",
        2,
        "job failed in RQ without recording an outcome: reactor.errors.StatementError: "
        "worker query failed: "
        'relation "photo_jobs" does not exist',
    )


def test_a_session_holding_a_dead_reactors_lock_key_does_not_keep_its_route(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    first = start_reactor(spawn, "--route", OK, "--sweep-interval", "600", **NO_ROUTES)
    with throwaway_role(env) as attacker:
        spoofer = psycopg.connect(as_role(env.database_url, attacker), autocommit=True)
        # Any role may read pg_locks: the reactor's key is there.
        (key,) = spoofer.execute(
            "SELECT objid::int FROM pg_locks WHERE locktype = 'advisory'"
            " AND classid = reactor_routes_lock_class()::oid AND objsubid = 2 AND granted"
        ).fetchone() or (None,)
        assert key is not None
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        # Granted once the killed reactor's session has ended.
        spoofer.execute("SET statement_timeout = '20s'")
        spoofer.execute("SELECT pg_advisory_lock(reactor_routes_lock_class(), %s)", [key])
        second = start_reactor(
            spawn, "--route", FAILS, "--sweep-interval", "600", name="second", **NO_ROUTES
        )
        assert routes_in_use(conn)["photo.process"].handler == "tests.handlers.always_fails"
        assert second.stop() == 0, second.output()
        spoofer.close()


def live_rows(conn: psycopg.Connection[Any]) -> list[tuple[int, int]]:
    """(lock_key, backend_pid) of the live rows."""
    return [
        (int(k), int(p))
        for k, p in conn.execute(
            "SELECT lock_key, backend_pid FROM reactor_routes WHERE reactor_routes_live(lock_key)"
        )
    ]


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    found = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert found is not None
    return int(found[0])


def test_keeping_routes_behind_a_pooler_records_the_new_holder_and_ignores_a_foreign_one(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    """Behind a transaction pooler the server session that took the lock can close, and the
    next check takes it on another: that session's pid is recorded. If meanwhile another
    session took the key, the reactor records its routes again under a key of its own."""
    registration = RouteRegistration({"photo.process": parse_route(OK)})
    first = env.connect(autocommit=False)
    registration.register(first)
    assert live_rows(conn) == [(registration.lock_key, backend_pid(first))]
    first.close()  # the pooler closes that server session
    second = env.connect(autocommit=False)
    registration.keep(second)
    assert live_rows(conn) == [(registration.lock_key, backend_pid(second))]

    second.close()
    foreign = env.connect(autocommit=True)
    foreign.execute(
        "SELECT pg_advisory_lock(reactor_routes_lock_class(), %s)", [registration.lock_key]
    )
    spoofed_key = registration.lock_key
    third = env.connect(autocommit=False)
    registration.keep(third)
    assert registration.lock_key != spoofed_key
    assert live_rows(conn) == [(registration.lock_key, backend_pid(third))]
    with third.transaction():
        kept = third.execute(queries.ROUTES_KEPT, {"lock_key": registration.lock_key})
        assert kept.fetchone() == (1, True)
