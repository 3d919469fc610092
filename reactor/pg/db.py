"""Opening Postgres connections, and the one place psycopg errors become ours.

Every connection gets TCP keepalives and `tcp_user_timeout`, so a silently dead peer is noticed
in seconds, not never (~7 s with these values). Connection failures are reported as one
line with the password masked; at start-up they are `ConfigError` (exit 2), at runtime the
caller treats them as `DatabaseError` and reconnects.

Past one machine: the URL may be a libpq multi-host URL (`postgresql://db1,db2/app`). A
connection that writes is only ever opened on a read-write server: unless the URL (or
`PGTARGETSESSIONATTRS`) says otherwise, libpq is asked for `target_session_attrs=read-write`,
so it skips standbys; if the URL asked for something else, the server is checked after
connecting. Landing on a read-only server is a connection failure (`DatabaseError`, retried),
and so is any error `is_connection_failure` recognises (a lost session, a server in recovery
or shutting down, a read-only transaction): the caller drops the connection and reconnects.

A connection may be given an idle-in-transaction timeout (`connect(...,
idle_in_transaction_seconds=...)`, a session setting, so only where no pooler sits between):
Postgres then closes a session whose transaction waits on something else (a hung Redis during
a claim) longer than that, and the rollback frees the transaction's row locks.

Server-side prepared statements are on for a connection that reaches its Postgres backend
itself (`direct_session`) and off behind a pooler, unless asked for or refused
(`set_prepared_statements`, `REACTOR_PREPARED_STATEMENTS=1|0`): behind a pooler in
transaction mode (PgBouncer before 1.21) each transaction may run on another server session,
where a statement prepared earlier does not exist, or one of another client's has the name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

from reactor.errors import (
    ConfigError,
    DatabaseError,
    LockBusyError,
    SchemaError,
    StatementError,
)
from reactor.pg import queries
from reactor.redact import ambiguous_userinfo, redact

__all__ = [
    "LATEST_SCHEMA_VERSION",
    "Connection",
    "abandon",
    "check_schema",
    "check_url",
    "connect",
    "describe_error",
    "direct_session",
    "is_connection_failure",
    "outside_transaction",
    "prepared_statements_enabled",
    "rehearse",
    "schema_version",
    "set_prepared_statements",
    "translate_error",
    "translating",
]

#: The migration version this release of the code needs (the last file in sql/).
LATEST_SCHEMA_VERSION = 21

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


#: Environment variable that turns psycopg's server-side prepared statements on ("1"/"true").
PREPARED_STATEMENTS_ENV = "REACTOR_PREPARED_STATEMENTS"
#: psycopg prepares a statement after it ran this many times on a connection (its default).
PREPARE_THRESHOLD = 5
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
#: The CLI's choice; None: read `PREPARED_STATEMENTS_ENV`.
_prepared_statements: bool | None = None

#: SQLSTATEs after which the session is useless, though the socket may be open: a read-only
#: transaction (a standby, an old primary back), admin/crash shutdown, cannot connect now, the
#: session ended by its idle-in-transaction timeout.
_CONNECTION_SQLSTATES = frozenset({"25006", "25P03", "57P01", "57P02", "57P03"})
#: Message fragments of the same failures from servers or poolers that send no SQLSTATE.
_CONNECTION_MESSAGES = ("recovery", "read-only", "shutting down", "server closed")


def set_prepared_statements(enabled: bool | None) -> None:
    """Turn server-side prepared statements on or off for connections opened from now on
    (None: follow `REACTOR_PREPARED_STATEMENTS`, else each connection's `direct_session`)."""
    global _prepared_statements
    _prepared_statements = enabled


def prepared_statements_enabled(env: Mapping[str, str] | None = None) -> bool | None:
    """Whether new connections may prepare statements on the server: as chosen (the CLI
    option, else `REACTOR_PREPARED_STATEMENTS`), or None when nothing chose, and then each
    connection prepares only if it is a `direct_session`.

    Raises:
        ConfigError: `REACTOR_PREPARED_STATEMENTS` is not a boolean.
    """
    if _prepared_statements is not None:
        return _prepared_statements
    raw = (os.environ if env is None else env).get(PREPARED_STATEMENTS_ENV, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{PREPARED_STATEMENTS_ENV} must be 1 or 0 (true/false), not {raw!r}")


def is_connection_failure(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) means the session must be dropped and reopened."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.OperationalError | psycopg.InterfaceError):
            return True
        if isinstance(seen, psycopg.Error):
            state = seen.sqlstate or ""
            if state in _CONNECTION_SQLSTATES or state.startswith("08"):
                return True
            text = str(seen).lower()
            if any(fragment in text for fragment in _CONNECTION_MESSAGES):
                return True
        seen = seen.__cause__
    return False


def describe_error(exc: BaseException) -> str:
    """One line, no password: the first line of the error's message."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # libpq prefixes "connection failed: connection to server at ... failed:"; keep the cause.
    return redact(line)


def translate_error(
    exc: psycopg.Error, what: str, conn: Connection | None = None
) -> DatabaseError | StatementError:
    """The project error for a psycopg error: `DatabaseError` when the connection is lost or
    the server is in trouble or read-only (reconnect and retry; see `is_connection_failure`),
    `StatementError` when one statement failed on a healthy connection (DataError,
    IntegrityError, ProgrammingError...: retrying the same statement cannot help)."""
    message = f"{what}: {describe_error(exc)}"
    lost = is_connection_failure(exc) or (conn is not None and (conn.closed or conn.broken))
    return DatabaseError(message) if lost else StatementError(message)


@contextmanager
def translating(what: str, conn: Connection | None = None) -> Iterator[None]:
    """Run statements; a psycopg error among them leaves as the project's (`translate_error`),
    so callers above `reactor.pg` catch `DatabaseError` / `StatementError` only.

    Raises:
        DatabaseError: the connection is lost (reconnect).
        StatementError: a statement failed on a healthy connection (`LockBusyError`: a lock
            asked for without waiting long, `lock_timeout` or `NOWAIT`, is held).
    """
    try:
        yield
    except psycopg.errors.LockNotAvailable as exc:
        raise LockBusyError(f"{what}: {describe_error(exc)}") from exc
    except psycopg.Error as exc:
        raise translate_error(exc, what, conn) from exc


def abandon(conn: Connection) -> None:
    """Roll back the open transaction, if the connection still allows it (else close it)."""
    if conn.closed or conn.broken:
        return
    try:
        conn.rollback()
    except psycopg.Error:
        conn.close()


@contextmanager
def outside_transaction(conn: Connection) -> Iterator[None]:
    """Run the block's statements in autocommit on an idle connection: each is its own
    implicit transaction, with no BEGIN or COMMIT to send (psycopg switches modes client-side,
    without a round trip). The connection is back in its own mode afterwards, unless the
    block lost it.

    Raises:
        DatabaseError: the connection was inside a transaction (it is rolled back).
    """
    if conn.autocommit:
        yield
        return
    if conn.info.transaction_status is not psycopg.pq.TransactionStatus.IDLE:
        abandon(conn)
        raise DatabaseError("autocommit refused: the connection was inside a transaction")
    conn.autocommit = True
    try:
        yield
    finally:
        if not (conn.closed or conn.broken):
            conn.autocommit = False


def connect(
    url: str,
    *,
    autocommit: bool = False,
    purpose: str = "work",
    read_write: bool = True,
    idle_in_transaction_seconds: float | None = None,
) -> Connection:
    """Open a connection for one role (`purpose` goes into `application_name`); with
    `read_write` (every role that writes), only on a server that accepts writes; with
    `idle_in_transaction_seconds`, a session the server ends when a transaction of it sits
    idle that long.

    Raises:
        ConfigError: the URL is malformed (a retry cannot help).
        DatabaseError: the server could not be reached, refused us, or is read-only.
    """
    params = check_url(url)
    extra: dict[str, Any] = {}
    # libpq skips read-only hosts of a multi-host URL itself when asked to.
    wanted = params.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS")
    if read_write and not wanted:
        extra["target_session_attrs"] = "read-write"
    check_after = read_write and wanted not in (None, "", "read-write", "primary")
    prepared = prepared_statements_enabled()
    try:
        conn = psycopg.connect(
            url,
            autocommit=autocommit,
            application_name=f"photo-reactor {purpose}",
            prepare_threshold=PREPARE_THRESHOLD if prepared else None,
            **_KEEPALIVES,
            **extra,
        )
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"bad database URL: {describe_error(exc)}") from None
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot connect to Postgres: {describe_error(exc)}") from exc
    if check_after:
        _require_writable(conn)
    if idle_in_transaction_seconds is not None:
        _end_idle_transactions(conn, idle_in_transaction_seconds)
    if prepared is None:
        try:
            direct = direct_session(conn)
        except StatementError:
            direct = False  # unknown: prepare nothing
        except DatabaseError:
            conn.close()
            raise
        if direct:
            conn.prepare_threshold = PREPARE_THRESHOLD
    return conn


def direct_session(conn: Connection) -> bool:
    """Whether `conn` reaches its Postgres backend with no pooler between: the backend's own
    process id is the one the connection's start-up reported. A pooler (PgBouncer, Pgcat,
    Odyssey, Supavisor) answers the start-up itself, with a cancel key of its own, and may
    run each transaction on another server session.

    Raises:
        DatabaseError: the connection failed.
    """
    with outside_transaction(conn), translating("backend pid query failed", conn):
        row = conn.execute(queries.BACKEND_PID).fetchone()
    return row is not None and row[0] == conn.info.backend_pid


def check_url(url: str) -> dict[str, Any]:
    """The connection parameters of `url`, checked without connecting (a server may be down).

    Raises:
        ConfigError: the URL is malformed; the message never shows it (it may hold a password).
    """
    if ambiguous_userinfo(url):
        raise ConfigError(f"bad database URL: {_AMBIGUOUS}")
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"bad database URL: {describe_error(exc)}") from None
    _check_hosts(params)
    return params


def _end_idle_transactions(conn: Connection, seconds: float) -> None:
    """Set the session's `idle_in_transaction_session_timeout` (committed: a rolled-back
    set_config would be undone); close `conn` and fail if it cannot be set."""
    try:
        conn.execute(
            queries.SET_IDLE_IN_TRANSACTION_TIMEOUT,
            {"timeout": f"{max(1, round(seconds * 1000))}ms"},
        )
        if not conn.autocommit:
            conn.commit()
    except psycopg.Error as exc:
        conn.close()
        raise DatabaseError(f"cannot connect to Postgres: {describe_error(exc)}") from exc


def _check_hosts(params: Mapping[str, Any]) -> None:
    """Refuse what libpq would only report when connecting: ports that are not numbers, or
    a list of ports that does not match the list of hosts.

    Raises:
        ConfigError: the host or port list is malformed.
    """
    ports = str(params.get("port") or "").split(",")
    for port in ports:
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"bad database URL: invalid port {port!r}")
    hosts = str(params.get("host") or params.get("hostaddr") or "").split(",")
    if len(ports) > 1 and len(ports) != len(hosts):
        raise ConfigError(f"bad database URL: {len(ports)} ports given for {len(hosts)} hosts")


def _require_writable(conn: Connection) -> None:
    """Close `conn` and fail if its server cannot take writes (the URL asked for any server)."""
    try:
        row = conn.execute(queries.SERVER_READ_ONLY).fetchone()
        if not conn.autocommit:
            conn.rollback()
    except psycopg.Error as exc:
        conn.close()
        raise DatabaseError(f"cannot connect to Postgres: {describe_error(exc)}") from exc
    if row is not None and row[0]:
        where = f"{conn.info.host}:{conn.info.port}"
        conn.close()
        raise DatabaseError(
            f"cannot connect to Postgres: the server at {where} is read-only (a standby?)"
        )


def schema_version(conn: Connection) -> int:
    """The highest applied migration version, 0 for a database never migrated."""
    with conn.cursor() as cur:
        cur.execute(queries.LEDGER_EXISTS)
        row = cur.fetchone()
        if row is None or not row[0]:
            return 0
        cur.execute(queries.SCHEMA_VERSION)
        row = cur.fetchone()
    return int(row[0]) if row else 0


def check_schema(conn: Connection) -> None:
    """Refuse to work on a database that is not at `LATEST_SCHEMA_VERSION`.

    Raises:
        SchemaError: migrations are missing (or the database is newer than this code).
        ConfigError: this role may not read the migration ledger.
        DatabaseError: the version could not be read otherwise.
    """
    try:
        version = schema_version(conn)
        if not conn.autocommit:
            conn.rollback()
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"cannot read the schema version: {describe_error(exc)} "
            "(this role needs SELECT on reactor_migrations)"
        ) from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot read the schema version: {describe_error(exc)}") from exc
    # Named, because libpq's defaults may have reached a database the user did not mean.
    where = f"{conn.info.dbname!r} on {conn.info.host}:{conn.info.port}"
    if version < LATEST_SCHEMA_VERSION:
        raise SchemaError(
            f"database is not migrated: {where} is at schema version {version}, "
            f"this release needs {LATEST_SCHEMA_VERSION}: run `reactor migrate` against it "
            "(or set DATABASE_URL)"
        )
    if version > LATEST_SCHEMA_VERSION:
        raise SchemaError(
            f"database schema version {version} of {where} is newer than this release "
            f"({LATEST_SCHEMA_VERSION}): upgrade photo-reactor"
        )


def rehearse(
    conn: Connection, row: Mapping[str, Any], statements: Callable[[Connection], object]
) -> None:
    """Warm a new session up: insert the throwaway `row` (`queries.WARM_UP_ROW`), run
    `statements` on it, and roll everything back. The first real row then finds the triggers,
    indexes and plans it needs already loaded. A role that may not insert rehearses on no row;
    a statement error (the rehearsal is only an optimisation) leaves it at that.

    Raises:
        DatabaseError: the connection failed.
    """
    try:
        with conn.transaction():
            may_insert = conn.execute(queries.MAY_INSERT_ROWS).fetchone()
            if may_insert is not None and may_insert[0]:
                conn.execute(queries.WARM_UP_ROW, row)
            statements(conn)
            raise psycopg.Rollback()
    except psycopg.Error as exc:
        error = translate_error(exc, "warm-up failed", conn)
        if not isinstance(error, StatementError):
            raise error from exc
