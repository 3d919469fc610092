"""`reactor migrate --sql [--all]`: the SQL another migration tool applies. Applied by psql, it
builds the schema `reactor migrate` builds (`pg_dump -s` equal), ledger included, from an
empty database or from one part-migrated."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from tests.support.cli import run_cli
from tests.support.db import schema_dump
from tests.support.paths import ROOT

SQL_FILES = sorted((ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql"))


def psql(url: str, path: Path) -> None:
    result = subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def ledger(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT version, name FROM reactor_migrations ORDER BY 1")
        return [(int(r[0]), str(r[1])) for r in rows]


def test_all_is_every_file_as_it_is_and_builds_the_schema(
    make_empty_database: Callable[[], str], database_url: str, tmp_path: Path
) -> None:
    # No database is needed: a URL of nothing must not matter.
    out = run_cli(None, "migrate", "--sql", "--all", "--database-url", "postgresql://nowhere/x")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "".join(p.read_text() for p in SQL_FILES)
    script = tmp_path / "all.sql"
    script.write_text(out.stdout)
    fresh = make_empty_database()
    psql(fresh, script)
    assert schema_dump(fresh) == schema_dump(database_url)  # database_url: `reactor migrate`'s
    assert ledger(fresh) == ledger(database_url)


def test_sql_prints_what_is_not_applied_yet(
    make_empty_database: Callable[[], str], database_url: str, tmp_path: Path
) -> None:
    url = make_empty_database()
    for path in SQL_FILES[:3]:
        psql(url, path)
    out = run_cli(None, "migrate", "--sql", "--database-url", url)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "".join(p.read_text() for p in SQL_FILES[3:])
    script = tmp_path / "rest.sql"
    script.write_text(out.stdout)
    psql(url, script)
    assert schema_dump(url) == schema_dump(database_url)
    again = run_cli(None, "migrate", "--sql", "--database-url", url)
    assert (again.returncode, again.stdout) == (0, "")  # nothing left, and it says so
    assert again.stderr == "reactor: nothing to apply: the database is up to date\n"
    assert ledger(url) == ledger(database_url)


def test_sql_on_an_unreachable_database_is_one_line(make_empty_database: Callable[[], str]) -> None:
    alone = run_cli(None, "migrate", "--all")
    assert alone.returncode == 2
    assert "--all goes with --sql" in alone.stderr
    unreachable = run_cli(None, "migrate", "--sql", "--database-url", "postgresql://127.0.0.1:1/x")
    assert unreachable.returncode == 2
    assert unreachable.stdout == ""
    assert len(unreachable.stderr.strip().splitlines()) == 1, unreachable.stderr


def test_the_alembic_recipe_builds_the_schema(
    make_empty_database: Callable[[], str], database_url: str
) -> None:
    """docs/testing.md's revision body, with the SQLAlchemy connection Alembic's
    `op.get_bind()` returns (Alembic itself is not a dependency)."""
    out = run_cli(None, "migrate", "--sql", "--all")
    assert out.returncode == 0, out.stderr
    url = make_empty_database()
    engine = create_engine(
        make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    )
    try:
        with engine.begin() as bind:  # Alembic runs a revision in a transaction
            bind.connection.cursor().execute(out.stdout)
    finally:
        engine.dispose()
    assert schema_dump(url) == schema_dump(database_url)
    assert (
        "op.get_bind().connection.cursor().execute(sql)" in (ROOT / "docs/testing.md").read_text()
    )
