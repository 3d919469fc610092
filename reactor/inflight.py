"""A statement sent now and its result read later, on the worker's own thread.

The worker classes overlap a Postgres round trip with RQ's Redis work for the same job: the
fenced start's read (`PEEK`) goes out before RQ marks the job started, and the `done` write
(`DONE`) as soon as the handler returned, before RQ records the success. `InFlight.send` hands
the statement to libpq and returns; `InFlight.receive` waits for its result, polling the socket
with the GIL released. No second thread is involved, so a job pays for no thread hand-off.

Guarantees:
- at most one statement is in flight, and `receive` always ends it: the connection is left
  idle with every result read, or closed (the owner's `Store` reconnects on its next use);
- a statement that could not be sent, or whose result was an error or never came, is reported
  as such (`send` returns False, `receive` None): the caller then runs it through
  `Store.execute`, which retries with backoff. Every statement here is fenced by the attempt
  number, so one that reached the server and runs again changes nothing more;
- with prepared statements enabled (`REACTOR_PREPARED_STATEMENTS`), each statement is prepared
  once per server session under a name that carries a hash of its text; otherwise it goes out
  as an unnamed statement, which a transaction pooler accepts.
"""

from __future__ import annotations

import contextlib
import re
import select
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import psycopg
from psycopg import pq

from reactor import db, queries

__all__ = ["DONE", "PEEK", "InFlight", "Result", "Statement"]

_NAMED = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class Statement:
    """One of `reactor.queries`' statements in libpq's positional form ($1, $2, ...)."""

    query: str
    params: tuple[str, ...]
    name: str

    @classmethod
    def of(cls, query: str) -> Statement:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        text = _NAMED.sub(number, query)
        return cls(text, tuple(names), f"reactor_{zlib.crc32(text.encode()):08x}")


PEEK = Statement.of(queries.ATTEMPT_PEEK)
DONE = Statement.of(queries.ATTEMPT_DONE)
_STATEMENTS = (PEEK, DONE)


@dataclass(frozen=True)
class Result:
    """What a statement answered: rows it changed (or returned), and its first value."""

    rows: int
    value: str | None


class ConnectionOwner(Protocol):
    """What `InFlight` needs of the owner of the connection (`reactor.lifecycle.Store`)."""

    @property
    def conn(self) -> db.Connection: ...

    def close(self) -> None: ...


def _encode(value: object) -> bytes | None:
    if value is None:
        return None
    return (repr(value) if isinstance(value, float) else str(value)).encode()


class InFlight:
    """At most one statement in flight on `owner`'s connection."""

    def __init__(self, owner: ConnectionOwner, *, prepared: bool) -> None:
        self._owner = owner
        self._prepared = prepared
        self._prepared_on: pq.abc.PGconn | None = None
        self._pending: pq.abc.PGconn | None = None

    def send(self, statement: Statement, params: Mapping[str, object]) -> bool:
        """Send `statement` without waiting; False if it could not be sent (nothing is then
        in flight). A statement still in flight is received (and dropped) first."""
        if self._pending is not None:
            self.receive()
        try:
            conn = self._owner.conn
            pgconn = conn.pgconn
            values = [_encode(params[name]) for name in statement.params]
            if not self._prepared:
                pgconn.send_query_params(statement.query.encode(), values)
            else:
                self._prepare(conn)
                pgconn.send_query_prepared(statement.name.encode(), values)
            while pgconn.flush():
                select.select([], [pgconn.socket], [])
        except Exception:
            self._owner.close()
            return False
        self._pending = pgconn
        return True

    def receive(self) -> Result | None:
        """The result of the statement in flight; None if nothing was in flight, the statement
        failed, or the connection did (it is then closed)."""
        pgconn, self._pending = self._pending, None
        if pgconn is None:
            return None
        result: Result | None = None
        failed = False
        try:
            while (res := self._next(pgconn)) is not None:
                if res.status == pq.ExecStatus.TUPLES_OK:
                    value = res.get_value(0, 0) if res.ntuples else None
                    result = Result(res.ntuples, None if value is None else value.decode())
                elif res.status == pq.ExecStatus.COMMAND_OK:
                    result = Result(res.command_tuples or 0, None)
                else:
                    failed = True
                    if res.error_field(pq.DiagnosticField.SQLSTATE) == b"26000":
                        self._prepared_on = None  # the session lost the prepared statement
        except Exception:
            failed = True
            self._owner.close()
        return None if failed else result

    def _next(self, pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
        """The next result; blocks (GIL released) until it is complete."""
        pgconn.consume_input()
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        return pgconn.get_result()

    def _prepare(self, conn: db.Connection) -> None:
        """Prepare every statement of this module once per server session."""
        if self._prepared_on is conn.pgconn:
            return
        for statement in _STATEMENTS:
            # The name carries a hash of the text: one a pooled session kept is the same.
            with contextlib.suppress(psycopg.errors.DuplicatePreparedStatement):
                conn.execute(f"PREPARE {statement.name} AS {statement.query}")
        self._prepared_on = conn.pgconn
