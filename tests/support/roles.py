"""Throwaway login roles for tests that need a role other than the superuser the suite runs
as (a connection limit, missing privileges, an attacker), and URLs that log in as them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from tests.support.env import Env


def as_role(url: str, role: str) -> str:
    """`url`, logging in as `role` (trust auth: no password)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{role}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@contextlib.contextmanager
def throwaway_role(env: Env, *options: str) -> Iterator[str]:
    """A throwaway login role (roles are per cluster: dropped at the end)."""
    name = f"reactor_r_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(env.pg_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN " + " ".join(options)).format(sql.Identifier(name))
        )
    try:
        yield name
    finally:
        with psycopg.connect(env.pg_server_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [name],
            )
            for (dbname,) in admin.execute(
                "SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate"
                " AND datname LIKE 'reactor_%%'"
            ).fetchall():
                with (
                    contextlib.suppress(psycopg.Error),
                    psycopg.connect(
                        with_database(env.pg_server_url, dbname), autocommit=True
                    ) as conn,
                ):
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            with contextlib.suppress(psycopg.Error):
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def with_database(url: str, dbname: str) -> str:
    """`url` on database `dbname`."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, ""))
