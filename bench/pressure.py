"""Claims under a held snapshot: the same flow without and with an old snapshot held open.

Each side is one run on a fresh database: the real `reactor run` (default settings, routes
`photo.process` to the no-op `bench.noop.noop`, and `photo.probe` to a queue no worker reads),
2 `reactor worker --simple` on `photo-process` running the no-op handler, and for the whole
run about 100 rows a second of `photo.process` (single-row autocommit inserts on one
connection, paced on a fixed schedule) through the full lifecycle (pending → active → done).
On the held side, another connection opens a `REPEATABLE READ` transaction and reads the table
before the flow starts, and keeps it open (idle in transaction) to the end: vacuum can then
remove none of the pending index's entries left since (a report, `pg_dump`, a forgotten
session).

Measured per time bucket (a minute; `--quick`: 30 s), for each side:
- the claim's mean time and shared buffers per call, server-side, from `pg_stat_statements`
  (the benchmark's throwaway server loads it; a server given in BENCH_DATABASE_URL that does
  not gets only the next column), and the reactor's own claim histogram (`/metrics`,
  `reactor_claim_seconds`: the round trip included);
- COMMIT → job in its RQ queue of probe inserts: a `photo.probe` row inserted every 200 ms on
  its own autocommit connection (`execute` returned after COMMIT), its job BLPOPed from the
  probe queue, p50 and p99;
- the size of the pending index (`photo_jobs_pending_due_idx`) at the bucket's end.
Then the ratios held / not held over the last bucket (the issue's target after 10 minutes held
at 100 rows/s: claim time within 5 times, COMMIT → job p99 within 3 times).

`--before` adds the same two sides with main's claim (`bench.fullclaim`: every claim over the
whole range, and the outer state check that let the planner read the whole pending index for
the UPDATE too), so the table shows before and after; `--minutes M`
sets each side's length (10; `--quick`: 1.5).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench.common import (
    REDIS_URL,
    ROOT,
    SERVER_URL,
    Reactor,
    flush_redis,
    fresh_database,
    percentile,
    redis_client,
    rq_workers,
    table,
)
from tests.support.servers import PostgresServer, free_port

#: Set by `python -m bench pressure --minutes M --before` (None: the defaults).
MINUTES: float | None = None
BEFORE = False

ROUTES = ("photo.process=bench.noop.noop", "photo.probe=bench.noop.noop@bench-probe")
WORK_QUEUE = "photo-process"
PROBE_QUEUE = "rq:queue:bench-probe"
RATE = 100.0  # rows a second
PROBE_EVERY = 0.2  # seconds
#: The claim statement in pg_stat_statements (the normalized text of CLAIM_DUE).
CLAIM_TEXT = "%ORDER BY coalesce(p.next_retry_at, p.created_at)%FOR UPDATE SKIP LOCKED%"
#: (name, entry point, snapshot held)
SIDES = {
    "bounded, not held": ("reactor", False),
    "bounded, held": ("reactor", True),
    "main's claim, not held": ("bench.fullclaim", False),
    "main's claim, held": ("bench.fullclaim", True),
}


@dataclass
class Bucket:
    """What one time bucket of one side measured."""

    end_s: float
    claim_ms: float | None = None  # server-side mean
    claim_buffers: float | None = None  # shared buffers per claim
    client_claim_ms: float | None = None  # the reactor's histogram mean
    claims: int = 0
    probes: list[float] = field(default_factory=list)  # seconds
    index_kb: float = 0.0
    done: int = 0

    def row(self) -> list[str]:
        def ms(value: float | None, digits: int = 2) -> str:
            return "–" if value is None else f"{value:,.{digits}f}"

        p50 = percentile(self.probes, 0.5) * 1000 if self.probes else None
        p99 = percentile(self.probes, 0.99) * 1000 if self.probes else None
        return [
            f"{self.end_s / 60:.1f}",
            ms(self.claim_ms, 3),
            ms(self.claim_buffers, 0),
            ms(self.client_claim_ms, 3),
            ms(p50),
            ms(p99),
            f"{self.index_kb:,.0f}",
            f"{self.done:,}",
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "end_s": self.end_s,
            "claim_ms": self.claim_ms,
            "claim_buffers": self.claim_buffers,
            "client_claim_ms": self.client_claim_ms,
            "claims": self.claims,
            "probes": len(self.probes),
            "probe_p50_ms": percentile(self.probes, 0.5) * 1000 if self.probes else None,
            "probe_p99_ms": percentile(self.probes, 0.99) * 1000 if self.probes else None,
            "index_kb": self.index_kb,
            "done": self.done,
        }


def _has_statements(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW shared_preload_libraries").fetchone()
    return bool(row and "pg_stat_statements" in str(row[0]))


@contextmanager
def _server() -> Iterator[tuple[str, bool]]:
    """A server URL, and whether pg_stat_statements is loaded there."""
    if os.environ.get("BENCH_DATABASE_URL") or _has_statements(SERVER_URL):
        yield SERVER_URL, _has_statements(SERVER_URL)
        return
    server = PostgresServer(
        settings={"fsync": "on", "shared_preload_libraries": "pg_stat_statements"}
    )
    try:
        yield server.url, True
    finally:
        server.stop()


class _Sampler:
    """Reads the cumulative counters a bucket is the difference of."""

    def __init__(self, url: str, statements: bool, metrics_port: int) -> None:
        self._conn = psycopg.connect(url, autocommit=True)
        self._statements = statements
        self._metrics = f"http://127.0.0.1:{metrics_port}/metrics"

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        conn = self._conn
        if self._statements:
            row = conn.execute(
                "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0),"
                "       coalesce(sum(shared_blks_hit + shared_blks_read), 0)"
                "  FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                "   AND query LIKE %s",
                [CLAIM_TEXT],
            ).fetchone()
            assert row is not None
            out["calls"], out["exec_ms"], out["blocks"] = map(float, row)
        row = conn.execute(
            "SELECT pg_relation_size('photo_jobs_pending_due_idx'),"
            "       (SELECT count(*) FROM photo_jobs WHERE state = 'done')"
        ).fetchone()
        assert row is not None
        out["index_bytes"], out["done"] = float(row[0]), float(row[1])
        with urllib.request.urlopen(self._metrics, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("reactor_claim_seconds_sum"):
                    out["client_sum"] = float(line.split()[-1])
                elif line.startswith("reactor_claim_seconds_count"):
                    out["client_count"] = float(line.split()[-1])
        return out

    def close(self) -> None:
        self._conn.close()


def _bucket(end_s: float, before: dict[str, float], after: dict[str, float]) -> Bucket:
    bucket = Bucket(end_s, index_kb=after["index_bytes"] / 1024, done=int(after["done"]))
    if "calls" in after:
        calls = after["calls"] - before["calls"]
        bucket.claims = int(calls)
        if calls:
            bucket.claim_ms = (after["exec_ms"] - before["exec_ms"]) / calls
            bucket.claim_buffers = (after["blocks"] - before["blocks"]) / calls
    count = after.get("client_count", 0.0) - before.get("client_count", 0.0)
    if count:
        sum_ = after.get("client_sum", 0.0) - before.get("client_sum", 0.0)
        bucket.client_claim_ms = sum_ * 1000 / count
    return bucket


@contextmanager
def _workers(url: str, count: int) -> Iterator[None]:
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": REDIS_URL,
        "REACTOR_ROUTES": ",".join(ROUTES),
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "reactor", "worker", WORK_QUEUE, "--simple", "-q"]
    with rq_workers(command, WORK_QUEUE, count, env):
        yield


def _flow(url: str, stop: threading.Event, started: float) -> None:
    """Single-row inserts at RATE a second, on a fixed schedule (a late one does not shift it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        i = 0
        while not stop.is_set():
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [f"f{i}"]
            )
            i += 1
            pause = started + i / RATE - time.monotonic()
            if pause > 0:
                stop.wait(pause)


def _probes(
    url: str, stop: threading.Event, started: float, out: list[tuple[float, float]]
) -> None:
    """A probe row every PROBE_EVERY seconds: (seconds since start, COMMIT → job in queue)."""
    client = redis_client(blocking=True)
    with psycopg.connect(url, autocommit=True) as conn:
        i = 0
        while not stop.is_set():
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.probe')", [f"q{i}"]
            )
            committed = time.perf_counter()
            if client.blpop([PROBE_QUEUE], timeout=60) is None:
                raise RuntimeError("a probe's job never arrived")
            out.append((time.monotonic() - started, time.perf_counter() - committed))
            # No worker reads the probe queue: finish the row, so no sweep looks at its job.
            conn.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = %s", [f"q{i}"])
            i += 1
            pause = started + i * PROBE_EVERY - time.monotonic()
            if pause > 0:
                stop.wait(pause)
    client.close()


def _side(
    label: str,
    server_url: str,
    statements: bool,
    module: str,
    held: bool,
    seconds: float,
    bucket_s: float,
) -> list[Bucket]:
    flush_redis()
    with fresh_database(server_url) as url:
        if statements:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        holder = psycopg.connect(url)
        port = free_port()
        args = [a for r in ROUTES for a in ("--route", r)]
        reactor = Reactor(url, *args, "--metrics-port", str(port), module=module)
        try:
            if held:
                holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM photo_jobs").fetchone()
            reactor.started()
            with _workers(url, 2):
                return _measure(label, url, statements, port, seconds, bucket_s)
        finally:
            reactor.stop()
            holder.close()


def _measure(
    label: str, url: str, statements: bool, port: int, seconds: float, bucket_s: float
) -> list[Bucket]:
    sampler = _Sampler(url, statements, port)
    stop = threading.Event()
    probes: list[tuple[float, float]] = []
    started = time.monotonic()
    threads = [
        threading.Thread(target=_flow, args=(url, stop, started), daemon=True),
        threading.Thread(target=_probes, args=(url, stop, started, probes), daemon=True),
    ]
    buckets: list[Bucket] = []
    try:
        last = sampler.read()
        for thread in threads:
            thread.start()
        end = bucket_s
        while end <= seconds + 1e-6:
            time.sleep(max(0.0, started + end - time.monotonic()))
            now = sampler.read()
            buckets.append(_bucket(end, last, now))
            print(f"  {label}: {' | '.join(buckets[-1].row())}", file=sys.stderr, flush=True)
            last = now
            if not all(t.is_alive() for t in threads):
                raise RuntimeError("the flow or the probes stopped")
            end += bucket_s
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
        sampler.close()
    for bucket in buckets:
        begin = bucket.end_s - bucket_s
        bucket.probes = [d for at, d in probes if begin <= at < bucket.end_s]
    return buckets


def run(quick: bool) -> dict[str, Any]:
    minutes = MINUTES if MINUTES is not None else (1.5 if quick else 10.0)
    seconds = minutes * 60
    bucket_s = 30.0 if quick or minutes < 4 else 60.0
    names = [n for n in SIDES if BEFORE or n.startswith("bounded")]
    result: dict[str, Any] = {"minutes_per_side": minutes, "rate": RATE, "sides": {}}
    result["load_before"] = os.getloadavg()
    curves: dict[str, list[Bucket]] = {}
    with _server() as (server_url, statements):
        result["pg_stat_statements"] = statements
        for name in names:
            module, held = SIDES[name]
            curves[name] = _side(name, server_url, statements, module, held, seconds, bucket_s)
            result["sides"][name] = [b.as_dict() for b in curves[name]]
    result["load_after"] = os.getloadavg()
    headers = [
        "side",
        "minute",
        "claim ms (server)",
        "buffers/claim",
        "claim ms (reactor)",
        "probe p50 ms",
        "probe p99 ms",
        "pending index kB",
        "rows done",
    ]
    rows = [[name, *b.row()] for name, buckets in curves.items() for b in buckets]
    parts = [table(headers, rows)]
    summary = []
    for kind in ("bounded", "main's claim") if BEFORE else ("bounded",):
        ratios = _ratios(curves[f"{kind}, not held"][-1], curves[f"{kind}, held"][-1])
        result["ratios_" + ("bounded" if kind == "bounded" else "main")] = ratios
        summary.append([kind, *(_fmt_ratio(ratios.get(k)) for k in RATIO_KEYS)])
    parts.append(table(["claim", *RATIO_KEYS.values()], summary))
    result["table"] = "\n\n".join(parts)
    return result


RATIO_KEYS = {
    "claim_ms": "claim ms, held / not held (last bucket)",
    "client_claim_ms": "claim ms (reactor), held / not held",
    "probe_p99_ms": "probe p99, held / not held",
    "probe_p50_ms": "probe p50, held / not held",
}


def _ratios(free: Bucket, held: Bucket) -> dict[str, float]:
    a, b = free.as_dict(), held.as_dict()
    return {k: b[k] / a[k] for k in RATIO_KEYS if a.get(k) and b.get(k) is not None}


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"
