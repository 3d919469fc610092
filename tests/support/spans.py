"""Spans for the tracing tests: the test process's own (a real SDK exporting to memory), and
those child processes exported with `opentelemetry-instrument` and the console exporter
(one JSON object per span, in the form of the SDK's `ReadableSpan.to_json`), read back from
the file their standard output went to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.paths import ROOT

_EXPORTER = InMemorySpanExporter()
_INSTALLED = False
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")


def process_exporter() -> InMemorySpanExporter:
    """The exporter of this process's spans (the global provider is set once per process)."""
    global _INSTALLED
    if not _INSTALLED:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
        _INSTALLED = True
    return _EXPORTER


def local_spans(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [json.loads(span.to_json()) for span in exporter.get_finished_spans()]


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Every span the console exporter wrote to `path` (objects one after another, each
    starting a line; other lines, such as a plain `rq worker`'s log, are skipped)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    spans, pos = [], 0
    while pos < len(text):
        if text[pos] == "{":
            span, pos = decoder.raw_decode(text, pos)
            spans.append(span)
        else:
            pos = text.find("\n", pos) + 1 or len(text)
    return spans


def hex_id(value: str | int) -> str:
    """A span's or trace's id as plain hex (`to_json` writes `0x...`)."""
    return value[2:] if isinstance(value, str) else format(value, "x")


@dataclass
class Exporting:
    """A child process run under `opentelemetry-instrument`, its spans going to a file."""

    proc: subprocess.Popen[bytes]
    spans_path: Path
    log_path: Path
    _files: tuple[IO[bytes], IO[bytes]]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait (its SDK exports what is left at exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for f in self._files:
                f.close()

    def spans(self) -> list[dict[str, Any]]:
        return read_spans(self.spans_path)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def start_exporting(args: list[str], env: dict[str, str], directory: Path, name: str) -> Exporting:
    """Start `opentelemetry-instrument ARGS...` with the console exporter writing to a file."""
    env = {
        **env,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": name,
        # Spans leave within 50 ms: a process stopped by a test has exported them.
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    spans_path, log_path = directory / f"{name}.spans", directory / f"{name}.log"
    out, err = spans_path.open("ab"), log_path.open("ab")
    proc = subprocess.Popen(
        [INSTRUMENT, *args],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    return Exporting(proc, spans_path, log_path, (out, err))
