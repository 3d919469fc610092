"""RQ worker classes that run the attempt lifecycle in the long-lived worker process.

`reactor.Worker` forks a work horse per job (RQ's default worker); `reactor.SimpleWorker` runs
jobs in-process. Use them as `rq worker -w reactor.Worker QUEUE...`, `rq worker-pool -w
reactor.Worker -n 2 QUEUE...` or `reactor worker [QUEUE...]`.

For a job of `reactor.worker.entry.perform`, the worker process, not the job:
- keeps one autocommit Postgres connection for its whole life (reconnected with backoff), so
  no Postgres session is opened per job, and has the lifecycle and the routed handlers imported
  before the first fork;
- runs only its own handlers (`reactor.worker.own_routes`): its routes (`routes=`, `reactor worker
  --route`, `REACTOR_ROUTES`, else the recorded ones) inside `REACTOR_HANDLER_PREFIXES`. A job
  naming any other handler is refused before anything is imported: a failed attempt whose
  `last_error` says why (retried while attempts remain, like an unimportable handler);
- does the fenced start before the horse is forked (or the handler called), then hands the
  attempt over to `perform` (`reactor.worker.entry.hand_over`), which only calls the handler and
  reports how it ended through a pipe made before the fork (in memory in-process). The
  start is sent before RQ marks the job started and its answer read before the fork
  (`reactor.worker.inflight`: no thread hand-off), so its round trip overlaps RQ's own;
- heartbeats the row from one long-lived thread, told to beat after the fork and paused
  before the outcome is written (so no query is ever in flight at a fork, and never two at
  once), and at each beat renews RQ's heartbeats of the worker and the job (RQ's
  `maintain_heartbeats`) with a TTL of `BUSY_KEY_TTL_HEARTBEATS` beats: a worker that dies
  mid-job leaves a worker key that expires within that, which the sweep and `reactor status`
  read as "worker gone", while a live one's never lapses; and writes the outcome, fenced by
  the attempt. A `done` is sent the moment the handler returns (in-process) or its horse
  reports so (`reactor.worker.report`), and confirmed after RQ has recorded the success and
  the horse has exited (so a worker that dies in between may leave RQ showing the job
  unfinished while the row, which is the record, is `done`); any other outcome is written
  once the horse has exited. A horse that dies without reporting (SIGKILL, OOM, the job
  timeout's kill) is a failed attempt with a `last_error` that says so.

The classes also renew RQ's worker key in one round trip, and no more often than needed
(`reactor.worker.worker_key`), and speak systemd's notify protocol when
`NOTIFY_SOCKET` is set (`reactor.worker.watchdog`).

The horse never uses the worker's connection: it runs only the handler and leaves with
`os._exit`, which sends nothing on inherited sockets. With tracing on, no span export is in
progress at the fork (`tracing.exports_held`), so the horse's own export of its spans cannot
find the exporter locked, and the horse exports over connections of its own
(`tracing.own_connections`), not the worker's kept-alive ones. Jobs of other functions run as in RQ.
RQ's stored tracebacks and the log lines of the process are redacted (no passwords).

At start (`check_startup`, also run by `bootstrap`) the worker connects, checks the schema and
its routes (exit 2 with one line otherwise) and imports the handlers of the routes it serves.
A handler that cannot be imported stops the start (exit 2, one line naming it and the import
error): its jobs stay queued and no attempt is spent, where serving on would fail every one of
them (a forgotten PYTHONPATH failed rows within a minute); so does a served handler outside the
allow-list (a mistyped prefix). A worker that finds no route for its queues
(started beside its reactor, before the reactor recorded them) waits for them, saying so; one
started with no queue name (RQ's CLI then listens on `default`) serves its routes' queues.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
from collections.abc import Mapping
from typing import Any

import rq.worker
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker.base import BaseWorker, WorkerStatus

from reactor import tracing
from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.jobs import ENTRY_POINT, JobRef
from reactor.pg import db, registry
from reactor.redact import redact
from reactor.routes import Route, given_routes
from reactor.settings import BUSY_KEY_TTL_HEARTBEATS, WorkerSettings
from reactor.worker import lifecycle
from reactor.worker.entry import (
    HandlerImportError,
    Handoff,
    hand_over,
    load_handler,
)
from reactor.worker.inflight import DONE, START, InFlight
from reactor.worker.own_routes import HandlerRefusedError, OwnRoutes
from reactor.worker.report import ReportPipe
from reactor.worker.startup import StartupChecks
from reactor.worker.watchdog import SystemdNotify
from reactor.worker.worker_key import KeyRenewal

__all__ = ["SimpleWorker", "Worker"]

logger = logging.getLogger(__name__)

#: The `last_error` head of an attempt whose handler never reported an outcome (a horse killed
#: mid-handler, or RQ failing the job before the handler ran, e.g. on a Redis error).
HORSE_LOST = "WorkHorseLost: the work horse ended before the handler returned"
#: A row written this recently (in heartbeat intervals) is only read at start: the heartbeat
#: thread schedules the first beat from that write (`lifecycle.SCHEDULED_FRESHNESS`).
_FRESHNESS = lifecycle.SCHEDULED_FRESHNESS


def _describe_status(status: int | None) -> str:
    if status is not None and os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(number).name}"
        return f"killed by signal {number}"
    if status is not None and os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return "killed by the worker, or never started"


class _Lifecycle(SystemdNotify, StartupChecks, KeyRenewal, BaseWorker):
    """What both classes share: start checks, fenced start, heartbeat, outcome."""

    #: Whether jobs run in a forked work horse (a pipe carries the outcome back).
    forks = True

    def __init__(
        self,
        *args: Any,
        routes: Mapping[str, Route] | None = None,
        settings: WorkerSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        #: Set once a warm shutdown was asked for (SIGTERM/SIGINT): `reactor worker` then does
        #: not start RQ's work loop again.
        self.stop_requested = False
        self._settings_error: ConfigError | None = None
        if settings is None:
            try:
                settings = WorkerSettings.from_env()
            except ConfigError as exc:
                self._settings_error = exc
                settings = WorkerSettings(database_url="")
        self.settings = settings
        self._store = lifecycle.Store(settings.database_url)
        if routes is None:
            try:
                routes = given_routes() or None
            except ConfigError as exc:
                self._settings_error = self._settings_error or exc
        # The only handlers this worker runs: every job is checked against them.
        self._own = OwnRoutes(
            routes, settings.handler_prefixes, lambda: self._store.run(registry.routes_in_use)
        )
        try:
            db.prepared_statements_enabled()  # a bad value stops the start
        except ConfigError as exc:
            self._settings_error = self._settings_error or exc
        # The fenced start and the `done` write, overlapped with RQ's Redis work.
        self._inflight = InFlight(self._store)
        self._checked = False
        self._heartbeat = lifecycle.Heartbeater(self._store, settings.heartbeat_seconds)
        # RQ's TTLs while an attempt runs: renewed at every beat, so they lapse only once the
        # worker has stopped beating (`reactor.worker.worker_key`).
        self._attempt_key_ttl = math.ceil(BUSY_KEY_TTL_HEARTBEATS * settings.heartbeat_seconds)
        self._job: Job | None = None  # the running `perform` job, for the renewals
        self._running: Handoff | None = None
        self._started: lifecycle.Started | None = None  # the running attempt, once settled
        #: The pipe the running attempt's horse reports through (forking workers).
        self._report: ReportPipe | None = None
        self._horse_status: int | None = None

    def handle_warm_shutdown_request(self) -> None:
        self.stop_requested = True
        super().handle_warm_shutdown_request()

    def teardown(self) -> None:
        super().teardown()  # type: ignore[no-untyped-call]
        if not self.is_horse:
            self._store.close()

    # -- one job -----------------------------------------------------------------------------

    def _start(self, ref: JobRef, handler: str) -> tuple[Handoff, lifecycle.Started | None]:
        """Settle the fenced start that `_begin` sent (if it could): the settled handoff and
        the attempt (None if it does not run)."""
        answer = self._inflight.receive()  # None too if nothing was sent
        started: lifecycle.Started | None
        try:
            if answer is None:
                # Not sent, or no answer: the fenced start on the store (retried).
                started = lifecycle.start(self._store, self.settings, ref, _FRESHNESS)
            elif answer.first is None:
                started = lifecycle.recheck(self._store, self.settings, ref, _FRESHNESS)
            else:
                started = lifecycle.Started.of(answer.first)
        except (DatabaseError, StatementError) as exc:
            logger.error("attempt_unstarted %s error=%s", lifecycle.describe(ref), exc)
            return Handoff(ref, "unstarted", failure=exc), None
        except Exception as exc:
            # A statement error (a value the session cannot encode, a revoked privilege): this
            # job fails in RQ, and the worker goes on with the next (an exception here would
            # stop a forking worker's loop).
            logger.error(
                "attempt_unstarted %s error=%s", lifecycle.describe(ref), lifecycle.error_text(exc)
            )
            return Handoff(ref, "unstarted", failure=exc), None
        if started is None:
            return Handoff(ref, "skip"), None
        try:
            # Before any import: a handler the job names is only a claim (anyone who can write
            # to Redis or reactor_routes can name one), this worker's route is the authority.
            self._own.check(ref.type, handler)
            return Handoff(ref, "run", handler=load_handler(handler, self._own.prefixes)), started
        except HandlerRefusedError as exc:
            logger.error("handler_refused %s %s", lifecycle.describe(ref), exc)
            return Handoff(ref, "run", failure=exc), started
        except (HandlerImportError, ConfigError, DatabaseError, StatementError) as exc:
            # Unimportable, or the recorded routes unreadable: a failed attempt that says so.
            return Handoff(ref, "run", failure=exc), started

    def _finish(self, ref: JobRef, outcome: lifecycle.Outcome) -> bool | None:
        """Write the outcome: `done` as a prepared statement (confirming the one sent when the
        handler returned, in-process), the rest, and a `done` that found the connection
        broken, on the store, retried. Whether it changed the row (None: not written)."""
        if outcome.kind == "ok":
            # In flight here can only be the `done` sent when the handler returned.
            if not self._inflight.in_flight:
                self._inflight.send(DONE, self._attempt_params(ref))
            written = self._inflight.receive()  # None too if it could not be sent
            if written is not None:
                return lifecycle.note_done(ref, written.rows)
        else:
            self._inflight.receive()  # never leave a result unread before the store's statements
        started = self._started
        if started is None:
            return None  # never started: there is no outcome of ours to write
        try:
            return lifecycle.finish(self._store, self.settings, ref, started, outcome)
        except (DatabaseError, StatementError) as exc:
            logger.error(
                "outcome_lost %s error=%s (the row is rescued after stale_after)",
                lifecycle.describe(ref),
                exc,
            )
        except Exception:
            logger.exception("outcome_lost %s", lifecycle.describe(ref))
        return None

    def _attempt_params(self, ref: JobRef) -> dict[str, Any]:
        return lifecycle.attempt_params(self.settings, ref, _FRESHNESS)

    def _beat_for(self, ref: JobRef) -> None:
        """Heartbeat the running attempt, the first beat an interval after the row's last
        write: a row the start only read may have waited in the queue since its claim."""
        started = self._started
        written_ago = 0.0 if started is None else started.written_ago
        self._heartbeat.beat_for(ref, self._renew_rq_heartbeats, written_ago)

    def _send_done(self, ref: JobRef, outcome: lifecycle.Outcome) -> None:
        """The moment the handler returned (in-process) or its horse said so: send the `done`
        write, so that it runs while RQ records the job's success in Redis."""
        if outcome.kind == "ok":
            self._heartbeat.pause()  # no beat may share the connection with it
            self._inflight.send(DONE, self._attempt_params(ref))

    def _begin(self, job: Job) -> Handoff | None:
        """Send the fenced start of a `perform` job and return its handoff, still `starting`;
        None for a job of another function.

        The start runs while RQ does its own bookkeeping in Redis; the handoff settles before
        the horse is forked or the handler is called."""
        try:
            if job.func_name != ENTRY_POINT:
                return None
            job_type, photo_id, token = job.args
            ref = JobRef(str(job_type), str(photo_id), int(token))
            handler = str(job.kwargs["handler"])
        except Exception:
            return None  # not ours to judge: RQ runs (and fails) it as it is
        self._inflight.send(START, self._attempt_params(ref))
        handoff = Handoff(ref, "starting")

        def settle() -> None:
            settled, self._started = self._start(ref, handler)
            handoff.action = settled.action
            handoff.handler, handoff.failure = settled.handler, settled.failure
            if settled.action == "run" and not self.forks:
                self._beat_for(ref)
                handoff.on_report = lambda outcome: self._send_done(ref, outcome)

        handoff.settle = settle
        return handoff

    def execute_job(self, job: Job, queue: Queue) -> None:
        # Busy here (Redis's copy is RQ's) until the outcome is written: RQ ends its part idle,
        # and a stop asked for while idle raises wherever the worker is, cutting the write.
        self._state = WorkerStatus.BUSY
        self._execute(job, queue)
        self._state = WorkerStatus.IDLE  # after an exception the loop ends anyway

    def _execute(self, job: Job, queue: Queue) -> None:
        handoff = self._begin(job)
        if handoff is None:
            hand_over(None)
            super().execute_job(job, queue)
            return
        self._horse_status = None
        self._started = None
        hand_over(handoff)
        self._running, self._job = handoff, job
        # Made here, in the worker process, and current while RQ runs the job: a forked
        # horse inherits it as the parent of the handler's own spans (and flushes those).
        with tracing.processing(handoff.ref, job.meta, self.settings.trace_relationship) as span:
            try:
                super().execute_job(job, queue)
            finally:
                self._state = WorkerStatus.BUSY
                hand_over(None)
                self._running = self._job = None
                handoff.wait()  # RQ may have failed the job before it ran
                self._trace(span, handoff)

    def _trace(self, span: tracing.Processing, handoff: Handoff) -> None:
        """Write the outcome of a job that ran (telling its span), or tell why it did not."""
        if handoff.action != "run":
            span.skipped("superseded or finished" if handoff.action == "skip" else "start failed")
            return
        self._heartbeat.pause()
        outcome = self._collect(handoff)
        started = self._started
        if started is not None:
            span.started(started.attempt)
            span.ended(outcome.kind, outcome.error, outcome.kind == "error" and not started.last)
        if self._finish(handoff.ref, outcome) is False:
            span.superseded()

    def _before_fork(self, handoff: Handoff) -> None:
        """In the worker process, before the fork: settle the start (no query is in flight
        on our connection while forking) and make the pipe the horse reports through."""
        handoff.wait()
        if handoff.action == "run":
            self._report = ReportPipe()
            handoff.report_fd = self._report.write_fd

    def _after_fork(self, ref: JobRef) -> None:
        """In the parent, right after the fork: drop our copy of the pipe's write end (so the
        horse's exit is the end of it) and start heartbeating."""
        if self._report is not None:
            if self._running is not None:
                self._running.report_fd = None  # the horse's number now, not ours
            self._report.forked()
            self._beat_for(ref)

    def _await_report(self, horse_pid: int) -> None:
        """While the horse runs: once it reports that the handler returned, send the `done`
        write, so that its round trip overlaps the horse's own Redis work and exit."""
        running, report = self._running, self._report
        if running is None or report is None:
            return
        outcome = report.wait(horse_pid)
        if outcome is not None:
            self._send_done(running.ref, outcome)

    def _collect(self, handoff: Handoff) -> lifecycle.Outcome:
        outcome = handoff.outcome
        if self._report is not None:
            report, self._report = self._report, None
            outcome = report.collect()
        if outcome is None:
            why = _describe_status(self._horse_status) if self.forks else "RQ ended the job"
            outcome = lifecycle.Outcome("error", f"{HORSE_LOST} ({why})")
        return outcome

    # -- RQ hooks ------------------------------------------------------------------------------

    def _busy_key_ttl(self) -> int | None:
        return self._attempt_key_ttl if self._running is not None else None

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # The TTL of the job's execution in RQ's started registry (and of the worker key at
        # the job's start): a beat's, for an attempt; RQ's (the job's timeout) for other jobs.
        if self._running is not None:
            return self._attempt_key_ttl
        return super().get_heartbeat_ttl(job, working_time)

    def _renew_rq_heartbeats(self) -> None:
        """From the heartbeat thread, after each beat: RQ's renewal of the worker key, the
        job's execution and its `last_heartbeat`, with the attempt's TTL (one round trip)."""
        # A copy (one C call): RQ's thread adds and removes executions meanwhile. Once RQ has
        # ended the job its execution is gone, and only the worker key is renewed.
        job, executions = self._job, list(self.executions.values())
        execution = executions[0] if executions else None
        if job is None or execution is None:
            self.heartbeat(self._attempt_key_ttl)
            return
        self.maintain_heartbeats(job, execution)

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Any = None,
    ) -> None:
        # RQ stores this traceback text in the job's result: mask passwords first.
        super().handle_job_failure(job, queue, started_job_registry, redact(exc_string), execution)


class Worker(_Lifecycle, rq.worker.Worker):
    """RQ's forking worker with the attempt lifecycle in the worker process."""

    forks = True

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        if self._running is not None:
            self._before_fork(self._running)
        with tracing.exports_held():  # the horse exports its spans through the same exporter
            super().fork_work_horse(job, queue)  # returns in the parent only
        if self._running is not None:
            self._after_fork(self._running.ref)

    def wait_for_horse(self) -> tuple[int | None, int | None, Any]:
        self._await_report(self.horse_pid)
        pid, status, rusage = super().wait_for_horse()
        if pid:
            self._horse_status = status  # how a horse that never reported ended
        return pid, status, rusage

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        """In the work horse: RQ's, on exporter connections of the horse's own, then the export
        of the horse's spans (it leaves with `os._exit`), after the job's timeout has ended."""
        tracing.own_connections()
        try:
            return bool(super().perform_job(job, queue, execution))
        finally:
            tracing.flush()


class SimpleWorker(_Lifecycle, rq.worker.SimpleWorker):
    """RQ's in-process worker with the attempt lifecycle around the handler call."""

    forks = False
