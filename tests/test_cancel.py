"""Cancelling rows: `reactor cancel`, `reactor.cancel()`, and the fence that keeps a cancelled
row cancelled whatever its jobs do (pending, queued, started on a forking or a simple
`reactor worker`, finished), on real Postgres, Redis and worker processes."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from rq.job import Job
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import reactor
from reactor.jobs import job_id
from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import metric
from tests.support.processes import Process, start_reactor
from tests.support.rows import states
from tests.support.servers import free_port
from tests.support.waiting import wait_for

GATED = "photo.process=tests.handlers.gated"


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def row_of(conn: psycopg.Connection[Any], photo_id: str) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT state, prior_attempts, attempts, last_error FROM photo_jobs WHERE photo_id = %s",
        [photo_id],
    ).fetchone()
    assert row is not None
    return tuple(row)


def runs(conn: psycopg.Connection[Any], photo_id: str) -> list[tuple[int, str]]:
    query = "SELECT attempt, outcome FROM handler_runs WHERE photo_id = %s ORDER BY at"
    return [tuple(r) for r in conn.execute(query, [photo_id])]


def cancel(env: Env, *args: str) -> dict[str, Any]:
    result = run_cli(env, "cancel", *args)
    assert result.returncode == 0, result.stderr
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def dispatch(env: Env) -> None:
    """One sweep: claims the due rows and enqueues their jobs (no reactor runs)."""
    assert env.cli_json("sweep", "--route", GATED)["enqueued"] >= 1


def reactor_worker(spawn: Callable[..., Process], kind: str, *args: str) -> Process:
    simple = ("--simple",) if kind == "simple" else ()
    return spawn("-m", "reactor", "worker", "--route", GATED, *simple, *args, name="worker")


def test_a_pending_row_is_cancelled_at_once_and_re_armed_by_requeue_and_submit(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    reactor.submit(conn, "p1")
    reactor.submit(conn, "p2")
    assert cancel(env, "p1") == {"cancelled": 1, "stopped": 0, "not_found": [], "unchanged": []}
    state, _, _, error = row_of(conn, "p1")
    assert (state, error.startswith("cancelled by ")) == ("cancelled", True)
    # The fence: the sweep's claim passes it by, the other row goes out.
    assert env.cli_json("sweep", "--route", GATED)["claimed"] == 1
    assert row_of(conn, "p1")[0] == "cancelled"
    # Cancelling it again changes nothing; an id with no row is reported (exit 1).
    again = run_cli(env, "cancel", "p1", "nope")
    assert again.returncode == 1
    assert json.loads(again.stdout) == {
        "cancelled": 0,
        "stopped": 0,
        "not_found": ["nope"],
        "unchanged": ["p1"],  # found, already cancelled: said, not passed over in silence
    }
    assert "no row for: nope" in again.stderr
    # Counted by status and failures.
    counts = {t["type"]: t["counts"] for t in env.cli_json("status", "--json")["types"]}
    assert counts["photo.process"]["cancelled"] == 1
    listed = env.cli_json("failures", "--json")["failures"]
    assert [(f["photo_id"], f["state"]) for f in listed] == [("p1", "cancelled")]
    # requeue re-arms it like a failed row; so does submit() after another cancel.
    assert env.cli_json("requeue", "p1") == {"requeued": 1, "not_found": []}
    assert row_of(conn, "p1")[0] == "pending"
    assert cancel(env, "p1")["cancelled"] == 1
    assert reactor.submit(conn, "p1") is True
    assert row_of(conn, "p1")[:2] == ("pending", 0)


def test_a_queued_job_of_a_cancelled_row_never_runs(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    reactor.submit(conn, "p1")
    dispatch(env)
    assert row_of(conn, "p1")[:3] == ("active", 0, 1)
    queued = Job.key_for(job_id("photo.process", "p1", 1))
    assert env.redis().hget(queued, "status") == b"queued"
    # Not started: nothing to stop; the fenced start refuses it.
    assert cancel(env, "p1") == {"cancelled": 1, "stopped": 0, "not_found": [], "unchanged": []}
    worker = reactor_worker(spawn, "fork", "--burst")
    assert worker.exit_code(timeout=60) == 0
    assert "attempt_skipped" in worker.output()
    assert runs(conn, "p1") == []
    assert row_of(conn, "p1")[:3] == ("cancelled", 0, 1)


@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_a_started_job_is_asked_to_stop_and_its_outcome_never_counts(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process], kind: str
) -> None:
    worker = reactor_worker(spawn, kind)
    worker.wait_for_line("Listening on")
    reactor.submit(conn, "p1")
    dispatch(env)
    wait_for(lambda: runs(conn, "p1") == [(1, "started")], timeout=30, what="the handler")
    assert cancel(env, "p1") == {"cancelled": 1, "stopped": 1, "not_found": [], "unchanged": []}
    key = Job.key_for(job_id("photo.process", "p1", 1))
    if kind == "fork":
        # The work horse is killed: the handler never ends, and the attempt's failure (the
        # horse lost) is fenced off.
        wait_for(lambda: env.redis().hget(key, "status") in (b"stopped", b"failed"), timeout=30)
        worker.wait_for_line("failure_superseded")
        assert not any("attempt_failed" in line for line in worker.lines), worker.output()
        assert runs(conn, "p1") == [(1, "started")]
    else:
        # A simple worker has no horse to kill: the handler runs to its end, and its `done`
        # is fenced off.
        conn.execute("INSERT INTO gates VALUES ('p1:1')")
        worker.wait_for_line("completion_superseded")
        assert runs(conn, "p1") == [(1, "started"), (1, "ok")]
    state, prior, attempts, error = row_of(conn, "p1")
    assert (state, prior, attempts) == ("cancelled", 0, 1)
    assert error.startswith("cancelled by ")
    # A requeue starts a new life whose job runs to `done`.
    assert env.cli_json("requeue", "p1")["requeued"] == 1
    conn.execute("INSERT INTO gates VALUES ('p1:2') ON CONFLICT DO NOTHING")
    dispatch(env)
    wait_for(lambda: row_of(conn, "p1")[0] == "done", timeout=30, what="the new life done")
    assert row_of(conn, "p1")[1:3] == (1, 1)


def test_a_finished_row_keeps_done_even_when_the_cancel_waited_for_its_outcome(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    reactor.submit(conn, "p1")
    reactor.submit(conn, "p2")
    dispatch(env)
    # p1's outcome is being written (its row locked) when the cancel comes: the cancel waits,
    # then finds the row done and leaves it.
    outcome = env.connect(autocommit=False)
    outcome.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = 'p1'")
    canceller = env.connect(autocommit=False)
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(reactor.cancel(canceller, "p1")))
    thread.start()
    wait_for(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ).fetchone()
            == (1,)
        ),
        what="the cancel waiting for the row lock",
    )
    outcome.commit()
    thread.join(timeout=30)
    canceller.commit()
    assert answer == [False]
    assert row_of(conn, "p1")[0] == "done"
    # A finished row is not cancelled by the command either.
    assert cancel(env, "p1")["cancelled"] == 0
    assert row_of(conn, "p1")[0] == "done"
    assert row_of(conn, "p2")[0] == "active"


def test_python_cancel_runs_in_the_callers_transaction(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    reactor.submit(conn, "p1")
    with psycopg.connect(env.database_url) as tx:
        assert reactor.cancel(tx, "p1") is True
        tx.rollback()
    assert row_of(conn, "p1")[0] == "pending"
    engine = create_engine(env.database_url.replace("postgresql://", "postgresql+psycopg://"))
    env.cleanups.append(engine.dispose)
    with Session(engine) as session, session.begin():
        assert reactor.cancel(session, "p1") is True
    assert row_of(conn, "p1")[:1] + row_of(conn, "p1")[3:] == (
        "cancelled",
        "cancelled by reactor.cancel()",
    )
    assert reactor.cancel(conn, "p1") is False
    with pytest.raises(reactor.InvalidJobError):
        reactor.cancel(conn, "  ")


def test_bulk_cancel_of_pending_rows_skips_a_locked_row_without_waiting(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    reactor.submit_many(conn, [f"p{i}" for i in range(7)])
    reactor.submit(conn, "t1", "photo.thumb")
    held = env.connect(autocommit=False)
    held.execute("SELECT 1 FROM photo_jobs WHERE photo_id = 'p3' FOR UPDATE")
    result = run_cli(env, "cancel", "--pending", "--type", "photo.process", timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["cancelled"] == 6
    held.rollback()
    assert states(conn) == {"cancelled": 6, "pending": 2}
    assert row_of(conn, "p3")[0] == "pending"
    usage = run_cli(env, "cancel", "--pending")
    assert (usage.returncode, "--pending needs --type" in usage.stderr) == (2, True)


def test_prune_deletes_old_cancelled_rows(env: Env, conn: psycopg.Connection[Any]) -> None:
    reactor.submit_many(conn, ["p1", "p2"])
    assert cancel(env, "p1")["cancelled"] == 1
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep updated_at as given
        conn.execute("UPDATE photo_jobs SET updated_at = now() - interval '2 days'")
    dry = env.cli_json("prune", "--cancelled-older-than", "1d", "--dry-run")
    assert dry["would_delete_cancelled"] == 1
    assert env.cli_json("prune", "--cancelled-older-than", "1d")["deleted_cancelled"] == 1
    assert states(conn) == {"pending": 1}


def test_metrics_count_cancelled_rows(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    reactor.submit_many(conn, ["p1", "p2", "p3"])
    conn.execute("UPDATE photo_jobs SET next_retry_at = now() + interval '1 hour'")
    assert cancel(env, "p1", "p2")["cancelled"] == 2
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "0.5")

    def cancelled_rows() -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return metric(text, 'reactor_cancelled_rows{type="photo.process"}', -1)

    wait_for(lambda: cancelled_rows() == 2, what="the cancelled-rows gauge")


def test_metrics_count_rows_failed_in_the_last_five_minutes(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep updated_at as given
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at) VALUES"
            " ('now', 'photo.process', 'failed', 1, now()),"
            " ('earlier', 'photo.process', 'failed', 1, now() - interval '10 minutes'),"
            " ('other', 'photo.unrouted', 'failed', 1, now())"
        )
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "0.5")

    def failed_rows() -> tuple[float, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        name = "reactor_recently_failed_rows"
        return (
            metric(text, f'{name}{{type="photo.process"}}', -1),
            metric(text, f'{name}{{type="(unrouted)"}}', -1),
        )

    wait_for(lambda: failed_rows() == (1, 1), what="the recently-failed gauge")


def test_a_started_job_naming_a_worker_no_rq_worker_can_have_is_passed_over(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    """A started job whose worker name is not UTF-8 (written by hand: RQ names workers with
    text, so none listens on it) stops neither the cancel nor the stop of the other jobs."""
    client = env.redis()
    for photo_id, worker in (("IMG_A", b"\xffbad"), ("IMG_B", b"good")):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
            " VALUES (%s, 'photo.process', 'active', 1)",
            [photo_id],
        )
        key = Job.key_for(job_id("photo.process", photo_id, 1))
        client.hset(key, mapping={"status": "started", "worker_name": worker})
    listener = client.pubsub()  # type: ignore[no-untyped-call]  # redis-py's is untyped
    env.cleanups.append(listener.close)
    listener.subscribe("rq:pubsub:good")
    wait_for(lambda: listener.get_message(timeout=0.1), what="the subscription confirmed")
    found = cancel(env, "IMG_A", "IMG_B")
    assert (found["cancelled"], found["stopped"]) == (2, 1), found
    message = wait_for(
        lambda: listener.get_message(ignore_subscribe_messages=True, timeout=0.1),
        what="the stop-job command for IMG_B's worker",
    )
    assert json.loads(message["data"]) == {
        "command": "stop-job",
        "job_id": job_id("photo.process", "IMG_B", 1),
    }
    assert (row_of(conn, "IMG_A")[0], row_of(conn, "IMG_B")[0]) == ("cancelled", "cancelled")


def test_with_redis_down_every_row_is_cancelled_and_the_output_says_what_was_not_done(
    env: Env, conn: psycopg.Connection[Any]
) -> None:
    """More rows than one batch, one of them active: Postgres first (every row cancelled, the
    counts printed), then the stop that Redis could not take, named in one line (exit 1)."""
    ids = [f"p{i:04d}" for i in range(6000)]
    reactor.submit_many(conn, ids)
    conn.execute("UPDATE photo_jobs SET state = 'active', attempts = 1 WHERE photo_id = 'p5999'")
    down = f"redis://127.0.0.1:{free_port()}/15"
    result = run_cli(env, "cancel", "--redis-url", down, *ids, "nope")
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout) == {
        "cancelled": 6000,
        "stopped": 0,
        "not_found": ["nope"],
        "unchanged": [],
    }
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines[0] == "reactor: error: no row for: nope", lines
    assert lines[1].startswith("reactor: error: Redis failed (") and len(lines) == 2, lines
    assert "6000 rows cancelled, but their running jobs were not asked to stop" in lines[1]
    assert states(conn) == {"cancelled": 6000}
