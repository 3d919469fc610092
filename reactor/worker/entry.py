"""The RQ entry point every dispatched job runs: `perform(job_type, photo_id, token, *, handler)`.

It runs one attempt of one row under the fenced lifecycle of `reactor.worker.lifecycle`, in one of
two ways:

- In a plain `rq worker` (no `-w`), the job runs the whole lifecycle itself: fenced start,
  heartbeat thread, outcome, on one Postgres connection per process (a forked work horse opens
  its own; it never touches one inherited through the fork). Its own routes, the only
  handlers it runs (`reactor.worker.own_routes`), are `REACTOR_ROUTES`, else the routes the reactors
  recorded (read by each forked horse), inside `REACTOR_HANDLER_PREFIXES`.
- In a worker of the project's classes (`reactor.Worker`, `reactor.SimpleWorker`), the worker
  process did the fenced start and imported the handler before the fork, and handed the
  attempt over (`hand_over`). The job then only calls the handler and reports how it ended
  (`Handoff.report`: through a pipe from a forked horse, in memory in-process); the worker
  process heartbeats and writes the outcome.

Both paths obey the same fence, so both kinds of worker may serve one queue. The exception a
handler raised propagates after the outcome is known, so RQ shows the job in its failed
registry; on the plain path its text is re-raised with passwords masked when it held one (the
worker classes mask RQ's stored traceback instead). Handlers run at least once per attempt
and may run again after a worker dies mid-job: they must be idempotent.

Traced (`reactor.tracing`): on the plain path the job makes its CONSUMER span `process {type}`
itself; under the worker classes the worker process makes it before the fork, so the handler's
spans are its children. A forked horse exports its spans before it leaves.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn

from rq import get_current_job

from reactor import tracing
from reactor.errors import PermanentError
from reactor.jobs import JobRef
from reactor.pg.registry import routes_in_use
from reactor.redact import redact
from reactor.routes import given_routes, handler_allowed
from reactor.settings import WorkerSettings
from reactor.validate import message_of
from reactor.worker.lifecycle import (
    Heartbeater,
    Outcome,
    Store,
    backoff_seconds,
    describe,
    error_text,
    finish,
    start,
)
from reactor.worker.own_routes import HandlerRefusedError, OwnRoutes

__all__ = [
    "HandlerError",
    "HandlerImportError",
    "Handoff",
    "backoff_seconds",
    "call_handler",
    "check_plain",
    "decode_outcome",
    "hand_over",
    "import_handler",
    "load_handler",
    "perform",
]

logger = logging.getLogger(__name__)

Handler = Callable[[str], object]


class HandlerImportError(Exception):
    """The handler named in a route or a job cannot be imported (a failed attempt, retried)."""


class HandlerError(Exception):
    """A handler's exception re-raised with its text redacted (it held a password)."""


_handlers: dict[tuple[str, tuple[str, ...]], Handler | HandlerImportError] = {}


def import_handler(path: str, prefixes: tuple[str, ...] = ()) -> Handler:
    """Import the handler at dotted `path` (`pkg.module.func`) now (a module already imported
    is not run again). Given an allow-list, the object found must also be defined inside it:
    a module inside it may import anything (`from os import system`), and the path alone
    would let a route name that.

    Raises:
        HandlerImportError: "cannot import handler PATH: CAUSE".
    """
    module_name, _, attribute = path.rpartition(".")
    try:
        if not module_name:
            raise ValueError("not a dotted path")
        found = getattr(importlib.import_module(module_name), attribute)
        check_plain(found, attribute)
        defined = getattr(found, "__module__", None)
        if prefixes and not (
            isinstance(defined, str) and handler_allowed(f"{defined}.{attribute}", prefixes)
        ):
            raise TypeError(
                f"{attribute} is defined in {defined}, outside the allowed handler prefixes"
                f" ({','.join(prefixes)})"
            )
    except Exception as exc:
        cause = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise HandlerImportError(redact(f"cannot import handler {path}: {cause}")) from exc
    handler: Handler = found
    return handler


def check_plain(found: object, name: str) -> None:
    """Refuse what cannot be a handler: not callable, or an `async def` (nothing here awaits
    a coroutine, so its work would never run while the attempt was counted done).

    Raises:
        TypeError: "NAME is not callable" or "NAME is an async def: ...".
    """
    if not callable(found):
        raise TypeError(f"{name} is not callable")
    if inspect.iscoroutinefunction(found) or inspect.isasyncgenfunction(found):
        raise TypeError(f"{name} is an async def: handlers are plain functions")


def call_handler(func: Handler, photo_id: str) -> None:
    """Call `func(photo_id)`. An awaitable it returns (an async callable `check_plain` could
    not see) is closed unrun, and the attempt fails for good: a retry would do the same.

    Raises:
        PermanentError: the handler returned an awaitable.
    """
    pid = os.getpid()
    try:
        result = func(photo_id)
    except BaseException as exc:
        _leave_if_forked(pid, exc)
        raise
    _leave_if_forked(pid, None)
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise PermanentError(
            f"the handler returned a {type(result).__name__} that nothing awaits:"
            " handlers are plain functions"
        )


def _leave_if_forked(pid: int, exc: BaseException | None) -> None:
    """End a process the handler forked that came back here (its child returned or called
    `sys.exit`) with the status it meant: it must never report an outcome or go back to RQ's
    loop, where it would run as a second worker on the parent's sockets."""
    if os.getpid() == pid:
        return
    code = 0 if exc is None else 1
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def load_handler(path: str, prefixes: tuple[str, ...] = ()) -> Handler:
    """`import_handler`, once per process.

    A failure is remembered too: importing a broken module again could half-run it again;
    a fixed deploy restarts the worker anyway.

    Raises:
        HandlerImportError: "cannot import handler PATH: CAUSE".
    """
    found = _handlers.get((path, prefixes))
    if found is None:
        try:
            found = import_handler(path, prefixes)
        except HandlerImportError as exc:
            found = exc
        _handlers[path, prefixes] = found
    if isinstance(found, HandlerImportError):
        raise found
    return found


@dataclass
class Handoff:
    """One attempt whose lifecycle the worker process runs; the job only runs the handler.

    `action`: `starting` (the fenced start is in flight: `wait()` settles it), `run` (the
    fenced start succeeded; `handler` is imported, or `failure` says why it cannot be, which
    is the attempt's error), `skip` (superseded or finished: do nothing), `unstarted` (the
    start could not reach Postgres: `failure` is raised, nothing is reported, the row is left
    to the stale rescue).
    """

    ref: JobRef
    action: Literal["starting", "run", "skip", "unstarted"]
    handler: Handler | None = None
    failure: Exception | None = None
    #: Write end of the worker process's pipe (forking workers); None in-process.
    report_fd: int | None = None
    outcome: Outcome | None = None
    #: Settles a `starting` handoff (waits for the fenced start); set by the worker process.
    settle: Callable[[], None] | None = None
    #: Called with the outcome as soon as it is known (in-process workers only).
    on_report: Callable[[Outcome], None] | None = None

    def wait(self) -> None:
        """Wait until the fenced start has settled `action`."""
        settle, self.settle = self.settle, None
        if settle is not None:
            settle()

    def report(self, outcome: Outcome) -> None:
        """Tell the worker process how the handler ended (once)."""
        self.outcome = outcome
        if self.on_report is not None:
            self.on_report(outcome)
        if self.report_fd is not None:
            # One write well under the pipe's buffer: the horse never blocks on it.
            os.write(self.report_fd, json.dumps([outcome.kind, outcome.error]).encode())


def decode_outcome(data: bytes) -> Outcome | None:
    """The outcome a forked horse wrote with `Handoff.report`; None if it wrote none (or
    died mid-write)."""
    try:
        kind, error = json.loads(data.decode())
    except ValueError:
        return None
    if kind not in ("ok", "error", "permanent"):
        return None
    return Outcome(kind, error)


_handoff: Handoff | None = None


def hand_over(handoff: Handoff | None) -> None:
    """Set (or clear) the attempt the worker process runs the lifecycle of (before the fork)."""
    global _handoff
    _handoff = handoff


def perform(job_type: str, photo_id: str, token: int, *, handler: str) -> str:
    """Run `handler(photo_id)` for one attempt (`token`) of one row, under the fenced
    lifecycle.

    Returns:
        "done" when the handler succeeded (in a plain worker: and the row is done), or
        "skipped" when the attempt was not (or no longer) the row's.

    Raises:
        Exception: whatever the handler raised (after the outcome was recorded or reported).
    """
    handoff = _handoff
    ref = JobRef(job_type, photo_id, token)
    if handoff is not None and handoff.ref == ref:
        # A forked horse exports the handler's spans after RQ's part (`Worker.perform_job`).
        return _run_handed_over(handoff, photo_id)
    return _run_lifecycle(ref, handler)


def _run_handed_over(handoff: Handoff, photo_id: str) -> str:
    handoff.wait()
    if handoff.action == "skip":
        return "skipped"
    if handoff.action == "unstarted":
        assert handoff.failure is not None
        raise handoff.failure
    try:
        if handoff.handler is None:
            assert handoff.failure is not None
            raise handoff.failure
        call_handler(handoff.handler, photo_id)
    except PermanentError as exc:
        handoff.report(Outcome("permanent", error_text(exc)))
        raise
    except BaseException as exc:
        # An RQ job timeout, a shutdown: a failed attempt like any other error.
        handoff.report(Outcome("error", error_text(exc)))
        raise
    handoff.report(Outcome("ok"))
    return "done"


_store: Store | None = None
_store_pid = 0


def _process_store(settings: WorkerSettings) -> Store:
    # One connection per process. RQ forks a work horse per job, and a libpq connection must
    # never be shared across a fork, hence the pid check (the parent's copy is left untouched).
    global _store, _store_pid
    if _store is None or _store_pid != os.getpid():
        _store = Store(settings.database_url)
        _store_pid = os.getpid()
    return _store


def _reraise(exc: BaseException) -> NoReturn:
    """Re-raise the handler's exception, as a `HandlerError` with the text masked if it held
    a password (RQ stores and logs the traceback of what the job raised); one that is not an
    `Exception` (SystemExit, KeyboardInterrupt) as it is, for RQ to act on."""
    text = message_of(exc)
    if not isinstance(exc, Exception) or redact(text) == text:
        raise exc
    raise HandlerError(error_text(exc)).with_traceback(exc.__traceback__) from None


_heartbeater: Heartbeater | None = None
_heartbeater_pid = 0


def _process_heartbeater(settings: WorkerSettings, store: Store) -> Heartbeater:
    # One heartbeat thread per process, on the process's store (threads do not survive a
    # fork: a horse starts its own).
    global _heartbeater, _heartbeater_pid
    if _heartbeater is None or _heartbeater_pid != os.getpid():
        _heartbeater = Heartbeater(store, settings.heartbeat_seconds)
        _heartbeater_pid = os.getpid()
    return _heartbeater


_own: OwnRoutes | None = None
_own_pid = 0


def _process_own_routes(settings: WorkerSettings, store: Store) -> OwnRoutes:
    # Kept per process, like the store: an in-process worker reuses it (and reads the
    # recorded routes again only for a job they do not route); a forked horse reads them once.
    global _own, _own_pid
    if _own is None or _own_pid != os.getpid():
        _own = OwnRoutes(
            given_routes() or None, settings.handler_prefixes, lambda: store.run(routes_in_use)
        )
        _own_pid = os.getpid()
    return _own


def _run_lifecycle(ref: JobRef, handler: str) -> str:
    settings = WorkerSettings.from_env()
    job = get_current_job()
    meta = job.meta if job is not None else {}
    try:
        with tracing.processing(ref, meta, settings.trace_relationship) as span:
            return _run_traced(ref, handler, settings, span)
    finally:
        tracing.flush()  # a forked horse leaves with os._exit: export this job's spans


def _run_traced(
    ref: JobRef, handler: str, settings: WorkerSettings, span: tracing.Processing
) -> str:
    store = _process_store(settings)
    started = start(store, settings, ref)
    if started is None:
        span.skipped("superseded or finished")
        return "skipped"
    span.started(started.attempt)
    try:
        # Checked, then imported, inside the fence: a handler this worker does not run, or
        # cannot find, is a failed attempt with a last_error that says so (retried, since a
        # deploy may fix it), never a stuck row. The check comes first: nothing is imported
        # for a job that names a handler other than this worker's route.
        try:
            _process_own_routes(settings, store).check(ref.type, handler)
        except HandlerRefusedError as exc:
            logger.error("handler_refused %s %s", describe(ref), exc)
            raise
        func = load_handler(handler, settings.handler_prefixes)
        beats = _process_heartbeater(settings, store)
        beats.beat_for(ref, written_ago=started.written_ago)
        try:
            call_handler(func, ref.photo_id)
        finally:
            beats.pause()  # returns once no beat is in flight: the outcome write comes next
    except PermanentError as exc:
        span.ended("permanent", error_text(exc), retried=False)
        if not finish(store, settings, ref, started, Outcome("permanent", error_text(exc))):
            span.superseded()
        _reraise(exc)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: a failed attempt
        span.ended("error", error_text(exc), retried=not started.last)
        if not finish(store, settings, ref, started, Outcome("error", error_text(exc))):
            span.superseded()
        _reraise(exc)
    span.ended("ok", None, retried=False)
    if not finish(store, settings, ref, started, Outcome("ok")):
        span.superseded()
        return "skipped"
    return "done"
