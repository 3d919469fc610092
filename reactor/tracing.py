"""OpenTelemetry spans of a photo's way: submitted, published to RQ, processed.

Optional: with `opentelemetry-api` installed (the `photo-reactor[otel]` extra) the producer,
the reactor and the workers make spans through the global tracer provider (an SDK configured
by `opentelemetry-instrument`, or by the application); without it nothing imports
OpenTelemetry and every function here is a no-op; with the API but no SDK, the API's no-ops.

The trace context travels with the row, in W3C form (`traceparent`, `tracestate`), whatever
propagators the process configured: `submit()` stores the context of its PRODUCER span
`send {type}` in the row; the reactor's claim-and-enqueue of a batch is one PRODUCER span
`publish {type}` that links to each row's stored context (distinct contexts, at most
`MAX_BATCH_LINKS`); the RQ job carries the row's context in `job.meta`; the worker's CONSUMER
span `process {type}` links to it (`link`), is its child (`child`) or neither (`none`). Names
and attributes follow the OpenTelemetry messaging semantic conventions.

A stored context is a producer's input: `stored_context` keeps it only when it has the W3C
form within the columns' bounds, and everything that reads it here gives up quietly on a
malformed one (no link, no parent); nothing a row holds can fail a dispatch or a job.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import re
import struct
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

from reactor.jobs import JobRef

logger = logging.getLogger(__name__)

try:
    from opentelemetry import trace
    from opentelemetry._logs import get_logger_provider
    from opentelemetry.context import Context
    from opentelemetry.metrics import get_meter_provider
    from opentelemetry.trace import Link, SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: every function is a no-op
    ENABLED = False
else:
    ENABLED = True
    _W3C = TraceContextTextMapPropagator()
    # A proxy until a provider is set (by `opentelemetry-instrument` or the application),
    # then that provider's tracer: one for the process, not one per span.
    _TRACER = trace.get_tracer("reactor")

__all__ = [
    "ENABLED",
    "MAX_BATCH_LINKS",
    "Processing",
    "current_ids",
    "exports_held",
    "flush",
    "own_connections",
    "processing",
    "publishing",
    "stored_context",
    "submitting",
]

#: Links of one batch span at most (the SDK's default span link limit): the rows of a batch
#: beyond it, with contexts of their own, are counted but not linked.
MAX_BATCH_LINKS = 128
#: The columns' bounds (sql/): longer values are never stored.
MAX_TRACESTATE_CHARS = 512
#: How long a forked work horse waits for its spans to leave before it exits without them,
#: and how long a fork waits, in all, for exports in progress to end: a slow collector costs
#: spans, not jobs.
EXPORT_WAIT_SECONDS = 1.0
#: Once a wait reached its bound, for this long forks do not wait and horses drop their spans
#: without trying (a collector down or hung would otherwise cost every job both waits).
EXPORT_STALL_SECONDS = 30.0
_SYSTEM = "photo-reactor"
#: The walk for exporters' HTTP sessions: levels below the providers, objects at most.
_WALK_DEPTH, _WALK_LIMIT = 12, 5000
_NOT_WALKED = (type(None), type, ModuleType, str, bytes, int, float, bool)
#: In a work horse: the connection pools it inherited, kept unused (`own_connections`).
_INHERITED_POOLS: list[Any] = []
#: The providers' ids, and the HTTP sessions their exporters hold (`_sessions`).
_SESSIONS: tuple[tuple[int, ...], list[Any]] | None = None
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
# A W3C tracestate list member, `key=value` (the Trace Context grammar).
_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_NO_CONTEXT: dict[str, str | None] = {"traceparent": None, "tracestate": None}
#: Until when (CLOCK_MONOTONIC, the same in every process) exports are taken as stalled: in
#: memory shared with the horses forked after it is made, so a horse's finding reaches them.
_STALLED_UNTIL = mmap.mmap(-1, 8)


def stored_context(traceparent: object, tracestate: object) -> tuple[str | None, str | None]:
    """The (traceparent, tracestate) of a row or a job as carried on: both None unless the
    traceparent has the W3C form; the tracestate None unless it is bounded and has the W3C
    form too (which the API would otherwise refuse with a warning, once a job)."""
    if not isinstance(traceparent, str) or not _TRACEPARENT.fullmatch(traceparent):
        return None, None
    if not isinstance(tracestate, str) or len(tracestate) > MAX_TRACESTATE_CHARS:
        return traceparent, None
    members = [m.strip(" \t") for m in tracestate.split(",") if m.strip(" \t")]
    keys = {m.partition("=")[0] for m in members}
    if len(members) > 32 or len(keys) < len(members):
        return traceparent, None
    if not all(_MEMBER.fullmatch(member) for member in members):
        return traceparent, None
    return traceparent, tracestate


def _span_context(traceparent: str | None, tracestate: str | None) -> Any:
    """The valid remote span context of a carried context, or None."""
    if traceparent is None:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    try:
        found = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
    except Exception:  # a tracestate the API refuses: no link rather than a failed job
        return None
    return found if found.is_valid else None


def _messaging(operation: str, kind: str, destination: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": _SYSTEM,
        "messaging.operation.name": operation,
        "messaging.operation.type": kind,
    }
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    return attributes


def _error_type(text: str | None) -> str:
    """`error.type` of an error text `Type: message` (`lifecycle.error_text`)."""
    head = (text or "").partition(":")[0]
    return head if head.isidentifier() else "_OTHER"


@contextlib.contextmanager
def submitting(job_type: str, photo_ids: Sequence[str]) -> Iterator[dict[str, str | None]]:
    """A PRODUCER span `send {job_type}` around the INSERT of `photo_ids`; yields the
    `traceparent`/`tracestate` parameters to store (None: no valid context)."""
    if not ENABLED:
        yield _NO_CONTEXT
        return
    attributes = _messaging("send", "send", job_type)
    attributes["photo_jobs.type"] = job_type
    if len(photo_ids) == 1:
        attributes["photo_jobs.photo_id"] = photo_ids[0]
    else:
        attributes["messaging.batch.message_count"] = len(photo_ids)
    with _TRACER.start_as_current_span(
        f"send {job_type}", kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        carrier: dict[str, str] = {}
        _W3C.inject(carrier)  # the context of this span: nothing when it is not valid
        traceparent, tracestate = stored_context(
            carrier.get("traceparent"), carrier.get("tracestate")
        )
        try:
            yield {"traceparent": traceparent, "tracestate": tracestate}
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__qualname__)
            raise


@contextlib.contextmanager
def publishing(refs: Sequence[JobRef]) -> Iterator[None]:
    """A PRODUCER span `publish {type}` around the enqueue and COMMIT of one claimed batch,
    linked to the distinct stored contexts of its rows (the first `MAX_BATCH_LINKS`)."""
    if not ENABLED or not refs:
        yield
        return
    links = []
    seen: set[str] = set()
    for ref in refs:
        # One link per context (trace and span ids), whatever flags or tracestate rows add.
        if ref.traceparent is None or ref.traceparent[3:52] in seen:
            continue
        seen.add(ref.traceparent[3:52])
        found = _span_context(ref.traceparent, ref.tracestate)
        if found is not None:
            links.append(Link(found))
            if len(links) == MAX_BATCH_LINKS:
                break
    types = {ref.type for ref in refs}
    destination = next(iter(types)) if len(types) == 1 else None
    attributes = _messaging("publish", "send", destination)
    attributes["messaging.batch.message_count"] = len(refs)
    name = "publish" if destination is None else f"publish {destination}"
    with _TRACER.start_as_current_span(
        name, kind=SpanKind.PRODUCER, links=links, attributes=attributes
    ) as span:
        try:
            yield
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__qualname__)
            raise


class Processing:
    """What a worker tells its `process` span about one attempt (a no-op without tracing)."""

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def started(self, attempt: int) -> None:
        if self._span is not None:
            self._span.set_attribute("photo_jobs.attempt", attempt)

    def ended(self, kind: str, error: str | None, retried: bool) -> None:
        """The handler's outcome: `ok`, `error` (retried or not) or `permanent`."""
        span = self._span
        if span is None:
            return
        if kind == "ok":
            span.set_attribute("photo_jobs.outcome", "done")
            return
        span.set_attributes(
            {
                "photo_jobs.outcome": "failed",
                "error.type": _error_type(error),
                "photo_jobs.retried": retried,
            }
        )
        span.set_status(StatusCode.ERROR, (error or "")[:200])

    def superseded(self) -> None:
        """The outcome's write changed nothing: the attempt was superseded while it ran."""
        if self._span is not None:
            self._span.set_attribute("photo_jobs.superseded", True)

    def skipped(self, why: str) -> None:
        """The attempt did not run: `why` says so (superseded or finished; unstarted)."""
        if self._span is not None:
            self._span.set_attributes(
                {"photo_jobs.outcome": "skipped", "photo_jobs.skipped_reason": why}
            )


@contextlib.contextmanager
def processing(ref: JobRef, meta: Mapping[str, Any], relationship: str) -> Iterator[Processing]:
    """The CONSUMER span `process {type}` of one job, current while it runs, related to the
    context its `job.meta` carries as `relationship` says (`link`, `child`, `none`)."""
    if not ENABLED:
        yield Processing()
        return
    remote = None
    if relationship != "none" and isinstance(meta, Mapping):  # from Redis: anything at all
        remote = _span_context(*stored_context(meta.get("traceparent"), meta.get("tracestate")))
    parent = Context()  # a new trace unless `child`: a worker has no ambient request
    links = []
    if remote is not None and relationship == "child":
        parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    elif remote is not None:
        links.append(Link(remote))
    attributes = _messaging("process", "process", ref.type)
    attributes.update(
        {
            "messaging.message.id": ref.job_id,
            "photo_jobs.photo_id": ref.photo_id,
            "photo_jobs.type": ref.type,
            "photo_jobs.token": ref.token,
        }
    )
    with _TRACER.start_as_current_span(
        f"process {ref.type}",
        context=parent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes=attributes,
        # The outcome says how the attempt ended; the handler's exception goes on to RQ.
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield Processing(span)


def flush() -> None:
    """Export the spans this process ended so far (a forked work horse, before it exits),
    waiting at most `EXPORT_WAIT_SECONDS`: an exporter that the fork left unusable (a lock
    another thread of the parent held) costs this job's spans, never the job or the worker."""
    if not ENABLED:
        return
    force_flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if force_flush is None or _stalled():  # the API's no-op provider, or exports stalled
        return
    flushed = threading.Event()

    def run() -> None:
        try:
            force_flush()
        finally:
            flushed.set()

    threading.Thread(target=run, name="reactor-span-flush", daemon=True).start()
    if not flushed.wait(EXPORT_WAIT_SECONDS):
        _stall(f"spans_not_flushed within={EXPORT_WAIT_SECONDS:g}s: its spans are dropped")


def _stalled() -> bool:
    return bool(time.monotonic() < struct.unpack_from("d", _STALLED_UNTIL)[0])


def _stall(what: str) -> None:
    """A wait for an export reached its bound: log it, and stop waiting for a while."""
    struct.pack_into("d", _STALLED_UNTIL, 0, time.monotonic() + EXPORT_STALL_SECONDS)
    logger.warning(
        "%s (the collector is slow or down: for %gs forks do not wait for exports and work "
        "horses drop their spans)",
        what,
        EXPORT_STALL_SECONDS,
    )


def own_connections() -> None:
    """In a forked work horse, before anything in it exports: give the exporters' HTTP
    sessions connection pools of the horse's own.

    OTLP over HTTP keeps its connection to the collector alive, and a horse inherits it: the
    worker's exports and the horse's then share one connection, and requests sent at once
    reach the collector mixed into one it cannot decode, or have their answers read by the
    other process (spans lost, or sent twice). Each of requests' HTTP adapters of the
    sessions the providers' exporters hold (spans, logs, metrics) gets a new pool manager, made
    by the adapter itself (so a subclass's settings hold). The inherited pools are kept,
    unused, until the horse exits: dropping one would run its finalizer, which takes a lock
    the fork may have copied held. Never raises: an exporter this cannot handle costs a
    warning, and its exports may share the worker's connection."""
    adapters = sys.modules.get("requests.adapters")
    if adapters is None:  # no exporter of this process sends over requests
        return
    try:
        for session in _sessions():
            for adapter in session.adapters.values():
                if isinstance(adapter, adapters.HTTPAdapter):
                    _INHERITED_POOLS.append((adapter.poolmanager, adapter.proxy_manager))
                    adapter.proxy_manager = {}
                    adapter.init_poolmanager(
                        adapter._pool_connections, adapter._pool_maxsize, block=adapter._pool_block
                    )
    except Exception as exc:
        logger.warning("span_connections_shared error=%r (this horse exports on the worker's)", exc)


@contextlib.contextmanager
def exports_held() -> Iterator[None]:
    """Around a fork: no batch processor of this process's spans or logs is exporting.

    A thread exporting at the instant of a fork leaves the child a copy of the exporter's
    locks (a file's, a connection pool's) that no thread will release, and the child waits
    forever on the first: its own export of its spans, or a log line to the stream a console
    exporter writes to. Each of the SDK's batch processors (opentelemetry-sdk 1.34 and later)
    exports under one lock, held here across the fork; the SDK gives the child a fresh one.
    Exports still running after `EXPORT_WAIT_SECONDS` are not waited for: the child's bounded
    `flush` covers its spans. The exporters' HTTP sessions are found here, before the fork, so
    that `own_connections` in the horse does not look for them again.
    """
    _sessions()
    deadline = time.monotonic() + (0.0 if _stalled() else EXPORT_WAIT_SECONDS)
    with contextlib.ExitStack() as held:
        for lock in _export_locks():
            if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                held.callback(lock.release)
            elif not _stalled():
                _stall(f"span_export_in_progress at a fork for {EXPORT_WAIT_SECONDS:g}s")
        yield


def _export_locks() -> list[Any]:
    """The export lock of each batch processor of the global tracer and logger providers
    (none for other processors, other SDKs or no SDK)."""
    if not ENABLED:
        return []
    spans = getattr(trace.get_tracer_provider(), "_active_span_processor", None)
    logs = getattr(get_logger_provider(), "_multi_log_record_processor", None)
    processors = [
        *getattr(spans, "_span_processors", ()),
        *getattr(logs, "_log_record_processors", ()),
    ]
    locks = []
    for processor in processors:
        lock = getattr(getattr(processor, "_batch_processor", None), "_export_lock", None)
        if lock is not None:
            locks.append(lock)
    return locks


def _sessions() -> list[Any]:
    """The `requests` sessions of the global providers' exporters: found once for a set of
    providers (a walk of a few hundred objects) and kept, so that forked horses inherit them."""
    global _SESSIONS
    if not ENABLED or sys.modules.get("requests") is None:
        return []
    providers = [trace.get_tracer_provider(), get_logger_provider(), get_meter_provider()]
    key = tuple(id(provider) for provider in providers)
    if _SESSIONS is None or _SESSIONS[0] != key:
        _SESSIONS = (key, _http_sessions(providers))
    return _SESSIONS[1]


def _http_sessions(providers: Sequence[Any]) -> list[Any]:
    """The `requests` sessions reachable from `providers` (OTLP over HTTP holds one in its
    exporter, or in the exporter's client's transport, depending on the version; a wrapped
    exporter one level further down), found by a walk of their attributes and containers,
    bounded in depth and size."""
    requests = sys.modules["requests"]
    found: list[Any] = []
    seen: set[int] = set()
    level: list[Any] = list(providers)
    for _ in range(_WALK_DEPTH):
        below: list[Any] = []
        for item in level:
            if id(item) in seen or isinstance(item, _NOT_WALKED) or len(seen) >= _WALK_LIMIT:
                continue
            seen.add(id(item))
            if isinstance(item, requests.Session):
                found.append(item)
            elif isinstance(item, (list, tuple, set, frozenset)):
                below += item
            elif isinstance(item, dict):
                below += item.values()
            else:
                below += getattr(item, "__dict__", {}).values()
        level = below
    return found


def current_ids() -> tuple[str, str] | None:
    """The (trace_id, span_id) of the current span in hex, or None (no valid span)."""
    if not ENABLED:
        return None
    found = trace.get_current_span().get_span_context()
    if not found.is_valid:
        return None
    return format(found.trace_id, "032x"), format(found.span_id, "016x")
