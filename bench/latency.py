"""Dispatch latency: COMMIT of a single-row insert -> its job in the RQ queue.

The real `reactor run` process does the work; the benchmark inserts one row at a time
(autocommit: `execute` returns after COMMIT) and BLPOPs the queue, so it sees the job the
instant it is pushed. Beside it, the floor: a bare NOTIFY -> LISTEN round trip on the same
database, measured the same way.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.common import Reactor, Stat, fresh_database, percentile, redis_client, reset, table

QUEUE = "rq:queue:photo-process"


def _dispatch_round(url: str, inserts: int, pause: float, tag: str) -> list[float]:
    client = redis_client(blocking=True)
    delays = []
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(inserts):
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')",
                [f"{tag}-{i}"],
            )
            committed = time.perf_counter()
            popped = client.blpop([QUEUE], timeout=10)
            if popped is None:
                raise RuntimeError("job never arrived")
            delays.append(time.perf_counter() - committed)
            if pause:
                time.sleep(pause)
    client.close()
    return delays


def _notify_round(url: str, count: int, pause: float) -> list[float]:
    delays = []
    with (
        psycopg.connect(url, autocommit=True) as listener,
        psycopg.connect(url, autocommit=True) as sender,
    ):
        listener.execute("LISTEN bench_floor")
        for _ in range(count):
            sender.execute("NOTIFY bench_floor")
            committed = time.perf_counter()
            for _note in listener.notifies(timeout=10, stop_after=1):
                break
            delays.append(time.perf_counter() - committed)
            if pause:
                time.sleep(pause)
    return delays


def run(quick: bool) -> dict[str, Any]:
    inserts = 300 if quick else 2000
    reps = 3 if quick else 5
    pause = 0.002  # an idle-ish system between inserts, as in production at low load
    result: dict[str, Any] = {"inserts_per_run": inserts, "runs": reps}
    with fresh_database() as url:
        reset(url)
        reactor = Reactor(url, "--sweep-interval", "600").started()
        try:
            _dispatch_round(url, 50, pause, "warm")
            ours = [_dispatch_round(url, inserts, pause, f"r{rep}") for rep in range(reps)]
        finally:
            reactor.stop()
        floor = [_notify_round(url, inserts, pause) for _ in range(reps)]
    for name, runs in (("dispatch", ours), ("notify_floor", floor)):
        result[name] = {
            "p50_ms": Stat.of([percentile(r, 0.50) * 1000 for r in runs]).as_dict(),
            "p99_ms": Stat.of([percentile(r, 0.99) * 1000 for r in runs]).as_dict(),
        }
    p50 = Stat.of([percentile(r, 0.50) * 1000 for r in ours])
    p99 = Stat.of([percentile(r, 0.99) * 1000 for r in ours])
    f50 = Stat.of([percentile(r, 0.50) * 1000 for r in floor])
    f99 = Stat.of([percentile(r, 0.99) * 1000 for r in floor])
    result["table"] = table(
        ["path", "p50 ms", "p99 ms"],
        [
            ["insert COMMIT → job in RQ queue (reactor run)", p50.fmt(digits=2), p99.fmt(digits=2)],
            ["bare NOTIFY → LISTEN (floor)", f50.fmt(digits=2), f99.fmt(digits=2)],
        ],
    )
    result["ratio_p50_vs_floor"] = p50.median / f50.median
    return result
