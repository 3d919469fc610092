"""Test harness: real Postgres and Redis, one fresh database and Redis db per test.

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
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from psycopg import sql

from reactor.migrate import migrate
from reactor.routes import DEMO_ROUTE
from tests.servers import PostgresServer, RedisServer

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


# -- helpers -------------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def assert_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host in ("", "localhost") or host.startswith("/"):
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise pytest.UsageError(f"refusing to test against a non-loopback server: {host}")


def with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + path, parts.query, ""))


def _docker_answers() -> bool:
    if os.environ.get("REACTOR_TEST_DOCKER") != "1":
        return False
    sock_path = "/var/run/docker.sock"
    if os.environ.get("DOCKER_HOST"):
        return True
    if not os.path.exists(sock_path):
        return False
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(sock_path)
        except OSError:
            return False
    return True


# -- servers -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    url = os.environ.get("REACTOR_TEST_DATABASE_URL")
    if url:
        assert_loopback(url)
        yield url
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    server = PostgresServer()
    try:
        yield server.url
    finally:
        server.stop()


#: Redis databases the tests use (one per test, in turn), and the key that marks a database as
#: the suite's own: the suite flushes a database only if it is empty or holds this key.
TEST_REDIS_DBS = range(1, 13)
SUITE_MARKER_KEY = "photo-reactor:test-suite"


def refuse_foreign_redis_data(url: str) -> None:
    """Stop the run if a Redis database the suite would flush holds keys it did not write."""
    for number in TEST_REDIS_DBS:
        client = redis.Redis.from_url(with_path(url, str(number)))
        try:
            foreign = client.dbsize() > 0 and not client.exists(SUITE_MARKER_KEY)
        finally:
            client.close()
        if foreign:
            pytest.exit(
                f"refusing to use REACTOR_TEST_REDIS_URL: its database {number} holds keys "
                f"the test suite did not write (it flushes databases 1-12); give a Redis of "
                f"its own, or unset the variable to let the suite start one",
                returncode=2,
            )


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    url = os.environ.get("REACTOR_TEST_REDIS_URL")
    if url:
        assert_loopback(url)
        refuse_foreign_redis_data(url)
        yield url
        return
    if _docker_answers():
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
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(with_path(pg_server_url, name), autocommit=True) as conn:
        migrate(conn)
    yield name
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@dataclass
class Env:
    """One test's servers: its own database and Redis db."""

    pg_server_url: str
    database_url: str
    database_name: str
    redis_url: str
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("autocommit", True)
        conn = psycopg.connect(self.database_url, **kwargs)
        self.cleanups.append(conn.close)
        return conn

    def redis(self) -> redis.Redis:
        client = redis.Redis.from_url(self.redis_url)
        self.cleanups.append(client.close)
        return client

    def cli_json(self, *args: str) -> dict[str, Any]:
        """Run `python -m reactor ARGS...` against this env; its JSON output (exit 0 required)."""
        result = subprocess.run(
            [sys.executable, "-m", "reactor", *args],
            env=self.process_env(),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return dict(json.loads(result.stdout))

    def process_env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("REACTOR_", "DATABASE_URL", "REDIS_URL"))
        }
        env.update(
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            # Tests name the demo route (no process falls back to it); override to test others.
            REACTOR_ROUTES=DEMO_ROUTE,
        )
        env.update(extra)
        return env


_redis_dbs = itertools.cycle(TEST_REDIS_DBS)


def _new_database(pg_server_url: str, template: str) -> str:
    name = f"reactor_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    return name


def _drop_database(pg_server_url: str, name: str) -> None:
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def env(pg_server_url: str, redis_server_url: str, template_db: str) -> Iterator[Env]:
    name = _new_database(pg_server_url, template_db)
    redis_url = with_path(redis_server_url, str(next(_redis_dbs)))
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.set(SUITE_MARKER_KEY, "1")
    client.close()
    test_env = Env(pg_server_url, with_path(pg_server_url, name), name, redis_url)
    try:
        yield test_env
    finally:
        for cleanup in reversed(test_env.cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        _drop_database(pg_server_url, name)


@pytest.fixture
def make_empty_database(pg_server_url: str) -> Iterator[Callable[[], str]]:
    """Create unmigrated databases (all dropped at the end); each call returns a URL."""
    names: list[str] = []

    def make() -> str:
        name = f"reactor_e_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(pg_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        names.append(name)
        return with_path(pg_server_url, name)

    yield make
    for name in names:
        _drop_database(pg_server_url, name)


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


class Process:
    """A child process whose output is collected line by line (for waits and for failures)."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float = 20.0) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None and not any(text in line for line in self.lines):
                self._reader.join(timeout=2)
                raise AssertionError(f"{self.name} exited early:\n{self.output()}")
            return any(text in line for line in self.lines)

        wait_for(seen, timeout, what=f"{text!r} from {self.name}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def spawn(env: Env) -> Iterator[Callable[..., Process]]:
    """Start `python -m reactor ...` or `rq worker ...` subprocesses; all stopped at the end."""
    started: list[Process] = []

    def start(
        *args: str, name: str = "process", extra_env: dict[str, str] | None = None
    ) -> Process:
        proc = Process([sys.executable, *args], env.process_env(**(extra_env or {})), name)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def start_reactor(
    spawn: Callable[..., Process], *args: str, name: str = "reactor", **extra_env: str
) -> Process:
    """Start `reactor run` and wait until it listens (or polls) and has caught up."""
    proc = spawn("-m", "reactor", "run", *args, name=name, extra_env=extra_env)
    proc.wait_for_line("reactor_started")
    return proc


def start_worker(
    spawn: Callable[..., Process],
    env: Env,
    *queues: str,
    burst: bool = False,
    extra_args: tuple[str, ...] = (),
    redis_url: str | None = None,
    **extra_env: str,
) -> Process:
    """Start a plain `rq worker` on `queues` (default photo-process)."""
    url = redis_url or env.redis_url
    args = ["-m", "rq.cli", "worker", *(queues or ("photo-process",)), "--url", url]
    args += extra_args
    if burst:
        args.append("--burst")
    return spawn(*args, name="worker", extra_env=extra_env)
