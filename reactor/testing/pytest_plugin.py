"""The pytest plugin of `reactor.testing`, loaded by the package's `pytest11` entry point.

Two fixtures:
- `reactor_connection`: the connection the kit works on. By default a psycopg connection to
  `DATABASE_URL` (a test database: `run` runs every due row of its types, committed ones
  too), migrated to this release's schema (else the test fails saying so), in a transaction
  opened before the test and rolled back after it: the test's own `conn.transaction()` blocks
  are savepoints in it, and an explicit `commit()` is refused, so no test sees another's
  rows. Override it to hand the kit the connection your code under test writes on (Django's
  `connection`, a SQLAlchemy session).
- `reactor_jobs`: the kit bound to that connection (`ReactorJobs`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
import pytest

from reactor import testing
from reactor.errors import ReactorError
from reactor.pg.db import check_schema
from reactor.producer import DEFAULT_JOB_TYPE

__all__ = ["ReactorJobs", "reactor_connection", "reactor_jobs"]


class ReactorJobs:
    """`reactor.testing`'s functions on one connection."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def submitted(self, type: str | None = None) -> list[testing.Submitted]:  # noqa: A002
        return testing.submitted(self.conn, type)

    def assert_submitted(
        self,
        photo_id: str,
        type: str = DEFAULT_JOB_TYPE,  # noqa: A002
        **expected: Any,
    ) -> testing.Submitted:
        return testing.assert_submitted(self.conn, photo_id, type, **expected)

    def run(
        self,
        *,
        handlers: testing.Handlers | None = None,
        types: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[testing.JobResult]:
        return testing.run_jobs(self.conn, handlers=handlers, types=types, limit=limit)

    def advance(self, seconds: float, type: str | None = None) -> int:  # noqa: A002
        return testing.advance(self.conn, seconds, type)


@pytest.fixture
def reactor_connection() -> Iterator[Any]:
    """A psycopg connection to `DATABASE_URL`, in a transaction rolled back after the test."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        pytest.fail("reactor_connection: set DATABASE_URL, or override this fixture")
    with psycopg.connect(url) as conn:
        try:
            check_schema(conn)
        except ReactorError as exc:
            pytest.fail(f"reactor_connection: {exc}", pytrace=False)
        # Open before the test: on an idle connection, the app's `with conn.transaction():`
        # would begin a transaction of its own and commit it.
        with conn.transaction(force_rollback=True):
            yield conn


@pytest.fixture
def reactor_jobs(reactor_connection: Any) -> ReactorJobs:
    """The kit on `reactor_connection`."""
    return ReactorJobs(reactor_connection)
