"""`reactor.testing` on every kind of connection `submit()` takes, with no Redis anywhere:
rows submitted in an open transaction are listed and run there, through the worker's own
lifecycle (done, a retry after its backoff, failed), and the rollback leaves nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import reactor
from reactor import testing
from reactor.errors import ConfigError
from reactor.producer import sync_executor
from reactor.settings import DEFAULT_RETRY_BASE_SECONDS
from reactor.worker.entry import HandlerImportError
from tests.support.env import Env
from tests.support.processes import Process, child_environ, start_worker
from tests.support.urls import with_path

ROOT = Path(__file__).resolve().parent.parent


def flaky(photo_id: str) -> None:
    raise RuntimeError(f"{photo_id} not yet")


def broken(photo_id: str) -> None:
    raise reactor.PermanentError(f"{photo_id} is not a photo")


HANDLERS: dict[str, Callable[[str], object]] = {
    "photo.process": lambda photo_id: None,
    "photo.flaky": flaky,
    "photo.broken": broken,
}


def rows_seen_outside(url: str) -> int:
    with psycopg.connect(url) as other:
        row = other.execute("SELECT count(*) FROM photo_jobs").fetchone()
    assert row is not None
    return int(row[0])


def exercise(conn: Any) -> None:
    """Submit, list, run, advance and run again on `conn`, in its open transaction."""
    reactor.submit(conn, "ok")
    reactor.submit(conn, "flaky", "photo.flaky", max_attempts=2)
    reactor.submit(conn, "broken", "photo.broken")
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    reactor.submit(conn, "later", run_at=later)
    testing.assert_submitted(conn, "ok", state="pending", attempts=0, due=True)
    testing.assert_submitted(conn, "later", due=False, max_attempts=5)
    assert [r.photo_id for r in testing.submitted(conn, "photo.flaky")] == ["flaky"]

    first = testing.run_jobs(conn, handlers=HANDLERS)
    assert sorted((r.photo_id, r.outcome, r.attempt) for r in first) == [
        ("broken", "failed", 1),
        ("flaky", "retry", 1),
        ("ok", "done", 1),
    ]
    assert {r.photo_id: r.error for r in first}["broken"] == (
        "PermanentError: broken is not a photo"
    )
    testing.assert_submitted(conn, "ok", state="done", attempts=1)
    testing.assert_submitted(conn, "broken", "photo.broken", state="failed", attempts=1)
    retried = testing.assert_submitted(
        conn,
        "flaky",
        "photo.flaky",
        state="pending",
        attempts=1,
        due=False,
        last_error="RuntimeError: flaky not yet",
    )
    # The lifecycle's backoff after attempt 1: uniform in [base/2, base] after the
    # transaction's now (which the rows submitted in it were created at).
    now = testing.assert_submitted(conn, "ok").run_at
    delay = (retried.run_at - now).total_seconds()
    assert DEFAULT_RETRY_BASE_SECONDS / 2 <= delay <= DEFAULT_RETRY_BASE_SECONDS
    assert testing.run_jobs(conn, handlers=HANDLERS) == []  # nothing due: no sleeping here

    assert testing.advance(conn, DEFAULT_RETRY_BASE_SECONDS) == 2  # flaky, and later
    second = testing.run_jobs(conn, handlers=HANDLERS, types=["photo.flaky"])
    assert [(r.photo_id, r.outcome, r.attempt) for r in second] == [("flaky", "failed", 2)]
    testing.assert_submitted(conn, "flaky", "photo.flaky", state="failed", attempts=2)
    testing.assert_submitted(conn, "later", state="pending", due=False)
    a_failed_statement(conn)


def a_failed_statement(conn: Any) -> None:
    """A handler whose statement fails on `conn` ends its attempt like any exception: what it
    wrote is undone, and the test's transaction goes on."""
    execute = sync_executor(conn)

    def divide(photo_id: str) -> None:
        reactor.submit(conn, f"{photo_id}-child", "photo.child")  # its own work: undone
        execute("SELECT 1/0", {})

    reactor.submit(conn, "sql", "photo.sql", max_attempts=2)
    [first] = testing.run_jobs(conn, handlers={"photo.sql": divide})
    assert (first.outcome, first.attempt) == ("retry", 1)
    assert "division by zero" in (first.error or "")
    testing.assert_submitted(conn, "sql", "photo.sql", state="pending", attempts=1)
    assert testing.submitted(conn, "photo.child") == []
    testing.advance(conn, 3600)
    [second] = testing.run_jobs(conn, handlers={"photo.sql": divide})
    assert (second.outcome, second.attempt) == ("failed", 2)
    testing.assert_submitted(conn, "sql", "photo.sql", state="failed", attempts=2)
    testing.assert_submitted(conn, "ok", state="done")  # what the test did before, intact


def test_psycopg_in_the_callers_transaction(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        exercise(conn)
        assert rows_seen_outside(database_url) == 0  # all of it in the open transaction
        conn.rollback()
    assert rows_seen_outside(database_url) == 0


def test_psycopg_async(database_url: str) -> None:
    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            await reactor.submit_async(conn, "ok")
            await reactor.submit_async(conn, "flaky", "photo.flaky")
            await testing.assert_submitted_async(conn, "ok", state="pending")
            results = await testing.run_jobs_async(conn, handlers=HANDLERS)
            assert sorted((r.photo_id, r.outcome) for r in results) == [
                ("flaky", "retry"),
                ("ok", "done"),
            ]
            assert await testing.advance_async(conn, 3600) == 1
            again = await testing.run_jobs_async(conn, handlers=HANDLERS)
            assert [(r.photo_id, r.attempt) for r in again] == [("flaky", 2)]
            rows = await testing.submitted_async(conn)
            assert {(r.photo_id, r.state) for r in rows} == {("ok", "done"), ("flaky", "pending")}
            assert rows_seen_outside(database_url) == 0
            await conn.rollback()

    asyncio.run(run())
    assert rows_seen_outside(database_url) == 0


def sqlalchemy_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


@pytest.mark.parametrize("holder", ["Connection", "Session"])
def test_sqlalchemy(database_url: str, holder: str) -> None:
    engine = create_engine(sqlalchemy_url(database_url))
    try:
        with engine.connect() as connection:
            if holder == "Connection":
                exercise(connection)
            else:
                with Session(bind=connection) as session:
                    exercise(session)
            assert rows_seen_outside(database_url) == 0
            connection.rollback()
    finally:
        engine.dispose()
    assert rows_seen_outside(database_url) == 0


@pytest.mark.parametrize("holder", ["AsyncConnection", "AsyncSession"])
def test_sqlalchemy_async(database_url: str, holder: str) -> None:
    async def run() -> None:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with engine.connect() as connection:
                conn: Any = connection if holder == "AsyncConnection" else AsyncSession(connection)
                await reactor.submit_async(conn, "flaky", "photo.flaky", max_attempts=1)
                results = await testing.run_jobs_async(conn, handlers=HANDLERS)
                assert [(r.photo_id, r.outcome, r.error) for r in results] == [
                    ("flaky", "failed", "RuntimeError: flaky not yet")  # attempts spent
                ]
                await testing.assert_submitted_async(
                    conn, "flaky", "photo.flaky", state="failed", attempts=1
                )
                assert rows_seen_outside(database_url) == 0
                await connection.rollback()
        finally:
            await engine.dispose()

    asyncio.run(run())


DJANGO_KIT = textwrap.dedent(
    """
    import sys
    from tests.support.django_setup import configure
    configure()
    from django.db import connection, transaction
    from reactor import testing
    from tests.test_testing_kit import exercise

    class RolledBack(Exception):
        pass

    try:
        with transaction.atomic():  # what a Django TestCase wraps each test in
            exercise(connection)
            raise RolledBack
    except RolledBack:
        print("exercised")
    """
)


def test_django_connection(database_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", DJANGO_KIT],
        env=child_environ(DATABASE_URL=database_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exercised"
    assert rows_seen_outside(database_url) == 0


def test_handlers_default_to_reactor_routes(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(database_url) as conn:
        reactor.submit(conn, "p1", "photo.thumb")
        monkeypatch.delenv("REACTOR_ROUTES", raising=False)
        with pytest.raises(ConfigError, match=r"give handlers= .* or set REACTOR_ROUTES"):
            testing.run_jobs(conn)
        monkeypatch.setenv("REACTOR_ROUTES", "photo.thumb=tests.test_testing_kit.broken@thumbs")
        [result] = testing.run_jobs(conn)
        assert (result.photo_id, result.outcome) == ("p1", "failed")
        with pytest.raises(ValueError, match=r"no handler for types \['photo.other'\]"):
            testing.run_jobs(conn, types=["photo.other"])


def test_assert_submitted_says_what_was_submitted(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        reactor.submit(conn, "IMG_1")
        with pytest.raises(AssertionError) as missing:
            testing.assert_submitted(conn, "IMG_2")
        assert "no photo.process job for photo 'IMG_2'; submitted:" in str(missing.value)
        assert "photo_id='IMG_1'" in str(missing.value)
        with pytest.raises(AssertionError, match=r"state='pending' \(expected 'done'\)"):
            testing.assert_submitted(conn, "IMG_1", state="done")
        with pytest.raises(TypeError, match="unknown fields \\['colour'\\]"):
            testing.assert_submitted(conn, "IMG_1", colour="red")


def test_assert_not_submitted_lists_what_matches(database_url: str) -> None:
    """The refutation of `assert_submitted`, matching as it does: every field given equal."""
    with psycopg.connect(database_url) as conn:
        testing.assert_not_submitted(conn)  # nothing at all
        reactor.submit(conn, "IMG_1")
        reactor.submit(conn, "IMG_1", "photo.thumb", max_attempts=2)
        testing.assert_not_submitted(conn, "IMG_2")
        testing.assert_not_submitted(conn, "IMG_1", state="done")
        testing.assert_not_submitted(conn, type="photo.other")
        testing.assert_not_submitted(conn, "IMG_1", type="photo.thumb", max_attempts=5)
        with pytest.raises(AssertionError) as matched:
            testing.assert_not_submitted(conn, "IMG_1", state="pending")
        said = str(matched.value)
        assert said.startswith("expected no job matching photo_id='IMG_1', state='pending';")
        assert "2 submitted:" in said and "type='photo.thumb'" in said
        with pytest.raises(AssertionError, match="expected no job matching anything; 2 sub"):
            testing.assert_not_submitted(conn)
        with pytest.raises(TypeError, match="assert_not_submitted: unknown fields \\['colour'\\]"):
            testing.assert_not_submitted(conn, colour="red")
    with pytest.raises(AssertionError, match=r"type='photo.thumb'; 1 submitted:"):
        asyncio.run(no_thumb_async(database_url))


async def no_thumb_async(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await reactor.submit_async(conn, "IMG_1", "photo.thumb")
        await testing.assert_not_submitted_async(conn, "IMG_2", type="photo.thumb")
        await testing.assert_not_submitted_async(conn, type="photo.thumb")


def test_a_handler_that_cancels_its_row_is_superseded(database_url: str) -> None:
    """The outcome of an attempt whose row moved on while it ran is fenced off: not `done`."""
    with psycopg.connect(database_url) as conn:

        def cancel_own(photo_id: str) -> None:
            assert reactor.cancel(conn, photo_id)

        reactor.submit(conn, "IMG_1")
        [result] = testing.run_jobs(conn, handlers={"photo.process": cancel_own})
        assert (result.outcome, result.attempt, result.error) == ("superseded", 1, None)
        testing.assert_submitted(conn, "IMG_1", state="cancelled", attempts=1)


def test_a_row_another_attempt_holds_is_left_alone(database_url: str) -> None:
    """The kit claims as the reactor does: a row another transaction has locked (a reactor's
    claim in flight) is skipped, not waited for and not run twice."""
    with psycopg.connect(database_url, autocommit=True) as setup:
        reactor.submit(setup, "held")
        reactor.submit(setup, "free")
    with psycopg.connect(database_url) as holder, psycopg.connect(database_url) as conn:
        holder.execute("SELECT FROM photo_jobs WHERE photo_id = 'held' FOR UPDATE")
        results = testing.run_jobs(conn, handlers=HANDLERS)
        assert [(r.photo_id, r.outcome) for r in results] == [("free", "done")]


PLUGIN_TEST = textwrap.dedent(
    """
    import reactor

    def test_submit_then_run(reactor_jobs):
        reactor.submit(reactor_jobs.conn, "IMG_9")
        reactor_jobs.assert_submitted("IMG_9", state="pending")
        reactor_jobs.assert_not_submitted("IMG_8")  # the next test's: never seen here
        [result] = reactor_jobs.run(handlers={"photo.process": lambda photo_id: None})
        assert result.outcome == "done"
        reactor_jobs.assert_submitted("IMG_9", state="done")

    def test_fails_with_the_listing(reactor_jobs):
        reactor.submit(reactor_jobs.conn, "IMG_8")
        reactor_jobs.assert_submitted("IMG_7")
    """
)


def test_pytest_plugin_fixture(database_url: str, tmp_path: Path) -> None:
    out = run_pytest(tmp_path, database_url, PLUGIN_TEST)
    assert "1 failed, 1 passed" in out, out
    assert "no photo.process job for photo 'IMG_7'; submitted:" in out
    # The failure points at the test's line; the kit's own frames are hidden.
    assert 'reactor_jobs.assert_submitted("IMG_7")' in out, out
    assert "reactor/testing/" not in out, out
    assert rows_seen_outside(database_url) == 0  # each test's transaction rolled back


def run_pytest(tmp_path: Path, database_url: str, test_source: str) -> str:
    """Run `test_source` as a project's test module (`tmp_path` its root); pytest's output."""
    (tmp_path / "test_app.py").write_text(test_source)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py"],
        env=child_environ(DATABASE_URL=database_url),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout + out.stderr


ISOLATION_TEST = textwrap.dedent(
    """
    import reactor

    def test_one(reactor_jobs):
        with reactor_jobs.conn.transaction():  # the app's own transaction block
            reactor.submit(reactor_jobs.conn, "LEAK_1")
        reactor.submit(reactor_jobs.conn, "LEAK_2")
        assert [r.photo_id for r in reactor_jobs.submitted()] == ["LEAK_1", "LEAK_2"]

    def test_two(reactor_jobs):
        assert reactor_jobs.submitted() == []
        with reactor_jobs.conn.transaction():
            reactor.submit(reactor_jobs.conn, "LEAK_3")
        reactor_jobs.assert_submitted("LEAK_3")
    """
)


def test_pytest_plugin_fixture_isolates_tests(database_url: str, tmp_path: Path) -> None:
    """The fixture's transaction is open before the test runs: the app's own transaction
    blocks are savepoints in it, and nothing a test writes reaches the next test."""
    out = run_pytest(tmp_path, database_url, ISOLATION_TEST)
    assert "2 passed" in out, out
    assert rows_seen_outside(database_url) == 0


COMMITTING_TEST = textwrap.dedent(
    """
    import os

    import psycopg
    import reactor

    def test_commits_on_its_own_connection(reactor_jobs):
        with psycopg.connect(os.environ["DATABASE_URL"]) as own:
            reactor.submit(own, "IMG_OWN")

    def test_next(reactor_jobs):
        reactor_jobs.assert_not_submitted()
    """
)


def test_pytest_plugin_fixture_refuses_committed_rows(database_url: str, tmp_path: Path) -> None:
    """`run` runs every due row it sees: a row an earlier run committed fails each test at
    once, naming it, and a test that commits fails its teardown (not a later test, far off)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        for n in range(4):
            reactor.submit(conn, f"LEAKED_{n}")
    out = run_pytest(tmp_path, database_url, PLUGIN_TEST)
    assert "2 errors" in out, out
    assert (
        "reactor_connection: photo_jobs already holds 4 row(s) (photo.process 'LEAKED_0' pending,"
        " photo.process 'LEAKED_1' pending, photo.process 'LEAKED_2' pending, ...) committed"
        " before this test" in out
    ), out
    assert "or empty this one (TRUNCATE photo_jobs)" in out
    assert "def reactor_connection" not in out  # one line, no fixture source

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE photo_jobs")
    out = run_pytest(tmp_path, database_url, COMMITTING_TEST)
    assert "1 passed, 2 errors" in out, out
    assert "ERROR at teardown of test_commits_on_its_own_connection" in out
    assert (
        "reactor_connection: this test committed 1 row(s) (photo.process 'IMG_OWN' pending)"
        " to photo_jobs" in out
    ), out
    assert "ERROR at setup of test_next" in out
    assert "def reactor_connection" not in out


def test_pytest_plugin_fixture_connection_errors_in_one_line(tmp_path: Path) -> None:
    """No traceback and no password: the fixture's own failures are one line each."""
    out = run_pytest(tmp_path, "postgresql://kit:s3cret@127.0.0.1:1/nowhere", PLUGIN_TEST)
    assert "2 errors" in out, out
    assert (
        "reactor_connection: postgresql://kit:***@127.0.0.1:1/nowhere: cannot connect to"
        ' Postgres: connection failed: connection to server at "127.0.0.1", port 1 failed:' in out
    ), out
    assert "s3cret" not in out and "Traceback" not in out and "def reactor_connection" not in out
    out = run_pytest(tmp_path, "password=s3cret host=127.0.0.1 port=1 bogus=1", PLUGIN_TEST)
    assert "2 errors" in out, out
    assert "reactor_connection: DATABASE_URL: bad database URL: invalid connection option" in out
    assert "s3cret" not in out and "def reactor_connection" not in out
    out = run_pytest(tmp_path, "", PLUGIN_TEST)
    assert "2 errors" in out, out
    assert "reactor_connection: set DATABASE_URL, or override this fixture" in out
    assert "def reactor_connection" not in out


PATCHED_HANDLER_TEST = textwrap.dedent(
    """
    from unittest import mock

    import reactor

    HANDLERS = {"photo.process": "rv_app.photos.process"}

    def test_the_real_handler(reactor_jobs):
        reactor.submit(reactor_jobs.conn, "IMG_1")
        [result] = reactor_jobs.run(handlers=HANDLERS)
        assert result.outcome == "done"

    def test_a_patched_handler(reactor_jobs):
        reactor.submit(reactor_jobs.conn, "IMG_2")
        bad = reactor.PermanentError("patched")
        with mock.patch("rv_app.photos.process", side_effect=bad) as patched:
            [result] = reactor_jobs.run(handlers=HANDLERS)
        patched.assert_called_once_with("IMG_2")
        assert (result.outcome, result.error) == ("failed", "PermanentError: patched")
    """
)


def test_a_dotted_path_is_resolved_on_each_run(database_url: str, tmp_path: Path) -> None:
    """A handler named by its path is looked up when `run` runs, not once per process: a
    test that patches it gets its mock, whichever test ran the real handler before."""
    (tmp_path / "rv_app").mkdir()
    (tmp_path / "rv_app" / "__init__.py").write_text("")
    (tmp_path / "rv_app" / "photos.py").write_text("def process(photo_id):\n    pass\n")
    out = run_pytest(tmp_path, database_url, PATCHED_HANDLER_TEST)
    assert "2 passed" in out, out


def test_a_handler_that_cannot_be_imported(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        reactor.submit(conn, "IMG_1")
        for path, cause in [
            ("tests.no_such_module.process", "No module named 'tests.no_such_module'"),
            ("tests.test_testing_kit.HANDLERS", "TypeError: HANDLERS is not callable"),
            ("process", "ValueError: not a dotted path"),
        ]:
            with pytest.raises(HandlerImportError) as raised:
                testing.run_jobs(conn, handlers={"photo.process": path})
            assert str(raised.value) == f"cannot import handler {path}: {cause}"
        testing.assert_submitted(conn, "IMG_1", state="pending", attempts=0)


def test_an_async_handler_is_refused_not_counted_done(database_url: str) -> None:
    """Nothing awaits a coroutine: run_jobs reported `done` for a handler that never ran."""

    async def process(photo_id: str) -> None:
        raise AssertionError("never awaited, so never reached")

    class AsyncCall:
        async def __call__(self, photo_id: str) -> None:
            raise AssertionError("never awaited, so never reached")

    with psycopg.connect(database_url) as conn:
        reactor.submit(conn, "IMG_1")
        with pytest.raises(TypeError, match="is an async def: handlers are plain functions"):
            testing.run_jobs(conn, handlers={"photo.process": process})
        testing.assert_submitted(conn, "IMG_1", state="pending", attempts=0)
        (result,) = testing.run_jobs(conn, handlers={"photo.process": AsyncCall()})
        assert (result.outcome, result.attempt) == ("failed", 1)
        assert result.error == (
            "PermanentError: the handler returned a coroutine that nothing awaits:"
            " handlers are plain functions"
        )


def test_pytest_plugin_fixture_on_a_database_not_migrated(env: Env, tmp_path: Path) -> None:
    (tmp_path / "test_app.py").write_text(PLUGIN_TEST)
    bare = f"reactor_kit_bare_{os.getpid()}"
    admin = psycopg.connect(env.pg_server_url, autocommit=True)
    admin.execute(f"DROP DATABASE IF EXISTS {bare}")
    admin.execute(f"CREATE DATABASE {bare}")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py"],
            env=child_environ(DATABASE_URL=with_path(env.pg_server_url, bare)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        admin.execute(f"DROP DATABASE {bare}")
    assert "2 errors" in out.stdout, out.stdout + out.stderr
    assert "reactor_connection: database is not migrated" in out.stdout
    assert "run `reactor migrate` against it" in out.stdout
    assert "Traceback" not in out.stdout and "UndefinedTable" not in out.stdout


def transient(photo_id: str) -> None:
    raise RuntimeError("transient")


def corrupt(photo_id: str) -> None:
    raise reactor.PermanentError("corrupt")


PARITY_ROUTES = {
    "photo.process": "tests.test_testing_kit.done_handler",
    "photo.flaky": "tests.test_testing_kit.transient",
    "photo.broken": "tests.test_testing_kit.corrupt",
}


def done_handler(photo_id: str) -> None:
    pass


def parity_rows(url: str, prefix: str) -> dict[tuple[str, str], tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        found = conn.execute(
            "SELECT photo_id, type, state, attempts, prior_attempts, last_error,"
            " extract(epoch FROM next_retry_at - updated_at)"
            " FROM photo_jobs WHERE photo_id LIKE %s",
            [prefix + "%"],
        )
        return {(r[0].removeprefix(prefix), r[1]): tuple(r[2:]) for r in found}


@pytest.mark.parametrize("worker_class", ["plain rq worker", "reactor.SimpleWorker"])
def test_the_kit_writes_what_a_worker_writes(
    env: Env, spawn: Callable[..., Process], worker_class: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rows, run once by a real worker (through RQ) and once by the kit, end the
    same: state, attempts, token, last_error, and a retry due within the backoff (of a base
    long enough that the worker's retry is not due again when the kit runs)."""
    base = 600.0
    monkeypatch.setenv("REACTOR_RETRY_BASE_SECONDS", str(base))
    with env.connect() as conn:
        for prefix in ("w-", "k-"):
            reactor.submit(conn, prefix + "p", "photo.process")
            reactor.submit(conn, prefix + "p", "photo.flaky", max_attempts=2)
            reactor.submit(conn, prefix + "p", "photo.broken")
    routes = ",".join(f"{t}={h}" for t, h in PARITY_ROUTES.items())
    # The worker's rows first: the kit then finds them not due (done, failed, or retried later).
    with env.connect() as conn:
        conn.execute(
            "UPDATE photo_jobs SET next_retry_at = now() + interval '1 hour' WHERE photo_id = 'k-p'"
        )
    swept = env.cli_json(
        "sweep", *(a for t, h in PARITY_ROUTES.items() for a in ("--route", f"{t}={h}"))
    )
    assert swept["enqueued"] == 3
    extra = ("-w", "reactor.SimpleWorker") if worker_class != "plain rq worker" else ()
    worker = start_worker(
        spawn,
        env,
        "photo-process",
        "photo-flaky",
        "photo-broken",
        burst=True,
        extra_args=extra,
        REACTOR_ROUTES=routes,
        REACTOR_RETRY_BASE_SECONDS=str(base),
    )
    assert worker.proc.wait(timeout=120) == 0, worker.output()
    with env.connect() as conn:
        conn.execute("UPDATE photo_jobs SET next_retry_at = NULL WHERE photo_id = 'k-p'")
    with psycopg.connect(env.database_url) as conn:
        results = testing.run_jobs(conn, handlers=PARITY_ROUTES)
        assert sorted((r.photo_id, r.type) for r in results) == [
            ("k-p", t) for t in sorted(PARITY_ROUTES)
        ]
        conn.commit()
    by_worker, by_kit = parity_rows(env.database_url, "w-"), parity_rows(env.database_url, "k-")
    assert by_worker.keys() == by_kit.keys()
    for key, row in by_worker.items():
        if key[1] == "photo.flaky":  # pending after the backoff, uniform in [base/2, base]
            for seen in (row, by_kit[key]):
                assert seen[:4] == ("pending", 1, 0, "RuntimeError: transient")
                assert base / 2 - 0.1 <= seen[4] <= base
        else:
            assert (key, by_kit[key]) == (key, row)
    assert by_worker[("p", "photo.broken")][:4] == ("failed", 1, 0, "PermanentError: corrupt")
