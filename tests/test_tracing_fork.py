"""A fork while a batch span processor exports: the forking worker holds exports across its
fork, and a work horse's flush of its spans is bounded, so a lock the parent's exporting
thread held at the fork never hangs a horse (the real SDK, real forks, in child programs:
`tests.support.fork_exports`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
import requests.adapters
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from reactor import submit, tracing
from tests.support.env import Env
from tests.support.otlp_sink import OtlpSink
from tests.support.paths import ROOT
from tests.support.rows import insert_rows
from tests.support.servers import free_port
from tests.support.spans import INSTRUMENT

ROUTE = "photo.process=tests.handlers.traced"


def _program(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.fork_exports", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def _names(spans: Path) -> list[str]:
    return spans.read_text(encoding="utf-8").splitlines() if spans.exists() else []


def _fork_while_exporting(mode: str, tmp_path: Path) -> tuple[dict[str, Any], list[str], str]:
    done = _program([mode, str(tmp_path / "spans")])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), _names(tmp_path / "spans"), done.stderr


def test_a_fork_waits_for_the_export_in_progress_and_the_child_exports(tmp_path: Path) -> None:
    child, names, stderr = _fork_while_exporting("held", tmp_path)
    assert child["exited"] and child["status"] == 0, (child, stderr)
    # The fork waited for the 0.3 s export, then the child exported in about as long.
    assert child["seconds"] < 1.0, child
    assert sorted(names) == ["in the child", "in the parent"], names
    assert "spans_not_flushed" not in stderr


def test_a_child_that_finds_the_exporter_locked_gives_its_spans_up_in_time(
    tmp_path: Path,
) -> None:
    child, names, stderr = _fork_while_exporting("bare", tmp_path)
    # Without the bound the child waits forever on the lock its parent's thread held.
    assert child["exited"] and child["status"] == 0, (child, stderr)
    assert 1.0 <= child["seconds"] < 5.0, child
    assert names == ["in the parent"], names
    assert "spans_not_flushed within=1s" in stderr, stderr


def test_a_forking_worker_forks_no_horse_while_its_spans_are_exported(
    env: Env, tmp_path: Path
) -> None:
    """Each job's `process` span is exported by the worker while the next job's horse is
    forked; every horse still exports its handler's span, none gives up."""
    conn = env.connect()
    photos = [f"p{i}" for i in range(4)]
    for photo_id in photos:
        submit(conn, photo_id)
    env.cli_json("sweep", "--route", ROUTE)
    spans = tmp_path / "spans"
    done = _program(["worker", str(spans)], env.process_env(REACTOR_ROUTES=ROUTE))
    assert done.returncode == 0, done.stderr
    assert "spans_not_flushed" not in done.stderr, done.stderr
    states = conn.execute("SELECT state, count(*) FROM photo_jobs GROUP BY state").fetchall()
    assert states == [("done", len(photos))], (states, done.stderr)
    names = _names(spans)
    assert names.count("handler work") == len(photos), (names, done.stderr)
    assert names.count("process photo.process") == len(photos), names


def _queued(env: Env, conn: Any, count: int) -> list[str]:
    """`count` photos' jobs in the queue (dispatched by `reactor sweep`)."""
    insert_rows(conn, count)
    env.cli_json("sweep", "--route", ROUTE)
    return [f"p{i}" for i in range(1, count + 1)]


def _burst_worker_exporting_to(
    env: Env, endpoint: str, **otel: str
) -> subprocess.CompletedProcess[str]:
    """A forking `reactor worker --burst` under `opentelemetry-instrument`, its spans sent over
    OTLP/HTTP to `endpoint`, the batch exports every 20 ms."""
    return subprocess.run(
        [INSTRUMENT, sys.executable, "-m", "reactor", "worker", "--burst"],
        cwd=ROOT,
        env=env.process_env(
            REACTOR_ROUTES=ROUTE,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_METRICS_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            OTEL_BSP_SCHEDULE_DELAY="20",
            **otel,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_horses_exporting_over_otlp_http_send_every_span_once(env: Env) -> None:
    """A forking worker under `opentelemetry-instrument` exporting over OTLP/HTTP (as the
    compose profile's does) to a collector on loopback, the worker's batch exports coming
    every 20 ms: each horse exports on a connection of its own, so no span is lost, sent
    twice, or sent mixed up with the worker's (a keep-alive connection the horse inherits
    carries both processes' requests at once)."""
    conn = env.connect()
    photos = _queued(env, conn, 60)
    with OtlpSink() as sink:
        done = _burst_worker_exporting_to(env, sink.endpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    states = conn.execute("SELECT state, count(*) FROM photo_jobs GROUP BY state").fetchall()
    errors = conn.execute("SELECT last_error FROM photo_jobs WHERE state <> 'done'").fetchall()
    assert states == [("done", len(photos))], f"{states} {errors[:3]} {done.stderr[-3000:]}"
    received = sink.received
    assert received.corrupt == [], received.corrupt[:3]
    names = Counter(name for name, _, _ in received.spans)
    assert names["process photo.process"] == len(photos), names
    assert names["handler work"] == len(photos), names
    ids = [span_id for _, span_id, _ in received.spans]
    assert len(ids) == len(set(ids)), "a span was sent twice"
    # Whether requests collided or not: no connection carried both a horse's spans (the
    # handler's) and the worker's (`process`).
    horses = {port for name, _, port in received.spans if name == "handler work"}
    worker = {port for name, _, port in received.spans if name == "process photo.process"}
    assert horses & worker == set(), "a horse exported on the worker's connection"


@pytest.mark.slow  # a fault: every export refused, the exporter's retries timed out
def test_a_collector_that_is_down_costs_horses_their_spans_not_each_job_a_wait(
    env: Env,
) -> None:
    """With nothing listening where spans go, the first horse's export gives up after its
    bound; the horses after it drop their spans without trying (and forks do not wait for the
    worker's own failing exports), so the warning comes once, not once a job."""
    conn = env.connect()
    photos = _queued(env, conn, 12)
    nowhere = f"http://127.0.0.1:{free_port()}"
    done = _burst_worker_exporting_to(env, nowhere, OTEL_EXPORTER_OTLP_TIMEOUT="3")
    assert done.returncode == 0, done.stderr[-3000:]
    states = conn.execute("SELECT state, count(*) FROM photo_jobs GROUP BY state").fetchall()
    assert states == [("done", len(photos))], (states, done.stderr[-3000:])
    waits = ("spans_not_flushed", "span_export_in_progress")
    stalls = [line for line in done.stderr.splitlines() if any(wait in line for wait in waits)]
    assert len(stalls) == 1, done.stderr[-5000:]


class _Wrapping(SpanExporter):
    """An exporter that hands its spans to another (a filter, a sampler of its own)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export(spans)


def test_the_sessions_of_plain_and_wrapped_exporters_are_found() -> None:
    plain, wrapped = requests.Session(), requests.Session()
    provider = TracerProvider()
    for session, wrap in ((plain, False), (wrapped, True)):
        exporter: SpanExporter = OTLPSpanExporter(endpoint="http://127.0.0.1:9", session=session)
        provider.add_span_processor(BatchSpanProcessor(_Wrapping(exporter) if wrap else exporter))
    try:
        found = tracing._http_sessions([provider])
    finally:
        provider.shutdown()
    assert any(s is plain for s in found) and any(s is wrapped for s in found), found


class _Refusing(requests.adapters.HTTPAdapter):
    refuse = False

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        if self.refuse:
            raise RuntimeError("no pool for you")
        super().init_poolmanager(*args, **kwargs)


def test_a_session_that_cannot_get_a_new_pool_costs_a_warning_not_the_job(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    session, adapter = requests.Session(), _Refusing()
    session.mount("http://", adapter)
    adapter.refuse = True
    monkeypatch.setattr(tracing, "_sessions", lambda: [session])
    with caplog.at_level(logging.WARNING, logger="reactor.tracing"):
        tracing.own_connections()
    assert "span_connections_shared" in caplog.text and "no pool for you" in caplog.text
