"""Scale-out: 1, 2 and 4 reactors draining the same backlog, and duplicates (must be 0).

All reactors listen on an empty table; one transaction then inserts the whole backlog (one
NOTIFY wakes them all), and the clock runs until every row is `active`.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.common import (
    Reactor,
    Stat,
    count_state,
    fresh_database,
    redis_client,
    reset,
    table,
    wait_until,
)


def _round(url: str, reactors: int, rows: int) -> tuple[float, int]:
    reset(url)
    procs = [Reactor(url, "--sweep-interval", "600") for _ in range(reactors)]
    try:
        for proc in procs:
            proc.started()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type)"
                " SELECT 's' || i, 'photo.process' FROM generate_series(1, %s) i",
                [rows],
            )
            committed = time.perf_counter()
        wait_until(lambda: count_state(url, "pending") == 0, 600, 0.02)
        elapsed = time.perf_counter() - committed
    finally:
        for proc in procs:
            proc.stop()
    ids = redis_client().lrange("rq:queue:photo-process", 0, -1)
    if count_state(url, "active") != rows or len(set(ids)) != rows:
        raise RuntimeError("a row was not dispatched, or its job is missing")
    return rows / elapsed, len(ids) - len(set(ids))


def run(quick: bool) -> dict[str, Any]:
    rows = 20_000 if quick else 200_000
    reps = 3 if quick else 5
    counts = [1, 2, 4]
    rates: dict[int, list[float]] = {n: [] for n in counts}
    dups = dict.fromkeys(counts, 0)
    with fresh_database() as url:
        for rep in range(reps):
            for n in counts[rep % 3 :] + counts[: rep % 3]:
                rate, doubled = _round(url, n, rows)
                rates[n].append(rate)
                dups[n] += doubled
    stats = {n: Stat.of(v) for n, v in rates.items()}
    base = stats[1].median
    return {
        "rows": rows,
        "jobs_per_second": {str(n): s.as_dict() for n, s in stats.items()},
        "duplicates": {str(n): d for n, d in dups.items()},
        "two_over_one": stats[2].median / base,
        "table": table(
            ["reactors", f"jobs/s ({rows:,} rows)", "÷ one reactor", "duplicates"],
            [
                [str(n), stats[n].fmt(digits=0), f"{stats[n].median / base:.2f}×", str(dups[n])]
                for n in counts
            ],
        ),
    }
