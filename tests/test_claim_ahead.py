"""A drain claims its next batch on a second connection while the current one is enqueued
(`reactor.dispatcher.ahead`): every row still goes out once, a claim that fails there is
handled as one in turn (the failing row refused, the rest flowing), and whatever fails leaves
no claim open and no connection in pipeline mode. A reactor does so on its claim-ahead
session (a role that cannot open it: `tests/test_hardening.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import pq

from reactor.dispatcher.drain import Dispatcher
from reactor.errors import DatabaseError, RedisUnavailableError
from reactor.jobs import job_id
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer
from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows, states
from tests.support.rq_state import jobs_missing, queue_ids
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
    insert_rows(conn, 200)
    start_reactor(spawn, "--batch-size", "10")
    wait_for(lambda: states(conn) == {"active": 200}, timeout=60, what="200 rows active")
    assert jobs_missing(conn, client) == []
    assert len(queue_ids(client)) == 200
    sessions = {
        name
        for (name,) in conn.execute(
            "SELECT DISTINCT a.application_name FROM claimed_by c"
            " JOIN pg_stat_activity a ON a.pid = c.pid"
        )
    }
    assert sessions == {"photo-reactor work", "photo-reactor claim-ahead"}, sessions


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

    result = dispatcher.drain(work, [TYPE], ahead=lambda: ahead)

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

    result = dispatcher.drain(work, [TYPE], ahead=lambda: ahead)

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
    client.set("rq:queue:photo-process", "junk")  # the script refuses every batch
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)

    with pytest.raises(RedisUnavailableError):
        dispatcher.drain(work, [TYPE], ahead=lambda: ahead)

    assert states(conn) == {"pending": 12}
    assert client.keys("rq:job:*") == []
    assert _idle(work, ahead)
    client.delete("rq:queue:photo-process")
    result = dispatcher.drain(work, [TYPE], ahead=lambda: ahead)
    assert (result.claimed, result.enqueued) == (12, 12)
    assert jobs_missing(conn, client) == []


def test_a_lost_claim_ahead_session_fails_the_drain_and_loses_nothing(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 12)
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    conn.execute("SELECT pg_terminate_backend(%s)", [ahead.info.backend_pid])
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)

    with pytest.raises(DatabaseError):
        dispatcher.drain(work, [TYPE], ahead=lambda: ahead)

    # The first batch was claimed on the work session, and rolled back with the drain.
    assert states(conn) == {"pending": 12}
    assert queue_ids(client) == []
    assert _idle(work)
    fresh = env.connect(autocommit=False)
    result = dispatcher.drain(work, [TYPE], ahead=lambda: fresh)
    assert (result.claimed, result.enqueued, result.already_enqueued) == (12, 12, 0)
    assert sorted(queue_ids(client)) == sorted(job_id(TYPE, f"p{i}", 1) for i in range(1, 13))
