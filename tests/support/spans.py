"""Spans for the tracing tests: the test process's own (a real SDK exporting to memory), and
those child processes exported with `opentelemetry-instrument` and the console exporter
(one JSON object per span, in the form of the SDK's `ReadableSpan.to_json`), read back from
the file their standard output went to."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.paths import ROOT

_EXPORTER = InMemorySpanExporter()
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")


class _SwitchedTracer(trace.Tracer):
    """The SDK's tracer while `recording` is on, the API's no-op one otherwise: the global
    provider can be set only once a process, and the other tests of this process must see
    no tracing (no context stored in their rows)."""

    recording = False

    def __init__(self, real: trace.Tracer) -> None:
        self._real, self._noop = real, trace.NoOpTracer()

    def _now(self) -> trace.Tracer:
        return self._real if _SwitchedTracer.recording else self._noop

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._now().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._now().start_as_current_span(*args, **kwargs)


class _SwitchedProvider(trace.TracerProvider):
    def __init__(self) -> None:
        self._sdk = TracerProvider()
        self._sdk.add_span_processor(SimpleSpanProcessor(_EXPORTER))

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _SwitchedTracer(self._sdk.get_tracer(*args, **kwargs))


_PROVIDER: _SwitchedProvider | None = None


@contextlib.contextmanager
def recording() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (a real SDK exporting to memory, emptied first) while the
    block runs; off again after it."""
    global _PROVIDER
    if _PROVIDER is None:
        _PROVIDER = _SwitchedProvider()
        trace.set_tracer_provider(_PROVIDER)
    _EXPORTER.clear()
    _SwitchedTracer.recording = True
    try:
        yield _EXPORTER
    finally:
        _SwitchedTracer.recording = False


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
        """SIGTERM, then wait (its SDK exports what is left at exit). A process that does not
        stop in time fails the test with every thread's stack (faulthandler, on SIGABRT, in
        each process of its group: a forking worker's horse too) and its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            tail = "\n".join(self.log().splitlines()[-200:])
            raise AssertionError(
                f"{self.log_path.stem} did not stop within {timeout:g}s of SIGTERM; "
                f"its stacks and log:\n{tail}"
            ) from None
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
        # Stacks of every thread on SIGABRT (`Exporting.stop`, a process that hangs).
        "PYTHONFAULTHANDLER": "1",
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
