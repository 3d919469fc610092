"""A statement sent now and its result read later, on the worker's own thread.

The worker classes overlap a Postgres round trip with RQ's Redis work for the same job: the
fenced start (`START`) goes out before RQ marks the job started, and the `done` write
(`DONE`) as soon as the handler returned, before RQ records the success. `InFlight.send` hands
the statement to libpq and returns; `InFlight.receive` waits for its result, polling the socket
with the GIL released (`poll`, so any descriptor number works). No second thread is involved,
so a job pays for no thread hand-off.

Guarantees:
- at most one statement is in flight, and `receive` always ends it: the connection is left
  idle with every result read, or closed (the owner's `Store` reconnects on its next use);
- a statement that could not be sent, or whose result was an error or never came, is reported
  as such (`send` returns False, `receive` None): the caller then runs it through
  `Store.execute`, which retries with backoff. Every statement here is fenced by the attempt
  number, so one that reached the server and runs again changes nothing more. A parameter that
  cannot go out as text (a NUL character, a character the session's encoding lacks) is not
  sent either, and psycopg's own path reports it as before;
- anything else raised while a statement is sent or awaited (RQ's job timeout, a signal)
  closes the connection and propagates: the timeout is never absorbed;
- parameters are encoded in the session's client encoding;
- on a connection that prepares statements (`reactor.pg.db.connect`: a direct session, or
  `REACTOR_PREPARED_STATEMENTS=1`), each statement is prepared once per server session, at the
  protocol level (so PgBouncer 1.21+ can track it), under a name that carries a hash of its
  text; otherwise it goes out as an unnamed statement, which any transaction pooler accepts.
"""

from __future__ import annotations

import contextlib
import re
import select
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import psycopg
from psycopg import pq

from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.pg import db, queries

__all__ = ["DONE", "START", "InFlight", "Result", "Statement"]

_NAMED = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class Statement:
    """One of `reactor.pg.queries`' statements in libpq's positional form ($1, $2, ...)."""

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


START = Statement.of(queries.ATTEMPT_START)
DONE = Statement.of(queries.ATTEMPT_DONE)
_STATEMENTS = (START, DONE)


@dataclass(frozen=True)
class Result:
    """What a statement answered: rows it changed (or returned), and its first row's values
    (None: no row)."""

    rows: int
    first: tuple[str | None, ...] | None


class ConnectionOwner(Protocol):
    """What `InFlight` needs of the owner of the connection (`reactor.worker.lifecycle.Store`)."""

    @property
    def conn(self) -> db.Connection: ...

    def close(self) -> None: ...


def _encode(value: object, encoding: str) -> bytes | None:
    """A parameter in text format, in the session's encoding.

    Raises:
        ValueError: a NUL character (libpq would cut the value there), or a character the
            session's encoding cannot hold.
    """
    if value is None:
        return None
    text = repr(value) if isinstance(value, float) else str(value)
    if "\x00" in text:
        raise ValueError("a text parameter cannot hold a NUL character")
    return text.encode(encoding)


def _drain(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """Every result of the command sent last; blocks (GIL released) until they are in."""
    results: list[pq.abc.PGresult] = []
    while True:
        pgconn.consume_input()
        while pgconn.is_busy():
            _wait(pgconn, select.POLLIN)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            return results
        results.append(result)


def _flush(pgconn: pq.abc.PGconn) -> None:
    while pgconn.flush():
        _wait(pgconn, select.POLLOUT)


def _wait(pgconn: pq.abc.PGconn, event: int) -> None:
    """Block until the socket is ready (poll, not select: a process may hold more than
    FD_SETSIZE descriptors)."""
    poller = select.poll()
    poller.register(pgconn.socket, event)
    poller.poll()


def _sqlstate(result: pq.abc.PGresult) -> bytes | None:
    return result.error_field(pq.DiagnosticField.SQLSTATE)


class InFlight:
    """At most one statement in flight on `owner`'s connection.

    A failure of the connection (psycopg or socket errors) is reported as no answer, with the
    connection closed. Anything else raised meanwhile (RQ's job timeout, a signal) closes the
    connection, since its state is then unknown, and propagates.
    """

    def __init__(self, owner: ConnectionOwner) -> None:
        self._owner = owner
        self._prepared_on: pq.abc.PGconn | None = None
        self._pending: pq.abc.PGconn | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a statement was sent and its result not read yet."""
        return self._pending is not None

    def send(self, statement: Statement, params: Mapping[str, object]) -> bool:
        """Send `statement` without waiting; False if it was not sent (nothing is then in
        flight): the connection failed (it is closed), or a parameter cannot be sent as
        text (the connection is left as it was; psycopg's own path reports the error). A
        statement still in flight is received (and dropped) first."""
        if self._pending is not None:
            self.receive()
        try:
            conn = self._owner.conn
            encoding = conn.info.encoding
        except (ConfigError, DatabaseError, StatementError):
            return False  # the store's own path reports it
        try:
            values = [_encode(params[name], encoding) for name in statement.params]
        except ValueError:  # UnicodeEncodeError too
            return False
        pgconn = conn.pgconn
        try:
            with self._closing_on_error():
                if conn.prepare_threshold is not None:
                    self._prepare(pgconn)
                    pgconn.send_query_prepared(statement.name.encode(), values)
                else:
                    pgconn.send_query_params(statement.query.encode(), values)
                self._pending = pgconn  # from here on, `receive` reads it or closes
                _flush(pgconn)
        except (psycopg.Error, OSError):
            return False
        return True

    def receive(self) -> Result | None:
        """The result of the statement in flight; None if nothing was in flight, the statement
        failed, or the connection did (it is then closed)."""
        pgconn = self._pending
        if pgconn is None:
            return None
        try:
            with self._closing_on_error():
                results = _drain(pgconn)
        except (psycopg.Error, OSError):
            return None
        self._pending = None
        answer: Result | None = None
        for result in results:
            if result.status == pq.ExecStatus.TUPLES_OK:
                first = None
                if result.ntuples:
                    values = (result.get_value(0, i) for i in range(result.nfields))
                    first = tuple(None if v is None else v.decode() for v in values)
                answer = Result(result.ntuples, first)
            elif result.status == pq.ExecStatus.COMMAND_OK:
                answer = Result(result.command_tuples or 0, None)
            else:
                if _sqlstate(result) == b"26000":
                    self._prepared_on = None  # the session lost the prepared statement
                return None
        return answer

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """Close the connection if the body raises anything: its state is then unknown."""
        try:
            yield
        except BaseException:
            self._pending = None
            self._owner.close()
            raise

    def _prepare(self, pgconn: pq.abc.PGconn) -> None:
        """Prepare every statement of this module once per session, at the protocol level
        (what a pooler that tracks prepared statements, PgBouncer 1.21+, sees and follows).

        Raises:
            psycopg.OperationalError: a statement could not be prepared.
        """
        if self._prepared_on is pgconn:
            return
        for statement in _STATEMENTS:
            pgconn.send_prepare(statement.name.encode(), statement.query.encode())
            _flush(pgconn)
            for result in _drain(pgconn):
                # The name carries a hash of the text: one a pooled session kept is the same.
                if result.status != pq.ExecStatus.COMMAND_OK and _sqlstate(result) != b"42P05":
                    message = (result.error_message or b"").decode(errors="replace").strip()
                    raise psycopg.OperationalError(f"cannot prepare {statement.name}: {message}")
        self._prepared_on = pgconn
