"""The producer API: put photo jobs into `photo_jobs` inside the caller's transaction.

This is a transactional outbox: the rows commit or roll back with the photos they belong to,
and their NOTIFY (sent by the table's triggers) is delivered only if they commit. Nothing here
commits or rolls back.

`submit` and `submit_many` take whatever connection the application holds: a psycopg
`Connection`, a SQLAlchemy `Connection` or `Session` on Postgres (psycopg or psycopg2 driver),
or Django's `connection` (postgresql backend). `submit_async` and `submit_many_async` take a
psycopg `AsyncConnection` or a SQLAlchemy `AsyncConnection`/`AsyncSession`. SQLAlchemy and
Django are never imported here: an object is recognised by its class's module, and used only
through its own public methods (`exec_driver_sql`, `connection()`, `cursor()`), so the
statement runs in that object's current transaction. Every id is validated before the database
is touched (`InvalidJobError`); any other object gets a `TypeError` that says what is needed.

Idempotent: a `pending` or `active` row is left as it is; a `done`, `failed` or `cancelled`
row is re-armed (a new life at attempts 0, due from now, its attempts added to
`prior_attempts` by the table's trigger so that the fencing token goes on growing). `cancel`
and `cancel_async` move a pending or active row to `cancelled` in the caller's transaction,
through the same connection kinds. The counts returned are read from the statement's result,
so they are true in psycopg's pipeline mode too.

Traced (`reactor.tracing`, with the `otel` extra): each call makes a PRODUCER span `send
{type}` around its statement and stores that span's W3C context in the rows it inserts or
re-arms, in the same statement.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq

from reactor import tracing
from reactor.errors import InvalidJobError
from reactor.pg import queries
from reactor.validate import check_job_type, check_max_attempts, check_photo_id

__all__ = [
    "DEFAULT_JOB_TYPE",
    "AsyncExecute",
    "Executed",
    "SyncExecute",
    "async_executor",
    "cancel",
    "cancel_async",
    "submit",
    "submit_async",
    "submit_many",
    "submit_many_async",
    "sync_executor",
]

DEFAULT_JOB_TYPE = "photo.process"
#: The `last_error` of a row cancelled by `cancel()` (`reactor cancel` names who).
CANCELLED_BY_CALLER = "cancelled by reactor.cancel()"

#: What a statement run on the caller's connection gave: the row count and the rows returned.
Executed = tuple[int, list[tuple[Any, ...]]]
SyncExecute = Callable[[str, Mapping[str, Any]], Executed]
AsyncExecute = Callable[[str, Mapping[str, Any]], Coroutine[Any, Any, Executed]]

#: SQLAlchemy drivers whose parameter style (`%(name)s`) the statement is written in.
_SQLALCHEMY_DRIVERS = frozenset({"psycopg", "psycopg2", "psycopg_async"})


def submit(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
    *,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> bool:
    """Insert (or re-arm) the job of `photo_id` in the caller's current transaction.

    Args:
        conn: the caller's connection (see the module docstring); its transaction decides
            whether the job exists.
        photo_id: the photo.
        type: the job type (must have a route in the reactor to be dispatched).
        run_at: not before this time (timezone-aware); None = at once.
        max_attempts: attempts before a failure is final; None = the table default (5), or
            the existing row's value when a done/failed row is re-armed.

    Returns:
        True when a row was inserted or re-armed; False when it was already pending/active.

    Raises:
        InvalidJobError: a bad photo id, type, run_at or max_attempts (checked before the
            database).
        TypeError: `conn` is not a connection this function can use (a message says what is
            needed).
        Exception: the driver's own error when the statement fails.
    """
    return submit_many(conn, [photo_id], type, run_at=run_at, max_attempts=max_attempts) == 1


def submit_many(
    conn: Any,
    photo_ids: Iterable[str],
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
    *,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> int:
    """Submit every id of `photo_ids` in one statement, in the caller's current transaction
    (repeated ids count once); how many rows were inserted or re-armed. Its COMMIT sends one
    notification per type (and per kind: inserted, re-armed), however many ids.

    Raises:
        InvalidJobError, TypeError: see `submit` (no id is written when one is invalid).
        Exception: the driver's own error when the statement fails.
    """
    params = _params(photo_ids, type, run_at, max_attempts)
    run = sync_executor(conn)
    if not params["photo_ids"]:
        return 0
    with tracing.submitting(type, params["photo_ids"]) as context:
        return _count(run(queries.SUBMIT_MANY, {**params, **context}))


async def submit_async(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
    *,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> bool:
    """`submit` for a psycopg `AsyncConnection` or a SQLAlchemy `AsyncConnection` or
    `AsyncSession`.

    Raises:
        InvalidJobError, TypeError: see `submit`.
        Exception: the driver's own error when the statement fails.
    """
    submitted = await submit_many_async(
        conn, [photo_id], type, run_at=run_at, max_attempts=max_attempts
    )
    return submitted == 1


async def submit_many_async(
    conn: Any,
    photo_ids: Iterable[str],
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
    *,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> int:
    """`submit_many` for a psycopg `AsyncConnection` or a SQLAlchemy `AsyncConnection` or
    `AsyncSession`.

    Raises:
        InvalidJobError, TypeError: see `submit`.
        Exception: the driver's own error when the statement fails.
    """
    params = _params(photo_ids, type, run_at, max_attempts)
    run = async_executor(conn)
    if not params["photo_ids"]:
        return 0
    with tracing.submitting(type, params["photo_ids"]) as context:
        return _count(await run(queries.SUBMIT_MANY, {**params, **context}))


def cancel(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
) -> bool:
    """Cancel the job of `photo_id` in the caller's current transaction: a `pending` or
    `active` row becomes `cancelled` (terminal; `submit()` or `reactor requeue` re-arms it).

    A running attempt is not interrupted (`reactor cancel` also asks its worker to stop it),
    but its outcome is fenced off: the row stays `cancelled`, and a queued job never runs its
    handler. A row that is already finished is left as it is.

    Returns:
        True when the row was cancelled; False when there is none, or it is done, failed or
        cancelled already.

    Raises:
        InvalidJobError: a bad photo id or type (checked before the database).
        TypeError: `conn` is not a connection this function can use (as for `submit`).
        Exception: the driver's own error when the statement fails.
    """
    run = sync_executor(conn)
    return _count(run(queries.CANCEL_COUNTED, _cancel_params(photo_id, type))) == 1


async def cancel_async(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002 - the column's name
) -> bool:
    """`cancel` for the async connections `submit_async` takes.

    Raises:
        InvalidJobError, TypeError: see `cancel`.
        Exception: the driver's own error when the statement fails.
    """
    run = async_executor(conn)
    return _count(await run(queries.CANCEL_COUNTED, _cancel_params(photo_id, type))) == 1


# -- parameters ----------------------------------------------------------------------------


def _params(
    photo_ids: Iterable[str], job_type: str, run_at: datetime | None, max_attempts: int | None
) -> dict[str, Any]:
    if isinstance(photo_ids, str):
        raise InvalidJobError("photo_ids must be a collection of ids, not one string")
    unique = list(dict.fromkeys(photo_ids))  # ON CONFLICT cannot touch one row twice
    for photo_id in unique:
        check_photo_id(photo_id)
    # In one order for every caller: two transactions submitting overlapping ids lock their
    # rows in the same order, so they cannot deadlock.
    ids = sorted(unique)
    check_job_type(job_type)
    if run_at is not None and (not isinstance(run_at, datetime) or run_at.utcoffset() is None):
        raise InvalidJobError(f"run_at must be a timezone-aware datetime, got {run_at!r:.60}")
    if max_attempts is not None:
        check_max_attempts(max_attempts)
    return {"photo_ids": ids, "type": job_type, "run_at": run_at, "max_attempts": max_attempts}


def _cancel_params(photo_id: str, job_type: str) -> dict[str, Any]:
    check_photo_id(photo_id)
    check_job_type(job_type)
    return {"photo_ids": [photo_id], "type": job_type, "reason": CANCELLED_BY_CALLER}


# -- connections ---------------------------------------------------------------------------


def _class_name(conn: object) -> str:
    return type(conn).__name__


def _kind(conn: object) -> str:
    """What kind of connection `conn` is, from its class alone (nothing is imported)."""
    if isinstance(conn, psycopg.Connection):
        return "psycopg"
    if isinstance(conn, psycopg.AsyncConnection):
        return "psycopg async"
    # By the SQLAlchemy classes it is or derives from (Flask-SQLAlchemy's session is a subclass).
    sqlalchemy = {k.__name__ for k in type(conn).__mro__ if k.__module__.startswith("sqlalchemy.")}
    if sqlalchemy & {"AsyncConnection", "AsyncSession", "async_scoped_session"}:
        return "sqlalchemy async"
    if sqlalchemy & {"Connection", "Session", "scoped_session"}:
        return "sqlalchemy"
    module = type(conn).__module__
    if module.startswith("django.") and hasattr(conn, "cursor") and hasattr(conn, "vendor"):
        return "django"
    return "unknown"


def _rows(cursor: Any) -> Executed:
    return int(cursor.rowcount), list(cursor.fetchall()) if cursor.description else []


def sync_executor(conn: Any) -> SyncExecute:
    """A function (statement, params) -> (rowcount, rows) that runs on `conn`, in its current
    transaction (`reactor.testing` runs the lifecycle's statements through it too).

    Raises:
        TypeError: `conn` is not a connection `submit()` can use.
    """
    kind = _kind(conn)
    if kind == "psycopg":

        def run_psycopg(query: str, params: Mapping[str, Any]) -> Executed:
            # No parameters: sent as it is (its `%` signs are not placeholders).
            cursor = conn.execute(query, params or None)
            if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
                with conn.pipeline():  # in pipeline mode, the result comes at this sync
                    pass
            return _rows(cursor)

        return run_psycopg
    if kind == "sqlalchemy":
        if hasattr(conn, "registry"):  # a scoped_session: the session of this scope
            conn = conn()
        target = conn if hasattr(conn, "exec_driver_sql") else conn.connection()
        _check_sqlalchemy_dialect(target.dialect, conn)

        def run_sqlalchemy(query: str, params: Mapping[str, Any]) -> Executed:
            result = target.exec_driver_sql(query, dict(params) or None)
            return int(result.rowcount), [tuple(r) for r in result] if result.returns_rows else []

        return run_sqlalchemy
    if kind == "django":
        if conn.vendor != "postgresql":
            raise TypeError(f"submit() needs a Postgres database; Django's is {conn.vendor}")

        def run_django(query: str, params: Mapping[str, Any]) -> Executed:
            with conn.cursor() as cursor:
                cursor.execute(query, params or None)
                return _rows(cursor)

        return run_django
    if kind in ("psycopg async", "sqlalchemy async"):
        raise _unusable(conn, "an async connection needs submit_async() / submit_many_async()")
    raise _unusable(conn, "submit() needs a Postgres connection: psycopg, SQLAlchemy or Django")


def _count(executed: Executed) -> int:
    """The count a statement returns as its one-row result (true in psycopg's pipeline mode,
    where a cursor's rowcount is -1)."""
    return int(executed[1][0][0])


def async_executor(conn: Any) -> AsyncExecute:
    """`sync_executor` for a psycopg `AsyncConnection` or a SQLAlchemy `AsyncConnection` or
    `AsyncSession`.

    Raises:
        TypeError: `conn` is not a connection `submit_async()` can use.
    """
    kind = _kind(conn)
    if kind == "psycopg async":

        async def run_psycopg(query: str, params: Mapping[str, Any]) -> Executed:
            async with conn.cursor() as cursor:
                await cursor.execute(query, params or None)
                if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
                    async with conn.pipeline():  # in pipeline mode, the result comes here
                        pass
                rows = await cursor.fetchall() if cursor.description else []
                return int(cursor.rowcount), list(rows)

        return run_psycopg
    if kind == "sqlalchemy async":
        holder = conn

        async def run_sqlalchemy(query: str, params: Mapping[str, Any]) -> Executed:
            session = holder() if hasattr(holder, "registry") else holder  # async_scoped_session
            target = session if hasattr(session, "exec_driver_sql") else await session.connection()
            _check_sqlalchemy_dialect(target.dialect, session)
            result = await target.exec_driver_sql(query, dict(params) or None)
            return int(result.rowcount), [tuple(r) for r in result] if result.returns_rows else []

        return run_sqlalchemy
    raise _unusable(
        conn,
        "submit_async() needs an async Postgres connection: a psycopg AsyncConnection, or a "
        "SQLAlchemy AsyncConnection or AsyncSession",
    )


def _check_sqlalchemy_dialect(dialect: Any, conn: object) -> None:
    if dialect.name != "postgresql" or dialect.driver not in _SQLALCHEMY_DRIVERS:
        raise TypeError(
            "submit() needs a Postgres connection: psycopg, SQLAlchemy (postgresql+psycopg or "
            "postgresql+psycopg2) or Django; got a SQLAlchemy "
            f"{_class_name(conn)} on {dialect.name}+{dialect.driver}"
        )


def _unusable(conn: object, need: str) -> TypeError:
    return TypeError(f"{need}; got {type(conn).__module__}.{_class_name(conn)}")
