"""Operator counts on a big table: `reactor status`, the dashboard's overview read and
`reactor prune --dry-run` at 50,000 and at 5,000,000 `done` rows.

The table holds the `done` rows (one type, last written 30 days ago) and a small live part
(1,000 pending, 100 active, 500 failed rows); it grows from the first size to the second
with one `INSERT … SELECT generate_series`, then `VACUUM ANALYZE`, as autovacuum would leave
it. Measured in this process on one connection, every operation alone and in turn, each
repetition a fresh read (no cache):
- `read_status` (what `reactor status` reads, without its Redis lookup of workers);
- `read_overview` (the dashboard's read, its `done` count read anew: the page's worst case);
- `admin.prune(dry_run=True)` of done rows older than 7 days;
- the same three exactly (`--exact`: every finished row counted, what the release before
  always did), as the reference;
- `read_vacuum_health` (the catalog read behind the horizon and vacuum figures).
The ratio is the figure at 5,000,000 rows over the one at 50,000.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.common import Stat, fresh_database, redis_client, table
from reactor.ops import admin
from reactor.ops.overview import read_overview
from reactor.ops.status import read_finished_counts, read_status
from reactor.pg import db
from reactor.pg.vacuum import read_vacuum_health
from reactor.routes import parse_routes

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
WEEK = 7 * 86400.0

_DONE = (
    "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
    " SELECT 'd' || i, 'photo.process', 'done', 1, now() - interval '30 days',"
    "        now() - interval '30 days'"
    "   FROM generate_series(%s::int, %s::int) AS i"
)
_LIVE = (
    "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error)"
    " SELECT 'l' || i, 'photo.process',"
    "        CASE WHEN i <= 1000 THEN 'pending' WHEN i <= 1100 THEN 'active' ELSE 'failed' END,"
    "        CASE WHEN i <= 1000 THEN 0 ELSE 1 END,"
    "        CASE WHEN i > 1100 THEN 'RuntimeError: boom' END"
    "   FROM generate_series(1, 1600) AS i"
)


def _grow(url: str, have: int, want: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        if have == 0:
            conn.execute(_LIVE)
        conn.execute(_DONE, [have + 1, want])
        conn.execute("VACUUM ANALYZE photo_jobs")


def _operations(conn: db.Connection) -> dict[str, Callable[[], object]]:
    client = redis_client()
    return {
        "status": lambda: read_status(conn, 300),
        "dashboard overview": lambda: read_overview(conn, client, ROUTES, 300),
        "prune --dry-run": lambda: admin.prune(conn, done_older_than=WEEK, dry_run=True),
        "status --exact": lambda: read_status(conn, 300, exact=True),
        "dashboard overview, exact": lambda: _exact_overview(conn, client),
        "prune --dry-run --exact": lambda: admin.prune(
            conn, done_older_than=WEEK, dry_run=True, exact=True
        ),
        "vacuum health read": lambda: read_vacuum_health(conn),
    }


def _exact_overview(conn: db.Connection, client: Any) -> object:
    done = read_finished_counts(conn, ("done",), exact=True)
    return read_overview(conn, client, ROUTES, 300, done)


def _measure(url: str, reps: int) -> dict[str, list[float]]:
    conn = db.connect(url, purpose="bench", read_write=False)
    try:
        operations = _operations(conn)
        for operation in operations.values():  # plans and caches warm
            operation()
            conn.rollback()
        times: dict[str, list[float]] = {name: [] for name in operations}
        for _ in range(reps):
            for name, operation in operations.items():
                started = time.perf_counter()
                operation()
                times[name].append((time.perf_counter() - started) * 1000)
                conn.rollback()
    finally:
        conn.close()
    return times


def _done_rows(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'done'").fetchone()
    return int(row[0]) if row else 0


def run(quick: bool) -> dict[str, Any]:
    sizes = [50_000, 500_000] if quick else [50_000, 5_000_000]
    reps = 5 if quick else 15
    stats: dict[int, dict[str, Stat]] = {}
    with fresh_database() as url:
        have = 0
        for size in sizes:
            _grow(url, have, size)
            have = size
            assert _done_rows(url) == size
            stats[size] = {name: Stat.of(v) for name, v in _measure(url, reps).items()}
    small, big = sizes
    rows = [
        [
            name,
            stats[small][name].fmt(" ms", 1),
            stats[big][name].fmt(" ms", 1),
            f"{stats[big][name].median / stats[small][name].median:.1f}×",
        ]
        for name in stats[small]
    ]
    return {
        "sizes": sizes,
        "ms": {str(size): {n: s.as_dict() for n, s in by.items()} for size, by in stats.items()},
        "table": table(["operation", f"{small:,} done rows", f"{big:,} done rows", "ratio"], rows)
        + f"\n\nMedians (min–max) of {reps} reads each, in turn on one connection; the table"
        " also holds 1,000 pending, 100 active and 500 failed rows.",
    }
