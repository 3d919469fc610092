"""A drain claims its next batch on a second connection while the current one is enqueued
(`reactor.dispatcher.ahead`): every row still goes out once, a claim that fails there is
handled as one in turn (the failing row refused, the rest flowing), and whatever fails leaves
no claim open and no connection in pipeline mode. A reactor does so on its claim-ahead
session, opened after its first backlog (a role that cannot open it:
`tests/test_hardening.py`; behind a pooler it opens none: `tests/test_scaleout.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
import redis
from psycopg import pq

from reactor.dispatcher.drain import Dispatcher
from reactor.errors import DatabaseError, RedisUnavailableError
from reactor.jobs import JobRef, job_id
from reactor.pg import db
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer, EnqueueResult
from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows, states
from tests.support.rq_state import jobs_missing, queue_ids
from tests.support.servers import free_port
from tests.support.waiting import wait_for

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
TYPE = "photo.process"

#: Records which session claimed each row (made it `active`).
_CLAIMED_BY = """
CREATE TABLE claimed_by (photo_id text, pid int);
CREATE FUNCTION note_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO claimed_by VALUES (NEW.photo_id, pg_backend_pid()); RETURN NEW; END $$;
CREATE TRIGGER note_claim AFTER UPDATE ON photo_jobs FOR EACH ROW
WHEN (OLD.state = 'pending' AND NEW.state = 'active') EXECUTE FUNCTION note_claim();
"""

_POISON = """
CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'poisoned row' USING ERRCODE = '22003'; END $$;
CREATE TRIGGER poison BEFORE UPDATE ON photo_jobs FOR EACH ROW
WHEN (NEW.photo_id = 'poison' AND NEW.state = 'active') EXECUTE FUNCTION poison();
"""


def test_a_reactor_claims_a_backlog_on_its_work_and_claim_ahead_sessions(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    conn.execute(_CLAIMED_BY)
    insert_rows(conn, 100, prefix="a")
    reactor = start_reactor(spawn, "--batch-size", "10")
    # The first backlog's full batches open the claim-ahead session; the next uses it.
    wait_for(lambda: states(conn) == {"active": 100}, timeout=60, what="100 rows active")
    wait_for(lambda: _sessions(conn) >= {"photo-reactor claim-ahead"}, what="claim-ahead")
    insert_rows(conn, 100, prefix="b")
    wait_for(lambda: states(conn) == {"active": 200}, timeout=60, what="200 rows active")
    assert jobs_missing(conn, client) == []
    assert len(queue_ids(client)) == 200
    assert "claim_ahead" not in reactor.output(), reactor.output()
    sessions = {
        name
        for (name,) in conn.execute(
            "SELECT DISTINCT a.application_name FROM claimed_by c"
            " JOIN pg_stat_activity a ON a.pid = c.pid"
        )
    }
    assert sessions == {"photo-reactor work", "photo-reactor claim-ahead"}, sessions


def _sessions(conn: psycopg.Connection[Any]) -> set[str]:
    return {
        str(name)
        for (name,) in conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        )
    }


def _idle(*conns: psycopg.Connection[Any]) -> bool:
    return all(
        c.info.transaction_status is pq.TransactionStatus.IDLE
        and c.pgconn.pipeline_status == pq.PipelineStatus.OFF
        for c in conns
    )


def test_a_backlog_is_claimed_on_both_connections_and_each_row_goes_out_once(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    conn.execute(_CLAIMED_BY)
    insert_rows(conn, 47)
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)

    result = dispatcher.drain(work, [TYPE], ahead=ahead)

    assert (result.claimed, result.enqueued, result.batches) == (47, 47, 10)
    assert states(conn) == {"active": 47}
    assert sorted(queue_ids(client)) == sorted(job_id(TYPE, f"p{i}", 1) for i in range(1, 48))
    assert jobs_missing(conn, client) == []
    by_session = Counter(pid for _, pid in conn.execute("SELECT photo_id, pid FROM claimed_by"))
    assert set(by_session) == {work.info.backend_pid, ahead.info.backend_pid}, by_session
    assert _idle(work, ahead)


def test_a_row_failing_a_claim_sent_ahead_is_refused_and_its_type_flows(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    conn.execute(_CLAIMED_BY)
    conn.execute(_POISON)
    insert_rows(conn, 10, prefix="a")
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('poison', %s)", [TYPE])
    insert_rows(conn, 10, prefix="b")
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)

    result = dispatcher.drain(work, [TYPE], ahead=ahead)

    assert (result.claimed, result.enqueued) == (20, 20)
    assert states(conn) == {"active": 20, "pending": 1}
    assert [r.photo_id for r in dispatcher.refused.current()] == ["poison"]
    assert dispatcher.quarantined == {}
    assert jobs_missing(conn, client) == []
    # The batch that met the row was one claimed ahead (the first batch is claimed in turn).
    pids = {pid for _, pid in conn.execute("SELECT photo_id, pid FROM claimed_by")}
    assert ahead.info.backend_pid in pids
    assert _idle(work, ahead)


def test_a_failed_enqueue_rolls_back_the_batch_and_the_claim_sent_ahead(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 12)
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    dispatcher = Dispatcher(Enqueuer(unreachable, ROUTES), ROUTES, batch_size=5)

    with pytest.raises(RedisUnavailableError):
        dispatcher.drain(work, [TYPE], ahead=ahead)

    assert states(conn) == {"pending": 12}
    assert _idle(work, ahead)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)
    result = dispatcher.drain(work, [TYPE], ahead=ahead)
    assert (result.claimed, result.enqueued) == (12, 12)
    assert jobs_missing(conn, client) == []


class _StallingEnqueuer(Enqueuer):
    """Stalls before enqueueing the batch that `stall_at` counts (1: the first)."""

    def __init__(self, *args: Any, stall_at: int, seconds: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls, self._stall_at, self._seconds = 0, stall_at, seconds

    def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
        self._calls += 1
        if self._calls == self._stall_at:
            time.sleep(self._seconds)  # the fault: a process stalled inside the claim
        return super().enqueue(refs)


def test_a_failed_drain_keeps_a_connection_whose_claim_ahead_met_a_bad_row(env: Env) -> None:
    """The claim sent ahead fails on a row while the batch before it cannot be enqueued: both
    claims roll back, and both connections stay open (the one that met the row is healthy)."""
    conn = env.connect()
    conn.execute(_POISON)
    insert_rows(conn, 5, prefix="a")
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('poison', %s)", [TYPE])
    insert_rows(conn, 5, prefix="b")
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    # Slow to fail (no Redis answers): the claim sent ahead has met the row by then.
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    enqueuer = _StallingEnqueuer(unreachable, ROUTES, stall_at=1, seconds=0.5)
    dispatcher = Dispatcher(enqueuer, ROUTES, batch_size=5)

    with pytest.raises(RedisUnavailableError):
        dispatcher.drain(work, [TYPE], ahead=ahead)

    assert not work.closed and not ahead.closed
    assert _idle(work, ahead)
    assert states(conn) == {"pending": 11}


def test_a_lost_claim_ahead_session_is_closed_and_the_drain_goes_on_without_it(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 12)
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    conn.execute("SELECT pg_terminate_backend(%s)", [ahead.info.backend_pid])
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)

    result = dispatcher.drain(work, [TYPE], ahead=ahead)

    assert (result.claimed, result.enqueued, result.already_enqueued) == (12, 12, 0)
    assert sorted(queue_ids(client)) == sorted(job_id(TYPE, f"p{i}", 1) for i in range(1, 13))
    assert jobs_missing(conn, client) == []
    assert ahead.closed and _idle(work)
    assert sum("claim_ahead_lost" in r.getMessage() for r in caplog.records) == 1


def test_the_idle_in_transaction_timeout_ends_a_stalled_claim_made_ahead(env: Env) -> None:
    """A claim read from pipeline mode still gets the server's idle-in-transaction timeout,
    the guard against a claim whose row locks outlive a stalled enqueue."""
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 10)
    work = db.connect(env.database_url, idle_in_transaction_seconds=1)
    ahead = db.connect(env.database_url, idle_in_transaction_seconds=1)
    enqueuer = _StallingEnqueuer(client, ROUTES, stall_at=2, seconds=2.5)
    dispatcher = Dispatcher(enqueuer, ROUTES, batch_size=5)

    with pytest.raises(DatabaseError, match="COMMIT failed"):
        dispatcher.drain(work, [TYPE], ahead=ahead)

    # The second batch, claimed ahead, was ended by the server: its rows are pending again
    # (their jobs, written after the stall, are found queued by the next claim).
    assert states(conn) == {"active": 5, "pending": 5}
    fresh = env.connect(autocommit=False)
    result = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5).drain(fresh, [TYPE])
    assert (result.claimed, result.enqueued, result.already_enqueued) == (5, 0, 5)
    assert jobs_missing(conn, client) == []
