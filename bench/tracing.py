"""Tracing's cost end to end: photos submitted → handler → `done`, with tracing on and off, side by
side in one run (alternating order each round).

Each side: a producer process submits the photos with `reactor.submit`, one photo per call under
a span of its own ("upload", as a web request would), 20 calls per transaction; one `reactor
run` and 2 worker processes (`reactor.SimpleWorker` and `reactor.Worker`, in turn) with the
no-op handler (`bench.noop`); the clock runs from the first submit to the last row `done` (every
process is up before it starts). **On**: every process runs under `opentelemetry-instrument`
with the SDK's batch span processor and the console exporter writing to a file, so every span is
built, batched and written; **off**: the same processes without it (the API installed, no SDK:
the API's no-ops). The spans each "on" side's files hold are counted, so spans dropped by a full
batch queue would show (a dropped span costs less than an exported one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from rq import Queue, Worker

from bench.common import (
    REDIS_URL,
    ROOT,
    Stat,
    fresh_database,
    redis_client,
    reset,
    stop_processes,
    table,
)
from bench.common import wait_until as _wait_until

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
ROUTE = "photo.process=bench.noop.noop"
CLASSES = {"simple": "reactor.SimpleWorker", "fork": "reactor.Worker"}
PER_TRANSACTION = 20

PRODUCER = f"""
import sys, psycopg
from opentelemetry import trace
from reactor import submit

count, url = int(sys.argv[1]), sys.argv[2]
tracer = trace.get_tracer("bench")
with psycopg.connect(url) as conn:
    print("ready", file=sys.stderr, flush=True)
    sys.stdin.readline()  # the clock starts once the process is up
    for first in range(0, count, {PER_TRANSACTION}):
        for i in range(first, min(first + {PER_TRANSACTION}, count)):
            with tracer.start_as_current_span("upload"):
                submit(conn, f"t{{i}}")
        conn.commit()
"""


def _env(url: str, traced: bool, name: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": REDIS_URL,
        "REACTOR_ROUTES": ROUTE,
        "REACTOR_PREPARED_STATEMENTS": "1",
        "PYTHONPATH": str(ROOT),
    }
    if traced:
        env.update(
            OTEL_TRACES_EXPORTER="console",
            OTEL_METRICS_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            OTEL_SERVICE_NAME=name,
        )
    return env


def _command(traced: bool, *args: str) -> list[str]:
    return [INSTRUMENT, sys.executable, *args] if traced else [sys.executable, *args]


def _spans(directory: Path) -> int:
    """Spans the console exporter wrote to the files of `directory` (one `"name"` each)."""
    return sum(p.read_text(errors="replace").count('"name": ') for p in directory.iterdir())


def _unfinished(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM photo_jobs WHERE state = 'pending')"
        " OR EXISTS (SELECT FROM photo_jobs WHERE state = 'active')"
    ).fetchone()
    return bool(row and row[0])


def _side(url: str, kind: str, photos: int, traced: bool) -> tuple[float, int]:
    """(jobs/s, spans exported) of one side."""
    reset(url)
    with tempfile.TemporaryDirectory() as spans_dir, tempfile.TemporaryFile() as logs:
        out = Path(spans_dir)
        procs: list[subprocess.Popen[bytes]] = []

        def start(name: str, *args: str) -> None:
            with (out / name).open("wb") as spans:
                procs.append(
                    subprocess.Popen(
                        _command(traced, *args),
                        env=_env(url, traced, name),
                        stdout=spans if traced else subprocess.DEVNULL,
                        stderr=logs,
                    )
                )

        try:
            start("reactor", "-m", "reactor", "run", "--sweep-interval", "600")
            for n in range(2):
                command = ["-m", "rq.cli", "worker", "-w", CLASSES[kind], "photo-process"]
                start(f"worker-{n}", *command, "--url", REDIS_URL, "-q")
            client = redis_client()
            probe = Queue("photo-process", connection=client)
            _wait_until(lambda: Worker.count(queue=probe) >= 2, timeout=60, interval=0.02)
            client.close()
            with (
                psycopg.connect(url, autocommit=True) as poll,
                (out / "producer").open("wb") as producer_spans,
            ):
                producer = subprocess.Popen(
                    [*_command(traced, "-c", PRODUCER), str(photos), url],
                    env=_env(url, traced, "producer"),
                    stdin=subprocess.PIPE,
                    stdout=producer_spans,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                assert producer.stdin is not None and producer.stderr is not None
                if producer.stderr.readline().strip() != "ready":
                    raise RuntimeError(f"the producer failed: {producer.stderr.read()[-2000:]}")
                started = time.perf_counter()
                producer.stdin.write("go\n")
                producer.stdin.close()
                if producer.wait() != 0:
                    raise RuntimeError(f"the producer failed: {producer.stderr.read()[-2000:]}")
                _wait_until(lambda: not _unfinished(poll), timeout=1800, interval=0.02)
                elapsed = time.perf_counter() - started
        except BaseException:
            logs.seek(0)
            sys.stderr.write(logs.read().decode(errors="replace")[-3000:])
            raise
        finally:
            stop_processes(procs)
        return photos / elapsed, _spans(out) if traced else 0


def run(quick: bool) -> dict[str, Any]:
    photos = 300 if quick else 3000
    rounds = 1 if quick else 5
    rates: dict[tuple[str, bool], list[float]] = {}
    spans: dict[str, list[int]] = {"simple": [], "fork": []}
    with fresh_database() as url:
        for round_ in range(rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for kind in ("simple", "fork"):
                for traced in order:
                    rate, exported = _side(url, kind, photos, traced)
                    rates.setdefault((kind, traced), []).append(rate)
                    if traced:
                        spans[kind].append(exported)
    rows = []
    for kind in ("simple", "fork"):
        ratios = [on / off for on, off in zip(rates[kind, True], rates[kind, False], strict=True)]
        rows.append(
            [
                f"{kind}: jobs/s, {photos:,} photos, 2 workers",
                Stat.of(rates[kind, True]).fmt(digits=0),
                Stat.of(rates[kind, False]).fmt(digits=0),
                Stat.of(ratios).fmt("×", digits=2),
                f"{min(spans[kind]) / photos:.2f}",
                "≥ 0.95×",
            ]
        )
    headers = ["measure", "tracing on", "off", "on ÷ off", "spans/photo (min)", "target"]
    return {
        "photos": photos,
        "rounds": rounds,
        "rates": {f"{k}:{'on' if t else 'off'}": v for (k, t), v in rates.items()},
        "spans": spans,
        "table": table(headers, rows),
    }
