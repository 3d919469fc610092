"""The history of finished rows: moving them out of `photo_jobs` into `photo_jobs_history`
(one partition per UTC month), dropping whole months of it, and counting it.

A queue table that keeps every finished row grows without end, and deleting millions of them
is slow and leaves as many dead tuples. Archived rows instead leave the queue table batch by
batch, at the pace they finished; a month of history leaves by `DROP TABLE` of its partition,
at once. Each archive batch is one statement (DELETE … RETURNING feeding INSERT) in its own
short transaction, `FOR UPDATE SKIP LOCKED`, oldest first: a row is either still in
`photo_jobs` or in the history, never both and never neither. Before moving rows of a state,
the partitions of their months are created (that needs the ownership of
`photo_jobs_history`: another role moves nothing and gets the error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reactor.errors import StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.estimates import Count, planner_rows, read_limit
from reactor.pg.prune import PRUNED_STATES, PruneResult, prune_finished

__all__ = [
    "ARCHIVED_STATES",
    "HistoryMonth",
    "archive_finished",
    "count_history",
    "drop_history",
    "history_months_before",
]

#: The states archived, like the states pruned.
ARCHIVED_STATES = PRUNED_STATES

#: The most months of history an archive round creates partitions for, per state (one index
#: probe each): a state with rows in more months moves the oldest, then fails on the first
#: month without its partition, and the next round goes on from there.
MONTHS_PER_ROUND = 120


@dataclass(frozen=True)
class HistoryMonth:
    """A monthly partition of the history, and its rows as the statistics have them."""

    name: str
    estimated_rows: int


def archive_finished(
    conn: Connection,
    ages: Iterable[tuple[str, float]],
    batch_size: int,
    *,
    pause_seconds: float = 0.0,
    stop: threading.Event | None = None,
    on_batch: Callable[[str, int], None] | None = None,
) -> PruneResult:
    """Move the rows of each (state, age) last updated more than `age` seconds ago into the
    history, as `reactor.pg.prune.prune_finished` deletes them (same batches, pauses and
    stop); the result counts the rows moved. Rows last updated in a year BC stay (no
    partition can be named for them; a prune deletes them).

    A state whose partitions cannot be made or whose batch fails on a healthy connection does
    not hold back the others: every state is archived as far as it goes, then the first
    failure is raised.

    Raises:
        StatementError: a state's partitions could not be made or its batch failed (that
            batch's rows stay in photo_jobs; the message says how many rows went).
        DatabaseError: the connection was lost.
    """
    moved = PruneResult(0, 0, 0, 0)
    failure: StatementError | None = None
    for state, age in ages:
        try:
            failing = f"cannot make the history's partitions for {state} rows"
            with translating(failing), conn.transaction():
                conn.execute(
                    queries.ADD_HISTORY_MONTHS,
                    {"state": state, "age": age, "months": MONTHS_PER_ROUND},
                )
            result = prune_finished(
                conn,
                [(state, age)],
                batch_size,
                pause_seconds=pause_seconds,
                stop=stop,
                on_batch=on_batch,
                statement=queries.ARCHIVE_FINISHED,
                what="archive",
            )
        except StatementError as exc:
            failure = failure or exc
            continue
        moved = PruneResult(
            moved.done + result.done,
            moved.failed + result.failed,
            moved.batches + result.batches,
            moved.cancelled + result.cancelled,
        )
    if failure is not None:
        archived = moved.done + moved.failed + moved.cancelled
        raise StatementError(f"{failure} ({archived} rows archived)") from failure
    return moved


def drop_history(conn: Connection, age: float) -> list[str]:
    """Drop the history months whose every row finished more than `age` seconds ago; their
    partitions' names, oldest first.

    Raises:
        DatabaseError: the drop failed, or waited 5 s for its lock (nothing dropped).
    """
    with translating("cannot drop old history"), conn.transaction():
        return [str(row[0]) for row in conn.execute(queries.DROP_HISTORY_BEFORE, {"age": age})]


def history_months_before(conn: Connection, age: float) -> list[HistoryMonth]:
    """What `drop_history(conn, age)` would drop.

    Raises:
        DatabaseError: the catalog could not be read.
    """
    with translating("cannot read the history's partitions"), conn.transaction():
        return [
            HistoryMonth(str(name), int(rows))
            for name, rows in conn.execute(queries.HISTORY_MONTHS_BEFORE, {"age": age})
        ]


def count_history(conn: Connection, *, exact: bool = False) -> tuple[Count, int]:
    """Rows in the history (exact below the bound `reactor.pg.estimates.read_limit` sets, the
    planner's estimate beyond, unless `exact`) and its number of monthly partitions.

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    limit = read_limit(conn, queries.ESTIMATE_HISTORY, {}, exact=exact)
    row = conn.execute(queries.HISTORY_COUNT_UP_TO, {"limit": limit}).fetchone()
    assert row is not None
    counted, months = int(row[0]), int(row[1])
    if limit is None or counted < limit:
        return Count(counted), months
    guess = planner_rows(conn, queries.ESTIMATE_HISTORY, {})
    return Count(max(guess, counted), estimated=True), months
