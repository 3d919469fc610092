"""What the admin's actions run on the database: `requeue` (of `photo_jobs`' rows, the
statement of `reactor requeue`, `REQUEUE_PHOTOS`) and `restore` (of archived photos,
`RESTORE_ARCHIVED`), each in one transaction whose lock waits end after `LOCK_TIMEOUT_MS`
(`RowHeldError`: nothing done), not behind a row another session holds for as long as it does.

`requeue` locks the rows in the action's state first, in key order, and moves only those, so a
row that left that state meanwhile is never moved (`REQUEUE_PHOTOS` alone takes any finished
row). Given the tokens a page showed, it moves only the rows still at them: a row submitted
again and run to the same state since is another life, which the operator did not see.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import OperationalError, connections, transaction
from django.db.models import F

from reactor.pg import queries
from reactor.producer import SyncExecute, sync_executor

__all__ = ["HELD", "LOCK_TIMEOUT_MS", "REQUEUE_BATCH", "RowHeldError", "requeue", "restore"]

#: Photo ids per requeue statement, as `reactor requeue` batches them.
REQUEUE_BATCH = 5000
#: How long an action waits for a row another session holds (a claim, an outcome being
#: written, an operator's open transaction) before it gives up, changing nothing.
LOCK_TIMEOUT_MS = 3000
HELD = "a selected row is held by another session: nothing done; try again"


class RowHeldError(Exception):
    """A row the action needs stayed locked by another session past `LOCK_TIMEOUT_MS`."""


def _lock_timed_out(exc: BaseException) -> bool:
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return code == "55P03"  # lock_not_available (psycopg 3: sqlstate; psycopg2: pgcode)


@contextmanager
def _bounded(using: str) -> Iterator[SyncExecute]:
    """A transaction on `using` whose lock waits end after `LOCK_TIMEOUT_MS`; its executor.

    Raises:
        RowHeldError: a wait ended so (everything done in it is rolled back).
    """
    try:
        with transaction.atomic(using=using):
            execute = sync_executor(connections[using])
            execute(queries.SET_LOCAL_LOCK_TIMEOUT, {"timeout": f"{LOCK_TIMEOUT_MS}ms"})
            yield execute
    except OperationalError as exc:
        if _lock_timed_out(exc):
            raise RowHeldError(HELD) from exc
        raise


def _run_by_type(execute: SyncExecute, statement: str, by_type: Mapping[str, Iterable[str]]) -> int:
    moved = 0
    for job_type, ids in by_type.items():
        photo_ids = sorted(set(ids))
        for start in range(0, len(photo_ids), REQUEUE_BATCH):
            chunk = photo_ids[start : start + REQUEUE_BATCH]
            moved += execute(statement, {"photo_ids": chunk, "type": job_type})[0]
    return moved


def requeue(
    queryset: Any, state: str, tokens: Mapping[tuple[str, str], int | None] | None = None
) -> tuple[int, int]:
    """Requeue the rows of `queryset` in `state` (and, if `tokens` are given, only those
    at their token there: (type, photo id) -> token); (rows moved, rows in `state` left alone
    at another token). The rows are locked first, in key order, so none changes before the
    statement runs.

    Raises:
        RowHeldError: a row stayed locked by another session.
    """
    held = (
        queryset.filter(state=state)
        .annotate(token=F("prior_attempts") + F("attempts"))
        .order_by("photo_id", "type")
        .select_for_update()
        .values_list("type", "photo_id", "token")
    )
    by_type: dict[str, list[str]] = defaultdict(list)
    changed = 0
    with _bounded(queryset.db) as execute:
        for job_type, photo_id, token in held:
            if tokens is None or tokens.get((job_type, photo_id)) == token:
                by_type[job_type].append(photo_id)
            else:  # another life of the row than the page showed
                changed += 1
        return _run_by_type(execute, queries.REQUEUE_PHOTOS, by_type), changed


def restore(queryset: Any) -> int:
    """`RESTORE_ARCHIVED` for the photos of `queryset`, type by type; rows it brought back.

    Raises:
        RowHeldError: a row stayed locked by another session.
    """
    by_type: dict[str, list[str]] = defaultdict(list)
    for job_type, photo_id in queryset.values_list("type", "photo_id"):
        by_type[job_type].append(photo_id)
    with _bounded(queryset.db) as execute:
        return _run_by_type(execute, queries.RESTORE_ARCHIVED, by_type)
