"""What every benchmark shares: servers, fresh databases, processes, who holds the doorbell,
statistics, tables. The throwaway servers are the test suite's (`tests.support.servers`), the
one piece the benchmarks take from tests/.

Servers come from BENCH_DATABASE_URL (any database of the server: benchmarks create and drop
databases of their own there) and BENCH_REDIS_URL (a Redis database the benchmarks flush: name
one that holds nothing of yours). Without them, the benchmarks start throwaway servers from the
binaries (PostgreSQL with fsync on, as a real server) and remove them at exit: they never write
into a server they were not told about. Each benchmark gets a fresh migrated database.
"""

from __future__ import annotations

import atexit
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql
from rq import Queue, Worker

from reactor.pg.migrate import migrate
from reactor.routes import DEMO_ROUTE
from tests.support.servers import PostgresServer, RedisServer

ROOT = Path(__file__).resolve().parent.parent


def _throwaway_postgres() -> str:
    server = PostgresServer(settings={"fsync": "on"})
    atexit.register(server.stop)
    return server.url


def _throwaway_redis() -> str:
    server = RedisServer()
    atexit.register(server.close)
    return server.url


SERVER_URL = os.environ.get("BENCH_DATABASE_URL") or _throwaway_postgres()
REDIS_URL = os.environ.get("BENCH_REDIS_URL") or _throwaway_redis()


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


@contextmanager
def fresh_database(
    server_url: str = SERVER_URL,
    prepare: Callable[[psycopg.Connection[Any]], object] = migrate,
) -> Iterator[str]:
    """A new database on `server_url`'s server, made ready by `prepare` (on an autocommit
    connection; by default every migration); yields its URL, drops it afterwards."""
    name = f"reactor_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_database(server_url, name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            prepare(conn)
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def redis_client(*, blocking: bool = False) -> redis.Redis:
    # redis-py's default 5 s socket timeout would break a long BLPOP.
    return redis.Redis.from_url(REDIS_URL, socket_timeout=None if blocking else 5)


def flush_redis() -> None:
    """Empty the benchmark's Redis database (a million jobs take seconds to free: no timeout)."""
    client = redis_client(blocking=True)
    client.flushdb()
    client.close()


def reset(url: str) -> None:
    """Empty the table and the benchmark's Redis database."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE photo_jobs")
    flush_redis()


def insert_pending(url: str, count: int, prefix: str = "p", **columns: Any) -> None:
    names = ", ".join(["photo_id", "type", *columns])
    values = ", ".join(["%(prefix)s || i", "'photo.process'", *(f"%({c})s" for c in columns)])
    query = f"INSERT INTO photo_jobs ({names}) SELECT {values} FROM generate_series(1, %(n)s) i"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(query, {"prefix": prefix, "n": count, **columns})
        conn.execute("VACUUM ANALYZE photo_jobs")


class Reactor:
    """`reactor run` as a subprocess (`module`: another entry point of the same command);
    `started()` waits until it listens."""

    def __init__(self, database_url: str, *args: str, module: str = "reactor") -> None:
        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL}
        env["PYTHONPATH"] = str(ROOT)
        # The benchmarks' jobs go to the demo handler, named here (no process defaults to it).
        env.setdefault("REACTOR_ROUTES", DEMO_ROUTE)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "run", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def started(self, timeout: float = 30) -> Reactor:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stderr:
            if "reactor_started" in line:
                # keep draining stderr so the reactor never blocks on a full pipe
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return self
            if time.monotonic() > deadline:
                break
        raise RuntimeError("reactor did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        time.sleep(interval)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process, then wait (SIGKILL after 30 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def rq_workers(
    command: Sequence[str], queue: str, count: int, env: Mapping[str, str]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes running `command` (RQ workers of `queue`), registered with RQ before
    this yields, stopped at the end; their output goes to one file, whose tail is printed if
    the block fails."""
    logs = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    procs = [
        subprocess.Popen(list(command), env=dict(env), stdout=logs, stderr=logs)
        for _ in range(count)
    ]
    client = redis_client()
    try:
        probe = Queue(queue, connection=client)
        wait_until(lambda: Worker.count(queue=probe) >= count, timeout=60, interval=0.02)
        yield procs
    except BaseException:
        logs.seek(0)
        sys.stderr.write(logs.read().decode(errors="replace")[-3000:])
        raise
    finally:
        stop_processes(procs)
        logs.close()
        client.close()


def armed_by(conn: psycopg.Connection[Any]) -> int | None:
    """The pid holding every doorbell key (sql/0004) in exclusive mode, if any."""
    row = conn.execute(
        """SELECT pid FROM pg_locks
            WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND classid = (photo_jobs_doorbell_key() >> 32)::oid
              AND objid::bigint - (photo_jobs_doorbell_key() & 4294967295)
                  BETWEEN 0 AND photo_jobs_doorbell_stripes() - 1
            GROUP BY pid HAVING count(DISTINCT objid) = photo_jobs_doorbell_stripes()"""
    ).fetchone()
    return None if row is None else int(row[0])


def count_state(url: str, state: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM photo_jobs WHERE state = %s", [state]).fetchone()
    return int(row[0]) if row else 0


@dataclass(frozen=True)
class Stat:
    """Median with min and max over repetitions."""

    median: float
    low: float
    high: float
    runs: int
    #: Every run's value, in the order measured (kept in results/latest.json).
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(statistics.median(values), min(values), max(values), len(values), tuple(values))

    def fmt(self, unit: str = "", digits: int = 1) -> str:
        return f"{self.median:,.{digits}f}{unit} ({self.low:,.{digits}f}–{self.high:,.{digits}f})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "runs": self.runs,
            "values": [round(v, 6) for v in self.values],
        }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
