"""Small helpers shared by the integration tests: reading rows and RQ state."""

from __future__ import annotations

import re
import urllib.request
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


def states(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Row count by state."""
    return dict(conn.execute("SELECT state, count(*) FROM photo_jobs GROUP BY state").fetchall())


def rows(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str, int]]:
    """(photo_id, type, state, attempts) of every row."""
    return [
        tuple(r)
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
        f"INSERT INTO photo_jobs ({names}) SELECT {values} FROM generate_series(1, %(n)s) AS i",
        {"prefix": prefix, "n": count, **columns},
    )


def metric(text: str, name: str) -> float:
    """One sample of a Prometheus text exposition (0 if absent)."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def scrape(port: int) -> str:
    """The /metrics text of a reactor serving on 127.0.0.1:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def doorbell_locks(conn: psycopg.Connection[Any]) -> list[tuple[int, str, bool]]:
    """(pid, mode, granted) of each session's locks on the doorbell keys in this database,
    one entry per session, mode and state (however many of the striped keys it holds)."""
    return [
        (int(pid), str(mode), bool(granted))
        for pid, mode, granted in conn.execute(
            """SELECT DISTINCT pid, mode, granted FROM pg_locks
                WHERE locktype = 'advisory'
                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND classid = (photo_jobs_doorbell_key() >> 32)::oid
                  AND objid::bigint - (photo_jobs_doorbell_key() & 4294967295)
                      BETWEEN 0 AND photo_jobs_doorbell_stripes() - 1
                ORDER BY granted DESC, pid"""
        )
    ]


def armed_by(conn: psycopg.Connection[Any]) -> int | None:
    """The pid holding every doorbell key in exclusive mode, if any."""
    row = conn.execute(
        """SELECT pid FROM pg_locks
            WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND classid = (photo_jobs_doorbell_key() >> 32)::oid
              AND objid::bigint - (photo_jobs_doorbell_key() & 4294967295)
                  BETWEEN 0 AND photo_jobs_doorbell_stripes() - 1
            GROUP BY pid HAVING count(DISTINCT objid) = photo_jobs_doorbell_stripes()"""
    ).fetchone()
    return None if row is None else int(row[0])


def listener_pids(conn: psycopg.Connection[Any]) -> list[int]:
    """Backend pids of the reactors' LISTEN connections to this database, oldest first."""
    return [
        int(pid)
        for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'photo-reactor listener' ORDER BY backend_start"
        )
    ]
