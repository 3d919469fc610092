"""Memory: RSS of `reactor run` at start, after warm-up, at its peak and at the end of a
drain of N rows (sampled from /proc every 20 ms)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.common import Reactor, count_state, flush_redis, fresh_database, table, wait_until


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def run(quick: bool) -> dict[str, Any]:
    rows = 100_000 if quick else 1_000_000
    with fresh_database() as url:
        flush_redis()
        reactor = Reactor(url, "--sweep-interval", "600").started()
        pid = reactor.proc.pid
        try:
            start = _rss_mib(pid)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO photo_jobs (photo_id, type)"
                    " SELECT 'w' || i, 'photo.process' FROM generate_series(1, 20000) i"
                )
            wait_until(lambda: count_state(url, "active") == 20_000, 120, 0.1)
            warm = _rss_mib(pid)
            peak = [warm]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak.append(_rss_mib(pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.perf_counter()
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO photo_jobs (photo_id, type)"
                    " SELECT 'm' || i, 'photo.process' FROM generate_series(1, %s) i",
                    [rows],
                )
            wait_until(lambda: count_state(url, "pending") == 0, 1200, 0.5)
            elapsed = time.perf_counter() - started
            done.set()
            sampler.join()
            end = _rss_mib(pid)
        finally:
            reactor.stop()
        flush_redis()
    return {
        "rows": rows,
        "rss_mib": {"start": start, "after_warmup": warm, "peak": max(peak), "end": end},
        "end_over_warm": end / warm,
        "drain_seconds": elapsed,
        "table": table(
            ["moment", "RSS MiB"],
            [
                ["started, idle", f"{start:.1f}"],
                ["after a 20,000-row warm-up", f"{warm:.1f}"],
                [f"peak while draining {rows:,} rows", f"{max(peak):.1f}"],
                [f"end ({elapsed:.0f} s later)", f"{end:.1f} ({end / warm:.2f}× warm)"],
            ],
        ),
    }
