"""Hardening: a connection limit, a poison row, a hijacked migration ledger, a planted pickle, a
hostile HTTP client, junk types and a NOTIFY flood must not break the guarantees.

Every test here reproduces the fault or the attack on real servers (a role limited to two
connections, a trigger that raises, a database owned by a non-superuser, a pickle in Redis,
idle sockets, a flood from a test connection) and checks the guarantee, not a mock of it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.conftest import Env, Process, start_reactor, wait_for
from tests.helpers import insert_rows, jobs_missing, states


def _as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{role}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@contextlib.contextmanager
def _role(env: Env, *options: str) -> Iterator[str]:
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
                    psycopg.connect(_with_db(env.pg_server_url, dbname), autocommit=True) as conn,
                ):
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            with contextlib.suppress(psycopg.Error):
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _with_db(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, ""))


# -- 1. a row is never active without its job, even when a connection cannot be opened -------


@pytest.fixture
def limited_role(env: Env) -> Iterator[str]:
    """A role that may hold two connections at once: the reactor's listener and work
    connections, so the prefetch connection of a backlog drain cannot be opened."""
    with _role(env, "CONNECTION LIMIT 2") as name:
        conn = env.connect()
        conn.execute(
            sql.SQL(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}"
            ).format(sql.Identifier(name))
        )
        yield name


def test_no_active_row_without_its_job_under_a_connection_limit(
    env: Env, spawn: Callable[..., Process], limited_role: str
) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 60)
    reactor = start_reactor(
        spawn, "--batch-size", "10", DATABASE_URL=_as_role(env.database_url, limited_role)
    )
    missing_seen: list[str] = []
    samples = 0

    def quiescent() -> bool:
        nonlocal samples
        samples += 1
        missing_seen.extend(jobs_missing(conn, client))
        return states(conn) == {"active": 60}

    # Sampled while the reactor drains, and at quiescence: never an active row without its job.
    wait_for(quiescent, timeout=60, interval=0.005, what="60 rows active")
    assert missing_seen == [], f"active rows without their job: {sorted(set(missing_seen))[:10]}"
    assert jobs_missing(conn, client) == []
    assert len(client.lrange("rq:queue:photo-process", 0, -1)) == 60
    # More rows later, on the same reactor: still all delivered.
    insert_rows(conn, 25, prefix="q")
    wait_for(lambda: states(conn) == {"active": 85}, timeout=60, what="85 rows active")
    assert jobs_missing(conn, client) == []
    assert reactor.proc.poll() is None
    assert any("prefetch_unavailable" in line for line in reactor.lines), reactor.output()
