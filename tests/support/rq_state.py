"""Reading RQ's state in Redis: what waits in a queue, and which active rows have no job."""

from __future__ import annotations

from typing import Any

import psycopg
import redis
from rq.job import Job

from reactor.jobs import job_id


def queue_ids(client: redis.Redis, queue: str = "photo-process") -> list[str]:
    """Job ids waiting in an RQ queue, in order."""
    return [
        raw.decode() if isinstance(raw, bytes) else raw
        for raw in client.lrange(f"rq:queue:{queue}", 0, -1)
    ]


def jobs_missing(conn: psycopg.Connection[Any], client: redis.Redis) -> list[str]:
    """Ids of the jobs of `active` rows that do not exist in Redis."""
    expected = [
        job_id(t, p, a)
        for t, p, a in conn.execute(
            "SELECT type, photo_id, attempts FROM photo_jobs WHERE state = 'active'"
        )
    ]
    with client.pipeline(transaction=False) as pipe:
        for jid in expected:
            pipe.exists(Job.key_for(jid))
        found = pipe.execute()
    return [jid for jid, ok in zip(expected, found, strict=True) if not ok]
