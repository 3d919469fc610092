"""Workers run only their own handlers, and the grants README gives each role are enough and
no more.

Real reactors, sweeps and workers of every kind (`rq worker`, `-w reactor.Worker`, `-w
reactor.SimpleWorker`, `reactor worker`) on real Postgres and Redis. A tampered route names
`tests.planted.run`, which stands for `os.system`: importing or running it leaves a file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from rq.job import Job

import reactor
from reactor import submit
from reactor.jobs import job_id
from reactor.pg.registry import routes_in_use
from tests.handlers import SCHEMA
from tests.support.cli import NO_ROUTES, cli_without_routes, one_line, run_cli
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.processes import Process, start_worker
from tests.support.roles import as_role, throwaway_role
from tests.support.rows import states
from tests.support.waiting import wait_for

OK = "photo.process=tests.handlers.ok"
NOOP = "photo.process=tests.handlers.noop"
FAILS = "photo.process=tests.handlers.always_fails"
PLANTED = "tests.planted.run"
WORKER_CLASSES = {"fork": "reactor.Worker", "simple": "reactor.SimpleWorker"}


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def burst_worker(
    spawn: Callable[..., Process],
    env: Env,
    kind: str,
    *,
    route: str | None = None,
    prefixes: str | None = None,
    exit_code: int = 0,
    **extra_env: str,
) -> Process:
    """A burst worker of `kind` with `route` as its own (by flag for `reactor worker`, else in
    REACTOR_ROUTES; None: the recorded routes) and the handler allow-list `prefixes`."""
    if kind == "cli":
        flags = ["--burst"]
        flags += ["--route", route] if route else []
        flags += ["--handler-prefix", prefixes] if prefixes else []
        worker = spawn(
            "-m", "reactor", "worker", *flags, name="worker", extra_env={**NO_ROUTES, **extra_env}
        )
    else:
        extra_env["REACTOR_ROUTES"] = route or ""
        if prefixes:
            extra_env["REACTOR_HANDLER_PREFIXES"] = prefixes
        worker_class = ("--worker-class", WORKER_CLASSES[kind]) if kind in WORKER_CLASSES else ()
        worker = start_worker(spawn, env, burst=True, extra_args=worker_class, **extra_env)
    assert worker.exit_code(timeout=60) == exit_code, worker.output()
    return worker


def tamper_and_dispatch(env: Env, conn: psycopg.Connection[Any], handler: str) -> None:
    """A reactor recorded OK; a role that may write reactor_routes (as README let workers)
    rewrites the handler; a sweep started without routes enqueues p1's job with it."""
    assert cli_without_routes(env, "sweep", "--route", OK).returncode == 0
    conn.execute("UPDATE reactor_routes SET handler = %s", [handler])
    submit(conn, "p1", max_attempts=1)
    swept = cli_without_routes(env, "sweep")
    assert swept.returncode == 0, swept.stderr
    job = Job.fetch(job_id("photo.process", "p1", 1), connection=env.redis())
    assert job.kwargs["handler"] == handler


def row(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    found = conn.execute("SELECT state, attempts, last_error FROM photo_jobs").fetchone()
    assert found is not None
    return tuple(found)


@pytest.mark.parametrize("kind", ["rq", "fork", "simple", "cli"])
def test_a_job_naming_a_tampered_route_is_refused_and_nothing_is_imported(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    tmp_path: Path,
    kind: str,
) -> None:
    tamper_and_dispatch(env, conn, PLANTED)
    worker = burst_worker(spawn, env, kind, route=OK, PLANTED_TRACE_DIR=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [], worker.output()
    assert row(conn) == (
        "failed",
        1,
        "HandlerRefusedError: handler 'tests.planted.run' refused for type 'photo.process': "
        "this worker's route runs tests.handlers.ok",
    )
    refusals = [line for line in worker.lines if "handler_refused" in line]
    assert len(refusals) == 1, worker.output()
    assert "photo_id='p1' token=1" in refusals[0]


def test_a_handler_outside_the_allowed_prefixes_is_refused_whatever_the_routes_say(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    tmp_path: Path,
) -> None:
    # A plain `rq worker` follows the recorded routes, which now name the planted handler:
    # the job is refused in the work horse, a failed attempt.
    tamper_and_dispatch(env, conn, PLANTED)
    worker = burst_worker(
        spawn, env, "rq", prefixes="tests.handlers", PLANTED_TRACE_DIR=str(tmp_path)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [], worker.output()
    assert row(conn) == (
        "failed",
        1,
        "HandlerRefusedError: handler 'tests.planted.run' refused for type 'photo.process': "
        "outside the allowed handler prefixes (tests.handlers)",
    )
    refusals = [line for line in worker.lines if "handler_refused" in line]
    assert len(refusals) == 1, worker.output()


@pytest.mark.parametrize(("kind", "route"), [("cli", None), ("cli", OK), ("fork", OK)])
def test_a_worker_class_serving_a_handler_outside_its_prefixes_does_not_start(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    tmp_path: Path,
    kind: str,
    route: str | None,
) -> None:
    """A tampered recorded route, or the worker's own route under a mistyped prefix: the worker
    exits 2 in one line before it takes a job, which stays queued with no attempt spent."""
    tamper_and_dispatch(env, conn, PLANTED if route is None else OK.partition("=")[2])
    prefixes = "tests.handlers" if route is None else "tests.handler"  # a typo: matches none
    worker = burst_worker(
        spawn,
        env,
        kind,
        route=route,
        prefixes=prefixes,
        exit_code=2,
        PLANTED_TRACE_DIR=str(tmp_path),
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [], worker.output()
    errors = [line for line in worker.lines if "outside the allowed handler prefixes" in line]
    assert len(errors) == 1 and "no attempt spent" in errors[0], worker.output()
    assert row(conn) == ("active", 1, None)  # as the sweep left it: its job still queued
    assert env.redis().llen("rq:queue:photo-process") == 1


@pytest.mark.parametrize("kind", ["rq", "fork", "simple"])
def test_a_name_an_allowed_module_imports_from_outside_is_not_run(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    tmp_path: Path,
    kind: str,
) -> None:
    """The allow-list bounds where a handler is defined, not only the path that names it: a
    route rewritten to `tests.reexports.run` (inside the allowed `tests.reexports`, defined in
    `tests.planted`) is refused: a plain worker fails the attempt, a worker of the classes
    does not start."""
    tamper_and_dispatch(env, conn, "tests.reexports.run")
    worker = burst_worker(
        spawn,
        env,
        kind,
        prefixes="tests.reexports",
        exit_code=0 if kind == "rq" else 2,
        PLANTED_TRACE_DIR=str(tmp_path),
    )
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ran-")], worker.output()
    cause = (
        "cannot import handler tests.reexports.run: TypeError: run is defined in tests.planted,"
        " outside the allowed handler prefixes (tests.reexports)"
    )
    if kind == "rq":
        assert row(conn) == ("failed", 1, f"HandlerImportError: {cause}")
    else:
        errors = [line for line in worker.lines if cause in line]
        assert len(errors) == 1 and "no attempt spent" in errors[0], worker.output()
        assert row(conn) == ("active", 1, None)


def test_a_malformed_recorded_route_is_refused_in_one_line_and_no_row_is_lost(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    assert cli_without_routes(env, "sweep", "--route", OK).returncode == 0
    conn.execute("UPDATE reactor_routes SET handler = 'os.system; touch /tmp/x'")
    submit(conn, "p1")
    expected = (
        "reactor: error: bad route 'photo.process=os.system; touch /tmp/x@photo-process' "
        "recorded in reactor_routes: handler must be a dotted path like pkg.module.func"
    )
    assert one_line(cli_without_routes(env, "sweep"), 2) == expected
    assert one_line(cli_without_routes(env, "worker", "--burst"), 2) == expected
    # A worker of the classes, given no route, reads the recorded ones at start.
    worker = start_worker(
        spawn, env, burst=True, extra_args=("--worker-class", "reactor.Worker"), **NO_ROUTES
    )
    assert worker.exit_code(timeout=60) == 2, worker.output()
    assert expected.removeprefix("reactor: error: ") in worker.output()
    assert states(conn) == {"pending": 1}


def readme_grants(worker: str, producer: str, monitor: str) -> list[str]:
    """The GRANT statements of README's Security section, for these roles."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sql\n(GRANT .*?)```", text, re.S)
    assert block is not None, "README has no ```sql block of GRANTs"
    statements = []
    for text in block.group(1).split(";"):
        statement = re.sub(r"--[^\n]*", "", text).strip()
        if not statement:
            continue
        statement = statement.replace("photo_worker", f'"{worker}"')
        statement = statement.replace("photo_monitor", f'"{monitor}"')
        statements.append(statement.replace("photo_producer", f'"{producer}"'))
    return statements


def test_workers_and_producers_work_with_readmes_grants_and_workers_cannot_write_routes(
    env: Env, spawn: Callable[..., Process]
) -> None:
    owner = env.connect()
    with (
        throwaway_role(env) as worker_role,
        throwaway_role(env) as producer_role,
        throwaway_role(env) as monitor_role,
    ):
        grants = readme_grants(worker_role, producer_role, monitor_role)
        assert any("reactor_routes" in g for g in grants), grants
        for grant in grants:
            owner.execute(grant.encode())
        producer = psycopg.connect(as_role(env.database_url, producer_role))
        worker_url = as_role(env.database_url, worker_role)
        for round_ in (1, 2):  # a new row, then the re-arm of a done one
            with producer.transaction():
                assert submit(producer, "p1")
            assert env.cli_json("sweep", "--route", NOOP)["enqueued"] == 1
            worker = burst_worker(spawn, env, "cli", route=NOOP, DATABASE_URL=worker_url)
            assert "worker_ready" in worker.output()
            found = owner.execute("SELECT state, attempts FROM photo_jobs").fetchone()
            assert found == ("done", 1), (round_, worker.output())
        # The producer's grants also cancel a row, and re-arm a cancelled one.
        with producer.transaction():
            assert submit(producer, "p1")
            assert reactor.cancel(producer, "p1")
            assert submit(producer, "p1")
        assert owner.execute("SELECT state FROM photo_jobs").fetchone() == ("pending",)
        # What a worker's role can do to routes, pauses and the ledger: read them.
        with psycopg.connect(worker_url, autocommit=True) as as_worker:
            assert routes_in_use(as_worker)["photo.process"].handler == "tests.handlers.noop"
            for statement in (
                "UPDATE reactor_routes SET handler = 'tests.planted.run'",
                "INSERT INTO reactor_paused_types (type, paused_by) VALUES ('photo.process', 'x')",
                "DELETE FROM reactor_migrations",
                "INSERT INTO photo_jobs (photo_id, type) VALUES ('p2', 'photo.process')",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    as_worker.execute(statement)
        # A producer writes no attempt counter (a huge prior_attempts stopped its type's
        # claims) and no state but a re-arm's.
        for statement in (
            "UPDATE photo_jobs SET prior_attempts = 9223372036854775807",
            "UPDATE photo_jobs SET attempts = 0",
            "INSERT INTO photo_jobs (photo_id, type, prior_attempts) VALUES ('p9', 'photo.process', 1)",
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES ('p9', 'photo.process', 'done')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), producer.transaction():
                producer.execute(statement)
        producer.close()
        found = owner.execute("SELECT prior_attempts, attempts FROM photo_jobs").fetchone()
        # Each re-arm carried the lives' attempts into the token: two dispatched lives, then a
        # cancelled one that never ran; the row waits at attempts 0 of its fourth life.
        assert found == (2, 0)
        # The monitor reads what status and failures show.
        monitor = {"DATABASE_URL": as_role(env.database_url, monitor_role)}
        for command in ("status", "failures"):
            shown = run_cli(env, command, extra_env=monitor)
            assert shown.returncode == 0, (command, shown.stderr)


def test_a_worker_following_the_recorded_routes_runs_a_route_changed_on_purpose(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    tmp_path: Path,
) -> None:
    """The worker reads the recorded routes again when a job names another handler: a route
    changed on purpose runs at once, a tampered one outside the allow-list never does."""
    assert cli_without_routes(env, "sweep", "--route", OK).returncode == 0
    worker = spawn(
        *("-m", "reactor", "worker", "--simple", "--handler-prefix", "tests.handlers"),
        name="worker",
        extra_env={**NO_ROUTES, "PLANTED_TRACE_DIR": str(tmp_path)},
    )
    worker.wait_for_line("worker_ready")

    def outcome(photo_id: str) -> tuple[Any, ...] | None:
        found = conn.execute(
            "SELECT state, last_error FROM photo_jobs WHERE photo_id = %s AND attempts = 1",
            [photo_id],
        ).fetchone()
        return tuple(found) if found is not None and found[0] != "active" else None

    submit(conn, "p1")
    assert cli_without_routes(env, "sweep").returncode == 0
    assert wait_for(lambda: outcome("p1"), timeout=30, what="p1 run") == ("done", None)
    # No reactor runs: a sweep records the new route as it dispatches p2.
    submit(conn, "p2", max_attempts=1)
    assert cli_without_routes(env, "sweep", "--route", FAILS).returncode == 0
    assert wait_for(lambda: outcome("p2"), timeout=30, what="p2 run") == (
        "failed",
        "RuntimeError: boom 1",
    )
    conn.execute("UPDATE reactor_routes SET handler = %s", [PLANTED])
    submit(conn, "p3", max_attempts=1)
    assert cli_without_routes(env, "sweep").returncode == 0
    refused = wait_for(lambda: outcome("p3"), timeout=30, what="p3 refused")
    assert refused is not None and refused[0] == "failed", refused
    assert "outside the allowed handler prefixes" in refused[1], refused
    assert sorted(p.name for p in tmp_path.iterdir()) == [], worker.output()
