"""Reading and writing the `photo_jobs` table directly, as the tests check and seed it."""

from __future__ import annotations

from typing import Any

import psycopg


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


def unwritten_for(conn: psycopg.Connection[Any], seconds: float) -> bool:
    """Whether every active row has had no write for more than `seconds` (what the sweep's
    `--stale-after` asks before it rescues a row whose job RQ has ended)."""
    row = conn.execute(
        "SELECT bool_and(greatest(updated_at, heartbeat_at) < now() - make_interval(secs => %s))"
        " FROM photo_jobs WHERE state = 'active'",
        [seconds],
    ).fetchone()
    return bool(row and row[0])
