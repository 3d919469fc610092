"""Opening Postgres connections, and the one place psycopg errors become ours.

Every connection gets TCP keepalives and `tcp_user_timeout`, so a silently dead peer is noticed
in seconds, not never (NOTES: ~7 s with these values). Connection failures are reported as one
line with the password masked; at start-up they are `ConfigError` (exit 2), at runtime the
caller treats them as `DatabaseError` and reconnects.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import TupleRow

from reactor.errors import ConfigError, DatabaseError, SchemaError, StatementError
from reactor.redact import ambiguous_userinfo, redact

__all__ = [
    "LATEST_SCHEMA_VERSION",
    "Connection",
    "check_schema",
    "connect",
    "describe_error",
    "schema_version",
    "translate_error",
]

#: The migration version this release of the code needs (the last file in sql/).
LATEST_SCHEMA_VERSION = 7

Connection = psycopg.Connection[TupleRow]

#: Why a URL with a raw `@`, `/`, `?` or `#` in its password is refused (without echoing it).
_AMBIGUOUS = (
    "the user name or password holds a raw '@', '/', '?' or '#'; "
    "percent-encode them (e.g. '@' as %40)"
)

_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
    "connect_timeout": 5,
}


def describe_error(exc: BaseException) -> str:
    """One line, no password: the first line of the error's message."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # libpq prefixes "connection failed: connection to server at ... failed:"; keep the cause.
    return redact(line)


def translate_error(exc: psycopg.Error, what: str, conn: Connection | None = None) -> DatabaseError:
    """The project error for a psycopg error: `DatabaseError` when the connection is lost or
    the server is in trouble (reconnect and retry), `StatementError` when one statement failed
    on a healthy connection (DataError, IntegrityError, ProgrammingError...: retrying the same
    statement cannot help)."""
    message = f"{what}: {describe_error(exc)}"
    lost = isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) or (
        conn is not None and (conn.closed or conn.broken)
    )
    return DatabaseError(message) if lost else StatementError(message)


def connect(url: str, *, autocommit: bool = False, purpose: str = "work") -> Connection:
    """Open a connection for one role (`purpose` goes into `application_name`).

    Raises:
        ConfigError: the URL is malformed (a retry cannot help).
        DatabaseError: the server could not be reached or refused us.
    """
    if ambiguous_userinfo(url):
        raise ConfigError(f"bad database URL: {_AMBIGUOUS}")
    try:
        return psycopg.connect(
            url,
            autocommit=autocommit,
            application_name=f"photo-reactor {purpose}",
            **_KEEPALIVES,
        )
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"bad database URL: {describe_error(exc)}") from None
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot connect to Postgres: {describe_error(exc)}") from exc


def schema_version(conn: Connection) -> int:
    """The highest applied migration version, 0 for a database never migrated."""
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass('reactor_migrations') IS NOT NULL")
        row = cur.fetchone()
        if row is None or not row[0]:
            return 0
        cur.execute("SELECT coalesce(max(version), 0) FROM reactor_migrations")
        row = cur.fetchone()
    return int(row[0]) if row else 0


def check_schema(conn: Connection) -> None:
    """Refuse to work on a database that is not at `LATEST_SCHEMA_VERSION`.

    Raises:
        SchemaError: migrations are missing (or the database is newer than this code).
    """
    try:
        version = schema_version(conn)
        if not conn.autocommit:
            conn.rollback()
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot read the schema version: {describe_error(exc)}") from exc
    if version < LATEST_SCHEMA_VERSION:
        raise SchemaError(
            f"database is not migrated (schema version {version}, "
            f"need {LATEST_SCHEMA_VERSION}): run `reactor migrate`"
        )
    if version > LATEST_SCHEMA_VERSION:
        raise SchemaError(
            f"database schema version {version} is newer than this release "
            f"({LATEST_SCHEMA_VERSION}): upgrade photo-reactor"
        )
