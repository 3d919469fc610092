"""Fixtures of the test suite: real Postgres and Redis, one fresh database and Redis db per test.

Where the servers come from:
- by default, throwaway servers the suite starts from the `postgres`/`initdb`/`redis-server`
  binaries (PATH or /usr/lib/postgresql) and removes at the end: no local server is touched;
- only when told by URL, `REACTOR_TEST_DATABASE_URL` / `REACTOR_TEST_REDIS_URL` (the database
  named in the Postgres URL is only used to create and drop the test databases; the suite
  flushes Redis databases 1-12 of that server, and refuses to start if one of them holds keys
  it did not write);
- `REACTOR_TEST_DOCKER=1`: testcontainers instead of the binaries.
Every URL must point at a loopback address: tests never touch anything else.

Isolation: the schema is migrated once into a template database; every test gets its own
database cloned from it (`CREATE DATABASE ... TEMPLATE`) and its own flushed Redis db, so tests
run in any order. Tests that break Redis start a private `RedisServer`.

Only fixtures live here; what they are built from, and what tests import, is in tests/support.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Generator, Iterator

import pytest

from tests.support import db
from tests.support.docker import docker_answers
from tests.support.env import Env
from tests.support.processes import Process
from tests.support.redis_dbs import fresh_redis_db, refuse_foreign_redis_data
from tests.support.servers import PostgresServer, RedisServer
from tests.support.urls import assert_loopback, with_path

# -- servers -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    url = os.environ.get("REACTOR_TEST_DATABASE_URL")
    if url:
        assert_loopback(url)
        yield url
        return
    if docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    server = PostgresServer()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    url = os.environ.get("REACTOR_TEST_REDIS_URL")
    if url:
        assert_loopback(url)
        refuse_foreign_redis_data(url)
        yield url
        return
    if docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7-alpine") as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
        return
    server = RedisServer()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> Iterator[str]:
    name = f"reactor_tpl_{os.getpid()}"
    db.create_template(pg_server_url, name)
    yield name
    db.drop_database(pg_server_url, name)


# -- one test's servers --------------------------------------------------------------------


@pytest.fixture
def env(pg_server_url: str, redis_server_url: str, template_db: str) -> Iterator[Env]:
    name = db.clone_template(pg_server_url, template_db)
    redis_url = fresh_redis_db(redis_server_url)
    test_env = Env(pg_server_url, with_path(pg_server_url, name), name, redis_url)
    try:
        yield test_env
    finally:
        for cleanup in reversed(test_env.cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        db.drop_database(pg_server_url, name)


@pytest.fixture
def make_empty_database(pg_server_url: str) -> Iterator[Callable[[], str]]:
    """Create unmigrated databases (all dropped at the end); each call returns a URL."""
    names: list[str] = []

    def make() -> str:
        name = db.create_empty(pg_server_url)
        names.append(name)
        return with_path(pg_server_url, name)

    yield make
    for name in names:
        db.drop_database(pg_server_url, name)


@pytest.fixture
def empty_database(make_empty_database: Callable[[], str]) -> str:
    """An unmigrated database; its URL."""
    return make_empty_database()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis server of this test's own, which the test may stop and start."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()


# -- processes -----------------------------------------------------------------------------


#: The processes a test spawned, for the report of a failure.
SPAWNED = pytest.StashKey[list[Process]]()
#: Lines of each spawned process's output that a failed test's report shows.
SHOWN_OUTPUT_LINES = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the last lines of every process it spawned: a failure
    seen once on a loaded CI run can then be read, not only guessed at."""
    report = yield
    if report.when == "call" and report.failed:
        for proc in item.stash.get(SPAWNED, []):
            tail = "\n".join(proc.lines[-SHOWN_OUTPUT_LINES:])
            report.sections.append((f"Captured output of {proc.name} (last lines)", tail))
    return report


@pytest.fixture
def spawn(env: Env, request: pytest.FixtureRequest) -> Iterator[Callable[..., Process]]:
    """Start `python -m reactor ...` or `rq worker ...` subprocesses; all stopped at the end."""
    started: list[Process] = []
    request.node.stash[SPAWNED] = started

    def start(
        *args: str, name: str = "process", extra_env: dict[str, str] | None = None
    ) -> Process:
        proc = Process([sys.executable, *args], env.process_env(**(extra_env or {})), name)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill_all()


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids a test started indirectly (work horses that outlive their killed worker): the
    test appends them, and those still alive are SIGKILLed at its end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def database_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    """A migrated database of this test's own, and no Redis (for what must work without it)."""
    name = db.clone_template(pg_server_url, template_db)
    try:
        yield with_path(pg_server_url, name)
    finally:
        db.drop_database(pg_server_url, name)
