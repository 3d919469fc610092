"""The tests' databases on the Postgres server: one migrated template per run, a clone of it
per test (`CREATE DATABASE ... TEMPLATE`, so tests run in any order), and unmigrated ones on
request. Every database created here is named with a random suffix and dropped by its fixture."""

from __future__ import annotations

import subprocess
import uuid

import psycopg
from psycopg import sql

from reactor.pg.migrate import migrate
from tests.support.servers import find_binary
from tests.support.urls import with_path


def create_database(pg_server_url: str, name: str, template: str | None = None) -> None:
    """Create database `name` (a clone of `template` if given)."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(statement)


def drop_database(pg_server_url: str, name: str) -> None:
    """Drop database `name` if it exists, whoever is still connected to it."""
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def create_template(pg_server_url: str, name: str) -> None:
    """(Re)create database `name` and migrate it: the template of every test's database."""
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
    create_database(pg_server_url, name)
    with psycopg.connect(with_path(pg_server_url, name), autocommit=True) as conn:
        migrate(conn)


def clone_template(pg_server_url: str, template: str) -> str:
    """A new database cloned from `template`; its name."""
    name = f"reactor_t_{uuid.uuid4().hex[:12]}"
    create_database(pg_server_url, name, template)
    return name


def create_empty(pg_server_url: str) -> str:
    """A new unmigrated database; its name."""
    name = f"reactor_e_{uuid.uuid4().hex[:12]}"
    create_database(pg_server_url, name)
    return name


def schema_dump(url: str) -> str:
    """`pg_dump --schema-only` of the database at `url`, without the lines that vary from run
    to run (newer pg_dump brackets its output with \\restrict lines holding a random key)."""
    pg_dump = find_binary("pg_dump")
    assert pg_dump, "pg_dump is needed for the schema comparison"
    out = subprocess.run(
        [pg_dump, "--schema-only", "--no-owner", "--no-privileges", "-d", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "\n".join(
        line for line in out.splitlines() if not line.startswith(("\\restrict", "\\unrestrict"))
    )
