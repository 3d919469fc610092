"""Retention of many finished rows: deleting them (`reactor prune`) against moving them into
the history (`reactor archive`) and dropping their month there.

Two databases side by side, each with the same `done` rows (one type, last written 40 days
ago, in one calendar month) and a small live part (1,000 pending rows), after `VACUUM
ANALYZE`. In the first, `admin.prune` deletes them (5,000 rows a transaction, no pause: the
fastest a cron `reactor prune` goes; `reactor run`'s retention is throttled to 1,000 rows/s).
In the second, `admin.archive` moves them into `photo_jobs_history` (the same batches), then
`drop_history` drops their month. For each: seconds and rows a second, and what the queue
table holds afterwards (dead tuples, heap and index size), and the drop's milliseconds. The
order of the two alternates each round.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.common import Stat, fresh_database, table, wait_until
from reactor.ops import admin
from reactor.pg import db
from reactor.pg.history import drop_history

MONTH = 30 * 86400.0

_DONE = (
    "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
    " SELECT 'd' || i, 'photo.process', 'done', 1,"
    "        date_trunc('month', now() - interval '40 days') + interval '2 days',"
    "        date_trunc('month', now() - interval '40 days') + interval '2 days'"
    "                                                         + i * interval '1 millisecond'"
    "   FROM generate_series(1, %s::int) AS i"
)
_LIVE = (
    "INSERT INTO photo_jobs (photo_id, type)"
    " SELECT 'l' || i, 'photo.process' FROM generate_series(1, 1000) AS i"
)


def _fill(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_LIVE)
        conn.execute(_DONE, [rows])
        conn.execute("VACUUM ANALYZE photo_jobs")


def _table_after(url: str) -> dict[str, int]:
    """The queue table once every other session has gone (a session reports its dead tuples
    to the statistics when it exits, at the latest)."""
    with psycopg.connect(url, autocommit=True) as conn:
        wait_until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND backend_type = 'client backend'"
                ).fetchone()
                == (0,)
            ),
            timeout=30,
        )
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_dead_tup, pg_relation_size('photo_jobs'), pg_indexes_size('photo_jobs')"
            "  FROM pg_stat_user_tables WHERE relid = 'photo_jobs'::regclass"
        ).fetchone()
    assert row is not None
    return {"dead": int(row[0]), "heap": int(row[1]), "indexes": int(row[2])}


def _prune(url: str, rows: int) -> dict[str, float]:
    conn = db.connect(url, purpose="bench")
    try:
        started = time.perf_counter()
        result = admin.prune(conn, done_older_than=MONTH)
        seconds = time.perf_counter() - started
    finally:
        conn.close()
    assert result.done == rows, result
    return {"seconds": seconds, **_table_after(url)}


def _archive(url: str, rows: int) -> dict[str, float]:
    conn = db.connect(url, purpose="bench")
    try:
        started = time.perf_counter()
        result = admin.archive(conn, older_than=MONTH)
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        dropped = drop_history(conn, MONTH)
        drop_ms = (time.perf_counter() - started) * 1000
    finally:
        conn.close()
    assert result.moved.done == rows and len(dropped) >= 1, (result, dropped)
    return {"seconds": seconds, "drop_ms": drop_ms, **_table_after(url)}


def run(quick: bool) -> dict[str, Any]:
    rows = 200_000 if quick else 2_000_000
    rounds = 1 if quick else 3
    sides: dict[str, list[dict[str, float]]] = {"prune": [], "archive": []}
    for round_ in range(rounds):
        order = ["prune", "archive"] if round_ % 2 == 0 else ["archive", "prune"]
        for side in order:
            with fresh_database() as url:
                _fill(url, rows)
                sides[side].append(_prune(url, rows) if side == "prune" else _archive(url, rows))

    def stat(side: str, key: str) -> Stat:
        return Stat.of([r[key] for r in sides[side]])

    def mib(side: str, key: str) -> str:
        return f"{stat(side, key).median / 2**20:,.1f} MiB"

    drop = stat("archive", "drop_ms")
    table_rows = [
        [
            "delete them from photo_jobs (reactor prune)",
            stat("prune", "seconds").fmt(" s", 1),
            f"{rows / stat('prune', 'seconds').median:,.0f}",
            f"{stat('prune', 'dead').median:,.0f}",
            mib("prune", "heap"),
            mib("prune", "indexes"),
        ],
        [
            "move them to the history (reactor archive)",
            stat("archive", "seconds").fmt(" s", 1),
            f"{rows / stat('archive', 'seconds').median:,.0f}",
            f"{stat('archive', 'dead').median:,.0f}",
            mib("archive", "heap"),
            mib("archive", "indexes"),
        ],
        [
            "then drop their month (--drop-history-after)",
            drop.fmt(" ms", 1),
            "",
            "none (not touched)",
            "",
            "",
        ],
    ]
    return {
        "rows": rows,
        "rounds": rounds,
        "sides": sides,
        "table": table(
            [
                f"{rows:,} done rows, one month",
                "time",
                "rows/s",
                "dead tuples left in photo_jobs",
                "photo_jobs heap after",
                "its indexes after",
            ],
            table_rows,
        )
        + f"\n\nMedians (min–max) of {rounds} rounds, the order alternating; 5,000 rows a"
        " transaction, no pause; photo_jobs also holds 1,000 pending rows.",
    }
