"""Dashboard: `/api/overview` latency on a big table, and the Postgres backends it opens.

The table holds `rows` rows of four types, as a long-lived deployment has them: 2 % pending
(half of them due), 0.2 % active, 1 % failed, the rest done. The last 6 % of the rows were
written in the last hour (a busy hour: about 1,000 rows a minute at 1,000,000 rows), the
others over the 30 days before, in the order of their ids, so the table's pages follow time as
they do when rows arrive over time. Then `reactor dashboard` runs as a subprocess and is asked
for `/api/overview`:
- one request at a time, each making its own read (`--cache-seconds 0`; the release before
  had no cache): the cost of one read;
- one client asking again as soon as it has its answer, with the default settings;
- 30 clients at once, in rounds, with the default settings: the latency each client sees,
  and the most Postgres backends the dashboard held meanwhile (`pg_stat_activity`).

With BENCH_DASHBOARD_BEFORE=REV (a git revision of this repository), the dashboard of that
revision (`git archive REV reactor`) runs beside the current one, the two asked in turn, so
the table compares before and after on the same data.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

from bench.common import REDIS_URL, ROOT, Stat, fresh_database, table, wait_until

CLIENTS = 30

_BUILD = """
INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts, next_retry_at,
                        last_error, created_at, updated_at)
SELECT 'p' || i,
       (ARRAY['photo.process', 'photo.thumb', 'photo.exif', 'photo.ocr'])[1 + i %% 4],
       s.state,
       CASE WHEN s.state = 'pending' THEN i %% 2 ELSE 1 + i %% 3 END,
       5,
       CASE WHEN s.state = 'pending' AND i %% 2 = 1 THEN now() + interval '10 minutes' END,
       CASE WHEN s.state = 'failed' OR (s.state = 'pending' AND i %% 2 = 1)
            THEN 'RuntimeError: boom ' || i END,
       u.at - interval '1 minute',
       u.at
  FROM generate_series(1, %(rows)s) AS i,
       LATERAL (SELECT CASE WHEN i %% 1000 < 20 THEN 'pending'
                            WHEN i %% 1000 < 22 THEN 'active'
                            WHEN i %% 1000 < 32 THEN 'failed'
                            ELSE 'done' END AS state) AS s,
       LATERAL (SELECT CASE WHEN i > %(old)s
                            THEN now() - (%(rows)s - i) * %(recent_step)s::interval
                            ELSE now() - interval '1 hour' - (%(old)s - i) * %(old_step)s::interval
                       END AS at) AS u
"""

#: The share of the rows written in the last hour.
RECENT_SHARE = 0.06


def _build(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        old = int(rows * (1 - RECENT_SHARE))
        conn.execute(
            _BUILD,
            {
                "rows": rows,
                "old": old,
                "recent_step": f"{3599 / (rows - old)} seconds",
                "old_step": f"{30 * 86400 / old} seconds",
            },
        )
        conn.execute("VACUUM ANALYZE photo_jobs")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Dashboard:
    """`reactor dashboard` of the package found at `source`, as a subprocess."""

    def __init__(self, url: str, source: Path, *args: str) -> None:
        self.port = _free_port()
        env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": REDIS_URL}
        env["PYTHONPATH"] = str(source)
        env["REACTOR_ROUTES"] = "photo.process=reactor.demo.process_photo"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reactor", "dashboard", "--port", str(self.port), *args],
            env=env,
            cwd=source,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._answers, timeout=60, interval=0.1)

    def _answers(self) -> bool:
        try:
            self.get()
        except OSError:
            return False
        return True

    def get(self) -> float:
        """Seconds for one `/api/overview` (200 required)."""
        started = time.perf_counter()
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}/api/overview", timeout=120
        ) as response:
            response.read()
            assert response.status == 200
        return time.perf_counter() - started

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _backends(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'photo-reactor dashboard'"
    ).fetchone()
    return int(row[0]) if row else 0


def _concurrent(url: str, board: _Dashboard, rounds: int) -> tuple[list[float], int]:
    """`rounds` rounds of `CLIENTS` simultaneous requests: every latency, the peak backends."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(url, autocommit=True) as watcher:
            while not done.is_set():
                peak[0] = max(peak[0], _backends(watcher))

    sampler = threading.Thread(target=sample)
    sampler.start()
    latencies: list[float] = []
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            for _ in range(rounds):
                latencies += pool.map(lambda _: board.get(), range(CLIENTS))
    finally:
        done.set()
        sampler.join()
    return latencies, peak[0]


def _checkout(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "reactor"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(quick: bool) -> dict[str, Any]:
    rows, reads, rounds = (100_000, 10, 2) if quick else (1_000_000, 30, 5)
    before = os.environ.get("BENCH_DASHBOARD_BEFORE")
    sides: dict[str, dict[str, Any]] = {}
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        _build(url, rows)
        sources = {"after": ROOT}
        if before:
            sources = {f"before ({before})": _checkout(before, Path(tmp)), **sources}
        uncached = {
            name: _Dashboard(url, src, *([] if name != "after" else ["--cache-seconds", "0"]))
            for name, src in sources.items()
        }
        try:
            for name, board in uncached.items():
                board.get()  # plans and caches warm
                sides[name] = {"reads_s": []}
            for _ in range(reads):  # in turn, so both see the same machine
                for name, board in uncached.items():
                    sides[name]["reads_s"].append(board.get())
        finally:
            for board in uncached.values():
                board.stop()
        for name, src in sources.items():
            board = _Dashboard(url, src)  # the default settings
            try:
                again = [board.get() for _ in range(reads)]
                latencies, peak = _concurrent(url, board, rounds)
            finally:
                board.stop()
            sides[name].update(back_to_back_s=again, concurrent_s=latencies, peak_backends=peak)
    names = list(sides)
    result_rows = [
        [
            "one request at a time, each a read: ms",
            *(Stat.of([t * 1000 for t in sides[n]["reads_s"]]).fmt("", 0) for n in names),
        ],
        [
            "one client, back to back, default settings: ms",
            *(Stat.of([t * 1000 for t in sides[n]["back_to_back_s"]]).fmt("", 0) for n in names),
        ],
        [
            f"{CLIENTS} clients at once ({rounds} rounds), default settings: ms",
            *(Stat.of([t * 1000 for t in sides[n]["concurrent_s"]]).fmt("", 0) for n in names),
        ],
        [
            f"most Postgres backends of the dashboard, {CLIENTS} clients at once",
            *(str(sides[n]["peak_backends"]) for n in names),
        ],
    ]
    return {
        "rows": rows,
        "sides": sides,
        "table": table(["/api/overview", *names], result_rows)
        + f"\n\n{rows:,} rows; medians (min–max) of {reads} requests to each (in turn, for the"
        f" reads), and of {rounds} rounds of {CLIENTS} simultaneous requests.",
    }
