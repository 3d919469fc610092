"""One attempt's fenced lifecycle, shared by both worker paths.

The same statements run whether the lifecycle lives in the job (a plain `rq worker` runs
`reactor.worker.entry.perform`) or in the long-lived worker process (`reactor.Worker`,
`reactor.SimpleWorker`):

Every statement is fenced by the job's token: the row's `prior_attempts + attempts` when it
was dispatched, which grows with every dispatch over the row's whole history (a re-arm by
`requeue` or `submit()` starts a new life at attempts 0 and adds the old attempts to
`prior_attempts`). So a job of an earlier attempt, or of an earlier life, never runs and never
writes an outcome; `attempts` still counts per life for `max_attempts` and the backoff.

1. `start` — the fenced start (one statement when it may run): proceed only if the row is
   `active` at this token (the claim or rescue that enqueued this job commits after the
   enqueue: the start waits for one in flight). Otherwise the row is read again once no
   transaction is moving it: `active` at this token, it starts; else the attempt was
   superseded, the row is finished, or the claim that enqueued the job rolled back (its
   COMMIT lost: the next claim of the row finds the job ended and replaces it), and the
   handler must not run. A row the claim stamped less than a quarter heartbeat interval ago
   (a whole interval for the worker classes, whose first beat is due an interval after that
   stamp) is only read; any other is stamped (`heartbeat_at`), so the sweep cannot take a job
   that waited long in the queue for a dead worker's before its first heartbeat.
2. `Heartbeater` — one thread per process that touches `heartbeat_at` every
   `heartbeat_seconds` while a handler runs, so the sweep does not rescue a live attempt (for
   the worker classes it also renews the worker's RQ key at each beat, which tells the sweep
   the worker lives).
3. `finish` — the outcome, fenced by the token (`state = 'active' AND prior_attempts +
   attempts = N`):
   ok → `done`; permanent → `failed`; error → `pending` after a backoff while attempts remain,
   else `failed`. A superseded attempt changes nothing.

`Store` holds one autocommit connection and retries a statement on a lost connection with
backoff; that is safe because every statement is fenced by the token, so running it
twice changes nothing more. Error texts that reach the row are redacted and bounded.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import tenacity

from reactor.errors import DatabaseError, PermanentError, StatementError
from reactor.jobs import JobRef, short_id, shown_type, warm_up_ref
from reactor.pg import db, queries
from reactor.settings import WorkerSettings
from reactor.throttle import LogThrottle
from reactor.validate import error_text

_T = TypeVar("_T")

__all__ = [
    "HEARTBEAT_SLACK",
    "Heartbeater",
    "Outcome",
    "Started",
    "Store",
    "attempt_params",
    "backoff_seconds",
    "error_text",
    "finish",
    "note_done",
    "outcome_of",
    "recheck",
    "start",
    "warm_up",
]

logger = logging.getLogger(__name__)

#: Warnings about jobs whose row is missing: a few a minute at most.
_missing_log = LogThrottle(burst=5, interval_seconds=60.0)

#: A quarter of the heartbeat interval: how often the worker classes' heartbeat thread looks
#: whether a beat is due, and how recently the claim must have stamped a row for the start of
#: a plain `rq worker`'s job to only read it (its heartbeat comes an interval after the start).
HEARTBEAT_SLACK = 0.25
#: How recently (in intervals) the row must have been written for the worker classes' start to
#: only read it: their first beat is due an interval after that write, not after the start, so
#: either way a running attempt's stamp is at most 1 + HEARTBEAT_SLACK intervals old.
SCHEDULED_FRESHNESS = 1.0


@dataclass(frozen=True)
class Outcome:
    """How a handler call ended: `ok`, `error` (retried while attempts remain) or
    `permanent` (failed at once); `error` holds the redacted text for `last_error`."""

    kind: Literal["ok", "error", "permanent"]
    error: str | None = None


@dataclass(frozen=True)
class Started:
    """An attempt that may run: its number in the row's current life, the life's limit, and
    how long ago the row was last written (0 if the start stamped it)."""

    attempt: int
    max_attempts: int
    written_ago: float = 0.0

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> Started:
        """From ATTEMPT_START's row (as values, or as the text an `InFlight` result holds)."""
        return cls(int(row[0] or 0), int(row[1] or 0), max(0.0, float(row[2] or 0.0)))

    @property
    def last(self) -> bool:
        """Whether a failure of this attempt is final."""
        return self.attempt >= self.max_attempts


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Delay before the retry that follows failed attempt `attempt` (1-based).

    Exponential (`base * 2**(attempt-1)`, capped at `cap`) with "equal jitter": uniformly in
    [d/2, d], so retries of a burst spread out but never come sooner than half the step.
    """
    step = min(cap, base * 2.0 ** min(attempt - 1, 62))
    return step / 2 + random.uniform(0, step / 2)


def outcome_of(exc: BaseException) -> Outcome:
    """How an attempt whose handler raised `exc` ended: `permanent` for a `PermanentError`,
    else `error` (retried while attempts remain)."""
    return Outcome("permanent" if isinstance(exc, PermanentError) else "error", error_text(exc))


def describe(ref: JobRef) -> str:
    """The attempt, for log lines."""
    return f"type={shown_type(ref.type)} photo_id={short_id(ref.photo_id)} token={ref.token}"


class Store:
    """One autocommit connection of one process, reconnected on demand.

    `connect` is lazy: the first statement opens it. The owner must not use it from a forked
    child (the child would share the server session): the worker classes never do, and the
    job path (`reactor.worker.entry`) keeps one `Store` per process id.
    """

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._conn: db.Connection | None = None
        # Built once: it sits on the path of every job.
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(DatabaseError)
            & tenacity.retry_if_not_exception_type(StatementError),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=5),
            stop=tenacity.stop_after_attempt(6),
            reraise=True,
        )

    @property
    def conn(self) -> db.Connection:
        """The open connection (opened now if needed).

        Raises:
            ConfigError: the URL is malformed.
            DatabaseError: Postgres could not be reached.
        """
        if self._conn is None or self._conn.closed:
            self._conn = db.connect(self._url, autocommit=True, purpose="worker")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @staticmethod
    def _statement(
        conn: db.Connection, query: str, params: dict[str, Any]
    ) -> tuple[int, tuple[Any, ...] | None]:
        with db.translating("worker query failed"):
            cursor = conn.execute(query, params)
            return cursor.rowcount, cursor.fetchone() if cursor.description else None

    def execute_once(
        self, query: str, params: dict[str, Any]
    ) -> tuple[int, tuple[Any, ...] | None]:
        """One statement once; (rows changed, first row). Raises as `run_once` does."""
        return self.run_once(lambda conn: self._statement(conn, query, params))

    def run_once(self, work: Callable[[db.Connection], _T]) -> _T:
        """`work(connection)` once; a failed connection is closed (the next call reconnects).

        Raises:
            StatementError: a statement failed on a healthy connection.
            DatabaseError: the connection failed.
        """
        try:
            return work(self.conn)
        except StatementError:
            raise  # the statement's own failure: retrying it cannot help
        except DatabaseError:
            # A lost session, or a server that became read-only (a failover): reconnect.
            self.close()
            raise

    def execute(self, query: str, params: dict[str, Any]) -> tuple[int, tuple[Any, ...] | None]:
        """`execute_once`, retried as `run` is.

        Raises:
            StatementError: the statement failed on a healthy connection.
            DatabaseError: Postgres stayed unreachable through every retry.
        """
        return self.run(lambda conn: self._statement(conn, query, params))

    def run(self, work: Callable[[db.Connection], _T]) -> _T:
        """`run_once`, retried with backoff on connection failures (about 15 s in all): a
        session killed under a statement or a read (the recorded routes) costs a reconnect,
        not the attempt.

        Raises:
            StatementError: a statement failed on a healthy connection.
            DatabaseError: Postgres stayed unreachable through every retry.
        """
        try:
            # The first try outside tenacity: its bookkeeping would be paid on every job.
            return self.run_once(work)
        except StatementError:
            raise
        except DatabaseError:
            pass
        result: _T = self._retrying(self.run_once, work)
        return result


def _params(ref: JobRef) -> dict[str, Any]:
    return {"type": ref.type, "photo_id": ref.photo_id, "token": ref.token}


def warm_up(store: Store) -> None:
    """Rehearse an attempt's statements (start, both ways; heartbeat; done) on a throwaway row
    that is rolled back, so the first real job pays for neither the session's first write nor
    the statements' first use.

    Raises:
        DatabaseError: Postgres could not be reached.
    """
    ref = warm_up_ref()
    params = _params(ref)

    def attempt(conn: db.Connection) -> None:
        # fresh: only read; then not fresh (0 s): stamped.
        for fresh in (1.0, 0.0):
            conn.execute(queries.ATTEMPT_START, {**params, "fresh": fresh})
        for query in (queries.ATTEMPT_HEARTBEAT, queries.ATTEMPT_DONE):
            conn.execute(query, params)

    try:
        db.rehearse(store.conn, {**params, "state": "active", "attempts": ref.token}, attempt)
    except (DatabaseError, StatementError):
        store.close()
        raise


def attempt_params(
    settings: WorkerSettings, ref: JobRef, freshness: float = HEARTBEAT_SLACK
) -> dict[str, Any]:
    """The parameters of this attempt's statements (with the start's `fresh` bound:
    `freshness` heartbeat intervals)."""
    return {**_params(ref), "fresh": settings.heartbeat_seconds * freshness}


def start(
    store: Store, settings: WorkerSettings, ref: JobRef, freshness: float = HEARTBEAT_SLACK
) -> Started | None:
    """The fenced start; the attempt, or None when it must not run.

    A row `active` at this attempt that the claim stamped less than `freshness` heartbeat
    intervals ago is only read: no write, no WAL, no new row version. The caller's first
    heartbeat must then come within an interval of that stamp (`Started.written_ago`).

    Raises:
        DatabaseError: Postgres stayed unreachable (the row is left to the stale rescue).
    """
    _, row = store.execute(queries.ATTEMPT_START, attempt_params(settings, ref, freshness))
    if row is not None:
        return Started.of(row)
    return recheck(store, settings, ref, freshness)


def recheck(
    store: Store, settings: WorkerSettings, ref: JobRef, freshness: float = HEARTBEAT_SLACK
) -> Started | None:
    """After `ATTEMPT_START` found the row at no token it may run: the attempt if the row is
    `active` at this token once no transaction is moving it (the sweep's rescue that enqueued
    this job had not committed yet), else None, logged with the row's state.

    A rescue whose COMMIT was lost leaves the row at the token before: the job is refused,
    and the next sweep rescues the row again with this same token. A read that fails refuses
    too (the row is then left to the sweep).
    """
    try:
        _, current = store.execute(queries.ATTEMPT_RECHECK, _params(ref))
        if current is None:
            # Deleted while its job waited, a job made for a row that never existed, or a
            # worker whose DATABASE_URL is not its reactor's (sharing the Redis database of
            # another deployment). Throttled: anyone who can NOTIFY can make such jobs.
            if _missing_log.allow():
                logger.warning(
                    "attempt_skipped %s (row missing: is DATABASE_URL the reactor's database?)"
                    " suppressed=%d",
                    describe(ref),
                    _missing_log.suppressed(),
                )
            return None
        if tuple(current) != ("active", ref.token):
            why = f"row is {current[0]} at token {current[1]}"
        else:
            _, row = store.execute(queries.ATTEMPT_START, attempt_params(settings, ref, freshness))
            if row is not None:
                return Started.of(row)
            why = "row moved on again"
    except (DatabaseError, StatementError) as exc:
        logger.warning("attempt_skipped %s (row state unknown: %s)", describe(ref), error_text(exc))
        return None
    logger.info("attempt_skipped %s (%s)", describe(ref), why)
    return None


def note_done(ref: JobRef, changed: int) -> bool:
    """Whether the `done` write changed the row; a superseded one is logged."""
    if changed == 0:
        logger.warning("completion_superseded %s", describe(ref))
    return changed > 0


def finish(
    store: Store, settings: WorkerSettings, ref: JobRef, started: Started, outcome: Outcome
) -> bool:
    """Write the outcome of a started attempt; whether it changed the row (False: superseded).

    Raises:
        DatabaseError: Postgres stayed unreachable (the row is left to the stale rescue).
    """
    params = _params(ref)
    if outcome.kind == "ok":
        return note_done(ref, store.execute(queries.ATTEMPT_DONE, params)[0])
    params["error"] = outcome.error
    if outcome.kind == "permanent":
        changed = store.execute(queries.ATTEMPT_FAILED, params)[0]
        event = "attempt_failed_permanently %s"
    elif not started.last:
        delay = backoff_seconds(
            started.attempt, settings.retry_base_seconds, settings.retry_max_seconds
        )
        changed = store.execute(queries.ATTEMPT_RETRY, {**params, "delay": delay})[0]
        event = f"attempt_failed %s retry_in={delay:.1f}s"
    else:
        changed = store.execute(queries.ATTEMPT_FAILED, params)[0]
        event = "attempts_exhausted %s"
    if changed == 0:
        # Cancelled or re-dispatched while it ran: this attempt retries nothing.
        event = "failure_superseded %s (the row moved on while the attempt ran)"
    logger.warning(event, describe(ref))
    return changed > 0


class Heartbeater:
    """One heartbeat thread for a worker process's whole life, beating for one attempt at a time.

    `beat_for(ref)` starts beating for an attempt, `pause()` stops it; `pause` returns only
    when no beat is in flight, so the owner may fork or write the outcome on the same
    connection right after. Neither wakes the thread: it looks every `HEARTBEAT_SLACK`
    interval whether a beat is due, so the first beat comes 1 to 1.25 intervals after the
    row's last write (`written_ago` before the start: a start that only read the row), and a
    job costs two uncontended locks, not a thread wake-up. (A thread per job cost a
    thread start and a join per job, several milliseconds on a loaded machine.) With no attempt
    set the thread never queries, so it is never inside a query when the worker forks.
    """

    def __init__(self, store: Store, interval: float) -> None:
        self._store = store
        self._interval = interval
        self._lock = threading.Lock()
        self._busy = threading.Lock()
        self._ref: JobRef | None = None
        self._renew: Callable[[], None] | None = None
        self._due = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the (idle) thread now rather than on the first job (or again, if it died)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="reactor-heartbeat", daemon=True
                )
                self._thread.start()

    def beat_for(
        self, ref: JobRef, renew: Callable[[], None] | None = None, written_ago: float = 0.0
    ) -> None:
        """Beat for `ref` from now on, the first beat due an interval after the row's last
        write (`written_ago` seconds ago); `renew` (if given) is called after each beat,
        whether the beat's write succeeded or not (the worker classes renew their RQ key)."""
        self.start()
        with self._lock:
            self._ref = ref
            self._renew = renew
            self._due = time.monotonic() + self._interval - max(0.0, written_ago)

    def pause(self) -> None:
        with self._lock:
            self._ref = None
        with self._busy:  # wait out a beat in flight
            pass

    def _run(self) -> None:
        while True:
            time.sleep(self._interval * HEARTBEAT_SLACK)
            with self._lock:
                ref, renew = self._ref, self._renew
                if ref is None or time.monotonic() < self._due:
                    continue
                self._due = time.monotonic() + self._interval
            with self._busy:
                if self._ref is not ref:
                    continue  # paused (or moved on) meanwhile
                try:
                    if self._store.execute_once(queries.ATTEMPT_HEARTBEAT, _params(ref))[0] == 0:
                        logger.warning("heartbeat_superseded %s", describe(ref))
                        with self._lock:
                            if self._ref is ref:
                                self._ref = None
                except Exception as exc:  # a statement error too: the next beat is the retry
                    logger.warning("heartbeat_failed %s error=%s", describe(ref), error_text(exc))
                if renew is not None:
                    try:
                        renew()
                    except Exception as exc:  # Redis down: the next beat is the retry
                        logger.warning(
                            "worker_key_renewal_failed %s error=%s", describe(ref), error_text(exc)
                        )
