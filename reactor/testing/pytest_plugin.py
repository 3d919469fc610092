"""The pytest plugin of `reactor.testing`, loaded by the package's `pytest11` entry point.

Two fixtures:
- `reactor_connection`: the connection the kit works on. By default a psycopg connection to
  `DATABASE_URL` (a test database), migrated to this release's schema and holding no
  committed row in `photo_jobs` (else the test fails saying so: `run` would run such rows),
  in a transaction opened before the test and rolled back after it: the test's own
  `conn.transaction()` blocks are savepoints in it, and an explicit `commit()` is refused,
  so no test sees another's rows. A test whose code committed rows anyway (on a connection
  of its own) fails at teardown, naming them. Override it to hand the kit the connection
  your code under test writes on (Django's `connection`, a SQLAlchemy session).
- `reactor_jobs`: the kit bound to that connection (`ReactorJobs`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
import pytest

from reactor import testing
from reactor.errors import ConfigError, ReactorError
from reactor.pg.db import check_schema, connect
from reactor.producer import DEFAULT_JOB_TYPE
from reactor.redact import redact

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
        __tracebackhide__ = True
        return testing.assert_submitted(self.conn, photo_id, type, **expected)

    def assert_not_submitted(self, photo_id: str | None = None, **fields: Any) -> None:
        __tracebackhide__ = True
        testing.assert_not_submitted(self.conn, photo_id, **fields)

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
        pytest.fail("reactor_connection: set DATABASE_URL, or override this fixture", pytrace=False)
    try:
        conn = connect(url, purpose="tests")
    except ConfigError as exc:  # a malformed URL, not shown: it may hold a password
        pytest.fail(f"reactor_connection: DATABASE_URL: {exc}", pytrace=False)
    except ReactorError as exc:  # unreachable, refused: one line, the password masked
        pytest.fail(f"reactor_connection: {redact(url)}: {exc}", pytrace=False)
    with conn:
        try:
            check_schema(conn)
        except ReactorError as exc:
            pytest.fail(f"reactor_connection: {exc}", pytrace=False)
        committed = _committed(conn)
        if committed:
            # `run` would run them: a leak of an earlier test or run fails here, not far off.
            pytest.fail(
                f"reactor_connection: photo_jobs already holds {_rows(committed)} committed"
                " before this test (an earlier test or run committed them): use an empty test"
                " database, or empty this one (TRUNCATE photo_jobs)",
                pytrace=False,
            )
        # Open before the test: on an idle connection, the app's `with conn.transaction():`
        # would begin a transaction of its own and commit it.
        with conn.transaction(force_rollback=True):
            yield conn
        committed = _committed(conn)
        if committed:
            pytest.fail(
                f"reactor_connection: this test committed {_rows(committed)} to photo_jobs"
                " (on a connection other than reactor_connection); the next test would run"
                " them: write on the fixture's connection, or delete them in the test",
                pytrace=False,
            )


def _committed(conn: psycopg.Connection[Any]) -> list[testing.Submitted]:
    """The rows of `photo_jobs` outside any test's transaction (`conn` is idle: all of them
    committed); the transaction the read opened is ended."""
    rows = testing.submitted(conn)
    conn.rollback()
    return rows


def _rows(rows: list[testing.Submitted]) -> str:
    """'N row(s) (type photo_id state, ...)', the first three named."""
    named = ", ".join(f"{r.type} {r.photo_id!r} {r.state}" for r in rows[:3])
    more = ", ..." if len(rows) > 3 else ""
    return f"{len(rows)} row(s) ({named}{more})"


@pytest.fixture
def reactor_jobs(reactor_connection: Any) -> ReactorJobs:
    """The kit on `reactor_connection`."""
    return ReactorJobs(reactor_connection)
