"""Migrations: psql and `reactor migrate` agree, nothing applies twice, the wheel carries them."""

from __future__ import annotations

import subprocess
import sys
import venv
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from reactor.pg.db import LATEST_SCHEMA_VERSION
from reactor.pg.migrate import MIGRATION_LOCK_KEY, load_migrations
from tests.support.cli import run_cli
from tests.support.db import schema_dump
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.processes import Process

SQL_FILES = sorted((ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql"))
SCHEMA_FILE = ROOT / "sql" / "schema.sql"


def psql_file(url: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
        capture_output=True,
        text=True,
    )


def ledger(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return [
            tuple(r)
            for r in conn.execute("SELECT version, name FROM reactor_migrations ORDER BY 1")
        ]


def reactor_cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return run_cli(None, *args, "--database-url", url)


def test_files_are_numbered_and_match_the_code() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == list(range(1, LATEST_SCHEMA_VERSION + 1))
    assert [p.name for p in SQL_FILES] == [f"{m.version:04d}_{m.name}.sql" for m in migrations]
    for path in SQL_FILES:
        text = path.read_text()
        assert "\\" not in text.replace("\\\\", ""), f"{path.name} holds a psql meta-command"
        assert ":'" not in text and ':"' not in text, f"{path.name} uses psql variables"


def test_psql_and_migrate_build_the_same_schema(
    make_empty_database: Callable[[], str], env: Env
) -> None:
    by_psql = make_empty_database()
    for path in SQL_FILES:
        result = psql_file(by_psql, path)
        assert result.returncode == 0, result.stderr
    by_cli = env.database_url  # cloned from the template that reactor.pg.migrate built
    fresh = make_empty_database()
    result = reactor_cli("migrate", url=fresh)
    assert result.returncode == 0, result.stderr
    assert "applied 0003_create_notify_triggers" in result.stdout
    assert schema_dump(by_psql) == schema_dump(fresh) == schema_dump(by_cli)
    assert ledger(by_psql) == ledger(fresh)


def test_the_current_schema_file_builds_what_the_migrations_build(
    make_empty_database: Callable[[], str], env: Env
) -> None:
    loaded = make_empty_database()
    result = psql_file(loaded, SCHEMA_FILE)
    assert result.returncode == 0, result.stderr
    assert schema_dump(loaded) == schema_dump(env.database_url), (
        "sql/schema.sql is not what the migrations build: run scripts/schema.py"
    )
    assert ledger(loaded) == ledger(env.database_url)
    assert sorted(p.name for p in (ROOT / "sql").glob("*.sql")) == sorted(
        [*(p.name for p in SQL_FILES), SCHEMA_FILE.name]
    )
    status = reactor_cli("status", url=loaded)
    assert status.returncode == 0, status.stderr


def test_second_runs_are_refused_or_no_ops(empty_database: str) -> None:
    url = empty_database
    assert reactor_cli("migrate", url=url).returncode == 0
    before = schema_dump(url)
    again = reactor_cli("migrate", url=url)
    assert again.returncode == 0
    assert "nothing to do: database is already at schema version" in again.stdout
    for path in SQL_FILES:
        rerun = psql_file(url, path)
        assert rerun.returncode != 0
        assert "is already applied" in rerun.stderr
    assert schema_dump(url) == before
    assert len(ledger(url)) == LATEST_SCHEMA_VERSION


def test_psql_refuses_a_migration_whose_predecessor_is_missing(empty_database: str) -> None:
    result = psql_file(empty_database, SQL_FILES[1])
    assert result.returncode != 0
    # The ledger table does not even exist yet: 0002 cannot run first.
    assert "reactor_migration_begin" in result.stderr or "needs migration" in result.stderr


def test_psql_then_migrate_continues_where_psql_stopped(empty_database: str) -> None:
    assert psql_file(empty_database, SQL_FILES[0]).returncode == 0
    result = reactor_cli("migrate", url=empty_database)
    assert result.returncode == 0, result.stderr
    assert "applied 0001" not in result.stdout
    assert "applied 0002_create_dispatch_indexes" in result.stdout
    assert [v for v, _ in ledger(empty_database)] == list(range(1, LATEST_SCHEMA_VERSION + 1))


def test_concurrent_migrates_apply_once(empty_database: str) -> None:
    # Three at once: each run_cli waits in a thread of its own.
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: reactor_cli("migrate", url=empty_database), range(3)))
    outputs = [(r.stdout, r.stderr) for r in results]
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    applied = sum(out.count("applied 0") for out, _ in outputs)
    assert applied == LATEST_SCHEMA_VERSION
    assert len(ledger(empty_database)) == LATEST_SCHEMA_VERSION


def test_a_migrate_waiting_for_its_lock_names_who_holds_it_and_goes_on_once_free(
    empty_database: str, spawn: Callable[..., Process]
) -> None:
    """Any role may take an advisory key: a session squatting the migration lock kept `reactor
    migrate` waiting in silence. It now names the holder once, and applies when it is free."""
    with psycopg.connect(empty_database, autocommit=True, application_name="squatter") as other:
        other.execute("SELECT pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        pid = other.info.backend_pid
        role = other.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
        proc = spawn(
            "-m", "reactor", "migrate", name="migrate", extra_env={"DATABASE_URL": empty_database}
        )
        proc.wait_for_line("migration_lock_waiting")
        assert proc.proc.poll() is None
        (line,) = [x for x in proc.lines if "migration_lock_waiting" in x]
        assert f"holder_pid={pid} role={role!r} application='squatter'" in line
        assert f"pg_terminate_backend({pid})" in line
        assert other.execute("SELECT to_regclass('reactor_migrations')").fetchone() == (None,)
    assert proc.exit_code(timeout=60) == 0, proc.output()
    assert len(ledger(empty_database)) == LATEST_SCHEMA_VERSION
    assert sum("migration_lock_waiting" in x for x in proc.lines) == 1


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_migrates(empty_database: str, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("photo_reactor-*.whl"))
    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli(
        None,
        "migrate",
        "--database-url",
        empty_database,
        program=[str(target / "bin" / "reactor")],
        cwd=elsewhere,
        environ={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert f"database is at schema version {LATEST_SCHEMA_VERSION}" in result.stdout
    assert len(ledger(empty_database)) == LATEST_SCHEMA_VERSION
