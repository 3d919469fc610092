"""Who holds the doorbell: the advisory locks on its keys in the test's database (sql/0004),
and the reactors' LISTEN sessions, as seen from another session."""

from __future__ import annotations

from typing import Any

import psycopg


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
