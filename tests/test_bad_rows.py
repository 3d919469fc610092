"""One bad row is its own problem: the schema bounds the attempt counters (a huge
`prior_attempts` used to overflow every claim of its type), a row whose claim still fails is
found and left out while the rest of its type flows (`/healthz` says so and stays 200, `reactor
status` names the row), a type whose every claim fails is quarantined as before, and
`reactor sweep` exits 1 while it cannot claim. The migration keeps the rows it bounds.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import health
from tests.support.paths import ROOT
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows
from tests.support.rq_state import jobs_missing
from tests.support.servers import free_port
from tests.support.waiting import wait_for

BIGINT_MAX = 9223372036854775807
#: The bounds the schema sets (README, sql/): prior_attempts and max_attempts.
PRIOR_BOUND = 10**18
ATTEMPTS_BOUND = 10**6

_POISON = """
CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'poisoned row' USING ERRCODE = '22003'; END $$;
CREATE TRIGGER poison BEFORE UPDATE ON photo_jobs FOR EACH ROW
WHEN ({when} AND NEW.state = 'active') EXECUTE FUNCTION poison();
"""


def _count(conn: psycopg.Connection[Any], job_type: str, state: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM photo_jobs WHERE type = %s AND state = %s", [job_type, state]
    ).fetchone()
    return int(row[0]) if row else 0


def test_the_schema_bounds_the_counters_so_the_token_cannot_overflow(env: Env) -> None:
    conn = env.connect()
    for columns, values in (
        ("prior_attempts", [BIGINT_MAX]),
        ("prior_attempts", [PRIOR_BOUND + 1]),
        ("max_attempts", [ATTEMPTS_BOUND + 1]),
    ):
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                f"INSERT INTO photo_jobs (photo_id, type, {columns}) VALUES ('BIG', 'photo.process', %s)",
                values,
            )
    # A row at the bounds is claimed: its token fits.
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, prior_attempts, attempts, max_attempts)"
        " VALUES ('edge', 'photo.process', %s, %s, %s)",
        [PRIOR_BOUND, ATTEMPTS_BOUND - 1, ATTEMPTS_BOUND],
    )
    insert_rows(conn, 3)
    result = env.cli_json("sweep")
    assert (result["claimed"], result["enqueued"], result["claim_failures"]) == (4, 4, 0), result
    edge = conn.execute(
        "SELECT state, prior_attempts + attempts FROM photo_jobs WHERE photo_id = 'edge'"
    ).fetchone()
    assert edge == ("active", PRIOR_BOUND + ATTEMPTS_BOUND)
    # A re-arm starts a new life by the table's trigger, whatever the UPDATE says.
    conn.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = 'p1'")
    conn.execute("UPDATE photo_jobs SET state = 'pending', attempts = 1 WHERE photo_id = 'p1'")
    row = conn.execute(
        "SELECT prior_attempts, attempts FROM photo_jobs WHERE photo_id = 'p1'"
    ).fetchone()
    assert row == (1, 0)


def test_a_row_whose_claim_fails_is_left_out_and_named_while_its_type_flows(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    conn.execute(_POISON.format(when="NEW.photo_id = 'poison'"))
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('poison', 'photo.process')")
    insert_rows(conn, 10)
    # One sweep: the other rows are claimed, the poisoned one is named, and the exit says so.
    swept = run_cli(env, "sweep")
    assert swept.returncode == 1, swept.stderr
    result = json.loads(swept.stdout)
    assert (result["claimed"], result["claim_refused"], result["claim_failures"]) == (10, 1, 0)
    assert "1 row refused the claim" in swept.stderr.strip().splitlines()[-1], swept.stderr
    assert sum("row_refused" in line for line in swept.stderr.splitlines()) == 1, swept.stderr
    status = run_cli(env, "status")
    assert status.returncode == 0, status.stderr
    assert "claim refused: photo.process 'poison'" in status.stdout, status.stdout
    assert "poisoned row" in status.stdout, status.stdout
    named = json.loads(run_cli(env, "status", "--json").stdout)["claim_refused"]
    assert [r["photo_id"] for r in named] == ["poison"], named
    # A running reactor: new rows of the type flow, health names the row and stays 200.
    port = free_port()
    reactor = start_reactor(spawn, "--sweep-interval", "1", "--metrics-port", str(port))
    insert_rows(conn, 5, prefix="q")
    wait_for(lambda: _count(conn, "photo.process", "active") == 15, timeout=30, what="q rows")
    wait_for(lambda: "poison" in health(port)[1], timeout=30, what="health names the row")
    code, body = health(port)
    assert code == 200 and body.startswith("ok; ") and "poisoned row" in body, body
    assert _count(conn, "photo.process", "pending") == 1
    assert jobs_missing(conn, client) == []
    # The cure: the row is tried again with backoff and goes through.
    conn.execute("DROP TRIGGER poison ON photo_jobs")
    wait_for(lambda: _count(conn, "photo.process", "pending") == 0, timeout=90, what="cured")
    wait_for(lambda: health(port) == (200, "ok\n"), timeout=30, what="health clear")
    assert sum("row_refused" in line for line in reactor.lines) <= 1, reactor.output()
    assert "type_quarantined" not in reactor.output()


def test_a_type_whose_every_claim_fails_is_quarantined_and_sweep_exits_1(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    conn.execute(_POISON.format(when="NEW.type = 'photo.process'"))
    insert_rows(conn, 10)
    swept = run_cli(env, "sweep")
    assert swept.returncode == 1, swept.stderr
    result = json.loads(swept.stdout)
    assert (result["claimed"], result["claim_failures"], result["claim_refused"]) == (0, 1, 0)
    assert "the claim of 1 type failed" in swept.stderr, swept.stderr
    port = free_port()
    start_reactor(
        spawn,
        "--route",
        "photo.process=reactor.demo.process_photo",
        "--route",
        "photo.thumb=reactor.demo.process_photo",
        "--metrics-port",
        str(port),
    )
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) SELECT 't' || i, 'photo.thumb'"
        " FROM generate_series(1, 20) AS i"
    )
    wait_for(lambda: _count(conn, "photo.thumb", "active") == 20, timeout=30, what="thumbs")
    wait_for(lambda: health(port)[0] == 503, timeout=30, what="/healthz 503")
    assert "photo.process" in health(port)[1]
    assert _count(conn, "photo.process", "pending") == 10


def _psql(url: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
        capture_output=True,
        text=True,
    )


def test_the_migration_bounds_stored_rows_and_keeps_them(empty_database: str) -> None:
    url = empty_database
    first = next((ROOT / "sql").glob("*_bound_attempt_counters.sql"))
    for path in sorted((ROOT / "sql").glob("[0-9]*.sql")):
        if path == first:
            break
        assert _psql(url, path).returncode == 0, path
    planted = [
        ("huge", "pending", BIGINT_MAX, 0, 5),
        ("many", "failed", 5, 2_000_000, 3_000_000),
        ("wide", "pending", 0, 3, 2_147_483_647),
        ("plain", "done", 7, 2, 5),
    ]
    with psycopg.connect(url, autocommit=True) as conn:
        for row in planted:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, state, prior_attempts, attempts, max_attempts,"
                " type) VALUES (%s, %s, %s, %s, %s, 'photo.process')",
                row,
            )
    for path in sorted((ROOT / "sql").glob("[0-9]*.sql")):
        if path >= first:
            result = _psql(url, path)
            assert result.returncode == 0, result.stderr
    with psycopg.connect(url, autocommit=True) as conn:
        found = {
            r[0]: tuple(r[1:])
            for r in conn.execute(
                "SELECT photo_id, state, prior_attempts, attempts, max_attempts FROM photo_jobs"
            )
        }
        unvalidated = conn.execute(
            "SELECT count(*) FROM pg_constraint"
            " WHERE conrelid = 'photo_jobs'::regclass AND NOT convalidated"
            " AND conname LIKE '%bound_check'"
        ).fetchone()
    assert found == {
        "huge": ("pending", PRIOR_BOUND, 0, 5),
        # The token (prior_attempts + attempts) is kept: 2,000,005.
        "many": ("failed", 5 + 1_000_000, ATTEMPTS_BOUND, ATTEMPTS_BOUND),
        "wide": ("pending", 0, 3, ATTEMPTS_BOUND),
        "plain": ("done", 7, 2, 5),
    }
    assert unvalidated == (0,)
