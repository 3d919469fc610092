"""One bad Redis key fails only its own row or type: the sweep reads job statuses, workers and
queues key by key, rescues every other row of the pass, logs the bad key once, and counts the
failed rescue step in `reactor_sweep_failures_total` and `/healthz`; a key the enqueue would
write that holds another kind of value leaves out its row (a job key) or its type (a queue's
key), and every other row and type flows. Many bad job keys among a type's oldest rows are
all refused by one failed batch (not one per batch) and logged as one throttled record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from rq.job import Job

from reactor.dispatcher.drain import Dispatcher
from reactor.errors import RedisDataError
from reactor.jobs import JobRef
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer, EnqueueResult
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import health, metric, scrape
from tests.support.processes import Process, start_reactor
from tests.support.rows import states
from tests.support.servers import free_port
from tests.support.waiting import wait_for

HOUR_AGO = datetime.now(timezone.utc) - timedelta(hours=1)
#: photo.process on its queue, photo.thumb on `thumbs`.
TWO_QUEUES = (
    "--route",
    "photo.process=reactor.demo.process_photo",
    "--route",
    "photo.thumb=reactor.demo.process_photo@thumbs",
)

#: Bad job keys planted for the oldest pending rows of photo.process, clean rows after them.
BAD, CLEAN, BATCH = 300, 200, 100


def _stale_active(conn: psycopg.Connection[Any], photo_id: str, job_type: str) -> JobRef:
    """An active row at attempt 1 without a write for an hour (no trigger stamps it)."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
            " VALUES (%s, %s, 'active', 1, %s)",
            [photo_id, job_type, HOUR_AGO],
        )
    return JobRef(job_type, photo_id, 1)


def _attempts(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, int]]:
    return {
        r[0]: (r[1], r[2]) for r in conn.execute("SELECT photo_id, state, attempts FROM photo_jobs")
    }


def _job_key(ref: JobRef) -> str:
    key = Job.key_for(ref.job_id)
    return key.decode() if isinstance(key, bytes) else str(key)


def test_one_bad_job_key_fails_only_its_row(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    bad = _stale_active(conn, "wrongtype", "photo.process")
    client.set(_job_key(bad), "notahash")
    no_status = _stale_active(conn, "nostatus", "photo.process")
    client.hset(_job_key(no_status), "origin", "photo-process")
    unknown = _stale_active(conn, "unknown", "photo.process")
    client.hset(_job_key(unknown), "status", "weird")
    ghost = _stale_active(conn, "ghost", "photo.process")
    client.hset(_job_key(ghost), mapping={"status": "started", "worker_name": "nobody"})
    _stale_active(conn, "lost", "photo.process")  # no job at all
    swept = run_cli(env, "sweep", "--stale-after", "60")
    result = json.loads(swept.stdout)
    # Every row but the one whose key cannot be read is re-dispatched as attempt 2.
    assert _attempts(conn) == {
        "wrongtype": ("active", 1),
        "nostatus": ("active", 2),
        "unknown": ("active", 2),
        "ghost": ("active", 2),
        "lost": ("active", 2),
    }, swept.stderr
    assert result["unreadable_keys"] == 1, result
    assert _job_key(bad) in result["rescue_error"], result
    logged = [line for line in swept.stderr.splitlines() if "redis_key_unreadable" in line]
    assert len(logged) == 1 and _job_key(bad) in logged[0], swept.stderr


def test_a_bad_queue_key_counts_as_a_failed_rescue_and_health_says_so(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    # A job waiting in a queue whose key is not a list: the orphan check cannot read it.
    waiting = _stale_active(conn, "waiting", "photo.thumb")
    client.hset(_job_key(waiting), "status", "queued")
    client.set("rq:queue:thumbs", "junk")
    lost = _stale_active(conn, "lost", "photo.process")
    port = free_port()
    reactor = start_reactor(
        spawn,
        *TWO_QUEUES,
        "--sweep-interval",
        "0.5",
        "--stale-after",
        "60",
        "--metrics-port",
        str(port),
    )
    wait_for(lambda: health(port)[0] == 503, timeout=30, what="/healthz 503")
    body = health(port)[1]
    assert "rescue step failed" in body and "rq:queue:thumbs" in body, body
    assert metric(scrape(port), "reactor_sweep_failures_total") >= 3
    # The rest of the pass was rescued; the waiting row is left as it is.
    assert _attempts(conn) == {"waiting": ("active", 1), "lost": ("active", 2)}
    assert client.exists(Job.key_for(JobRef(lost.type, lost.photo_id, 2).job_id))
    logged = [line for line in reactor.lines if "redis_key_unreadable" in line]
    assert len(logged) == 1, reactor.output()
    # The key repaired: the next sweeps succeed and health is 200 again.
    client.delete("rq:queue:thumbs")
    wait_for(lambda: health(port)[0] == 200, timeout=30, what="/healthz 200")


def test_a_bad_queue_key_holds_up_only_its_type_and_a_bad_job_key_only_its_row(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    client.set("rq:queue:thumbs", "junk")
    planted = _job_key(JobRef("photo.process", "p2", 1))
    client.set(planted, "junk")
    port = free_port()
    start_reactor(
        spawn,
        *TWO_QUEUES,
        "--sweep-interval",
        "1",
        "--metrics-port",
        str(port),
    )
    with conn.transaction():
        for photo_id, job_type in [
            ("t1", "photo.thumb"),
            *((f"p{i}", "photo.process") for i in range(1, 5)),
            ("t2", "photo.thumb"),
        ]:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, %s)", [photo_id, job_type]
            )
    flowing = {"p1": ("active", 1), "p3": ("active", 1), "p4": ("active", 1)}
    wait_for(lambda: flowing.items() <= _attempts(conn).items(), what="the other rows")
    assert _attempts(conn)["p2"] == ("pending", 0)
    assert {_attempts(conn)[t] for t in ("t1", "t2")} == {("pending", 0)}
    status, body = health(port)
    assert status == 503 and "photo.thumb" in body and "rq:queue:thumbs" in body, body
    note = conn.execute("SELECT last_error FROM photo_jobs WHERE photo_id = 'p2'").fetchone()
    assert note is not None and planted in note[0]

    client.delete("rq:queue:thumbs", planted)
    everything = dict.fromkeys(("t1", "t2", "p1", "p2", "p3", "p4"), ("active", 1))
    wait_for(lambda: _attempts(conn) == everything, timeout=90, what="every row")
    wait_for(lambda: health(port)[0] == 200, timeout=30, what="/healthz 200")


def test_a_bad_key_at_a_rescued_row_s_next_job_holds_up_only_that_rescue(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    first = _stale_active(conn, "first", "photo.process")
    _stale_active(conn, "second", "photo.process")
    # No job for either (lost): each is re-dispatched as attempt 2, whose job key is planted
    # for the first.
    client.set(_job_key(JobRef(first.type, first.photo_id, 2)), "junk")
    swept = run_cli(env, "sweep", "--stale-after", "60")
    assert _attempts(conn) == {"first": ("active", 1), "second": ("active", 2)}, swept.stderr
    assert json.loads(swept.stdout)["rescue_refused"] == 1, swept.stdout


def _bad_keys_for_the_oldest_rows(conn: psycopg.Connection[Any], client: Any) -> None:
    """BAD pending rows (`bad1`...), the oldest, each with the key of its next job set to a
    string, then CLEAN rows (`ok1`...): what a user who can write to Redis can do."""
    for prefix, count, age in (("bad", BAD, "2 hours"), ("ok", CLEAN, "1 hour")):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, created_at)"
            " SELECT %(prefix)s || i, 'photo.process',"
            " now() - %(age)s::interval + i * interval '1 ms'"
            " FROM generate_series(1, %(n)s) AS i",
            {"prefix": prefix, "n": count, "age": age},
        )
    with client.pipeline(transaction=False) as pipe:
        for i in range(1, BAD + 1):
            pipe.set(_job_key(JobRef("photo.process", f"bad{i}", 1)), "junk")
        pipe.execute()


def _refused_notes(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return dict(
        conn.execute(
            "SELECT photo_id, last_error FROM photo_jobs WHERE last_error LIKE 'claim refused: %'"
        ).fetchall()
    )


def test_every_bad_job_key_of_a_batch_is_refused_by_one_failed_batch(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    conn, client = env.connect(), env.redis()
    _bad_keys_for_the_oldest_rows(conn, client)
    routes = parse_routes(["photo.process=reactor.demo.process_photo"])
    enqueuer = Enqueuer(client, routes)
    failed_batches = 0
    enqueue = enqueuer.enqueue

    def counted(refs: Any) -> EnqueueResult:
        nonlocal failed_batches
        try:
            return enqueue(refs)
        except RedisDataError:
            failed_batches += 1
            raise

    monkeypatch.setattr(enqueuer, "enqueue", counted)
    dispatcher = Dispatcher(enqueuer, routes, batch_size=BATCH)
    work = env.connect(autocommit=False)
    result = dispatcher.drain(work, ["photo.process"], lambda: False, 30.0)
    assert (result.claimed, result.enqueued) == (CLEAN, CLEAN)
    assert states(conn) == {"active": CLEAN, "pending": BAD}
    # One failed batch for each batch of bad rows (a row's pause may end once meanwhile), not
    # one for each bad key.
    assert failed_batches <= 2 * BAD // BATCH, failed_batches
    refused = dispatcher.refused.current()
    assert sorted(r.photo_id for r in refused) == sorted(f"bad{i}" for i in range(1, BAD + 1))
    # Each row is named with its own key.
    notes = _refused_notes(conn)
    assert len(notes) == BAD
    for row in refused:
        key = _job_key(JobRef("photo.process", row.photo_id, 1))
        assert key in row.error and key in notes[row.photo_id], (row, notes[row.photo_id])
    assert client.llen("rq:queue:photo-process") == CLEAN
    # Tried again once their pauses end, refused again: one record for them all, still.
    wait_for(
        lambda: (
            dispatcher.drain(work, ["photo.process"], lambda: False, 30.0) is not None
            and min(r.failures for r in dispatcher.refused.current()) >= 2
        ),
        what="every bad row tried again",
    )
    assert states(conn) == {"active": CLEAN, "pending": BAD}
    logged = [r.getMessage() for r in caplog.records if "row_refused" in r.getMessage()]
    assert len(logged) == 1 and f"rows={BATCH}" in logged[0], logged


def test_a_sweep_gets_clean_rows_past_hundreds_of_bad_keys_and_logs_them_once(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    _bad_keys_for_the_oldest_rows(conn, client)
    swept = run_cli(env, "sweep", "--batch-size", str(BATCH))
    result = json.loads(swept.stdout)
    assert (result["claimed"], result["claim_refused"]) == (CLEAN, BAD), swept.stderr
    assert swept.returncode == 1 and f"{BAD} rows refused the claim" in swept.stderr
    logged = [line for line in swept.stderr.splitlines() if "row_refused" in line]
    assert len(logged) == 1 and f"rows={BATCH}" in logged[0], swept.stderr
    assert len(_refused_notes(conn)) == BAD
    named = json.loads(run_cli(env, "status", "--json").stdout)["claim_refused"]
    assert named and all(r["photo_id"].startswith("bad") for r in named), named


def test_a_running_reactor_passes_bad_keys_and_logs_their_refusals_once_a_minute(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn, client = env.connect(), env.redis()
    _bad_keys_for_the_oldest_rows(conn, client)
    port = free_port()
    reactor = start_reactor(
        spawn, *TWO_QUEUES, "--batch-size", str(BATCH), "--metrics-port", str(port)
    )
    wait_for(lambda: states(conn).get("active") == CLEAN, timeout=30, what="the clean rows")
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('t1', 'photo.thumb')")
    wait_for(lambda: states(conn).get("active") == CLEAN + 1, timeout=30, what="the other type")
    status, body = health(port)
    assert status == 200 and body.startswith(f"ok; {BAD} row(s) left out of claims"), body
    # The keys removed: every row goes through as its pause ends, in a few records.
    client.delete(*(_job_key(JobRef("photo.process", f"bad{i}", 1)) for i in range(1, BAD + 1)))
    wait_for(lambda: states(conn) == {"active": BAD + CLEAN + 1}, timeout=90, what="every row")
    logged = [line for line in reactor.lines if "row_refused" in line]
    assert len(logged) == 1 and f"rows={BATCH}" in logged[0], reactor.output()
    recovered = [line for line in reactor.lines if "row_recovered" in line]
    assert 1 <= len(recovered) <= 2 * BAD // BATCH, reactor.output()
    wait_for(lambda: health(port) == (200, "ok\n"), timeout=30, what="/healthz ok")
