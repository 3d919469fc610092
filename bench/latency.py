"""Dispatch latency: COMMIT of a single-row insert -> its job in the RQ queue.

Low load: the real `reactor run` process does the work; the benchmark inserts one row every
5 ms (autocommit: `execute` returns after COMMIT; the next insert starts 5 ms after the one
before, or once its job arrived if that took longer) and BLPOPs the queue, so it sees the job
the instant it is pushed. Beside it, the floor: a bare NOTIFY -> LISTEN round trip on the same
database, measured the same way.

Saturating load: pgbench runs single-row inserting transactions from 16 clients as fast as
they go, for adaptive and plain reactors side by side. The delay of each row is measured inside
Postgres, from the writer's commit to the commit of the claim that enqueued its job (the job is
in Redis before that commit), with `track_commit_timestamp`: each row records its writer's
transaction id in a column added for the benchmark. When the benchmark server does not track
commit timestamps, a throwaway server (fsync on, like a real one) is started for this part.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    SERVER_URL,
    Reactor,
    Stat,
    armed_by,
    fresh_database,
    percentile,
    redis_client,
    reset,
    table,
    wait_until,
)
from bench.writers import SINGLE, pgbench
from tests.support.servers import PostgresServer

QUEUE = "rq:queue:photo-process"


def _dispatch_round(url: str, inserts: int, pause: float, tag: str) -> list[float]:
    client = redis_client(blocking=True)
    delays = []
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(inserts):
            begun = time.perf_counter()
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')",
                [f"{tag}-{i}"],
            )
            committed = time.perf_counter()
            popped = client.blpop([QUEUE], timeout=10)
            if popped is None:
                raise RuntimeError("job never arrived")
            delays.append(time.perf_counter() - committed)
            # Paced from the insert's start: one insert per `pause` (the job's delay included).
            time.sleep(max(0.0, pause - (time.perf_counter() - begun)))
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
            begun = time.perf_counter()
            sender.execute("NOTIFY bench_floor")
            committed = time.perf_counter()
            for _note in listener.notifies(timeout=10, stop_after=1):
                break
            delays.append(time.perf_counter() - committed)
            time.sleep(max(0.0, pause - (time.perf_counter() - begun)))
    return delays


def run(quick: bool) -> dict[str, Any]:
    inserts = 300 if quick else 1000
    reps = 3 if quick else 5
    pause = 0.005  # one insert every 5 ms: low load
    result: dict[str, Any] = {"inserts_per_run": inserts, "runs": reps}
    ours: list[list[float]] = []
    plain: list[list[float]] = []
    with fresh_database() as url:
        for rep in range(reps):
            for mode in ("adaptive", "plain") if rep % 2 == 0 else ("plain", "adaptive"):
                reset(url)
                reactor = Reactor(url, "--sweep-interval", "600", "--doorbell", mode).started()
                try:
                    _dispatch_round(url, 50, pause, f"warm{rep}{mode}")
                    delays = _dispatch_round(url, inserts, pause, f"r{rep}{mode}")
                finally:
                    reactor.stop()
                (ours if mode == "adaptive" else plain).append(delays)
        floor = [_notify_round(url, inserts, pause) for _ in range(reps)]
    for name, runs in (("dispatch", ours), ("dispatch_plain", plain), ("notify_floor", floor)):
        result[name] = {
            "p50_ms": Stat.of([percentile(r, 0.50) * 1000 for r in runs]).as_dict(),
            "p99_ms": Stat.of([percentile(r, 0.99) * 1000 for r in runs]).as_dict(),
        }
    p50 = Stat.of([percentile(r, 0.50) * 1000 for r in ours])
    p99 = Stat.of([percentile(r, 0.99) * 1000 for r in ours])
    f50 = Stat.of([percentile(r, 0.50) * 1000 for r in floor])
    f99 = Stat.of([percentile(r, 0.99) * 1000 for r in floor])
    q50 = Stat.of([percentile(r, 0.50) * 1000 for r in plain])
    q99 = Stat.of([percentile(r, 0.99) * 1000 for r in plain])
    result["ratio_p50_adaptive_vs_plain"] = p50.median / q50.median
    rows = [
        [
            "low load, adaptive: insert COMMIT → job in RQ queue",
            p50.fmt(digits=2),
            p99.fmt(digits=2),
            "",
            "",
        ],
        [
            "low load, plain: insert COMMIT → job in RQ queue",
            q50.fmt(digits=2),
            q99.fmt(digits=2),
            "",
            "",
        ],
        ["low load: bare NOTIFY → LISTEN (floor)", f50.fmt(digits=2), f99.fmt(digits=2), "", ""],
    ]
    result["ratio_p50_vs_floor"] = p50.median / f50.median
    saturated = _saturated(quick)
    result["saturated"] = saturated
    for load in LOADS:
        stats = {k: Stat.of(saturated[load][k]) for k in ("p50_ms", "p99_ms", "max_ms", "tps")}
        rows.append(
            [
                f"{load}: writer COMMIT → claim COMMIT",
                stats["p50_ms"].fmt(digits=2),
                stats["p99_ms"].fmt(digits=2),
                stats["max_ms"].fmt(digits=1),
                stats["tps"].fmt(digits=0),
            ]
        )
    result["table"] = table(["path", "p50 ms", "p99 ms", "max ms", "writer tx/s"], rows)
    return result


# -- saturating load -------------------------------------------------------------------------

#: The loaded runs: 16 writers flat out (adaptive and plain reactors), and 16 writers held to
#: a total rate this machine can also dispatch while writing (adaptive).
LOADS: dict[str, tuple[str, int | None]] = {
    "16 writers flat out, adaptive": ("adaptive", None),
    "16 writers flat out, plain": ("plain", None),
    "16 writers at 1,000 tx/s, adaptive": ("adaptive", 1000),
}

DELAYS = """
SELECT extract(epoch FROM pg_xact_commit_timestamp(xmin)
               - pg_xact_commit_timestamp((writer_xid % 4294967296)::text::xid)) * 1000
  FROM photo_jobs
"""


def _tracks_commit_timestamps(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW track_commit_timestamp").fetchone()
    return bool(row and row[0] == "on")


def _pending(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'pending'").fetchone()
    return int(row[0]) if row else 0


def _saturated_round(
    url: str, mode: str, seconds: float, script: Path, rate: int | None
) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE photo_jobs")
    reset(url)
    reactor = Reactor(url, "--sweep-interval", "600", "--doorbell", mode).started()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            wait_until(lambda: armed_by(conn) is not None, timeout=30)
            tps = pgbench(url, script, 16, seconds, rate)
            wait_until(lambda: _pending(conn) == 0, timeout=300)
            delays = [float(d) for (d,) in conn.execute(DELAYS)]
    finally:
        reactor.stop()
    return {
        "p50_ms": percentile(delays, 0.50),
        "p99_ms": percentile(delays, 0.99),
        "max_ms": max(delays),
        "tps": tps,
        "rows": len(delays),
    }


def _saturated(quick: bool) -> dict[str, Any]:
    seconds, reps = (3, 3) if quick else (10, 3)
    server = (
        None
        if _tracks_commit_timestamps(SERVER_URL)
        else PostgresServer(settings={"fsync": "on", "track_commit_timestamp": "on"})
    )
    runs: dict[str, dict[str, list[float]]] = {m: {} for m in LOADS}
    try:
        with (
            fresh_database(server.url if server else SERVER_URL) as url,
            tempfile.TemporaryDirectory() as tmp,
        ):
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(
                    "ALTER TABLE photo_jobs ADD COLUMN writer_xid bigint DEFAULT txid_current()"
                )
            script = Path(tmp) / "single.sql"
            script.write_text(SINGLE)
            for rep in range(reps):
                for load in LOADS if rep % 2 == 0 else reversed(LOADS):
                    mode, rate = LOADS[load]
                    for key, value in _saturated_round(url, mode, seconds, script, rate).items():
                        runs[load].setdefault(key, []).append(value)
    finally:
        if server is not None:
            server.stop()
    return {
        "server": "throwaway (fsync on, track_commit_timestamp on)" if server else SERVER_URL,
        **runs,
    }
