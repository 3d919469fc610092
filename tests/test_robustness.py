"""Robustness: rows holding timestamps Python cannot represent, a sweep that fails, a hung Redis.

- The schema refuses 'infinity' and '-infinity' in created_at, updated_at and next_retry_at
  (sql/0012), and the migration replaces the ones already stored, keeping what they meant.
- Rows written before that migration (planted here with the constraints dropped) break no
  reader: the sweep still rescues a stale row, dispatch stays prompt, /healthz stays 200,
  `reactor failures`, `status`, `sweep` and the dashboard answer.
- A sweep whose statement fails on a healthy connection does not pause dispatch.
- A hung Redis (SIGSTOP) keeps no claim's row locks beyond `--redis-timeout`, and a work
  session left idle in a transaction is ended by Postgres.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from rq.job import Job, JobStatus

from reactor.jobs import JobRef, job_id
from reactor.pg import db
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import health, metric, scrape
from tests.support.paths import ROOT
from tests.support.processes import Process, start_reactor
from tests.support.rows import states
from tests.support.rq_state import jobs_missing, queue_ids
from tests.support.servers import RedisServer, free_port
from tests.support.waiting import wait_for

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
CONSTRAINTS = {
    "created_at": "photo_jobs_created_at_finite_check",
    "updated_at": "photo_jobs_updated_at_finite_check",
    "next_retry_at": "photo_jobs_next_retry_at_finite_check",
}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def submit_after(port: int, counter: str, conn: psycopg.Connection[Any], photo_id: str) -> float:
    """Wait for the reactor's `counter` metric to grow, then submit a row: the seconds until
    the row is active."""
    before = metric(scrape(port), counter)
    wait_for(lambda: metric(scrape(port), counter) > before, timeout=10, what=f"{counter} up")
    started = time.monotonic()
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [photo_id])

    def active() -> bool:
        row = conn.execute("SELECT state FROM photo_jobs WHERE photo_id = %s", [photo_id])
        return row.fetchone() == ("active",)

    wait_for(active, timeout=15, interval=0.005, what=f"row {photo_id} dispatched")
    return time.monotonic() - started


def drop_finite_checks(conn: psycopg.Connection[Any]) -> None:
    """The table as it was before sql/0012: rows may hold non-finite timestamps."""
    for name in CONSTRAINTS.values():
        conn.execute(f"ALTER TABLE photo_jobs DROP CONSTRAINT IF EXISTS {name}")


def plant(conn: psycopg.Connection[Any], photo_id: str, state: str, **columns: object) -> None:
    """A row of photo.process with the given state and timestamps (a pending row with a
    next_retry_at is a retry: attempt 1 failed), inserted with no trigger firing."""
    names = ", ".join(["photo_id", "type", "state", "attempts", "last_error", *columns])
    values = ", ".join(["%s"] * (5 + len(columns)))
    retry = state == "pending" and "next_retry_at" in columns
    attempts = 1 if retry or state != "pending" else 0
    error = f"{photo_id} failed" if retry or state == "failed" else None
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # no NOTIFY either
        conn.execute(
            f"INSERT INTO photo_jobs ({names}) VALUES ({values})",
            [photo_id, "photo.process", state, attempts, error, *columns.values()],
        )


def give_job(client: redis.Redis, photo_id: str, attempt: int, status: str) -> None:
    """The RQ job an active row's worker would have: `queued` (waiting in the queue) or
    `started` (taken by a worker, out of the queue)."""
    ref = JobRef("photo.process", photo_id, attempt)
    Enqueuer(client, ROUTES).enqueue([ref])
    if status == "started":
        client.lrem("rq:queue:photo-process", 0, ref.job_id)
        Job.fetch(ref.job_id, connection=client).set_status(JobStatus.STARTED)


def plant_hostile_rows(conn: psycopg.Connection[Any], client: redis.Redis) -> None:
    drop_finite_checks(conn)
    # First in the sweep's pass over active rows: its job waits in the queue (left alone).
    plant(conn, "minus-infinity", "active", updated_at="-infinity")
    give_job(client, "minus-infinity", 1, "queued")
    plant(conn, "done-at-infinity", "done", updated_at="infinity")
    plant(conn, "failed-at-minus-infinity", "failed", updated_at="-infinity")
    plant(conn, "retry-at-infinity", "pending", next_retry_at="infinity")
    plant(conn, "created-at-infinity", "pending", created_at="infinity")


# -- the schema ------------------------------------------------------------------------------


@pytest.mark.parametrize("column", sorted(CONSTRAINTS))
@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_the_schema_refuses_non_finite_timestamps(env: Env, column: str, value: str) -> None:
    conn = env.connect()
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute(
            f"INSERT INTO photo_jobs (photo_id, type, {column}) VALUES ('a', 'photo.process', %s)",
            [value],
        )
    assert info.value.diag.constraint_name == CONSTRAINTS[column]
    assert CONSTRAINTS[column] in str(info.value)
    if column != "updated_at":  # the trigger stamps updated_at on every UPDATE
        conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('b', 'photo.process')")
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(f"UPDATE photo_jobs SET {column} = %s", [value])


def psql_file(url: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
        capture_output=True,
        text=True,
    )


def test_the_migration_replaces_stored_non_finite_values_keeping_their_meaning(
    empty_database: str,
) -> None:
    url = empty_database
    migration = next((ROOT / "sql").glob("*_refuse_nonfinite_timestamps.sql"))
    for path in sorted((ROOT / "sql").glob("*.sql")):
        if path == migration:
            break
        assert psql_file(url, path).returncode == 0, path
    with psycopg.connect(url, autocommit=True) as conn:
        plant(conn, "parked", "pending", next_retry_at="infinity")
        plant(conn, "overdue", "pending", next_retry_at="-infinity")
        plant(conn, "never", "pending", created_at="infinity")
        plant(conn, "ancient", "pending", created_at="-infinity")
        plant(conn, "stamped", "active", updated_at="-infinity")
        plant(conn, "finished", "done", updated_at="infinity")
        plant(conn, "plain", "pending")
        before = conn.execute("SELECT now()").fetchone()
    result = psql_file(url, migration)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(url, autocommit=True) as conn:
        found = {
            photo_id: (due, updated)
            for photo_id, due, updated in conn.execute(
                "SELECT photo_id, coalesce(next_retry_at, created_at)::text,"
                " updated_at >= %s FROM photo_jobs",
                [before[0] if before else None],
            )
        }
        due_now = {
            r[0]
            for r in conn.execute(
                "SELECT photo_id FROM photo_jobs"
                " WHERE state = 'pending' AND coalesce(next_retry_at, created_at) <= now()"
            )
        }
        checks = conn.execute(
            "SELECT conname, convalidated FROM pg_constraint"
            " WHERE conrelid = 'photo_jobs'::regclass AND conname = ANY (%s)",
            [list(CONSTRAINTS.values())],
        ).fetchall()
    # Parked rows stay parked, due rows stay due; every changed row was stamped by the trigger.
    assert found["parked"] == ("9999-01-01 00:00:00+00", True)
    assert found["never"] == ("9999-01-01 00:00:00+00", True)
    assert found["overdue"] == ("1970-01-01 00:00:00+00", True)
    assert found["ancient"] == ("1970-01-01 00:00:00+00", True)
    assert found["stamped"][1] and found["finished"][1]
    assert found["plain"][1] is False  # finite rows are not touched
    assert due_now == {"overdue", "ancient", "plain"}
    assert sorted(checks) == sorted((name, True) for name in CONSTRAINTS.values())


# -- rows written before the constraints ------------------------------------------------------


def test_a_hostile_row_stops_neither_rescue_nor_dispatch(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    plant_hostile_rows(conn, client)
    # A worker died long ago: its job is started, its row silent for an hour.
    plant(conn, "stale", "active", updated_at=datetime.now(timezone.utc) - timedelta(hours=1))
    give_job(client, "stale", 1, "started")
    port = free_port()
    reactor = start_reactor(
        spawn,
        "--sweep-interval",
        "0.5",
        "--stale-after",
        "60",
        "--metrics-port",
        str(port),
    )
    wait_for(
        lambda: (
            conn.execute(
                "SELECT state, attempts FROM photo_jobs WHERE photo_id = 'stale'"
            ).fetchone()
            == ("active", 2)
        ),
        timeout=30,
        what="the stale row rescued",
    )
    # Rows submitted right after a sweep are dispatched at once (a failed sweep used to pause
    # the loop for up to 10 s).
    slowest = max(submit_after(port, "reactor_sweeps_total", conn, str(i)) for i in range(4))
    assert slowest < 4.0, f"a submit took {slowest:.2f} s\n{reactor.output()}"
    assert health(port)[0] == 200, health(port)
    assert "sweep_failed" not in reactor.output()
    assert "connection_lost" not in reactor.output()
    assert jobs_missing(conn, client) == []


def test_readers_tolerate_rows_written_before_the_constraints(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    plant_hostile_rows(conn, client)
    failures = run_cli(env, "failures", "--json")
    assert failures.returncode == 0, failures.stderr
    listed = {f["photo_id"]: f for f in json.loads(failures.stdout)["failures"]}
    assert set(listed) == {"failed-at-minus-infinity", "retry-at-infinity"}
    assert listed["retry-at-infinity"]["next_retry_at"].startswith("9999-12-30")
    table = run_cli(env, "failures")
    assert table.returncode == 0, table.stderr
    assert "failed-at-minus-infinity" in table.stdout
    status = run_cli(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    counts = json.loads(status.stdout)["types"][0]["counts"]
    assert counts == {"pending": 2, "active": 1, "done": 1, "failed": 1, "cancelled": 0}
    sweep = run_cli(env, "sweep")
    assert sweep.returncode == 0, sweep.stderr
    assert json.loads(sweep.stdout)["rescued"] == 0
    port = free_port()
    dashboard = spawn("-m", "reactor", "dashboard", "--port", str(port), name="dashboard")
    dashboard.wait_for_line("dashboard_serving")
    code, body = get(f"http://127.0.0.1:{port}/api/overview")
    assert code == 200, body
    shown = {f["photo_id"] for f in json.loads(body)["failures"]}
    assert shown == {"failed-at-minus-infinity", "retry-at-infinity"}
    code, body = get(f"http://127.0.0.1:{port}/")
    assert code == 200, body
    assert states(conn) == {"pending": 2, "active": 1, "done": 1, "failed": 1}


# -- a sweep that fails ----------------------------------------------------------------------


def test_a_failing_sweep_does_not_pause_dispatch(env: Env, spawn: Callable[..., Process]) -> None:
    conn = env.connect()
    # A healthy connection, a statement that fails: a stale_after too large for an interval
    # makes the sweep's pass over active rows fail (claims do not use it).
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " VALUES ('busy', 'photo.process', 'active', 1)"
    )
    port = free_port()
    reactor = start_reactor(
        spawn, "--sweep-interval", "0.3", "--stale-after", "1e300", "--metrics-port", str(port)
    )
    reactor.wait_for_line("sweep_failed")
    # Each row submitted right after a sweep failed (the loop used to pause then, up to 10 s).
    slowest = max(
        submit_after(port, "reactor_sweep_failures_total", conn, str(i)) for i in range(6)
    )
    # Far below the pause of up to 10 s the bug made, with room for a loaded machine.
    assert slowest < 4.0, f"a submit took {slowest:.2f} s\n{reactor.output()}"
    # Logged a few times a minute, not at every sweep; /healthz says the sweeps fail.
    wait_for(lambda: health(port)[0] == 503, timeout=10, what="/healthz 503")
    assert "failed sweeps in a row" in health(port)[1]
    assert sum("sweep_failed" in line for line in reactor.lines) <= 3, reactor.output()
    assert "connection_lost" not in reactor.output()
    assert "loop_failed" not in reactor.output()


# -- an exception nothing expects ---------------------------------------------------------


def test_an_unexpected_exception_in_the_enqueue_rolls_the_turn_back_and_dispatch_goes_on(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A library error of a type the reactor knows nothing about (injected from outside, by a
    sitecustomize on PYTHONPATH, into the first batches' enqueue of a running `reactor run`):
    each failed turn is rolled back, counted, logged once a minute, and the loop goes on."""
    conn = env.connect()
    port = free_port()
    injected = 6
    inject = str(ROOT / "tests" / "support" / "odd_enqueue")
    reactor = start_reactor(
        spawn,
        "--metrics-port",
        str(port),
        PYTHONPATH=os.pathsep.join([inject, str(ROOT)]),
        ODD_ENQUEUE_FAILURES=str(injected),
    )
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('first', 'photo.process')")
    # Three failed turns in a row and more: /healthz says so, and why, until a turn succeeds.
    wait_for(
        lambda: health(port)[0] == 503 and "OddLibraryError: injected" in health(port)[1],
        timeout=30,
        interval=0.05,
        what="/healthz 503 naming the error",
    )
    wait_for(lambda: states(conn) == {"active": 1}, timeout=30, what="the row dispatched")
    assert reactor.proc.poll() is None, reactor.output()
    failures = metric(scrape(port), 'reactor_turn_failures_total{kind="OddLibraryError"}')
    assert failures == injected, reactor.output()
    logged = [line for line in reactor.lines if "turn_failed" in line]
    assert len(logged) == 1 and "OddLibraryError: injected" in logged[0], reactor.output()
    assert queue_ids(env.redis()) == [job_id("photo.process", "first", 1)]
    # And later rows go as usual.
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('second', 'photo.process')")
    wait_for(lambda: states(conn) == {"active": 2}, timeout=30, what="the next row dispatched")
    assert health(port) == (200, "ok\n")


# -- a hung Redis ----------------------------------------------------------------------------


def idle_in_transaction(conn: psycopg.Connection[Any]) -> float:
    """The longest a reactor session has been idle inside a transaction right now (seconds)."""
    row = conn.execute(
        "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - state_change)), 0)::float8"
        "  FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'photo-reactor work%%'"
        "   AND state LIKE 'idle in transaction%%'"
    ).fetchone()
    return float(row[0]) if row else 0.0


@pytest.mark.slow  # a fault held for seconds
def test_a_hung_redis_holds_no_claim_beyond_the_redis_timeout(
    env: Env, spawn: Callable[..., Process], private_redis: RedisServer
) -> None:
    conn = env.connect()
    reactor = start_reactor(
        spawn, "--sweep-interval", "2", REDIS_URL=private_redis.url, REACTOR_REDIS_TIMEOUT="2"
    )
    private_redis.freeze()
    try:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type)"
            " SELECT 'p' || i, 'photo.process' FROM generate_series(1, 20) AS i"
        )
        longest = 0.0
        seen: set[tuple[str, int]] = set()

        def retried_three_times() -> bool:
            nonlocal longest
            longest = max(longest, idle_in_transaction(conn))
            seen.update(states(conn).items())
            return sum("drain_retry" in line for line in reactor.lines) >= 3

        wait_for(retried_three_times, timeout=60, interval=0.05, what="three drain retries")
    finally:
        private_redis.thaw()
    # Each claim waits at most the Redis timeout (2 s) before it rolls back: never the 6 s
    # after which Postgres would end the session (a margin for a loaded machine between).
    assert longest < 5.0, f"a claim stayed open {longest:.1f} s\n{reactor.output()}"
    assert seen == {("pending", 20)}
    wait_for(lambda: states(conn) == {"active": 20}, timeout=30, what="20 rows active")
    client = redis.Redis.from_url(private_redis.url)
    try:
        ids = queue_ids(client)
        assert len(ids) == len(set(ids)) == 20
        assert jobs_missing(conn, client) == []
    finally:
        client.close()
    assert "connection_lost" not in reactor.output()


def test_postgres_ends_a_work_session_left_idle_in_a_transaction(env: Env) -> None:
    conn = db.connect(env.database_url, purpose="work", idle_in_transaction_seconds=0.5)
    env.cleanups.append(conn.close)
    pid = conn.info.backend_pid
    conn.execute("SELECT 1")  # a transaction opens, and then nothing happens in it
    admin = env.connect()
    wait_for(
        lambda: (
            admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            == (0,)
        ),
        timeout=10,
        what="the session ended",
    )
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout) as info:
        conn.execute("SELECT 1")
    assert db.is_connection_failure(info.value)
