""" "Worker gone" is one decision, on one query, for `reactor status` and the sweep: the rows
`status` counts are exactly those the next sweep re-dispatches for that reason (a job started
or ended by a worker whose key is gone, on a row quiet for `gone_after` but not yet stale).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from rq.job import Job

from reactor.jobs import JobRef
from tests.support.cli import run_cli
from tests.support.env import Env

ROUTES = (
    "--route",
    "photo.process=reactor.demo.process_photo",
    "--route",
    "photo.thumb=reactor.demo.process_photo",
)


def _active(conn: psycopg.Connection[Any], job_type: str, photo_id: str, ago: timedelta) -> JobRef:
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # updated_at as given
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
            " VALUES (%s, %s, 'active', 1, %s)",
            [photo_id, job_type, datetime.now(timezone.utc) - ago],
        )
    return JobRef(job_type, photo_id, 1)


def test_status_counts_exactly_the_rows_the_sweep_rescues_for_a_gone_worker(env: Env) -> None:
    conn, client = env.connect(), env.redis()
    # Ended in RQ by a worker that is gone, the row quiet for a minute: rescued for that.
    ended = _active(conn, "photo.process", "ended", timedelta(minutes=1))
    client.hset(Job.key_for(ended.job_id), mapping={"status": "finished", "worker_name": "w1"})
    # Started by a gone worker, but silent for an hour: stale, rescued as such.
    stale = _active(conn, "photo.thumb", "stale", timedelta(hours=1))
    client.hset(Job.key_for(stale.job_id), mapping={"status": "started", "worker_name": "w2"})
    shown = run_cli(env, "status", "--json", "--stale-after", "300")
    assert shown.returncode == 0, shown.stderr
    gone = {t["type"]: t["worker_gone"] for t in json.loads(shown.stdout)["types"]}
    stale_active = {t["type"]: t["stale_active"] for t in json.loads(shown.stdout)["types"]}
    assert gone == {"photo.process": 1, "photo.thumb": 0}
    assert stale_active == {"photo.process": 0, "photo.thumb": 1}
    swept = run_cli(env, "sweep", "--stale-after", "300", *ROUTES)
    assert swept.returncode == 0, swept.stderr
    result = json.loads(swept.stdout)
    # The ended row re-dispatched as a lost job, the stale one as a dead worker's.
    assert (result["lost"], result["rescued"]) == (1, 1), result
    attempts = dict(conn.execute("SELECT photo_id, attempts FROM photo_jobs").fetchall())
    assert attempts == {"ended": 2, "stale": 2}


def test_a_worker_key_without_expiry_counts_as_gone(env: Env) -> None:
    # RQ's workers always give their key an expiry; a work horse that outlived its killed
    # worker writes its counters to a key that had expired, which then never expires.
    conn, client = env.connect(), env.redis()
    orphaned = _active(conn, "photo.process", "orphaned", timedelta(minutes=1))
    client.hset(Job.key_for(orphaned.job_id), mapping={"status": "started", "worker_name": "w3"})
    client.hset("rq:worker:w3", "successful_job_count", 1)
    alive = _active(conn, "photo.thumb", "alive", timedelta(minutes=1))
    client.hset(Job.key_for(alive.job_id), mapping={"status": "started", "worker_name": "w4"})
    client.hset("rq:worker:w4", "state", "busy")
    client.expire("rq:worker:w4", 60)
    shown = run_cli(env, "status", "--json", "--stale-after", "300")
    gone = {t["type"]: t["worker_gone"] for t in json.loads(shown.stdout)["types"]}
    assert gone == {"photo.process": 1, "photo.thumb": 0}, shown.stderr
    swept = run_cli(env, "sweep", "--stale-after", "300", *ROUTES)
    assert json.loads(swept.stdout)["rescued"] == 1, swept.stderr
    attempts = dict(conn.execute("SELECT photo_id, attempts FROM photo_jobs").fetchall())
    assert attempts == {"orphaned": 2, "alive": 1}
