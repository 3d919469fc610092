"""`Env`, one test's servers: its own database (a clone of the migrated template) and its own
flushed Redis db, with connections that close when the test ends and the environment its
child processes get."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

from tests.support.cli import cli_json
from tests.support.processes import child_environ


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
        return cli_json(self, *args)

    def process_env(self, **extra: str) -> dict[str, str]:
        """The environment of a child process of this test (see `child_environ`)."""
        urls = {"DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url}
        return child_environ(**{**urls, **extra})
