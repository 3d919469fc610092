"""Heap-only (HOT) updates of `photo_jobs` (sql/0019), against a real Postgres.

The writes that keep an active row alive (the fenced start's stamp, heartbeats, a rescue's
re-dispatch) change no indexed column, so Postgres writes each new row version on its page
without index entries; every change of state stamps `updated_at` and clears `heartbeat_at`.
And the migration applied to a table that holds rows in every state: dispatch, rescue,
the worker's lifecycle, prune, status, the dashboard's charts and re-arm work after it.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import redis

from reactor import submit
from reactor.ops.overview import read_overview
from reactor.pg import queries
from tests.support.cli import cli_json, run_cli
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.redis_dbs import fresh_redis_db
from tests.support.rows import states

TYPE = "photo.process"
#: Counters of this session's writes to photo_jobs not yet reported (the current transaction's
#: included; before Postgres 15, the current transaction's alone).
XACT_UPDATES = (
    "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
    " WHERE relid = 'photo_jobs'::regclass"
)


def row(conn: psycopg.Connection[Any], photo_id: str = "p1") -> tuple[Any, ...]:
    found = conn.execute(
        "SELECT state, prior_attempts + attempts, updated_at, heartbeat_at"
        " FROM photo_jobs WHERE photo_id = %s",
        [photo_id],
    ).fetchone()
    assert found is not None
    return tuple(found)


def updates(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> tuple[int, int]:
    """(updates, heap-only updates) of photo_jobs that `query` made, run in a transaction of
    its own (the session reports its counts only between transactions)."""
    with conn.transaction():
        before = conn.execute(XACT_UPDATES).fetchone()
        conn.execute(query, params)
        after = conn.execute(XACT_UPDATES).fetchone()
    assert before is not None and after is not None
    return int(after[0]) - int(before[0]), int(after[1]) - int(before[1])


def test_the_writes_that_keep_an_active_row_alive_are_heap_only(env: Env) -> None:
    conn = env.connect()
    submit(conn, "p1")
    fence = {"photo_id": "p1", "type": TYPE}
    assert updates(
        conn, queries.CLAIM_DUE, {"type": TYPE, "limit": 10, "skip": [], "window": None}
    ) == (1, 0)
    state, token, claimed_at, beat = row(conn)
    assert (state, token, beat) == ("active", 1, None)

    # The fenced start of a row its claim stamped long enough ago (fresh = 0 s) stamps it.
    assert updates(conn, queries.ATTEMPT_START, {**fence, "token": 1, "fresh": 0.0}) == (1, 1)
    _, _, updated_at, started_at = row(conn)
    assert updated_at == claimed_at and started_at is not None and started_at > claimed_at

    assert updates(conn, queries.ATTEMPT_HEARTBEAT, {**fence, "token": 1}) == (1, 1)
    _, _, updated_at, beat = row(conn)
    assert updated_at == claimed_at and beat > started_at

    rescue = {
        "types": [TYPE],
        "photo_ids": ["p1"],
        "tokens": [1],
        "why": "worker lost",
        "error": "worker lost: no heartbeat",
        "stale_after": None,
    }
    assert updates(conn, queries.REDISPATCH, rescue) == (1, 1)
    state, token, updated_at, rescued_at = row(conn)
    assert (state, token, updated_at) == ("active", 2, claimed_at) and rescued_at > beat
    # `reactor failures` dates the rescued row by its last write, the rescue.
    listed = conn.execute(queries.FAILURES, {"type": None, "limit": 5, "error_chars": None})
    assert [(r[1], r[5], r[6]) for r in listed] == [("p1", rescue["error"], rescued_at)]

    # A change of state is no heap-only update (the partial indexes read `state`): it stamps
    # updated_at and clears heartbeat_at.
    assert updates(conn, queries.ATTEMPT_DONE, {**fence, "token": 2}) == (1, 0)
    state, token, updated_at, beat = row(conn)
    assert (state, token, beat) == ("done", 2, None) and updated_at > rescued_at

    submit(conn, "p1")  # the re-arm: a new life, the token going on
    assert row(conn)[:2] == ("pending", 2) and row(conn)[3] is None
    attempts = conn.execute("SELECT attempts FROM photo_jobs").fetchone()
    assert attempts is not None and attempts[0] == 0


def test_a_heartbeat_keeps_a_row_from_counting_as_stale(env: Env) -> None:
    """The sweep and `reactor status` read a row's last write as the later of its claim's
    stamp and its last heartbeat."""
    conn = env.connect()
    for photo_id in ("beating", "silent"):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
            " VALUES (%s, %s, 'active', 1, now() - interval '1 hour')",
            [photo_id, TYPE],
        )
    conn.execute(queries.ATTEMPT_HEARTBEAT, {"photo_id": "beating", "type": TYPE, "token": 1})
    page = conn.execute(
        queries.LIST_ACTIVE,
        {
            "types": [TYPE],
            "until": datetime.max.isoformat() + "+00:00",
            "after_at": "-infinity",
            "after_type": "",
            "after_id": "",
            "limit": 10,
            "stale_after": 300.0,
            "gone_after": 30.0,
        },
    ).fetchall()
    assert {r[1]: (r[5], r[6]) for r in page} == {
        "beating": (False, False),
        "silent": (True, True),
    }
    counts = conn.execute(
        queries.STATUS_PER_TYPE, {"types": [TYPE], "stale_after": 300.0}
    ).fetchall()
    assert counts[0][3] == 1


def psql_file(url: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
        capture_output=True,
        text=True,
    )


def test_the_migration_applies_on_rows_in_every_state_and_everything_works_after_it(
    empty_database: str, pg_server_url: str, redis_server_url: str
) -> None:
    url = empty_database
    migration = next((ROOT / "sql").glob("*_keep_heartbeats_heap_only.sql"))
    for path in sorted((ROOT / "sql").glob("[0-9]*.sql")):
        if path == migration:
            break
        assert psql_file(url, path).returncode == 0, path
    env = Env(pg_server_url, url, url.rsplit("/", 1)[-1], fresh_redis_db(redis_server_url))
    conn = env.connect()
    try:
        _migrate_a_table_in_use(env, conn)
    finally:
        conn.close()


def _migrate_a_table_in_use(env: Env, conn: psycopg.Connection[Any]) -> None:
    plant = (
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
        " VALUES (%s, %s, %s, %s, now() - %s::interval, now() - %s::interval)"
    )
    for photo_id, state, attempts, age in [
        ("due", "pending", 0, "1 minute"),
        ("lost", "active", 1, "1 hour"),  # its job is not in Redis: the sweep rescues it
        ("old-done", "done", 1, "10 days"),
        ("done", "done", 1, "5 minutes"),
        ("failed", "failed", 5, "5 minutes"),
        ("cancelled", "cancelled", 1, "5 minutes"),
    ]:
        conn.execute(plant, [photo_id, TYPE, state, attempts, age, age])

    migrated = run_cli(env, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    options = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'photo_jobs'::regclass"
    ).fetchone()
    assert options is not None and sorted(options[0]) == [
        "autovacuum_analyze_scale_factor=0",
        "autovacuum_analyze_threshold=10000",
        "autovacuum_vacuum_insert_scale_factor=0",
        "autovacuum_vacuum_insert_threshold=10000",
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=10000",
        "fillfactor=70",
    ], options
    assert conn.execute("SELECT count(heartbeat_at) FROM photo_jobs").fetchone() == (0,)

    status = cli_json(env, "status", "--json")["types"][0]
    assert status["stale_active"] == 1, status

    swept = cli_json(env, "sweep", "--stale-after", "60")
    assert (swept["claimed"], swept["lost"]) == (1, 1), swept
    worked = run_cli(env, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr
    assert states(conn) == {"done": 4, "failed": 1, "cancelled": 1}
    lost = row(conn, "lost")
    assert lost[:2] == ("done", 2) and lost[3] is None

    assert cli_json(env, "prune", "--done-older-than", "7d")["deleted_done"] == 1
    done = conn.execute("SELECT photo_id FROM photo_jobs WHERE state = 'done' ORDER BY 1")
    assert [r[0] for r in done] == ["done", "due", "lost"]

    client = redis.Redis.from_url(env.redis_url)
    try:
        overview = read_overview(conn, client, {}, 300.0)
    finally:
        client.close()
    charted = sum(sum(series) for series in overview.finished.done.values())
    assert charted == 3, overview.finished  # due, lost and the recent done row
    counts = overview.status.types[0].counts
    assert {k: n for k, n in counts.items() if n} == {"done": 3, "failed": 1, "cancelled": 1}

    # Re-arm of every finished state: a new life, nothing left of the old one's stamps.
    for photo_id in ("done", "failed", "cancelled"):
        submit(conn, photo_id)
        state, _, updated_at, beat = row(conn, photo_id)
        assert (state, beat) == ("pending", None)
        assert updated_at > datetime.now(updated_at.tzinfo) - timedelta(minutes=1)
    swept = cli_json(env, "sweep")
    assert swept["claimed"] == 3, swept
    worked = run_cli(env, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr
    assert states(conn) == {"done": 5}
