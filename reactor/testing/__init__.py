"""Test your application's submits and handlers with no Redis, no reactor and no worker.

Every function takes the connection your code holds, of any kind `reactor.submit()` takes
(psycopg, SQLAlchemy `Connection`/`Session`, Django's `connection`; the `_async` forms take a
psycopg `AsyncConnection` or a SQLAlchemy `AsyncConnection`/`AsyncSession`), and works inside
its open transaction, so a test wrapped in a transaction (or a Django `TestCase`) sees its own
rows; nothing here commits.

- `submitted(conn, type=None)`: the rows, due or not, as `Submitted` records;
  `assert_submitted(conn, photo_id, type="photo.process", **expected)` checks one (a failure
  lists what was submitted instead); `assert_not_submitted(conn, photo_id=None, **fields)`
  checks that no row matches (a failure lists the rows that do).
- `run_jobs(conn, handlers=None, types=None, limit=None)`: run the due rows now, through the
  worker's own lifecycle (the reactor's claim, the fenced start, the handler, then done, a
  retry with its backoff, or failed), in this process; `handlers` maps a type to a callable
  or a dotted path (by default the routes of `REACTOR_ROUTES`), imported on each call. A
  `JobResult` per attempt (`done`, `retry`, `failed`, `skipped`, `superseded`). Each
  handler call runs in a savepoint of the connection's own kind (psycopg's `transaction()`,
  SQLAlchemy's `begin_nested()`, Django's `atomic()`): a handler that raises, a failed
  statement included, leaves its writes undone and the transaction usable.
- `advance(conn, seconds)`: what waiting would do to the pending rows (they come due that
  much sooner), so the next `run_jobs` runs the retries.

The pytest plugin (`reactor.testing.pytest_plugin`, registered by the package's entry point)
adds the `reactor_jobs` fixture: these functions bound to the `reactor_connection` fixture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from typing import Any, TypeVar

import psycopg

from reactor.pg import queries
from reactor.producer import DEFAULT_JOB_TYPE, Executed, async_executor, sync_executor
from reactor.testing import kit
from reactor.testing.kit import JobResult, Submitted

__all__ = [
    "Handlers",
    "JobResult",
    "Submitted",
    "advance",
    "advance_async",
    "assert_not_submitted",
    "assert_not_submitted_async",
    "assert_submitted",
    "assert_submitted_async",
    "run_jobs",
    "run_jobs_async",
    "submitted",
    "submitted_async",
]

Handlers = Mapping[str, Callable[[str], object] | str]
_T = TypeVar("_T")


def submitted(conn: Any, type: str | None = None) -> list[Submitted]:  # noqa: A002
    """The rows of `photo_jobs` (of `type`, if given), due or not, in the order they are due."""
    return kit.submitted(sync_executor(conn)(queries.KIT_SUBMITTED, {"type": type}))


def assert_submitted(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002
    **expected: Any,
) -> Submitted:
    """The row of `photo_id` and `type`; `expected` fields of `Submitted` must match
    (`state="pending"`, `max_attempts=3`, `run_at=...`).

    Raises:
        AssertionError: no such row, or a field differs (the message lists the rows).
    """
    __tracebackhide__ = True
    return kit.check_expected(submitted(conn), photo_id, type, expected)


def assert_not_submitted(conn: Any, photo_id: str | None = None, **fields: Any) -> None:
    """That no row has `photo_id` (any, if None) and the given `fields` of `Submitted`
    (`type="photo.thumb"`, `state="pending"`); with neither, that nothing was submitted.
    A row matches as in `assert_submitted`: every field given is equal.

    Raises:
        AssertionError: rows match (the message lists them).
    """
    __tracebackhide__ = True
    kit.check_absent(submitted(conn), _wanted(photo_id, fields))


def _wanted(photo_id: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    return fields if photo_id is None else {"photo_id": photo_id, **fields}


def advance(conn: Any, seconds: float, type: str | None = None) -> int:  # noqa: A002
    """Bring every pending row (of `type`, if given) `seconds` closer to due, as if that much
    time had passed; how many rows moved."""
    return kit.advance(sync_executor(conn), seconds, type)


def run_jobs(
    conn: Any,
    *,
    handlers: Handlers | None = None,
    types: Iterable[str] | None = None,
    limit: int | None = None,
) -> list[JobResult]:
    """Run the due rows visible to `conn` (of `types`, else of every handled type; at most
    `limit`) through the worker's lifecycle, in this process, in `conn`'s transaction.

    Raises:
        ConfigError: no `handlers` and no `REACTOR_ROUTES`.
        ValueError: a type of `types` has no handler.
        HandlerImportError: a dotted path cannot be imported.
    """
    return kit.run(sync_executor(conn), _savepoint(conn), handlers, types, limit)


def _savepoint(conn: Any) -> kit.Savepoint:
    """A savepoint of `conn`'s open transaction, by its own API (so an ORM session and
    Django's atomic blocks know of it); `conn` is one `sync_executor` took."""
    if isinstance(conn, psycopg.Connection):
        # A savepoint once a statement opened the transaction (the claim did); in autocommit,
        # a transaction of its own.
        return conn.transaction
    if hasattr(conn, "begin_nested"):  # SQLAlchemy's Connection, Session, scoped_session
        return conn.begin_nested  # type: ignore[no-any-return]
    from django.db import transaction  # noqa: PLC0415 - Django is optional

    return lambda: transaction.atomic(using=conn.alias)


def _on_loop() -> Callable[[Coroutine[Any, Any, _T]], _T]:
    """Runs a coroutine on this thread's running loop, called from another thread."""
    loop = asyncio.get_running_loop()
    return lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def _bridged(conn: Any) -> Callable[[str, Mapping[str, Any]], Executed]:
    """The async connection's executor, callable from a thread while its loop runs."""
    execute, call = async_executor(conn), _on_loop()
    return lambda query, params: call(execute(query, params))


def _bridged_savepoint(conn: Any) -> kit.Savepoint:
    """`_savepoint` for an async connection, entered from a thread while its loop runs."""
    call = _on_loop()

    @contextmanager
    def savepoint() -> Iterator[None]:
        stack = AsyncExitStack()

        async def enter() -> None:
            if isinstance(conn, psycopg.AsyncConnection):
                await stack.enter_async_context(conn.transaction())
            else:  # SQLAlchemy's AsyncConnection, AsyncSession, async_scoped_session
                await stack.enter_async_context(conn.begin_nested())

        call(enter())
        try:
            yield
        except BaseException as exc:
            call(stack.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        call(stack.aclose())

    return savepoint


async def submitted_async(conn: Any, type: str | None = None) -> list[Submitted]:  # noqa: A002
    """`submitted` on an async connection."""
    return kit.submitted(await async_executor(conn)(queries.KIT_SUBMITTED, {"type": type}))


async def assert_submitted_async(
    conn: Any,
    photo_id: str,
    type: str = DEFAULT_JOB_TYPE,  # noqa: A002
    **expected: Any,
) -> Submitted:
    """`assert_submitted` on an async connection."""
    __tracebackhide__ = True
    return kit.check_expected(await submitted_async(conn), photo_id, type, expected)


async def assert_not_submitted_async(conn: Any, photo_id: str | None = None, **fields: Any) -> None:
    """`assert_not_submitted` on an async connection."""
    __tracebackhide__ = True
    kit.check_absent(await submitted_async(conn), _wanted(photo_id, fields))


async def advance_async(conn: Any, seconds: float, type: str | None = None) -> int:  # noqa: A002
    """`advance` on an async connection."""
    return await asyncio.to_thread(kit.advance, _bridged(conn), seconds, type)


async def run_jobs_async(
    conn: Any,
    *,
    handlers: Handlers | None = None,
    types: Iterable[str] | None = None,
    limit: int | None = None,
) -> list[JobResult]:
    """`run_jobs` on an async connection: the lifecycle and the (plain, synchronous) handlers
    run in a thread, each statement on `conn` in this event loop."""
    return await asyncio.to_thread(
        kit.run, _bridged(conn), _bridged_savepoint(conn), handlers, types, limit
    )
