"""The RQ entry point every dispatched job runs: the fenced lifecycle around a handler.

`perform(type, photo_id, attempt, handler=...)` runs inside a plain `rq worker` process:
1. Fenced start: proceed only if the row is `active` at this attempt, or `pending` at the
   attempt before (the claim's COMMIT was lost after the enqueue: this job takes the row
   over). Otherwise the attempt was superseded or the row is finished: log and return without
   running the handler.
2. Heartbeat: a thread touches `updated_at` every `REACTOR_HEARTBEAT_SECONDS` while the handler
   runs, so the sweep does not rescue a live attempt.
3. Outcome, fenced by the attempt number (`WHERE state = 'active' AND attempts = N`): success
   → `done`; `PermanentError` → `failed`; any other exception (an RQ job timeout included) →
   `pending` with `next_retry_at = now() + backoff` while attempts remain, else `failed`.
   A superseded attempt changes nothing. Exceptions are re-raised after the row is updated,
   so RQ shows the job in its failed registry (kept `FAILED_JOB_TTL_SECONDS`).

Handlers run at least once per attempt and may run again after a worker dies mid-job: they
must be idempotent.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import tenacity
from rq.utils import import_attribute

from reactor import db
from reactor.errors import DatabaseError, PermanentError
from reactor.settings import WorkerSettings

__all__ = ["backoff_seconds", "perform"]

logger = logging.getLogger(__name__)

#: Longest `last_error` kept in the row.
MAX_ERROR_CHARS = 2000

_START = """
UPDATE photo_jobs
   SET state = 'active', attempts = %(attempt)s
 WHERE photo_id = %(photo_id)s AND type = %(type)s
   AND ((state = 'active' AND attempts = %(attempt)s)
     OR (state = 'pending' AND attempts = %(attempt)s - 1))
RETURNING max_attempts
"""
_WHY_NOT = (
    "SELECT state, attempts FROM photo_jobs WHERE photo_id = %(photo_id)s AND type = %(type)s"
)
_FENCE = (
    "photo_id = %(photo_id)s AND type = %(type)s AND state = 'active' AND attempts = %(attempt)s"
)
_HEARTBEAT = "UPDATE photo_jobs SET updated_at = now() WHERE " + _FENCE
_DONE = (
    "UPDATE photo_jobs SET state = 'done', next_retry_at = NULL, last_error = NULL WHERE " + _FENCE
)
_FAILED = "UPDATE photo_jobs SET state = 'failed', last_error = %(error)s WHERE " + _FENCE
_RETRY = (
    "UPDATE photo_jobs SET state = 'pending', last_error = %(error)s,"
    " next_retry_at = now() + make_interval(secs => %(delay)s) WHERE " + _FENCE
)

_conn: db.Connection | None = None
_conn_pid = 0


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Delay before the retry that follows failed attempt `attempt` (1-based).

    Exponential (`base * 2**(attempt-1)`, capped at `cap`) with "equal jitter": uniformly in
    [d/2, d], so retries of a burst spread out but never come sooner than half the step.
    """
    step = min(cap, base * 2.0 ** min(attempt - 1, 62))
    return step / 2 + random.uniform(0, step / 2)


def _connection(settings: WorkerSettings) -> db.Connection:
    # One connection per process; RQ forks a work horse per job, and a libpq connection must
    # never be shared across a fork, hence the pid check.
    global _conn, _conn_pid
    if _conn is None or _conn.closed or _conn_pid != os.getpid():
        _conn = db.connect(settings.database_url, autocommit=True, purpose="worker")
        _conn_pid = os.getpid()
    return _conn


def _execute(
    settings: WorkerSettings, query: str, params: dict[str, Any]
) -> tuple[int, tuple[Any, ...] | None]:
    """Run one statement, retrying briefly on connection failures; (rows changed, first row).

    Retrying is safe: every statement here is fenced by the attempt number, so running it
    twice (a connection lost after the server applied it) changes nothing more.

    Raises:
        DatabaseError: Postgres stayed unreachable through every retry.
    """

    @tenacity.retry(
        retry=tenacity.retry_if_exception_type(DatabaseError),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=5),
        stop=tenacity.stop_after_attempt(6),
        reraise=True,
    )
    def attempt() -> tuple[int, tuple[Any, ...] | None]:
        try:
            conn = _connection(settings)
            cursor = conn.execute(query, params)
            return cursor.rowcount, cursor.fetchone() if cursor.description else None
        except psycopg.OperationalError as exc:
            if _conn is not None:
                _conn.close()
            raise DatabaseError(f"worker query failed: {db.describe_error(exc)}") from exc

    return attempt()


def _write(settings: WorkerSettings, query: str, params: dict[str, Any]) -> int:
    """Run one fenced UPDATE (retried like `_execute`); rows changed."""
    return _execute(settings, query, params)[0]


class _Heartbeat:
    """Touches the row's `updated_at` every `interval` seconds until stopped."""

    def __init__(self, settings: WorkerSettings, params: dict[str, Any]) -> None:
        self._settings = settings
        self._params = params
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reactor-heartbeat", daemon=True)
        self.superseded = False

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._settings.heartbeat_seconds):
            try:
                if _write(self._settings, _HEARTBEAT, self._params) == 0:
                    self.superseded = True
                    logger.warning("heartbeat_superseded %s", _describe(self._params))
                    return
            except DatabaseError as exc:
                logger.warning("heartbeat_failed %s error=%s", _describe(self._params), exc)


def _describe(params: dict[str, Any]) -> str:
    return f"type={params['type']} photo_id={params['photo_id']!r} attempt={params['attempt']}"


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text[:MAX_ERROR_CHARS]


def perform(job_type: str, photo_id: str, attempt: int, *, handler: str) -> str:
    """Run `handler(photo_id)` for one attempt of one row, under the fenced lifecycle.

    Returns:
        What happened: "done", or "skipped" when the attempt was not (or no longer) the row's.

    Raises:
        Exception: whatever the handler raised, after the row was moved to pending/failed.
    """
    settings = WorkerSettings.from_env()
    params: dict[str, Any] = {"type": job_type, "photo_id": photo_id, "attempt": attempt}
    _, row = _execute(settings, _START, params)
    if row is None:
        _, current = _execute(settings, _WHY_NOT, params)
        why = "row missing" if current is None else f"row is {current[0]} at attempt {current[1]}"
        logger.info("attempt_skipped %s (%s)", _describe(params), why)
        return "skipped"
    max_attempts = int(row[0])
    try:
        # Imported inside the fence: a handler that cannot be found is a failed attempt with a
        # last_error that says so (retried, since a deploy may fix it), never a stuck row.
        func: Callable[[str], object] = import_attribute(handler)
        with _Heartbeat(settings, params):
            func(photo_id)
    except PermanentError as exc:
        changed = _write(settings, _FAILED, {**params, "error": _error_text(exc)})
        logger.warning("attempt_failed_permanently %s changed=%d", _describe(params), changed)
        raise
    except Exception as exc:
        if attempt < max_attempts:
            delay = backoff_seconds(
                attempt, settings.retry_base_seconds, settings.retry_max_seconds
            )
            changed = _write(
                settings, _RETRY, {**params, "error": _error_text(exc), "delay": delay}
            )
            logger.warning(
                "attempt_failed %s retry_in=%.1fs changed=%d", _describe(params), delay, changed
            )
        else:
            changed = _write(settings, _FAILED, {**params, "error": _error_text(exc)})
            logger.warning("attempts_exhausted %s changed=%d", _describe(params), changed)
        raise
    changed = _write(settings, _DONE, params)
    if changed == 0:
        logger.warning("completion_superseded %s", _describe(params))
        return "skipped"
    return "done"
