"""Handlers the worker tests route to. Each records its runs in `handler_runs` of the test's
database (DATABASE_URL of the worker process), so tests can count executions per attempt."""

from __future__ import annotations

import os
import signal
import time
import zlib

import psycopg
from rq import get_current_job

from reactor import PermanentError

SCHEMA = """
CREATE TABLE IF NOT EXISTS handler_runs (
    photo_id text NOT NULL,
    attempt  int NOT NULL,
    pid      int NOT NULL,
    outcome  text NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS gates (name text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS transitions (
    photo_id text, old_state text, new_state text, attempts int, last_error text,
    at timestamptz DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION record_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO transitions (photo_id, old_state, new_state, attempts, last_error)
    VALUES (NEW.photo_id, OLD.state, NEW.state, NEW.attempts, NEW.last_error);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS record_transition ON photo_jobs;
CREATE TRIGGER record_transition AFTER UPDATE OF state ON photo_jobs
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION record_transition();
"""


def _attempt() -> int:
    job = get_current_job()
    assert job is not None
    return int(job.meta["token"])


def _record(photo_id: str, outcome: str) -> None:
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO handler_runs (photo_id, attempt, pid, outcome) VALUES (%s, %s, %s, %s)",
            [photo_id, _attempt(), os.getpid(), outcome],
        )


def _gate_open(name: str) -> bool:
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM gates WHERE name = %s", [name]).fetchone() is not None


def ok(photo_id: str) -> None:
    _record(photo_id, "ok")


def flaky_twice(photo_id: str) -> None:
    if _attempt() <= 2:
        _record(photo_id, "error")
        raise RuntimeError(f"transient failure {_attempt()}")
    _record(photo_id, "ok")


def always_fails(photo_id: str) -> None:
    _record(photo_id, "error")
    raise RuntimeError(f"boom {_attempt()}")


def binary_failure(photo_id: str) -> None:
    _record(photo_id, "error")
    header = "\x89PNG\x00\x00"
    raise ValueError(f"not an image: {header} ({_attempt()})")


def permanent(photo_id: str) -> None:
    _record(photo_id, "error")
    raise PermanentError("this photo is corrupt")


def wait_for_gate(name: str) -> None:
    """Until the test opens gate `name` (a polled condition with a deadline of 60 s)."""
    deadline = time.monotonic() + 60
    while not _gate_open(name) and time.monotonic() < deadline:
        time.sleep(0.05)


def gated(photo_id: str) -> None:
    """Each attempt waits until the test opens gate `photo_id:attempt` (a polled condition
    with a deadline), then succeeds."""
    _record(photo_id, "started")
    wait_for_gate(f"{photo_id}:{_attempt()}")
    _record(photo_id, "ok")


def gated_failure(photo_id: str) -> None:
    """As `gated`, then fails."""
    gated(photo_id)
    raise RuntimeError(f"failed after the gate {_attempt()}")


def slow_first_attempt(photo_id: str) -> None:
    """Attempt 1 works for REACTOR_TEST_WORK_SECONDS (simulated work); later ones at once."""
    _record(photo_id, "started")
    if _attempt() == 1:
        time.sleep(float(os.environ.get("REACTOR_TEST_WORK_SECONDS", "1")))
    _record(photo_id, "ok")


def sleeps(photo_id: str) -> None:
    """Works for REACTOR_TEST_WORK_SECONDS (simulated work), on every attempt."""
    _record(photo_id, "started")
    time.sleep(float(os.environ.get("REACTOR_TEST_WORK_SECONDS", "1")))
    _record(photo_id, "ok")


def fails_a_fifth_of_first_attempts(photo_id: str) -> None:
    if _attempt() == 1 and zlib.crc32(photo_id.encode()) % 5 == 0:
        _record(photo_id, "error")
        raise RuntimeError("first attempt of this photo fails")
    _record(photo_id, "ok")


def chaos(photo_id: str) -> None:
    """The chaos suite's handler: a little work; every tenth photo fails its first attempt,
    every fiftieth is told to fail for good."""
    bucket = zlib.crc32(photo_id.encode()) % 50
    _record(photo_id, "started")
    time.sleep(0.01)  # simulated work
    if bucket == 1:
        _record(photo_id, "permanent")
        raise PermanentError("told to fail")
    if bucket % 10 == 0 and _attempt() == 1:
        _record(photo_id, "error")
        raise RuntimeError("first attempt fails")
    _record(photo_id, "ok")


def chaos_told_to_fail(photo_id: str) -> bool:
    return zlib.crc32(photo_id.encode()) % 50 == 1


def noop(photo_id: str) -> None:
    """Does nothing (and opens no connection): for counting the worker's own sessions."""


def leaks_password(photo_id: str) -> None:
    """Fails with a URL holding a password (built at run time, so this source line, which a
    traceback quotes, does not hold it)."""
    _record(photo_id, "error")
    url = "https://svc:" + "S3cret" + "PW@photos.example/"
    raise RuntimeError(f"cannot fetch {url}{photo_id}")


def traced(photo_id: str) -> None:
    """Makes a span of its own (which must nest under the worker's `process` span); fails for
    ids starting with `fail`."""
    from opentelemetry import trace

    with trace.get_tracer("tests.handlers").start_as_current_span("handler work"):
        if photo_id.startswith("fail"):
            raise RuntimeError(f"cannot process {photo_id}")


async def async_def(photo_id: str) -> None:
    _record(photo_id, "ok")


class _AsyncCall:
    """An async handler `inspect.iscoroutinefunction` does not recognise: an object whose
    `__call__` is an async def."""

    async def __call__(self, photo_id: str) -> None:
        _record(photo_id, "ok")


async_callable = _AsyncCall()


def forks_a_child_that_exits(photo_id: str) -> None:
    """Forks a child that calls `sys.exit(0)` (as a handler's own subprocess code may): the
    child must end there, not report an outcome or run on as a worker."""
    pid = os.fork()
    if pid == 0:
        raise SystemExit(0)
    os.waitpid(pid, 0)
    _record(photo_id, "ok")


def system_exit(photo_id: str) -> None:
    _record(photo_id, "exit")
    raise SystemExit(3)


def dies_leaving_a_child(photo_id: str) -> None:
    """Forks a child that keeps the horse's descriptors until gate `child` opens, then kills
    its own horse with SIGKILL: no outcome is reported, and the report pipe stays open."""
    _record(photo_id, "started")
    if os.fork() == 0:
        wait_for_gate("child")
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def exits_quietly(photo_id: str) -> None:
    """Ends its process with status 0 and no word (`os._exit`), as a C library might."""
    _record(photo_id, "started")
    os._exit(0)
