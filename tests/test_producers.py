"""Producing from applications: `submit`, `submit_many` and their async forms on every kind of
connection an application holds (psycopg, SQLAlchemy sync and async, Django), against the
suite's Postgres and a real reactor.

For each kind, a rolled-back transaction leaves no row and sends no notification, and a
committed one gives the row, its notification and its dispatch. The reactor runs with the
plain doorbell, so that every commit notifies (the adaptive one notifies only while a reactor
waits), and a marker notification sent after a rollback shows that nothing came before it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import reactor
from tests.support.doorbell import armed_by
from tests.support.env import Env
from tests.support.processes import Process, child_environ, start_reactor
from tests.support.waiting import wait_for

MARKER = "photo.process end-of-test-marker"


@pytest.fixture
def listener(env: Env) -> Iterator[psycopg.Connection[Any]]:
    conn = env.connect(autocommit=True)
    conn.execute("LISTEN photo_jobs")
    yield conn
    conn.close()


@pytest.fixture
def dispatching(env: Env, spawn: Callable[..., Process]) -> None:
    """A reactor whose doorbell stays armed once armed: every commit notifies."""
    start_reactor(spawn, "--doorbell", "plain")
    with env.connect() as conn:
        wait_for(lambda: armed_by(conn) is not None, timeout=30, what="the doorbell armed")


def payloads_until_marker(env: Env, listener: psycopg.Connection[Any]) -> list[str]:
    """Every notification delivered before a marker sent now (so, every one sent before)."""
    with env.connect(autocommit=True) as other:
        other.execute("SELECT pg_notify('photo_jobs', %s)", [MARKER])
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for note in listener.notifies(timeout=1.0):
            if note.payload == MARKER:
                return seen
            seen.append(note.payload)
    raise AssertionError(f"no marker within 30 s; seen {seen[:5]}")


def state_of(env: Env, photo_id: str) -> str | None:
    with env.connect() as conn:
        row = conn.execute(
            "SELECT state FROM photo_jobs WHERE photo_id = %s", [photo_id]
        ).fetchone()
    return None if row is None else str(row[0])


def check_transactions(
    env: Env, listener: psycopg.Connection[Any], submit_in: Callable[[str, bool], object]
) -> None:
    """`submit_in(photo_id, commit)` submits one photo in a transaction it commits or rolls
    back; the rollback leaves nothing, the commit gives the row, its notification and its
    dispatch."""
    submit_in("rolled-back", False)
    assert payloads_until_marker(env, listener) == []
    assert state_of(env, "rolled-back") is None
    submit_in("committed", True)
    assert payloads_until_marker(env, listener) == ["photo.process"]
    wait_for(lambda: state_of(env, "committed") == "active", timeout=30, what="dispatched")


def sqlalchemy_url(env: Env, driver: str) -> str:
    return (
        make_url(env.database_url)
        .set(drivername=f"postgresql+{driver}")
        .render_as_string(hide_password=False)
    )


# -- each kind of connection -----------------------------------------------------------------


def test_psycopg_connection(env: Env, listener: psycopg.Connection[Any], dispatching: None) -> None:
    def submit_in(photo_id: str, commit: bool) -> None:
        with env.connect(autocommit=False) as conn:
            assert reactor.submit(conn, photo_id) is True
            conn.commit() if commit else conn.rollback()

    check_transactions(env, listener, submit_in)


def test_psycopg_async_connection(
    env: Env, listener: psycopg.Connection[Any], dispatching: None
) -> None:
    async def submit_in(photo_id: str, commit: bool) -> None:
        async with await psycopg.AsyncConnection.connect(env.database_url) as conn:
            assert await reactor.submit_async(conn, photo_id) is True
            await (conn.commit() if commit else conn.rollback())

    check_transactions(env, listener, lambda p, c: asyncio.run(submit_in(p, c)))


@pytest.mark.parametrize("holder", ["Connection", "Session", "scoped_session"])
def test_sqlalchemy(
    env: Env, listener: psycopg.Connection[Any], dispatching: None, holder: str
) -> None:
    engine = create_engine(sqlalchemy_url(env, "psycopg"))

    def submit_in(photo_id: str, commit: bool) -> None:
        if holder == "Session":
            with Session(engine) as session:
                assert reactor.submit(session, photo_id) is True
                session.commit() if commit else session.rollback()
        elif holder == "scoped_session":  # what Flask-SQLAlchemy's db.session is
            scoped = scoped_session(sessionmaker(engine))
            assert reactor.submit(scoped, photo_id) is True
            scoped.commit() if commit else scoped.rollback()
            scoped.remove()
        else:
            with engine.connect() as conn:
                assert reactor.submit(conn, photo_id) is True
                conn.commit() if commit else conn.rollback()

    try:
        check_transactions(env, listener, submit_in)
    finally:
        engine.dispose()


@pytest.mark.parametrize("holder", ["AsyncConnection", "AsyncSession"])
def test_sqlalchemy_async(
    env: Env, listener: psycopg.Connection[Any], dispatching: None, holder: str
) -> None:
    async def submit_in(photo_id: str, commit: bool) -> None:
        engine = create_async_engine(sqlalchemy_url(env, "psycopg"))
        try:
            if holder == "AsyncSession":
                async with AsyncSession(engine) as session:
                    assert await reactor.submit_async(session, photo_id) is True
                    await (session.commit() if commit else session.rollback())
            else:
                async with engine.connect() as conn:
                    assert await reactor.submit_async(conn, photo_id) is True
                    await (conn.commit() if commit else conn.rollback())
        finally:
            await engine.dispose()

    check_transactions(env, listener, lambda p, c: asyncio.run(submit_in(p, c)))


DJANGO_PRODUCER = textwrap.dedent(
    """
    import sys
    from tests.support.django_setup import configure
    configure()
    from django.db import connection, transaction
    import reactor

    class RolledBack(Exception):
        pass

    photo_id, commit = sys.argv[1], sys.argv[2] == "commit"
    try:
        with transaction.atomic():  # what a view under ATOMIC_REQUESTS or atomic() does
            assert reactor.submit(connection, photo_id) is True
            assert reactor.submit_many(connection, [photo_id + "-b", photo_id + "-c"]) == 2
            if not commit:
                raise RolledBack
    except RolledBack:
        pass
    """
)


def test_django_connection(env: Env, listener: psycopg.Connection[Any], dispatching: None) -> None:
    def submit_in(photo_id: str, commit: bool) -> None:
        subprocess.run(
            [sys.executable, "-c", DJANGO_PRODUCER, photo_id, "commit" if commit else "rollback"],
            env=child_environ(DATABASE_URL=env.database_url),
            check=True,
            timeout=60,
        )

    check_transactions(env, listener, submit_in)
    assert state_of(env, "rolled-back-b") is None
    wait_for(lambda: state_of(env, "committed-c") == "active", timeout=30, what="dispatched")


# -- many at once; what is refused -------------------------------------------------------------


def test_submit_many_writes_twenty_thousand_ids_in_one_statement_with_a_few_notifications(
    env: Env, listener: psycopg.Connection[Any]
) -> None:
    # This session arms the doorbell as an idle reactor does, so that the triggers notify.
    bell = env.connect(autocommit=True)
    bell.execute(
        "SELECT pg_advisory_lock(photo_jobs_doorbell_key() + s)"
        " FROM generate_series(0, photo_jobs_doorbell_stripes() - 1) AS s"
    )
    ids = [f"img-{i}" for i in range(20_000)]
    with env.connect(autocommit=False) as producer:
        assert reactor.submit_many(producer, [*ids, "img-1"]) == 20_000
        producer.commit()
        producer.execute(
            "UPDATE photo_jobs SET state = 'done' WHERE photo_id IN ('img-1', 'img-2')"
        )
        producer.commit()
        # Pending rows are left alone; done ones re-armed.
        assert reactor.submit_many(producer, ["img-0", "img-1", "img-2", "new"]) == 3
        producer.commit()
    notes = payloads_until_marker(env, listener)
    assert 1 <= len(notes) <= 4, notes[:10]
    bell.close()
    with env.connect() as check:
        assert check.execute(
            "SELECT count(*), count(*) FILTER (WHERE prior_attempts = 0) FROM photo_jobs"
        ).fetchone() == (20_001, 20_001)


def test_bad_ids_are_refused_before_the_database_and_other_objects_say_what_is_needed(
    env: Env,
) -> None:
    with env.connect(autocommit=False) as conn:
        with pytest.raises(reactor.InvalidJobError, match="must not be blank"):
            reactor.submit_many(conn, ["ok", "  "])
        with pytest.raises(reactor.InvalidJobError, match="timezone-aware"):
            reactor.submit(conn, "ok", run_at=datetime(2030, 1, 1))
        with pytest.raises(reactor.InvalidJobError, match="not one string"):
            reactor.submit_many(conn, "abc")
        assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (0,)
    sqlite_engine = create_engine("sqlite://")
    with Session(sqlite_engine) as session, pytest.raises(TypeError) as refused:
        reactor.submit(session, "p1")
    assert str(refused.value) == (
        "submit() needs a Postgres connection: psycopg, SQLAlchemy (postgresql+psycopg or "
        "postgresql+psycopg2) or Django; got a SQLAlchemy Session on sqlite+pysqlite"
    )
    with pytest.raises(TypeError, match=r"needs a Postgres connection.*got sqlite3\.Connection"):
        reactor.submit(sqlite3.connect(":memory:"), "p1")

    async def sync_call_on_an_async_connection() -> None:
        async with await psycopg.AsyncConnection.connect(env.database_url) as aconn:
            with pytest.raises(TypeError, match="async connection needs submit_async"):
                reactor.submit(aconn, "p1")

    asyncio.run(sync_call_on_an_async_connection())
