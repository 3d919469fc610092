"""OpenTelemetry end to end, with the real SDK: a producer in this process under a span,
`reactor run` and a worker as subprocesses under `opentelemetry-instrument` exporting their
spans (console exporter, to a file each); the test reads every process's spans and checks one
connected story per photo. Also: a malformed stored context breaks nothing, a re-arm stores
the new caller's context, the README's producer grants suffice, and without OpenTelemetry
importable nothing needs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reactor import submit, submit_many
from reactor.jobs import JobRef, job_id
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.roles import as_role, throwaway_role
from tests.support.spans import (
    Exporting,
    hex_id,
    local_spans,
    recording,
    start_exporting,
)
from tests.support.waiting import wait_for

ROUTE = "photo.process=tests.handlers.traced"
#: How each kind of worker is started (the worker classes, and a plain `rq worker`).
#: The `reactor` console script, as README runs it (`opentelemetry-instrument reactor run`).
REACTOR = str(Path(sys.executable).parent / "reactor")
WORKERS = {
    "forking": [REACTOR, "--log-format", "json", "worker"],
    "simple": [REACTOR, "--log-format", "json", "worker", "--simple"],
    "plain": [sys.executable, "-m", "rq.cli", "worker", "photo-process"],
}


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """This process's spans, recorded during the test only."""
    with recording() as spans:
        yield spans


def _states(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, int]]:
    rows = conn.execute("SELECT photo_id, state, attempts FROM photo_jobs").fetchall()
    return {photo_id: (state, attempts) for photo_id, state, attempts in rows}


def _context(span: dict[str, Any]) -> tuple[str, str]:
    return hex_id(span["context"]["trace_id"]), hex_id(span["context"]["span_id"])


def _links(span: dict[str, Any]) -> list[tuple[str, str]]:
    return [_context(link) for link in span["links"]]


def _run_story(
    env: Env, tmp_path: Path, worker: str, relationship: str, produce: Callable[[], None]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Exporting]:
    """Produce (in this process), run a reactor and a worker under opentelemetry-instrument
    until the rows have run, stop both; (reactor's spans, worker's spans, the worker)."""
    child = env.process_env(
        REACTOR_ROUTES=ROUTE,
        REACTOR_TRACE_RELATIONSHIP=relationship,
        REACTOR_RETRY_BASE_SECONDS="3600",  # a failed row waits: the story ends at one attempt
    )
    args = [*WORKERS[worker], *(["--url", env.redis_url] if worker == "plain" else [])]
    produce()
    # Poll-only, every 50 ms: the rows are claimed without a listener session to start.
    run = [REACTOR, "run", "--doorbell", "poll-only"]
    reactor = start_exporting(
        [*run, "--poll-interval", "0.05"], child, tmp_path, f"reactor-{worker}"
    )
    workers = start_exporting(args, child, tmp_path, f"worker-{worker}")
    conn = env.connect()
    try:
        wait_for(
            lambda: all(
                (state, attempts) in (("done", 1), ("pending", 1))
                for state, attempts in _states(conn).values()
            ),
            timeout=60,
            what="every row to run once",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_states(conn)}\n{workers.log()}\n{reactor.log()}") from None
    finally:
        assert workers.stop() == 0, workers.log()
        assert reactor.stop() == 0, reactor.log()
    return reactor.spans(), workers.spans(), workers


def _by_photo(spans: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for span in spans:
        if span["name"] == name:
            photo = span["attributes"]["photo_jobs.photo_id"]
            assert photo not in found, f"two {name} spans for {photo}"
            found[photo] = span
    return found


@pytest.mark.parametrize(
    ("worker", "relationship"),
    [("forking", "link"), ("simple", "child"), ("plain", "link"), ("forking", "none")],
)
def test_one_connected_story_per_photo(
    env: Env, tmp_path: Path, worker: str, relationship: str, exporter: InMemorySpanExporter
) -> None:
    conn = env.connect(autocommit=False)
    tracer = trace.get_tracer("tests")

    def produce() -> None:
        with tracer.start_as_current_span("upload"):
            submit(conn, "ok-1")
            submit_many(conn, ["fail-1", "ok-2"])
        conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('by-sql', 'photo.process')")
        # A producer role may write anything within the bounds: no link, and nothing breaks.
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, traceparent, tracestate) VALUES"
            " ('malformed', 'photo.process', 'not-a-trace-context', %s),"
            " ('zero-ids', 'photo.process', %s, 'a=b')",
            ["\x7f" * 512, f"00-{'0' * 32}-{'0' * 16}-01"],
        )
        conn.commit()

    reactor_spans, worker_spans, workers = _run_story(env, tmp_path, worker, relationship, produce)
    mine = local_spans(exporter)
    upload = next(s for s in mine if s["name"] == "upload")
    sends = {
        s["attributes"].get("photo_jobs.photo_id", "batch"): s for s in mine if s is not upload
    }
    assert {s["name"] for s in sends.values()} == {"send photo.process"}
    assert all(s["kind"] == "SpanKind.PRODUCER" for s in sends.values())
    assert all(hex_id(s["parent_id"]) == _context(upload)[1] for s in sends.values())
    assert sends["batch"]["attributes"]["messaging.batch.message_count"] == 2
    producer_of = {"ok-1": sends["ok-1"], "fail-1": sends["batch"], "ok-2": sends["batch"]}
    assert _states(env.connect()) == {
        "ok-1": ("done", 1),
        "ok-2": ("done", 1),
        "by-sql": ("done", 1),
        "malformed": ("done", 1),
        "zero-ids": ("done", 1),
        "fail-1": ("pending", 1),
    }

    # The reactor's batch spans link to the producers' contexts (each once), and to nothing
    # else: the rows without a valid context have no link.
    publish = [s for s in reactor_spans if s["name"] == "publish photo.process"]
    assert publish and all(s["kind"] == "SpanKind.PRODUCER" for s in publish)
    linked = [link for s in publish for link in _links(s)]
    assert sorted(linked) == sorted({_context(s) for s in sends.values()})
    assert sum(s["attributes"]["messaging.batch.message_count"] for s in publish) == 6

    processed = _by_photo(worker_spans, "process photo.process")
    assert set(processed) == {"ok-1", "ok-2", "fail-1", "by-sql", "malformed", "zero-ids"}, (
        workers.log()
    )
    for photo, span in processed.items():
        attributes = span["attributes"]
        assert span["kind"] == "SpanKind.CONSUMER"
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == "photo.process"
        assert attributes["messaging.message.id"] == job_id("photo.process", photo, 1)
        assert (attributes["photo_jobs.token"], attributes["photo_jobs.attempt"]) == (1, 1)
        producer = producer_of.get(photo)
        if producer is None or relationship == "none":
            assert span["links"] == [] and span["parent_id"] is None, photo
        elif relationship == "link":
            assert _links(span) == [_context(producer)] and span["parent_id"] is None
        else:
            assert span["links"] == []
            assert _context(span)[0] == _context(producer)[0]
            assert hex_id(span["parent_id"]) == _context(producer)[1]
    failed = processed["fail-1"]
    assert failed["attributes"]["error.type"] == "RuntimeError"
    assert failed["attributes"]["photo_jobs.retried"] is True
    assert failed["status"]["status_code"] == "ERROR"
    assert "error.type" not in processed["ok-1"]["attributes"]

    # The handler's own span nests under the `process` span (a forked horse exported it).
    for photo, span in processed.items():
        work = [
            s
            for s in worker_spans
            if s["name"] == "handler work" and s["parent_id"] == span["context"]["span_id"]
        ]
        assert len(work) == 1, f"{photo}: {workers.log()}"
    ids = [_context(s) for s in [*reactor_spans, *worker_spans]]
    assert len(ids) == len(set(ids)), "a span was exported twice"

    if worker != "plain":  # point 5: the worker's JSON log records of a job carry its ids
        _check_log_ids(workers.log(), processed)


def _check_log_ids(log: str, processed: dict[str, dict[str, Any]]) -> None:
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    failure = [r for r in records if r["event"] == "attempt_failed"]
    assert len(failure) == 1, log
    # RQ's prose is not split into an event: its records keep their whole message.
    ours = [r for r in records if r["logger"].startswith("reactor")]
    theirs = [r for r in records if r["logger"].startswith("rq.")]
    assert ours and all(re.fullmatch(r"[a-z]+(_[a-z]+)*", r["event"]) for r in ours), ours
    assert any(r["message"].split(": ")[-1].startswith("Job OK (") for r in theirs), theirs
    assert theirs and all(r["event"] is None for r in theirs), theirs
    trace_id, span_id = _context(processed["fail-1"])
    assert (failure[0]["trace_id"], failure[0]["span_id"]) == (trace_id, span_id)
    # Every record that names a job's photo was written inside that job's span, but RQ's line
    # announcing the job it dequeued, which its work loop writes before it runs the job.
    for record in records:
        if ": photo-process: tests.handlers.traced(" in record["message"]:
            continue
        for photo, span in processed.items():
            if f"'{photo}'" in record["message"] or f"({photo})" in record["message"]:
                assert (record.get("trace_id"), record.get("span_id")) == _context(span), record


def _send_context(exporter: InMemorySpanExporter) -> str:
    (send,) = [s for s in exporter.get_finished_spans() if s.name == "send photo.process"]
    found = send.get_span_context()
    assert found is not None
    return f"00-{found.trace_id:032x}-{found.span_id:016x}-{found.trace_flags:02x}"


def _readme_producer_grants(role: str) -> list[str]:
    """The README's statements for the producer role, for `role`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("```sql", 1)[1].split("```", 1)[0]
    code = "\n".join(line.split("--", 1)[0] for line in block.splitlines())
    return [s.replace("photo_producer", role) for s in code.split(";") if "photo_producer" in s]


def test_a_rearm_stores_the_new_callers_context_with_the_readme_grants(
    env: Env, exporter: InMemorySpanExporter
) -> None:
    owner = env.connect()
    owner.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, traceparent) VALUES"
        " ('finished', 'photo.process', 'done', 1, %s), ('waiting', 'photo.process', 'pending',"
        " 0, %s)",
        [f"00-{'1' * 32}-{'1' * 16}-01", f"00-{'2' * 32}-{'2' * 16}-01"],
    )
    tracer = trace.get_tracer("tests")
    with throwaway_role(env) as role:
        grants = _readme_producer_grants(role)
        assert len(grants) == 3, grants
        for grant in grants:
            owner.execute(grant)
        with psycopg.connect(as_role(env.database_url, role)) as producer:
            exporter.clear()
            with tracer.start_as_current_span("second upload"):
                assert submit_many(producer, ["finished", "waiting"]) == 1
    stored = dict(owner.execute("SELECT photo_id, traceparent FROM photo_jobs").fetchall())
    # The re-armed row has the new caller's context; the pending one is left as it was.
    assert stored == {
        "finished": _send_context(exporter),
        "waiting": f"00-{'2' * 32}-{'2' * 16}-01",
    }


def test_the_async_forms_store_the_context_in_the_same_insert(
    env: Env, exporter: InMemorySpanExporter
) -> None:
    import asyncio

    from reactor import submit_async

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(env.database_url) as conn:
            with trace.get_tracer("tests").start_as_current_span("upload"):
                assert await submit_async(conn, "async-1")

    asyncio.run(produce())
    stored = env.connect().execute("SELECT traceparent, tracestate FROM photo_jobs").fetchall()
    assert stored == [(_send_context(exporter), None)]


def test_a_batch_span_links_each_distinct_context_once_up_to_the_cap(
    exporter: InMemorySpanExporter,
) -> None:
    from reactor import tracing
    from reactor.jobs import JobRef

    contexts = [f"00-{n + 1:032x}-{n + 1:016x}-01" for n in range(tracing.MAX_BATCH_LINKS + 50)]
    refs = [JobRef("photo.process", f"p{n}", 1, tp, None) for n, tp in enumerate(contexts)]
    refs += [JobRef("photo.process", "same", 1, contexts[0], None)]  # a context seen already
    flags = contexts[1][:-2] + "00"  # the same context unsampled: still that context
    refs += [JobRef("photo.process", "flags", 1, flags, "k=v")]
    refs += [JobRef("photo.process", "bad", 1, "00-zz", None)]  # never stored so: ignored
    with tracing.publishing(refs):
        pass
    (span,) = local_spans(exporter)
    assert span["attributes"]["messaging.batch.message_count"] == len(refs)
    links = [f"00-{t}-{s}-01" for t, s in _links(span)]
    assert links == contexts[: tracing.MAX_BATCH_LINKS]


@pytest.mark.parametrize(
    ("tracestate", "kept"),
    [
        ("vendor=abc,other@tenant=x y", True),
        (" a=1 ,, b=2\t", True),
        ("BAD MEMBER INJECTED", False),  # no `=`
        ("a=1,a=2", False),  # a key twice
        (",".join(f"k{n}=v" for n in range(33)), False),  # 33 members
        ("a=trailing ", True),  # optional whitespace around a member
        ("a=x=y", False),
        ("Upper=1", False),
    ],
)
def test_a_stored_tracestate_is_kept_only_in_the_w3c_form(
    tracestate: str, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """One the API would refuse (with a warning, at every job) is dropped quietly instead."""
    from reactor import tracing

    traceparent = f"00-{1:032x}-{1:016x}-01"
    assert tracing.stored_context(traceparent, tracestate) == (
        traceparent,
        tracestate if kept else None,
    )
    # As the claim hands rows on (`stored_context`), then to a batch span.
    ref = JobRef("photo.process", "p", 1, *tracing.stored_context(traceparent, tracestate))
    with caplog.at_level("WARNING"), tracing.publishing([ref]):
        pass
    assert not caplog.records, caplog.text


def test_an_unknown_trace_relationship_stops_the_worker_with_one_line(env: Env) -> None:
    result = run_cli(env, "worker", "--burst", extra_env={"REACTOR_TRACE_RELATIONSHIP": "sideways"})
    out = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, out
    assert "REACTOR_TRACE_RELATIONSHIP must be one of link, child, none" in out, out
    assert "Traceback" not in out


def test_without_opentelemetry_importable_nothing_needs_it(env: Env) -> None:
    """As without the `otel` extra: submitting, dispatching and a job's run (JSON logs on)
    work, and none of those processes loads an OpenTelemetry module."""
    program = (sys.executable, str(ROOT / "tests" / "support" / "no_otel.py"))
    steps = [
        ["submit", "no-otel"],
        ["--log-format", "json", "sweep"],
        ["--log-format", "json", "worker", "--simple", "--burst"],
    ]
    for args in steps:
        result = run_cli(env, *args, program=program)
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip().splitlines()[-1] == "otel_modules=[]", result.stderr
    assert _states(env.connect()) == {"no-otel": ("done", 1)}
    # The probe sees OpenTelemetry when it is there (the extra is installed here).
    probe = "import sys, reactor, reactor.worker; print(sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert "opentelemetry.trace" in loaded.stdout


def test_a_skipped_attempt_says_why(env: Env, tmp_path: Path) -> None:
    """A job whose row is finished already runs no handler; its `process` span says why."""
    from reactor.routes import parse_routes
    from reactor.rq.enqueue import Enqueuer

    routes = parse_routes([ROUTE])
    owner = env.connect()
    owner.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts) VALUES"
        " ('finished', 'photo.process', 'done', 1)"
    )
    Enqueuer(env.redis(), routes).enqueue([JobRef("photo.process", "finished", 1)])
    args = [*WORKERS["simple"], "--burst"]
    worker = start_exporting(args, env.process_env(REACTOR_ROUTES=ROUTE), tmp_path, "worker")
    assert worker.proc.wait(timeout=60) == 0, worker.log()
    assert worker.stop() == 0
    (span,) = [s for s in worker.spans() if s["name"] == "process photo.process"]
    assert span["attributes"]["photo_jobs.outcome"] == "skipped"
    assert span["attributes"]["photo_jobs.skipped_reason"] == "superseded or finished"
    assert not [s for s in worker.spans() if s["name"] == "handler work"]
