"""Operator commands on rows: requeue finished rows, prune old ones (`reactor.pg.prune`),
archive them (`reactor.pg.history`).

Both work in batches of `batch_size` rows, each its own short transaction with `SKIP LOCKED`,
so they never hold locks on a large table for long and never wait behind the dispatcher.
Requeued rows move into `pending` (attempts 0), which fires the NOTIFY trigger: a running
reactor dispatches them at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from reactor.errors import ConfigError, StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.history import (
    HistoryMonth,
    archive_finished,
    drop_history,
    history_months_before,
)
from reactor.pg.prune import PRUNED_STATES, PruneResult, count_finished, prune_finished

__all__ = [
    "ArchiveResult",
    "PruneResult",
    "archive",
    "missing_photo_ids",
    "parse_duration",
    "prune",
    "requeue_failed",
    "requeue_photos",
]

DEFAULT_ADMIN_BATCH = 5000

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: The longest duration taken (100 years): Postgres cannot subtract much more from now().
MAX_DURATION_DAYS = 36_500


def parse_duration(text: str) -> float:
    """Seconds in `30s`, `15m`, `12h`, `7d` or `2w`. The unit is required: a bare `7` in a
    retention setting meant days to its writer and deleted a week of rows as seconds.

    Raises:
        ConfigError: not a duration with a unit, or longer than `MAX_DURATION_DAYS`.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if not match:
        raise ConfigError(
            f"bad duration {text[:40]!r}: give a number and a unit (s, m, h, d, w), e.g. 7d"
        )
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > MAX_DURATION_DAYS * 86400:
        raise ConfigError(f"bad duration {text[:40]!r}: at most {MAX_DURATION_DAYS}d (100 years)")
    return seconds


def _batched(conn: Connection, query: str, params: dict[str, object], limit: int) -> int:
    total = 0
    while True:
        with translating(f"batch failed after {total} rows"), conn.transaction():
            count = conn.execute(query, {**params, "limit": limit}).rowcount
        total += count
        if count < limit:
            return total


def requeue_failed(
    conn: Connection, job_type: str | None = None, *, batch_size: int = DEFAULT_ADMIN_BATCH
) -> int:
    """Move every `failed` row (of `job_type`, if given) back to `pending`; rows moved."""
    return _batched(conn, queries.REQUEUE_FAILED, {"type": job_type}, batch_size)


def requeue_photos(
    conn: Connection,
    photo_ids: Sequence[str],
    job_type: str | None = None,
    *,
    batch_size: int = DEFAULT_ADMIN_BATCH,
) -> int:
    """Move the `done`/`failed`/`cancelled` rows of these photos back to `pending`, and bring
    back as `pending` the latest archived life of those that have no row any more; rows
    moved."""
    total = 0
    for start in range(0, len(photo_ids), batch_size):
        params = {"photo_ids": list(photo_ids[start : start + batch_size]), "type": job_type}
        with translating(f"requeue failed after {total} rows"), conn.transaction():
            total += conn.execute(queries.REQUEUE_PHOTOS, params).rowcount
            total += conn.execute(queries.RESTORE_ARCHIVED, params).rowcount
    return total


def missing_photo_ids(
    conn: Connection, photo_ids: Sequence[str], job_type: str | None = None
) -> list[str]:
    """The given photo ids that have no row (of `job_type`, if given), in photo_jobs or its
    history, in the order given."""
    with translating("cannot look the photos up"), conn.transaction():
        found = {
            row[0]
            for row in conn.execute(
                queries.FOUND_PHOTO_IDS, {"photo_ids": list(photo_ids), "type": job_type}
            )
        }
    return [p for p in dict.fromkeys(photo_ids) if p not in found]


def _counted(conn: Connection, ages: list[tuple[str, float]], exact: bool) -> PruneResult:
    """What a prune or an archive of these (state, age) would take, counted (a dry run)."""
    found = {state: count_finished(conn, state, age, exact=exact) for state, age in ages}
    counts = {state: count.rows for state, count in found.items()}
    return PruneResult(
        counts.get("done", 0),
        counts.get("failed", 0),
        cancelled=counts.get("cancelled", 0),
        estimated=tuple(state for state, count in found.items() if count.estimated),
    )


def prune(
    conn: Connection,
    *,
    done_older_than: float | None,
    failed_older_than: float | None = None,
    cancelled_older_than: float | None = None,
    batch_size: int = DEFAULT_ADMIN_BATCH,
    dry_run: bool = False,
    exact: bool = False,
) -> PruneResult:
    """Delete `done` (and `failed`, `cancelled`) rows last updated longer ago than the given
    seconds; with `dry_run`, count them and delete nothing (many rows: the planner's estimate,
    named in `estimated`, unless `exact`)."""
    given = (("done", done_older_than), ("failed", failed_older_than))
    ages = [
        (state, age)
        for state, age in (*given, ("cancelled", cancelled_older_than))
        if age is not None
    ]
    if dry_run:
        return _counted(conn, ages, exact)
    return prune_finished(conn, ages, batch_size)


@dataclass(frozen=True)
class ArchiveResult:
    """Rows moved to the history (or, in a dry run, that would be) by state, and the history
    months dropped (or that would be), with their rows as the statistics have them."""

    moved: PruneResult
    dropped: list[HistoryMonth]


def archive(
    conn: Connection,
    *,
    older_than: float | None,
    drop_history_after: float | None = None,
    batch_size: int = DEFAULT_ADMIN_BATCH,
    dry_run: bool = False,
    exact: bool = False,
) -> ArchiveResult:
    """Move every done, failed and cancelled row last updated longer ago than `older_than`
    seconds into the history, then drop the history months older than `drop_history_after`;
    with `dry_run`, count what would go and change nothing."""
    ages = [] if older_than is None else [(state, older_than) for state in PRUNED_STATES]
    if dry_run:
        moved = _counted(conn, ages, exact)
        months = (
            []
            if drop_history_after is None
            else history_months_before(conn, drop_history_after, exact=exact)
        )
        return ArchiveResult(moved, months)
    try:
        moved = archive_finished(conn, ages, batch_size)
    except StatementError:
        # One state that cannot be archived does not keep old months: drop, then report it.
        if drop_history_after is not None:
            drop_history(conn, drop_history_after)
        raise
    if drop_history_after is None:
        return ArchiveResult(moved, [])
    # Names only: a dropped partition's rows are known only from the statistics read before.
    before = {m.name: m for m in history_months_before(conn, drop_history_after)}
    dropped = drop_history(conn, drop_history_after)
    return ArchiveResult(moved, [before.get(name, HistoryMonth(name, 0)) for name in dropped])
