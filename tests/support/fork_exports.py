"""A process that forks while its batch span processor is exporting, as a forking worker can.

`python -m tests.support.fork_exports held|bare SPANS`: sets up the real SDK (a batch
processor whose exporter takes 0.3 s an export, under a lock of its own, writing span names
to SPANS), ends one span and forks once its export has begun, around `tracing.exports_held()`
(`held`) or not (`bare`). The child ends a span of its own, runs `tracing.flush()` and exits;
the parent prints one JSON line: the child's exit status and how long it took.
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

#: The child's flush gives up sooner than in production: the test waits for it.
tracing.FLUSH_SECONDS = 1.0


class SlowExporter(SpanExporter):
    """Writes each span's name on a line of its own, holding its lock for 0.3 s an export
    (a file's or a connection pool's lock, held by the exporting thread)."""

    def __init__(self, path: Path) -> None:
        self._path, self._lock, self.exporting = path, threading.Lock(), threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self.exporting.set()
            time.sleep(0.3)
            with self._path.open("a", encoding="utf-8") as out:
                out.writelines(f"{span.name}\n" for span in spans)
        return SpanExportResult.SUCCESS


def main(mode: str, spans: Path) -> None:
    exporter = SlowExporter(spans)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1))
    trace.set_tracer_provider(provider)
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


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
