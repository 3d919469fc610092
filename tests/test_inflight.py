"""`reactor.worker.inflight`: a statement sent without waiting, its result read later.

Against a real Postgres, with and without prepared statements: answers and the fence, a start
racing the claim that enqueued its job, a statement error, a session that lost its
prepared statements, and a session terminated with a statement in flight (the store reconnects
on the next send) or before a read of the recorded routes (the read reconnects and answers).
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from reactor.errors import DatabaseError, StatementError
from reactor.pg import db
from reactor.pg.registry import routes_in_use
from reactor.worker.inflight import DONE, START, InFlight
from reactor.worker.lifecycle import Store
from tests.support.env import Env
from tests.support.waiting import wait_for


@pytest.fixture(params=[False, True], ids=["unnamed", "prepared"])
def prepared(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Connections opened meanwhile prepare statements or not (the store connects lazily)."""
    db.set_prepared_statements(bool(request.param))
    yield bool(request.param)
    db.set_prepared_statements(None)


@pytest.fixture
def store(env: Env) -> Iterator[Store]:
    owner = Store(env.database_url)
    yield owner
    owner.close()


@pytest.fixture
def conn(env: Env) -> Iterator[psycopg.Connection[Any]]:
    with env.connect(autocommit=True) as connection:
        connection.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts)"
            " VALUES ('p1', 'photo.process', 'active', 2, 7)"
        )
        yield connection


def params(attempt: int, photo_id: str = "p1") -> dict[str, object]:
    return {"photo_id": photo_id, "type": "photo.process", "token": attempt, "fresh": 60.0}


def state(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    row = conn.execute("SELECT state, attempts FROM photo_jobs WHERE photo_id = 'p1'").fetchone()
    assert row is not None
    return tuple(row)


def wait_for_lock(conn: psycopg.Connection[Any], session: int, statement: str) -> None:
    """Wait until `session` waits on a lock (its statement in flight, on the server)."""
    wait_for(
        lambda: (
            conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [session]
            ).fetchone()
            == ("Lock",)
        ),
        timeout=10,
        what=f"{statement} waiting on the row lock",
    )


def test_answers_follow_the_fence(
    store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    inflight = InFlight(store)
    assert inflight.send(START, params(2))
    started = inflight.receive()
    assert (
        started is not None
        and started.rows == 1
        and started.first is not None
        and started.first[1] == "7"
    )
    assert inflight.send(START, params(1))
    started = inflight.receive()
    assert started is not None and (started.rows, started.first) == (0, None)
    assert inflight.send(DONE, params(1))  # a superseded attempt
    written = inflight.receive()
    assert written is not None and written.rows == 0
    assert state(conn) == ("active", 2)
    assert inflight.send(DONE, params(2))
    written = inflight.receive()
    assert written is not None and written.rows == 1
    assert state(conn) == ("done", 2)
    assert inflight.receive() is None  # nothing in flight


@pytest.mark.parametrize("ends", ["commit", "rollback"])
def test_a_start_waits_for_the_claim_that_enqueued_its_job(
    env: Env, store: Store, conn: psycopg.Connection[Any], prepared: bool, ends: str
) -> None:
    """The enqueue precedes the claim's COMMIT, so a worker can start a job while its claim is
    still open: the start waits for it, then stamps the row (it read the row pending) and
    runs. Rolled back (its COMMIT lost), the row stays pending and the job does not run."""
    conn.execute("UPDATE photo_jobs SET state = 'pending', attempts = 2 WHERE photo_id = 'p1'")
    inflight = InFlight(store)
    session = store.conn.info.backend_pid
    with env.connect(autocommit=False) as claim:
        claimed = claim.execute(
            "UPDATE photo_jobs SET state = 'active', attempts = 3 WHERE photo_id = 'p1'"
            " RETURNING updated_at"
        ).fetchone()
        assert inflight.send(START, params(3))
        wait_for_lock(conn, session, "the start")
        claim.commit() if ends == "commit" else claim.rollback()
    started = inflight.receive()
    if ends == "rollback":
        assert started is not None and (started.rows, started.first) == (0, None)
        assert state(conn) == ("pending", 2)
        return
    assert (
        started is not None
        and started.rows == 1
        and started.first is not None
        and started.first[1] == "7"
    )
    assert state(conn) == ("active", 3)
    stamped = conn.execute(
        "SELECT greatest(updated_at, heartbeat_at) FROM photo_jobs WHERE photo_id = 'p1'"
    ).fetchone()
    assert claimed is not None and stamped is not None and stamped[0] > claimed[0]


def test_a_statement_error_is_no_answer_and_the_connection_stays_usable(
    store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    inflight = InFlight(store)
    assert inflight.send(START, {**params(2), "token": "two"})
    assert inflight.receive() is None
    session = store.conn.info.backend_pid
    assert inflight.send(START, params(2))
    started = inflight.receive()
    assert started is not None and started.first is not None and started.first[1] == "7"
    assert store.conn.info.backend_pid == session


def test_a_session_that_lost_its_prepared_statements_prepares_them_again(
    store: Store, conn: psycopg.Connection[Any]
) -> None:
    inflight = InFlight(store)
    assert store.conn.prepare_threshold is not None  # a direct session prepares by default
    assert inflight.send(START, params(2))
    assert inflight.receive() is not None
    store.conn.execute("DEALLOCATE ALL")  # what a pooler's reset query does
    assert inflight.send(START, params(2))
    assert inflight.receive() is None
    assert inflight.send(START, params(2))
    started = inflight.receive()
    assert started is not None and started.first is not None and started.first[1] == "7"


def test_a_session_terminated_mid_statement_is_closed_and_the_next_send_reconnects(
    env: Env, store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    inflight = InFlight(store)
    session = store.conn.info.backend_pid
    with env.connect() as locker, locker.transaction():
        # The row is locked: the `done` waits on the server, in flight, until its session ends.
        locker.execute("SELECT 1 FROM photo_jobs WHERE photo_id = 'p1' FOR UPDATE")
        assert inflight.send(DONE, params(2))
        wait_for_lock(conn, session, "the done")
        conn.execute("SELECT pg_terminate_backend(%s)", [session])
        assert inflight.receive() is None
    assert state(conn) == ("active", 2)
    assert inflight.send(DONE, params(2))
    written = inflight.receive()
    assert written is not None and written.rows == 1
    assert store.conn.info.backend_pid != session
    assert state(conn) == ("done", 2)


def test_a_read_on_a_terminated_session_reconnects_and_answers(
    store: Store, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO reactor_routes (type, handler, queue, lock_key, registered_by)"
        " VALUES ('photo.process', 'tests.handlers.ok', 'photos', 1, 'x')"
    )
    session = store.conn.info.backend_pid
    conn.execute("SELECT pg_terminate_backend(%s)", [session])
    # What a job's route check does: the killed session costs a reconnect, not the attempt.
    routes = store.run(routes_in_use)
    assert routes["photo.process"].handler == "tests.handlers.ok"
    assert store.conn.info.backend_pid != session
    # Once, without the retry, the same kill is the read's failure.
    session = store.conn.info.backend_pid
    conn.execute("SELECT pg_terminate_backend(%s)", [session])
    with pytest.raises(DatabaseError, match="cannot read the routes"):
        store.run_once(routes_in_use)
    assert store.run_once(routes_in_use) == routes


@pytest.fixture
def latin1_store(env: Env) -> Iterator[Store]:
    owner = Store(
        env.database_url + ("&" if "?" in env.database_url else "?") + "client_encoding=LATIN1"
    )
    yield owner
    owner.close()


def test_parameters_go_out_in_the_session_encoding(
    latin1_store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts) VALUES"
        " ('café', 'photo.process', 'active', 2)"
    )
    assert latin1_store.conn.info.encoding == "iso8859-1"
    inflight = InFlight(latin1_store)
    assert inflight.send(START, params(2, "café"))
    started = inflight.receive()
    assert started is not None and started.rows == 1
    assert inflight.send(DONE, params(2, "café"))
    written = inflight.receive()
    assert written is not None and written.rows == 1
    # One the encoding cannot hold is not sent; psycopg's own path reports it.
    session = latin1_store.conn.info.backend_pid
    assert not inflight.send(START, params(2, "€"))
    assert latin1_store.conn.info.backend_pid == session


def test_a_nul_character_is_not_sent(
    store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    # libpq would cut the value at the NUL, and the fence would match photo p1.
    inflight = InFlight(store)
    session = store.conn.info.backend_pid
    assert not inflight.send(START, params(2, "p1\x00x"))
    assert not inflight.send(DONE, params(2, "p1\x00x"))
    assert not inflight.in_flight
    assert state(conn) == ("active", 2)
    assert store.conn.info.backend_pid == session
    with pytest.raises(StatementError, match="cannot contain NUL"):
        store.execute("SELECT %(photo_id)s::text", {"photo_id": "p1\x00x"})


class _TimeoutSignalError(Exception):
    """What RQ's job timeout raises, as far as the waiting code can tell."""


def test_an_exception_while_waiting_propagates_and_closes_the_connection(
    env: Env, store: Store, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    inflight = InFlight(store)
    session = store.conn.info.backend_pid

    def interrupt(signum: int, frame: object) -> None:
        raise _TimeoutSignalError

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with env.connect() as locker, locker.transaction():
            locker.execute("SELECT 1 FROM photo_jobs WHERE photo_id = 'p1' FOR UPDATE")
            assert inflight.send(DONE, params(2))
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(_TimeoutSignalError):
                inflight.receive()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not inflight.in_flight
    assert inflight.send(START, params(2))
    assert inflight.receive() is not None
    assert store.conn.info.backend_pid != session


def test_a_socket_numbered_above_fd_setsize_works(
    env: Env, conn: psycopg.Connection[Any], prepared: bool
) -> None:
    # A handler may leave a worker holding many files: the wait must not rely on select().
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    owner = Store(env.database_url)
    try:
        assert owner.conn.pgconn.socket > 1024
        inflight = InFlight(owner)
        assert inflight.send(START, params(2))
        started = inflight.receive()
        assert started is not None and started.first is not None and started.first[1] == "7"
    finally:
        owner.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
