"""The test kit's work: list the submitted rows, and run the due ones through the worker's own
lifecycle on the caller's connection, in its transaction, with no Redis and no reactor.

`run_jobs` claims with the reactor's claim statement (`CLAIM_DUE`), then runs each claimed row
as a worker would: `reactor.worker.lifecycle.start` (the fenced start), the handler, and
`lifecycle.finish` (done; a retry after the lifecycle's backoff; failed on a `PermanentError`
or when attempts are spent). Only the delivery differs: the job is not enqueued in RQ, it is
run at once in this process. The statements run through `reactor.producer`'s executors, so the
kit takes exactly the connections `submit()` takes. Nothing here commits: the caller's
transaction decides what stays.

Each handler call runs in a savepoint of that transaction, so a handler that raises (a failed
statement on the caller's connection included) leaves its own writes undone and the
transaction usable: its exception is the attempt's outcome, never the test's. A handler named
by a dotted path is imported on each `run`, not through the worker's per-process cache, so
what a test patches at that path is what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Literal

from reactor.errors import ConfigError
from reactor.jobs import JobRef
from reactor.pg import queries
from reactor.producer import Executed, SyncExecute
from reactor.routes import given_routes
from reactor.settings import WorkerSettings
from reactor.tracing import stored_context
from reactor.worker.entry import call_handler, check_plain, import_handler
from reactor.worker.lifecycle import Outcome, Store, finish, outcome_of, start

__all__ = [
    "JobResult",
    "Submitted",
    "advance",
    "check_absent",
    "check_expected",
    "run",
    "submitted",
]

Handler = Callable[[str], object]
#: Opens a savepoint in the caller's transaction; leaving it with an exception rolls it back.
Savepoint = Callable[[], AbstractContextManager[object]]
#: Rows claimed per round: a bound on what one claim holds locked before its handlers run.
CLAIM_BATCH = 100


@dataclass(frozen=True)
class Submitted:
    """A row of `photo_jobs` as the caller's transaction sees it; `run_at` is when it is due."""

    photo_id: str
    type: str
    state: str
    attempts: int
    max_attempts: int
    run_at: datetime
    due: bool
    last_error: str | None


@dataclass(frozen=True)
class JobResult:
    """How one attempt that `run_jobs` ran ended: `done`, `retry` (pending again after the
    backoff), `failed` (a `PermanentError`, or its attempts spent; at attempt 0, spent before
    dispatch), `skipped` (the fenced start refused it), or `superseded` (the row moved on
    while the handler ran, e.g. the handler cancelled it: its outcome was not written, and
    `error` is the handler's, if it raised); `attempt` is its number in the row's current
    life."""

    photo_id: str
    type: str
    outcome: Literal["done", "retry", "failed", "skipped", "superseded"]
    attempt: int
    error: str | None = None


class CallerStore(Store):
    """The caller's connection as the lifecycle's `Store`: each statement runs once, in the
    caller's transaction (no reconnect and no retry: the connection is not ours)."""

    def __init__(self, execute: SyncExecute) -> None:
        super().__init__("")
        self._run = execute

    @property
    def conn(self) -> Any:
        raise RuntimeError("the test kit runs statements on the caller's connection only")

    def close(self) -> None:
        pass

    def execute_once(
        self, query: str, params: dict[str, Any]
    ) -> tuple[int, tuple[Any, ...] | None]:
        count, rows = self._run(query, params)
        return count, rows[0] if rows else None

    def execute(self, query: str, params: dict[str, Any]) -> tuple[int, tuple[Any, ...] | None]:
        return self.execute_once(query, params)


def submitted(rows: Executed) -> list[Submitted]:
    """`KIT_SUBMITTED`'s rows as `Submitted`."""
    return [Submitted(*row) for row in rows[1]]


def _known_fields(caller: str, given: Mapping[str, Any]) -> None:
    known = {f.name for f in fields(Submitted)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"{caller}: unknown fields {unknown}; known: {sorted(known)}")


def _differ(row: Submitted, wanted: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields of `row` that differ from `wanted`: (got, wanted) by name; the one matching
    rule of `assert_submitted` and `assert_not_submitted`."""
    return {k: (getattr(row, k), v) for k, v in wanted.items() if getattr(row, k) != v}


def _listing(rows: list[Submitted]) -> str:
    return "\n".join(f"  {r}" for r in rows) or "  (nothing)"


def check_expected(
    rows: list[Submitted], photo_id: str, job_type: str, expected: Mapping[str, Any]
) -> Submitted:
    """The row of `photo_id` and `job_type`, checked against `expected` (field: value).

    Raises:
        TypeError: `expected` names a field `Submitted` does not have.
        AssertionError: no such row, or a field differs; the message lists what was
            submitted.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not the kit's
    _known_fields("assert_submitted", expected)
    key = {"photo_id": photo_id, "type": job_type}
    found = next((r for r in rows if not _differ(r, key)), None)
    if found is None:
        raise AssertionError(
            f"no {job_type} job for photo {photo_id!r}; submitted:\n{_listing(rows)}"
        )
    differ = _differ(found, expected)
    if differ:
        said = ", ".join(f"{k}={got!r} (expected {want!r})" for k, (got, want) in differ.items())
        raise AssertionError(
            f"{job_type} job for photo {photo_id!r}: {said}; submitted:\n{_listing(rows)}"
        )
    return found


def check_absent(rows: list[Submitted], wanted: Mapping[str, Any]) -> None:
    """That no row matches `wanted` (field: value; none given: no row at all).

    Raises:
        TypeError: `wanted` names a field `Submitted` does not have.
        AssertionError: rows match; the message lists them.
    """
    __tracebackhide__ = True
    _known_fields("assert_not_submitted", wanted)
    found = [r for r in rows if not _differ(r, wanted)]
    if found:
        said = ", ".join(f"{k}={v!r}" for k, v in wanted.items()) or "anything"
        raise AssertionError(
            f"expected no job matching {said}; {len(found)} submitted:\n{_listing(found)}"
        )


def advance(execute: SyncExecute, seconds: float, job_type: str | None) -> int:
    """Bring the pending rows' due times `seconds` closer; how many rows moved."""
    if seconds < 0:
        raise ValueError("advance: seconds must be 0 or more")
    return execute(queries.KIT_ADVANCE, {"seconds": float(seconds), "type": job_type})[0]


def _handlers(
    handlers: Mapping[str, Handler | str] | None, types: Iterable[str] | None
) -> dict[str, Handler]:
    if handlers is None:
        handlers = {t: route.handler for t, route in given_routes().items()}
        if not handlers:
            raise ConfigError(
                "run_jobs: give handlers= (type -> callable or dotted path) or set REACTOR_ROUTES"
            )
    chosen = list(handlers) if types is None else list(dict.fromkeys(types))
    missing = [t for t in chosen if t not in handlers]
    if missing:
        raise ValueError(f"run_jobs: no handler for types {missing}")
    funcs: dict[str, Handler] = {}
    for job_type in chosen:
        given = handlers[job_type]
        if isinstance(given, str):
            funcs[job_type] = import_handler(given)
        else:
            check_plain(given, f"run_jobs: the handler of {job_type!r}")
            funcs[job_type] = given
    return funcs


def run(
    execute: SyncExecute,
    savepoint: Savepoint,
    handlers: Mapping[str, Handler | str] | None = None,
    types: Iterable[str] | None = None,
    limit: int | None = None,
) -> list[JobResult]:
    """Run the due rows of the handled types, in rounds until none is due (or `limit` rows
    ran): rows a handler submits run in the same call when they are due. Each handler call
    runs in a `savepoint()` of the connection `execute` runs on."""
    funcs = _handlers(handlers, types)
    settings = WorkerSettings.from_env()
    store = CallerStore(execute)
    results: list[JobResult] = []
    progress = True
    while progress and (limit is None or len(results) < limit):
        progress = False
        for job_type, func in funcs.items():
            room = CLAIM_BATCH if limit is None else min(CLAIM_BATCH, limit - len(results))
            if room <= 0:
                break
            params = {"type": job_type, "limit": room, "skip": [], "window": None}
            _, claimed = execute(queries.CLAIM_DUE, params)
            progress = progress or bool(claimed)
            for row_type, photo_id, token, state, traceparent, tracestate in claimed:
                context = stored_context(traceparent, tracestate)
                ref = JobRef(row_type, photo_id, int(token), *context)
                if state == "failed":  # spent before dispatch: the claim failed it
                    results.append(
                        JobResult(photo_id, row_type, "failed", 0, "attempts spent before dispatch")
                    )
                    continue
                results.append(_attempt(store, settings, ref, func, savepoint))
    return results


def _attempt(
    store: Store, settings: WorkerSettings, ref: JobRef, func: Handler, savepoint: Savepoint
) -> JobResult:
    started = start(store, settings, ref)
    if started is None:
        return JobResult(ref.photo_id, ref.type, "skipped", 0)
    try:
        # A failed statement aborts the whole transaction; rolled back to the savepoint, only
        # the handler's own work is lost and `finish` can still write the outcome.
        with savepoint():
            call_handler(func, ref.photo_id)
    except Exception as exc:
        outcome = outcome_of(exc)
    else:
        outcome = Outcome("ok")
    if not finish(store, settings, ref, started, outcome):
        # The outcome was fenced off (cancelled or re-dispatched meanwhile): nothing written.
        return JobResult(ref.photo_id, ref.type, "superseded", started.attempt, outcome.error)
    if outcome.kind == "ok":
        return JobResult(ref.photo_id, ref.type, "done", started.attempt)
    final = outcome.kind == "permanent" or started.last
    kind: Literal["retry", "failed"] = "failed" if final else "retry"
    return JobResult(ref.photo_id, ref.type, kind, started.attempt, outcome.error)
