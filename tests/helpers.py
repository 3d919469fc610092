"""Small helpers shared by the integration tests: reading rows and RQ state."""

from __future__ import annotations

from typing import Any

import psycopg
import redis
from rq.job import Job

from reactor.jobs import job_id


def queue_ids(client: redis.Redis, queue: str = "photo-process") -> list[str]:
    """Job ids waiting in an RQ queue, in order."""
    return [raw.decode() for raw in client.lrange(f"rq:queue:{queue}", 0, -1)]


def states(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Row count by state."""
    return dict(conn.execute("SELECT state, count(*) FROM photo_jobs GROUP BY state").fetchall())


def rows(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str, int]]:
    """(photo_id, type, state, attempts) of every row."""
    return [
        tuple(r)  # type: ignore[misc]
        for r in conn.execute(
            "SELECT photo_id, type, state, attempts FROM photo_jobs ORDER BY 1, 2"
        )
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


def insert_rows(
    conn: psycopg.Connection[Any], count: int, prefix: str = "p", **columns: Any
) -> None:
    """Insert `count` rows of photo.process in one statement (extra columns as constants)."""
    names = ", ".join(["photo_id", "type", *columns])
    values = ", ".join(["%(prefix)s || i", "'photo.process'", *(f"%({c})s" for c in columns)])
    conn.execute(
        f"INSERT INTO photo_jobs ({names}) SELECT {values} FROM generate_series(1, %(n)s) AS i",  # type: ignore[arg-type]
        {"prefix": prefix, "n": count, **columns},
    )
