"""The history of finished rows: moving them out of `photo_jobs` into `photo_jobs_history`
(one partition per UTC month), dropping whole months of it, and counting it.

A queue table that keeps every finished row grows without end, and deleting millions of them
is slow and leaves as many dead tuples. Archived rows instead leave the queue table batch by
batch, at the pace they finished; a month of history leaves by `DROP TABLE` of its partition,
at once. Each archive batch is one statement (DELETE … RETURNING feeding INSERT) in its own
short transaction, `FOR UPDATE SKIP LOCKED`, oldest first: a row is either still in
`photo_jobs` or in the history, never both and never neither. Before each batch, the
partitions of the months of the rows it will move are created, at most `MONTHS_PER_ROUND` a
round per state, and the batch stops short of the first month left without one, so no batch
meets a month without its partition (that needs the ownership of `photo_jobs_history`: another
role moves nothing and gets the error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reactor.errors import ReactorError, StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.estimates import Count, count_finished_older, planner_rows, read_limit
from reactor.pg.prune import PRUNED_STATES, PruneResult

__all__ = [
    "ARCHIVED_STATES",
    "MONTHS_PER_ROUND",
    "ArchiveIncompleteError",
    "HistoryMonth",
    "archive_finished",
    "count_history",
    "drop_history",
    "history_months_before",
]

#: The states archived, like the states pruned.
ARCHIVED_STATES = PRUNED_STATES

#: The most history partitions an archive round makes per state. One batch's are made in one
#: transaction, some 7 locks each, in a lock table of about 6,400 by default; the first batch
#: of a round always gets its oldest months, so every round moves rows.
MONTHS_PER_ROUND = 120


class ArchiveIncompleteError(StatementError):
    """An archive left rows older than its cutoff behind: a state's batch or partitions
    failed, or (`deferred`) a state's rows span more months than a round makes partitions
    for. The rows moved stay moved; the next round goes on from there."""

    def __init__(
        self, message: str, *, moved: PruneResult, left: Count | None, deferred: bool
    ) -> None:
        super().__init__(message)
        #: The rows moved before it stopped.
        self.moved = moved
        #: The rows older than the cutoff still in photo_jobs (None: they could not be counted).
        self.left = left
        #: True when nothing failed: rows were left for the next round's partitions.
        self.deferred = deferred


@dataclass(frozen=True)
class HistoryMonth:
    """A monthly partition of the history, and its rows as the statistics have them."""

    name: str
    estimated_rows: int
    #: Its rows counted (`history_months_before(..., exact=True)`), else None.
    rows: int | None = None


@dataclass(frozen=True)
class _Batch:
    """What the next archive batch of a state may move: the rows before `before` (a UTC
    month's start), once the partitions of the months in `create` are made."""

    create: list[str]
    before: str
    #: Rows may lie from `before` on, so a short batch does not mean the state is done.
    more: bool
    #: The oldest month needs a partition this round may no longer make: nothing can move.
    blocked: bool = False


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
        ArchiveIncompleteError: a state's partitions could not be made or its batch failed
            (that batch's rows stay in photo_jobs), or its rows span more than
            `MONTHS_PER_ROUND` months without a partition (`deferred`); the message says how
            many rows went and how many are left.
        DatabaseError: the connection was lost.
    """
    ages = list(ages)
    moved = dict.fromkeys(ARCHIVED_STATES, 0)
    batches = 0
    failure: StatementError | None = None
    deferred: list[str] = []
    for state, age in ages:
        try:
            state_batches, done = _archive_state(
                conn,
                state,
                age,
                batch_size,
                moved,
                pause_seconds=pause_seconds,
                stop=stop,
                on_batch=on_batch,
            )
        except StatementError as exc:
            failure = failure or exc
            continue
        batches += state_batches
        if not done:
            deferred.append(state)
    result = PruneResult(moved["done"], moved["failed"], batches, moved["cancelled"])
    if failure is None and not deferred:
        return result
    archived = sum(moved.values())
    left = _rows_left(conn, ages)
    said = "an unknown number of" if left is None else f"{'~' if left.estimated else ''}{left.rows}"
    if failure is not None:
        message = f"{failure} ({archived} rows archived, {said} rows left)"
    else:
        message = (
            f"archive stopped after {archived} rows, {said} rows left: the {','.join(deferred)}"
            f" rows span more months than the {MONTHS_PER_ROUND} a run makes partitions for;"
            " the next run goes on from there"
        )
    raise ArchiveIncompleteError(
        message, moved=result, left=left, deferred=failure is None
    ) from failure


def _archive_state(
    conn: Connection,
    state: str,
    age: float,
    batch_size: int,
    moved: dict[str, int],
    *,
    pause_seconds: float,
    stop: threading.Event | None,
    on_batch: Callable[[str, int], None] | None,
) -> tuple[int, bool]:
    """Archive one state batch by batch, adding to `moved`: the batches run, and False when
    rows were left for the next round's partitions.

    Raises:
        StatementError: its partitions could not be made or a batch failed.
        DatabaseError: the connection was lost.
    """
    budget = MONTHS_PER_ROUND
    batches = 0
    while stop is None or not stop.is_set():
        failing = f"cannot make the history's partitions for {state} rows"
        with translating(failing), conn.transaction():
            batch = _next_batch(conn, state, age, batch_size, budget)
            if batch is None or batch.blocked:
                return batches, batch is None
            if batch.create or not batches:
                conn.execute(
                    queries.ADD_HISTORY_MONTHS,
                    {"months": batch.create, "age": age, "ahead": not batches},
                )
        budget -= len(batch.create)
        with translating(f"archive failed after {moved[state]} rows"), conn.transaction():
            count = conn.execute(
                queries.ARCHIVE_FINISHED,
                {"state": state, "age": age, "limit": batch_size, "before": batch.before},
            ).rowcount
        batches += 1
        moved[state] += count
        if on_batch is not None and count:
            on_batch(state, count)
        if count == 0 or (count < batch_size and not batch.more):
            # Done, or what is left is locked by others (another archive): the next round's.
            return batches, True
        if stop is not None:
            stop.wait(pause_seconds)
    return batches, True


def _next_batch(
    conn: Connection, state: str, age: float, batch_size: int, budget: int
) -> _Batch | None:
    """The next batch of `state` (None: no row to move), making at most `budget` partitions.

    Raises:
        psycopg.Error: the read failed (callers run it under `translating`).
    """
    months = conn.execute(
        queries.HISTORY_BATCH_MONTHS, {"state": state, "age": age, "limit": batch_size}
    ).fetchall()
    if not months:
        return None
    create: list[str] = []
    for start, _, _, exists in months:
        if exists:
            continue
        if len(create) == budget:
            # This month and those after wait for the next round.
            return _Batch(create, str(start), more=True, blocked=start == months[0][0])
        create.append(str(start))
    # The batch may reach past the rows read (some were locked): not past their last month.
    seen = sum(int(rows) for _, _, rows, _ in months)
    return _Batch(create, str(months[-1][1]), more=seen >= batch_size)


def _rows_left(conn: Connection, ages: list[tuple[str, float]]) -> Count | None:
    """The rows of `ages` still in photo_jobs (what the next round would move, and rows of a
    year BC); None when they cannot be counted (the failure in hand says why)."""
    try:
        with translating("cannot count the rows left"), conn.transaction():
            counts = [count_finished_older(conn, state, age) for state, age in ages]
    except ReactorError:
        return None
    return Count(sum(c.rows for c in counts), any(c.estimated for c in counts))


def drop_history(conn: Connection, age: float) -> list[str]:
    """Drop the history months whose every row finished more than `age` seconds ago; their
    partitions' names, oldest first.

    Raises:
        DatabaseError: the drop failed, or waited 5 s for its lock (nothing dropped).
    """
    with translating("cannot drop old history"), conn.transaction():
        return [str(row[0]) for row in conn.execute(queries.DROP_HISTORY_BEFORE, {"age": age})]


def history_months_before(
    conn: Connection, age: float, *, exact: bool = False
) -> list[HistoryMonth]:
    """What `drop_history(conn, age)` would drop, each month's rows counted if `exact` (the
    statistics say 0 until a partition is first analyzed).

    Raises:
        DatabaseError: the catalog could not be read.
    """
    with translating("cannot read the history's partitions"), conn.transaction():
        months = conn.execute(queries.HISTORY_MONTHS_BEFORE, {"age": age}).fetchall()
        found = []
        for name, estimated, ends in months:
            rows = None
            if exact:
                row = conn.execute(queries.HISTORY_MONTH_ROWS, {"ends": ends}).fetchone()
                rows = int(row[0]) if row else 0
            found.append(HistoryMonth(str(name), int(estimated), rows))
        return found


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
