"""Processes that fork while their batch span processor is exporting, as a forking worker can.

Each sets up the real SDK with an exporter that holds a lock of its own while it exports (as
a file's or a connection pool's is held) and writes span names to SPANS, one a line.

- `python -m tests.support.fork_exports held|bare SPANS`: ends one span and forks once its
  export (0.3 s) has begun, around `tracing.exports_held()` (`held`) or not (`bare`). The
  child ends a span of its own, runs `tracing.flush()` and exits; the parent prints one JSON
  line: whether the child exited, its status, and how long it took.
- `python -m tests.support.fork_exports worker SPANS`: runs `reactor worker --burst` (a
  forking worker) under that SDK, the exports taking 0.1 s; the environment says the rest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from reactor import tracing
from reactor.cli import main as reactor_cli


class SlowExporter(SpanExporter):
    """Writes each span's name on a line of its own, holding its lock for `seconds` an
    export."""

    def __init__(self, path: Path, seconds: float) -> None:
        self._path, self._seconds = path, seconds
        self._lock, self.exporting = threading.Lock(), threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self.exporting.set()
            time.sleep(self._seconds)
            with self._path.open("a", encoding="utf-8") as out:
                out.writelines(f"{span.name}\n" for span in spans)
        return SpanExportResult.SUCCESS


def _provider(exporter: SlowExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1))
    trace.set_tracer_provider(provider)
    return provider


def fork_once(mode: str, spans: Path) -> None:
    exporter = SlowExporter(spans, 0.3)
    provider = _provider(exporter)
    tracer = trace.get_tracer("fork_exports")
    with tracer.start_as_current_span("in the parent"):
        pass
    if not exporter.exporting.wait(10):
        raise SystemExit("the parent's span was not exported within 10 s")
    began = time.monotonic()
    with tracing.exports_held() if mode == "held" else nullcontext():
        pid = os.fork()
    if pid == 0:
        with tracer.start_as_current_span("in the child"):
            pass
        tracing.flush()
        os._exit(0)
    deadline = began + 10
    while (reaped := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    took = time.monotonic() - began
    if reaped[0] == 0:
        os.kill(pid, 9)
    print(json.dumps({"exited": reaped[0] != 0, "status": reaped[1], "seconds": took}))
    provider.shutdown()


def run_worker(spans: Path) -> None:
    provider = _provider(SlowExporter(spans, 0.1))
    try:
        reactor_cli(["worker", "--burst"])
    finally:
        provider.shutdown()  # the worker's last spans


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        run_worker(Path(sys.argv[2]))
    else:
        fork_once(sys.argv[1], Path(sys.argv[2]))
