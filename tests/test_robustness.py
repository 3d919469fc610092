"""Timestamps Python cannot represent: the schema refuses 'infinity' and '-infinity' in
created_at, updated_at and next_retry_at (sql/0011), and the migration replaces the ones
already stored, keeping what they meant.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.env import Env
from tests.support.paths import ROOT

CONSTRAINTS = {
    "created_at": "photo_jobs_created_at_finite_check",
    "updated_at": "photo_jobs_updated_at_finite_check",
    "next_retry_at": "photo_jobs_next_retry_at_finite_check",
}


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
