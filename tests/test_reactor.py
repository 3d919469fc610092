"""The reactor (issue: LISTEN/NOTIFY dispatch, sweep, rescue, reconnects, shutdown).

Integration tests on real Postgres and Redis; the reactor runs as a real subprocess wherever
process behaviour (signals, reconnects, start-up errors) is what is tested.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from rq.job import Job, JobStatus

from reactor.dispatcher.drain import Dispatcher
from reactor.dispatcher.loop import Reactor
from reactor.errors import DatabaseError, RedisDataError
from reactor.jobs import JobRef, job_id
from reactor.pg.db import LATEST_SCHEMA_VERSION
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer, EnqueueResult
from reactor.rq.redis_url import connect_redis
from reactor.rq.state import RqState
from reactor.settings import ReactorSettings
from reactor.worker import lifecycle
from tests.support.cli import one_line, run_cli
from tests.support.doorbell import listener_pids
from tests.support.env import Env
from tests.support.notifications import Notifications
from tests.support.notify_socket import NotifySocket
from tests.support.processes import Process, start_reactor
from tests.support.redis_dbs import SUITE_MARKER_KEY
from tests.support.rows import insert_rows, rows, states
from tests.support.rq_state import jobs_missing, queue_ids
from tests.support.servers import PostgresServer, RedisServer, free_port
from tests.support.waiting import wait_for

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])


def test_committed_insert_is_queued_at_once(env: Env, spawn: Callable[..., Process]) -> None:
    start_reactor(spawn)
    conn, client = env.connect(), env.redis()
    delays = []
    for i in range(20):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [f"p{i}"]
        )
        committed = time.monotonic()
        wanted = job_id("photo.process", f"p{i}", 1)
        wait_for(
            lambda wanted=wanted: wanted in queue_ids(client),  # type: ignore[misc]
            timeout=5,
            interval=0.0005,
            what=wanted,
        )
        delays.append(time.monotonic() - committed)
    # A margin no loaded 2-core machine reaches, still far below the 30 s sweep (the only
    # other path); the latency itself is measured in bench/.
    assert max(delays) < 5.0, f"dispatch delays (s): {sorted(delays)}"
    # The job is pushed just before the claim commits: wait for the last COMMIT.
    wait_for(lambda: states(conn) == {"active": 20}, timeout=5, what="claims committed")
    # What README says tools find in job.meta.
    meta = Job.fetch(job_id("photo.process", "p19", 1), connection=client).meta
    assert meta == {"type": "photo.process", "photo_id": "p19", "token": 1}


def test_redis_outage_keeps_rows_pending_then_delivers_each_once(
    env: Env, spawn: Callable[..., Process], private_redis: RedisServer
) -> None:
    reactor = start_reactor(spawn, "--redis-url", private_redis.url)
    conn = env.connect()
    private_redis.stop()
    insert_rows(conn, 50)
    reactor.wait_for_line("drain_retry")
    assert states(conn) == {"pending": 50}
    assert reactor.proc.poll() is None
    private_redis.start()
    client = connect_redis(private_redis.url)
    wait_for(lambda: len(queue_ids(client)) == 50, timeout=30, what="50 queued jobs")
    ids = queue_ids(client)
    assert len(set(ids)) == 50
    assert set(ids) == {job_id("photo.process", f"p{i}", 1) for i in range(1, 51)}
    wait_for(lambda: states(conn) == {"active": 50}, timeout=5, what="claims committed")
    assert reactor.proc.poll() is None


def test_lost_commit_after_enqueue_never_enqueues_twice(env: Env) -> None:
    conn, killer, client = env.connect(autocommit=False), env.connect(), env.redis()
    insert_rows(killer, 3)

    class _KillingEnqueuer(Enqueuer):
        """Enqueues for real, then ends the claim's session: its COMMIT is lost."""

        def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
            result = super().enqueue(refs)
            killer.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
            return result

    lossy = Dispatcher(_KillingEnqueuer(client, ROUTES), ROUTES, batch_size=10)
    with pytest.raises(DatabaseError):
        lossy.drain(conn, ["photo.process"], lambda: False, 60.0)
    assert states(killer) == {"pending": 3}  # the COMMIT never happened
    assert len(queue_ids(client)) == 3  # but the jobs were enqueued

    again = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=10)
    result = again.drain(env.connect(autocommit=False), ["photo.process"], lambda: False, 60.0)
    assert (result.claimed, result.enqueued, result.already_enqueued) == (3, 0, 3)
    assert sorted(queue_ids(client)) == sorted(
        job_id("photo.process", f"p{i}", 1) for i in range(1, 4)
    )
    assert {(state, attempts) for _, _, state, attempts in rows(killer)} == {("active", 1)}


def test_the_claim_commits_durably(env: Env) -> None:
    """An asynchronous commit is visible before it is flushed: a worker could run a claim that
    a crash then loses, and the next claim would give its token out again."""
    conn = env.connect(autocommit=False)
    insert_rows(env.connect(), 2)
    seen: list[str] = []

    class _Watching(Enqueuer):
        """Reads the claim's transaction's setting, before its COMMIT."""

        def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
            row = conn.execute("SHOW synchronous_commit").fetchone()
            seen.append(str(row[0]) if row else "")
            return super().enqueue(refs)

    watching = Dispatcher(_Watching(env.redis(), ROUTES), ROUTES, batch_size=1)
    result = watching.drain(conn, ["photo.process"], lambda: False, 60.0)
    assert result.claimed == 2
    assert len(seen) >= 2 and set(seen) == {"on"}, seen


@pytest.mark.parametrize("extra", [0, 600], ids=["few", "backlog"])
def test_a_batch_keeps_the_jobs_already_enqueued_and_replaces_the_others(
    env: Env, extra: int
) -> None:
    """A job in its queue or started is enqueued already (a lost COMMIT's) and is left as it
    is; a finished job, a bare hash (a half-written job) or a `queued` job in no list is
    written again, all in one script run, whatever the batch's size. A job marked ended while
    its id is still in the queue (a hash someone else wrote) is queued once, not twice."""
    client = env.redis()
    enqueuer = Enqueuer(client, ROUTES)
    names = ("queued", "started", "finished", "bare", "listless", "stray", "new")
    queued, started, finished, bare, listless, stray, new = (
        JobRef("photo.process", name, 1) for name in names
    )
    more = [JobRef("photo.process", f"more{i}", 1) for i in range(extra)]
    enqueuer.enqueue([queued, started, finished, listless, stray])
    for ref in (started, finished, listless):
        client.lrem("rq:queue:photo-process", 0, ref.job_id)
    client.hset(Job.key_for(started.job_id), "status", "started")
    client.hset(Job.key_for(finished.job_id), "status", "finished")
    client.hset(Job.key_for(stray.job_id), "status", "failed")  # its id stays in the queue
    client.hset(Job.key_for(bare.job_id), "created_at", "x")  # no status, no data
    client.script_flush()  # a restarted Redis has no scripts: the client loads it again

    result = enqueuer.enqueue([new, queued, started, finished, bare, listless, stray, *more])

    assert (result.enqueued, result.already_enqueued) == (5 + extra, 2)
    expected = [ref.job_id for ref in (new, queued, finished, bare, listless, stray, *more)]
    assert sorted(queue_ids(client)) == sorted(expected)  # `queued` and `stray` once
    for ref in (new, queued, finished, bare, listless, stray):
        assert Job.fetch(ref.job_id, connection=client).get_status() == JobStatus.QUEUED
    assert client.hget(Job.key_for(started.job_id), "status") == b"started"


@pytest.mark.parametrize(
    "key", ["rq:queue:photo-process", "rq:queues", "rq:job:photo_2eprocess-p1-1"]
)
def test_a_key_of_the_wrong_type_fails_the_whole_batch_and_writes_nothing(
    env: Env, key: str
) -> None:
    """Redis does not undo what a script wrote before an error: the script checks every key a
    command of the batch writes before it writes anything."""
    client = env.redis()
    client.set(key, "junk")
    refs = [JobRef("photo.process", f"p{i}", 1) for i in range(3)]
    with pytest.raises(RedisDataError, match=f"Redis key {key} holds a string") as raised:
        Enqueuer(client, ROUTES).enqueue(refs)
    assert raised.value.key == key
    # A job key names its row; the queue's keys name none.
    assert raised.value.photo_id == ("p1" if key.startswith("rq:job:") else None)
    assert client.keys("rq:*") == [key.encode()]


def test_a_queue_key_of_the_wrong_type_quarantines_its_type_until_it_is_fixed(
    env: Env,
) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 1)
    client.set("rq:queue:photo-process", "junk")
    work = env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=10)
    result = dispatcher.drain(work, ["photo.process"], lambda: False, 60.0)
    assert result.claimed == 0 and "photo.process" in dispatcher.quarantined
    assert "rq:queue:photo-process" in dispatcher.quarantined["photo.process"].error
    assert states(conn) == {"pending": 1}
    assert client.keys("rq:job:*") == []  # nothing half-written
    client.delete("rq:queue:photo-process")

    def drained() -> bool:
        return dispatcher.drain(work, ["photo.process"], lambda: False, 60.0).claimed == 1

    wait_for(drained, what="the type's claim once its quarantine is over")
    assert states(conn) == {"active": 1}
    assert queue_ids(client) == [job_id("photo.process", "p1", 1)]
    assert "photo.process" not in dispatcher.quarantined


@pytest.mark.timeout(60)
def test_a_bad_queue_key_under_full_batches_ends_the_drain(env: Env) -> None:
    # A full batch puts its type back in the rotation before its delivery: the quarantine
    # must take it out again, or the drain claims and rolls back the same batch for ever.
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 20)
    client.set("rq:queue:photo-process", "junk")
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)
    result = dispatcher.drain(work, ["photo.process"], lambda: False, None, ahead)
    assert result.claimed == 0 and dispatcher.quarantined["photo.process"].failures == 1
    assert states(conn) == {"pending": 20}
    for each in (work, ahead):
        assert each.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_job_key_of_the_wrong_type_leaves_its_row_out_and_the_others_flow(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 5)
    planted = Job.key_for(job_id("photo.process", "p3", 1))
    client.set(planted, "junk")
    work = env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=10)
    result = dispatcher.drain(work, ["photo.process"], lambda: False, 60.0)
    assert (result.claimed, result.enqueued) == (4, 4)
    assert ("p3", "photo.process", "pending", 0) in rows(conn)
    assert states(conn) == {"active": 4, "pending": 1}
    (refused,) = dispatcher.refused.current()
    assert (refused.type, refused.photo_id) == ("photo.process", "p3")
    note = conn.execute("SELECT last_error FROM photo_jobs WHERE photo_id = 'p3'").fetchone()
    assert note is not None and planted in note[0]
    # Tried again once its pause is over, and left out for longer: the pause doubles.
    wait_for(
        lambda: (
            dispatcher.drain(work, ["photo.process"], lambda: False, 60.0) is not None
            and dispatcher.refused.current()[0].failures == 2
        ),
        what="the row tried again",
    )
    assert states(conn) == {"active": 4, "pending": 1}
    client.delete(planted)

    def drained() -> bool:
        return dispatcher.drain(work, ["photo.process"], lambda: False, 60.0).claimed == 1

    wait_for(drained, what="the row's claim once it is no longer left out")
    assert states(conn) == {"active": 5} and dispatcher.refused.current() == []


def test_a_bad_job_key_met_while_a_claim_is_sent_ahead(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 12)
    client.set(Job.key_for(job_id("photo.process", "p3", 1)), "junk")
    work, ahead = env.connect(autocommit=False), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=5)
    result = dispatcher.drain(work, ["photo.process"], lambda: False, 60.0, ahead)
    assert (result.claimed, result.enqueued) == (11, 11)
    assert states(conn) == {"active": 11, "pending": 1}
    assert [r.photo_id for r in dispatcher.refused.current()] == ["p3"]
    assert len(queue_ids(client)) == 11 and job_id("photo.process", "p3", 1) not in queue_ids(
        client
    )
    for each in (work, ahead):
        assert each.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_three_reactors_and_four_writers_dispatch_each_row_once(
    env: Env, spawn: Callable[..., Process]
) -> None:
    for n in range(3):
        start_reactor(spawn, "--batch-size", "200", name=f"reactor{n}")
    total, writers = 20_000, 4

    def write(w: int) -> None:
        with psycopg.connect(env.database_url, autocommit=True) as conn:
            for start in range(0, total // writers, 10):
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO photo_jobs (photo_id, type) SELECT %s || '-' || i, 'photo.process'"
                        " FROM generate_series(%s::int, %s::int) AS i",
                        [f"w{w}", start, start + 9],
                    )

    with ThreadPoolExecutor(writers) as pool:
        for future in [pool.submit(write, w) for w in range(writers)]:
            future.result()
    conn, client = env.connect(), env.redis()
    wait_for(
        lambda: states(conn) == {"active": total}, timeout=120, interval=0.2, what="all rows active"
    )
    ids = queue_ids(client)
    assert len(ids) == total
    assert len(set(ids)) == total
    assert jobs_missing(conn, client) == []


def test_notifications_missed_while_disconnected_are_caught_up(
    env: Env, spawn: Callable[..., Process]
) -> None:
    reactor = start_reactor(spawn, "--sweep-interval", "600")
    admin = env.connect()
    old = next(iter(listener_pids(admin)), None)
    assert old is not None
    admin.execute("SELECT pg_terminate_backend(%s)", [old])
    insert_rows(admin, 25)  # committed while the reactor is not listening
    wait_for(lambda: states(admin) == {"active": 25}, timeout=10, what="catch-up after reconnect")
    reactor.wait_for_line("reconnected")
    new = next(iter(listener_pids(admin)), None)
    assert new is not None and new != old


def test_no_listen_polls_within_one_poll_interval(env: Env, spawn: Callable[..., Process]) -> None:
    # --no-listen is --doorbell poll-only (default poll interval 1 s); the sweep is not needed.
    start_reactor(spawn, "--no-listen", "--sweep-interval", "600")
    admin = env.connect()
    assert next(iter(listener_pids(admin)), None) is None
    insert_rows(admin, 5)
    started = time.monotonic()
    wait_for(lambda: states(admin) == {"active": 5}, timeout=30, what="poll dispatch")
    # By a poll: the only other path is the sweep, ten minutes away (how close a poll comes to
    # its interval is measured in bench/).
    assert time.monotonic() - started < 1.0 + 10


def test_future_retry_is_dispatched_on_time_without_a_notification(
    env: Env, spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, "--sweep-interval", "60")
    conn, client = env.connect(), env.redis()
    due = conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, next_retry_at) VALUES ('later', 'photo.process', now() + interval '2 s')"
        " RETURNING next_retry_at"
    ).fetchone()[0]  # type: ignore[index]
    wanted = job_id("photo.process", "later", 1)
    wait_for(lambda: wanted in queue_ids(client), timeout=5, interval=0.002, what="timer dispatch")
    arrived = datetime.now(timezone.utc)
    # Margin for a loaded 2-core machine, still far below the 60 s sweep (the only slow path).
    assert due <= arrived <= due + timedelta(seconds=1), arrived - due


def run_sweep(env: Env, *args: str) -> dict[str, Any]:
    return env.cli_json("sweep", *args)


def make_stale(
    conn: psycopg.Connection[object],
    photo_id: str,
    attempts: int,
    max_attempts: int = 5,
    written: str = "1 hour",
) -> None:
    """Plant an active row last written `written` ago (by default a worker silent long ago)."""
    with conn.transaction():
        # Bypass the updated_at trigger to plant the row's last write in the past.
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts, updated_at)"
            " VALUES (%s, 'photo.process', 'active', %s, %s, now() - %s::interval)",
            [photo_id, attempts, max_attempts, written],
        )


def plant_job(client: redis.Redis, photo_id: str, attempt: int, where: str) -> None:
    """Give a planted active row the RQ job its worker would have: `queued` in the queue,
    `started` by a worker (out of the queue), `orphan` (status queued, in no queue), or ended
    (`finished`, `failed`: what RQ records before the worker classes write the outcome)."""
    ref = JobRef("photo.process", photo_id, attempt)
    Enqueuer(client, ROUTES).enqueue([ref])
    if where != "queued":
        client.lrem("rq:queue:photo-process", 0, ref.job_id)
    status = {"started": JobStatus.STARTED, "finished": JobStatus.FINISHED}.get(where)
    if where == "failed":
        status = JobStatus.FAILED
    if status is not None:
        Job.fetch(ref.job_id, connection=client).set_status(status)


def test_rescue_distinguishes_dead_workers_waiting_jobs_and_orphans(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    make_stale(conn, "dead", 1)
    plant_job(client, "dead", 1, "started")
    make_stale(conn, "spent", 5, max_attempts=5)
    plant_job(client, "spent", 5, "started")
    make_stale(conn, "waiting", 1)
    plant_job(client, "waiting", 1, "queued")
    make_stale(conn, "orphan", 1)
    plant_job(client, "orphan", 1, "orphan")
    result = run_sweep(env, "--stale-after", "60")
    assert (result["rescued"], result["rescue_failed"], result["lost"]) == (1, 1, 1)
    assert rows(conn) == [
        ("dead", "photo.process", "active", 2),
        ("orphan", "photo.process", "active", 2),
        ("spent", "photo.process", "failed", 5),
        ("waiting", "photo.process", "active", 1),  # a long wait in the queue is not death
    ]
    assert sorted(queue_ids(client)) == sorted(
        [
            job_id("photo.process", "waiting", 1),
            job_id("photo.process", "dead", 2),
            job_id("photo.process", "orphan", 2),
        ]
    )
    error = conn.execute("SELECT last_error FROM photo_jobs WHERE photo_id = 'spent'").fetchone()
    assert error == ("worker lost: no heartbeat for 60 s: attempt 5 of 5",)


def test_a_job_rq_ended_is_rescued_only_once_its_row_had_no_write_for_stale_after(
    env: Env,
) -> None:
    # The worker classes write the outcome just after RQ records the job's end: a row written
    # a moment ago may have its outcome on the way, and rescuing it would run it again.
    conn, client = env.connect(), env.redis()
    for photo_id, written, where in (
        ("fresh-finished", "0 s", "finished"),
        ("fresh-failed", "0 s", "failed"),
        ("old-finished", "1 hour", "finished"),
        ("old-failed", "1 hour", "failed"),
    ):
        make_stale(conn, photo_id, 1, max_attempts=1 if where == "finished" else 5, written=written)
        plant_job(client, photo_id, 1, where)
    make_stale(conn, "fresh-vanished", 1, written="0 s")  # no job at all: lost at once
    result = run_sweep(env, "--stale-after", "60")
    assert (result["lost"], result["rescue_failed"], result["rescued"]) == (2, 1, 0)
    assert rows(conn) == [
        ("fresh-failed", "photo.process", "active", 1),
        ("fresh-finished", "photo.process", "active", 1),
        ("fresh-vanished", "photo.process", "active", 2),
        ("old-failed", "photo.process", "active", 2),
        ("old-finished", "photo.process", "failed", 1),
    ]
    error = conn.execute(
        "SELECT last_error FROM photo_jobs WHERE photo_id = 'old-finished'"
    ).fetchone()
    assert error == ("job ended in RQ without recording an outcome: attempt 1 of 1",)


def test_a_row_whose_rescue_fails_does_not_hold_up_the_others(env: Env) -> None:
    # A trigger of the user's refuses one row's re-dispatch: the rest of its batch, and the
    # pages after it, are still rescued; that row stays as it was.
    conn, client = env.connect(), env.redis()
    for photo_id in ("a-ok", "b-poison", "c-ok"):
        make_stale(conn, photo_id, 1)
        plant_job(client, photo_id, 1, "started")
    conn.execute(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF NEW.photo_id = 'b-poison' THEN RAISE EXCEPTION 'no rescue for %', NEW.photo_id;"
        " END IF; RETURN NEW; END $$;"
        " CREATE TRIGGER refuse_poison BEFORE UPDATE ON photo_jobs"
        " FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
    )
    result = run_sweep(env, "--stale-after", "60", "--batch-size", "2")
    assert (result["rescued"], result["rescue_refused"]) == (2, 1)
    assert rows(conn) == [
        ("a-ok", "photo.process", "active", 2),
        ("b-poison", "photo.process", "active", 1),
        ("c-ok", "photo.process", "active", 2),
    ]


def test_active_rows_whose_job_vanished_from_redis_are_redispatched(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 4)
    assert run_sweep(env)["claimed"] == 4
    client.delete(*(f"rq:job:{job_id('photo.process', f'p{i}', 1)}" for i in (1, 2)))
    client.delete("rq:queue:photo-process")
    result = run_sweep(env)
    assert result["lost"] == 2
    assert [a for *_, a in rows(conn)] == [2, 2, 1, 1]
    assert sorted(queue_ids(client)) == sorted(job_id("photo.process", f"p{i}", 2) for i in (1, 2))
    assert jobs_missing(conn, client) == []


def test_garbage_notifications_and_odd_photo_ids(env: Env, spawn: Callable[..., Process]) -> None:
    reactor = start_reactor(spawn, "--sweep-interval", "600")
    conn, client = env.connect(), env.redis()
    rng = random.Random(7)
    for _ in range(200):
        payload = "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 40)))
        conn.execute("SELECT pg_notify('photo_jobs', %s)", [payload])
    conn.execute("SELECT pg_notify('photo_jobs', %s)", ["x" * 7999])
    conn.execute("SELECT pg_notify('photo_jobs', 'photo.unknown')")
    odd = ["a:b", "a.b", "with space", "ünïcødé", "写真", "x" * 255, "under_score", "-", "a-1-2"]
    for photo_id in odd:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [photo_id]
        )
    wanted = {job_id("photo.process", p, 1) for p in odd}
    wait_for(lambda: set(queue_ids(client)) == wanted, timeout=10, what="odd ids queued")
    assert reactor.proc.poll() is None
    assert "notification_ignored" in reactor.output()


def test_sigterm_during_a_large_drain_exits_cleanly(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    insert_rows(conn, 50_000)
    reactor = spawn("-m", "reactor", "run", name="reactor")
    wait_for(
        lambda: states(conn).get("active", 0) > 0, timeout=20, interval=0.005, what="drain started"
    )
    sent = time.monotonic()
    reactor.proc.send_signal(signal.SIGTERM)
    code = reactor.proc.wait(timeout=10)
    assert code == 0, reactor.output()
    assert time.monotonic() - sent < 5
    assert jobs_missing(conn, client) == []
    counts = states(conn)
    assert counts.get("pending", 0) > 0, "the stop came after the drain, not during it"
    assert counts.get("active", 0) == len(queue_ids(client))
    assert counts.get("active", 0) + counts.get("pending", 0) == 50_000


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_second_signal_exits_at_once_while_the_first_waits_for_the_batch(
    env: Env,
    spawn: Callable[..., Process],
    private_redis: RedisServer,
    tmp_path: Path,
    first: signal.Signals,
) -> None:
    """The first SIGTERM/SIGINT lets the batch in hand finish; a second one exits at once. The
    batch here waits on a hung Redis for up to a minute (--redis-timeout 60): only the second
    signal can end the process well within that."""
    conn = env.connect()
    # The first signal's handler says STOPPING=1 to systemd's socket: the sign it has run.
    notify = NotifySocket(str(tmp_path / "notify"))
    reactor = start_reactor(
        spawn,
        "--redis-timeout",
        "60",
        "--sweep-interval",
        "3600",
        REDIS_URL=private_redis.url,
        NOTIFY_SOCKET=str(tmp_path / "notify"),
    )
    private_redis.freeze()
    try:
        # More rows than a notification names: claimed first, then enqueued into the hung Redis.
        insert_rows(conn, 20)
        wait_for(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name LIKE 'photo-reactor work%%'"
                    " AND state LIKE 'idle in transaction%%'"
                ).fetchone()
                == (1,)
            ),
            timeout=20,
            what="a claim waiting on Redis",
        )
        # Two signals of one kind sent back to back coalesce into one (the kernel keeps one
        # pending, Python runs one handler): wait until the first was handled.
        reactor.proc.send_signal(first)
        notify.wait("STOPPING=1")
        assert reactor.proc.poll() is None, reactor.output()
        sent = time.monotonic()
        reactor.proc.send_signal(signal.SIGTERM if first == signal.SIGINT else first)
        code = reactor.exit_code(timeout=20)
        waited = time.monotonic() - sent
    finally:
        private_redis.thaw()
        notify.close()
    assert code == 1, reactor.output()
    assert waited < 20 < 60, waited  # not the Redis timeout's minute
    reactor.wait_for_line("second signal, exiting at once", timeout=5)
    # The claim died with the process: its rows are pending again, for the next reactor.
    wait_for(lambda: states(conn) == {"pending": 20}, timeout=30, what="the claim rolled back")


def assert_one_line_exit_2(
    result: subprocess.CompletedProcess[str], *needles: str, secret: str = ""
) -> None:
    out = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, out
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in out
    for needle in needles:
        assert needle in out, out
    if secret:
        assert secret not in out, out


def test_startup_errors_exit_2_with_one_line(env: Env, empty_database: str) -> None:
    unreachable = run_cli(
        env, "run", extra_env={"DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/x"}
    )
    assert_one_line_exit_2(unreachable, "cannot connect to Postgres", secret="hunter2")
    unmigrated = run_cli(env, "run", extra_env={"DATABASE_URL": empty_database})
    # Named: libpq's defaults may have reached another database than the one meant.
    where = empty_database.rsplit("/", 1)[1].split("?", maxsplit=1)[0]
    assert_one_line_exit_2(
        unmigrated, "not migrated", f"'{where}' on 127.0.0.1:", "reactor migrate"
    )
    # In the environment: a password given as a flag adds a warning line (test_hardening).
    bad_url = run_cli(
        env,
        "run",
        extra_env={"DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:5432/x?sslmode=nonsense"},
    )
    assert_one_line_exit_2(bad_url, secret="hunter2")
    bad_route = run_cli(env, "run", "--route", "nope")
    assert_one_line_exit_2(bad_route, "bad route")


def test_a_schema_newer_than_the_release_is_refused_with_one_line(env: Env) -> None:
    """A database migrated by a later release: the reactor refuses it (its statements may no
    longer fit the table) with one line naming both versions, exit 2, and touches nothing."""
    conn = env.connect()
    newer = LATEST_SCHEMA_VERSION + 1
    conn.execute(
        "INSERT INTO reactor_migrations (version, name) VALUES (%s, 'from_a_later_release')",
        [newer],
    )
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('waiting', 'photo.process')")
    result = run_cli(env, "run", timeout=60)
    line = one_line(result, 2)
    assert (
        f"database schema version {newer} of '{env.database_name}' on 127.0.0.1:" in line
        and f"is newer than this release ({LATEST_SCHEMA_VERSION}): upgrade photo-reactor" in line
    ), line
    assert conn.execute("SELECT state, attempts FROM photo_jobs").fetchall() == [("pending", 0)]
    assert conn.execute("SELECT count(*) FROM reactor_routes").fetchone() == (0,)


def test_wrong_passwords_exit_2_without_showing_them(env: Env) -> None:
    server = PostgresServer(password="right-horse")
    try:
        wrong = server.url.replace("right-horse", "wrong-staple")
        result = run_cli(env, "run", extra_env={"DATABASE_URL": wrong})
        assert_one_line_exit_2(result, "password authentication failed", secret="wrong-staple")
    finally:
        server.stop()
    redis_server = RedisServer(password="right-battery")
    try:
        wrong_redis = redis_server.url.replace("right-battery", "wrong-battery")
        result = run_cli(env, "run", extra_env={"REDIS_URL": wrong_redis})
        assert_one_line_exit_2(result, "Redis refused us", secret="wrong-battery")
    finally:
        redis_server.close()


def test_a_redis_user_without_scripting_is_refused_at_start(env: Env) -> None:
    server = RedisServer()
    try:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser(
            "noscript",
            enabled=True,
            passwords=["+lua-Secret-3301"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-@scripting"],
        )
        admin.close()
        url = server.url.replace("redis://", "redis://noscript:lua-Secret-3301@")
        result = run_cli(env, "run", extra_env={"REDIS_URL": url})
        assert_one_line_exit_2(result, "Redis refused us", "script", secret="lua-Secret-3301")
    finally:
        server.close()


def test_rows_parked_at_infinity_break_nothing(env: Env, spawn: Callable[..., Process]) -> None:
    conn, client = env.connect(), env.redis()
    # Rows written before sql/0012, which refuses them since.
    conn.execute("ALTER TABLE photo_jobs DROP CONSTRAINT photo_jobs_next_retry_at_finite_check")
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, next_retry_at) VALUES"
        " ('never', 'photo.process', 'infinity'), ('ancient', 'photo.process', '-infinity')"
    )
    port = free_port()
    reactor = start_reactor(
        spawn, "--sweep-interval", "0.2", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"
    )
    wait_for(
        lambda: queue_ids(client) == [job_id("photo.process", "ancient", 1)],
        what="-infinity is due",
    )

    def sweeps() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        match = re.search(r"^reactor_sweeps_total ([0-9.]+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    wait_for(lambda: sweeps() >= 3, what="three sweeps over the parked row")
    assert rows(conn) == [
        ("ancient", "photo.process", "active", 1),
        ("never", "photo.process", "pending", 0),
    ]
    status = env.cli_json("status", "--json")["types"][0]
    assert status["counts"]["pending"] == 1
    assert status["oldest_due_age_seconds"] is None  # nothing is due
    assert status["next_retry_at"] == "infinity"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'reactor_oldest_due_age_seconds{type="photo.process"} 0.0' in text
    assert reactor.proc.poll() is None
    assert "connection_lost" not in reactor.output()


def test_the_oldest_due_row_of_a_type_no_route_covers_has_an_age_an_alert_can_see(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A typo'd type is never dispatched: its wait shows under `type="(unrouted)"`."""
    conn = env.connect()
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep created_at as given
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, created_at, next_retry_at) VALUES"
            " ('typo', 'photo.proces', now() - interval '10 minutes', NULL),"
            " ('later', 'photo.thumb', now() - interval '1 hour', now() + interval '1 hour')"
        )
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "0.5")

    def age(job_type: str) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        name = re.escape(f'reactor_oldest_due_age_seconds{{type="{job_type}"}}')
        found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        return float(found.group(1)) if found else None

    wait_for(lambda: age("(unrouted)") is not None, what="the unrouted types' age")
    assert 600 <= (age("(unrouted)") or 0) < 700  # the typo's; the row not yet due is not
    assert age("photo.process") == 0
    conn.execute("DELETE FROM photo_jobs WHERE photo_id = 'typo'")
    wait_for(lambda: age("(unrouted)") == 0, what="no unrouted row due")


def test_the_rescue_pass_pages_in_time_order_where_clocks_go_back(env: Env) -> None:
    """In a zone whose clocks go back, the text of a later time can sort first: the pass
    pages by time, so the rows between two text-ordered pages are not skipped."""
    conn = env.connect()
    conn.execute(f"ALTER DATABASE {env.database_name} SET timezone = 'America/New_York'")
    for prefix, at, count in (("late", "06:10", 10), ("early", "05:30", 3)):
        # 01:10-05 and 01:30-04 on the night the clocks went back: text and time disagree.
        insert_rows(conn, count, prefix, state="active", attempts=1, updated_at=f"2025-11-02 {at}Z")
    result = env.cli_json("sweep", "--batch-size", "10")  # no job in Redis: every row is lost
    assert result["lost"] == 13, result
    assert states(conn) == {"active": 13}
    tokens = conn.execute("SELECT DISTINCT prior_attempts + attempts FROM photo_jobs")
    assert tokens.fetchall() == [(2,)]


def test_a_job_left_in_rqs_intermediate_list_is_an_orphan_at_the_second_look(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A worker moves a job into RQ's intermediate list just before it starts it; one killed in
    between leaves it there, `queued`, until RQ's maintenance minutes later. The orphan check
    takes such a job for lost when two checks in a row find it there."""
    conn, client = env.connect(), env.redis()
    enqueuer = Enqueuer(client, ROUTES)
    limbo, waiting = JobRef("photo.process", "limbo", 1), JobRef("photo.process", "waiting", 1)
    enqueuer.enqueue([limbo, waiting])
    intermediate = "rq:queue:photo-process:intermediate"
    client.lmove("rq:queue:photo-process", intermediate, "LEFT", "RIGHT")  # limbo went first
    assert client.lrange(intermediate, 0, -1) == [limbo.job_id.encode()]
    rq_state = RqState(client, ROUTES)
    assert rq_state.orphaned([limbo, waiting]) == [False, False]
    assert rq_state.orphaned([limbo, waiting]) == [True, False]
    # End to end: a running reactor's sweeps re-dispatch it as a new attempt.
    client.delete(intermediate, "rq:queue:photo-process")
    make_stale(conn, "stuck", 1)
    stuck = JobRef("photo.process", "stuck", 1)
    enqueuer.enqueue([stuck])
    client.lmove("rq:queue:photo-process", intermediate, "LEFT", "RIGHT")
    start_reactor(spawn, "--stale-after", "1", "--sweep-interval", "0.3")
    wait_for(
        lambda: ("stuck", "photo.process", "active", 2) in rows(conn),
        timeout=30,
        what="the job stuck in the intermediate list re-dispatched",
    )
    assert job_id("photo.process", "stuck", 2) in queue_ids(client)


def _inserted(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'photo_jobs'"
    ).fetchone()
    return int(row[0]) if row else 0


def test_start_up_rehearsals_leave_nothing_behind(env: Env) -> None:
    """A reactor's start and a worker's warm-up each insert a throwaway row, run their
    statements on it and roll it back (so the first real row finds everything loaded): no
    row, no notification to an armed reactor, no Redis key is left (but the suite's marker)."""
    notes = Notifications(env, armed=True)
    conn = env.connect()
    inserted_before = _inserted(conn)

    def start_both(_: psycopg.Connection[Any]) -> None:
        settings = ReactorSettings(env.database_url, env.redis_url, ROUTES)
        reactor = Reactor(settings)
        reactor.start()
        reactor.close()
        store = lifecycle.Store(env.database_url)
        lifecycle.warm_up(store)
        store.close()

    assert notes.sent_by(start_both) == []
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (0,)
    assert env.redis().keys("*") == [SUITE_MARKER_KEY.encode()]
    # The rows did exist: the statistics count both inserts (sent as each session ended).
    wait_for(
        lambda: _inserted(conn) >= inserted_before + 2,
        timeout=10,
        what="the two rehearsal inserts counted",
    )
