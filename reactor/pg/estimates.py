"""Counts of rows that may be millions (finished rows: done, failed, cancelled): exact while
they are few, the planner's estimate once they are many, and always saying which.

A count reads at most `EXACT_UP_TO` rows, or `SAMPLE_UP_TO` when the planner expects
`TRUST_ESTIMATE_FROM` or more (the table's statistics from its last ANALYZE, scaled by Postgres
to the table's current size; no row is read for that): a count below its bound is exact; one
that reaches it stops there and becomes the planner's estimate, never less than the rows
already seen. So `reactor status`, the dashboard and `reactor prune --dry-run` cost no more on
a table of millions than on one of a hundred thousand, and statistics left stale by a mass
change (every failed row requeued, and no ANALYZE since) cannot hide that fewer than
`SAMPLE_UP_TO` are left; `exact=True` counts every row (a scan) for whoever needs the figure to
the row. Pending and active rows, the hot states, are always counted exactly elsewhere (they
are few, and read through their partial indexes).

Counts by type (`read_state_rows`, `counts_by_type`) ask the planner about a bounded number of
types: those the table's statistics list as common and those the caller names; every other type
is counted in one figure, so a table of thousands of types (an INSERT-only role can make them)
costs a row each of a read, never a statement each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reactor.pg import queries
from reactor.pg.db import Connection

__all__ = [
    "EXACT_UP_TO",
    "SAMPLE_UP_TO",
    "TRUST_ESTIMATE_FROM",
    "Count",
    "StateRows",
    "TypeCounts",
    "count_finished_older",
    "counts_by_type",
    "planner_rows",
    "read_limit",
    "read_state_rows",
]

#: A count reads at most this many rows; one that reaches it is the planner's estimate.
EXACT_UP_TO = 100_000

#: When the planner expects this many rows or more, a count reads at most `SAMPLE_UP_TO`.
TRUST_ESTIMATE_FROM = 10 * EXACT_UP_TO
SAMPLE_UP_TO = EXACT_UP_TO // 10


@dataclass(frozen=True)
class Count:
    """A number of rows, and whether it is the planner's estimate rather than a count."""

    rows: int
    estimated: bool = False


def planner_rows(conn: Connection, explain: str, params: Mapping[str, Any]) -> int:
    """The rows the planner expects of `explain` (an `EXPLAIN (FORMAT JSON)` statement).

    Raises:
        psycopg.Error: the statement failed (callers run it under `translating`).
    """
    row = conn.execute(explain, params).fetchone()
    assert row is not None
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return max(0, round(float(plan[0]["Plan"]["Plan Rows"])))


def _bound(expected: int) -> int:
    """The rows a count reads when the planner expects `expected` of them."""
    return SAMPLE_UP_TO if expected >= TRUST_ESTIMATE_FROM else EXACT_UP_TO


def read_limit(
    conn: Connection, explain: str, params: Mapping[str, Any], *, exact: bool
) -> int | None:
    """How many rows a count reads: every one (`exact`), `SAMPLE_UP_TO` when the planner
    expects `TRUST_ESTIMATE_FROM` or more of `explain` (an `EXPLAIN (FORMAT JSON)` statement),
    else `EXACT_UP_TO`.

    Raises:
        psycopg.Error: the statement failed (callers run it under `translating`).
    """
    return None if exact else _bound(planner_rows(conn, explain, params))


@dataclass(frozen=True)
class StateRows:
    """The rows of one state by type as `read_state_rows` found them: every row when
    `complete`; else the planner's estimate of each type in `guessed` (the types the table's
    statistics list as common and those the caller named; left out when the planner gave its
    floor) and the rows read of each other type (fewer than it may have), with `expected`, the
    planner's estimate of the state's rows."""

    state: str
    by_type: dict[str, int]
    complete: bool = True
    expected: int = 0
    guessed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TypeCounts:
    """Rows of one state of each type asked about (those with none left out) and of every
    other type together, and whether they are the planner's estimates."""

    by_type: dict[str, int]
    other: int = 0
    estimated: bool = False


def read_state_rows(
    conn: Connection, state: str, types: Iterable[str] = (), *, exact: bool = False
) -> StateRows:
    """The rows of `state` by type: one read of at most the bound (`exact`: every row) and,
    when the bound is reached, one estimate for each of `types` (a few: the caller's own) and
    each common type (as many as the statistics target lets ANALYZE keep, whatever number of
    types the table holds).

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    expected = 0 if exact else planner_rows(conn, queries.ESTIMATE_ROWS_OF_STATE, {"state": state})
    limit = None if exact else _bound(expected)
    params = {"state": state, "limit": limit}
    read = {str(t): int(n) for t, n in conn.execute(queries.FINISHED_COUNTS_UP_TO, params)}
    if limit is None or sum(read.values()) < limit:
        return StateRows(state, read)
    # The read stops at the first rows it meets (in table or index order): a type may have many
    # rows it did not reach, which the statistics, sampled over the whole table, still list.
    guessed = {str(row[0]) for row in conn.execute(queries.COMMON_TYPES)} | set(types)
    for job_type in sorted(guessed):
        guess = _type_rows(conn, state, job_type, read.get(job_type, 0))
        if guess is not None:
            read[job_type] = guess
    return StateRows(state, read, False, expected, frozenset(guessed))


def counts_by_type(conn: Connection, rows: StateRows, types: Iterable[str]) -> TypeCounts:
    """Rows of `rows.state` of each of `types` (a few: one estimate each when the read was
    not complete, never below the rows of it read) and of every other type together (then the
    planner's estimate of the state less that of `types`, never below the rows of the others
    read or estimated).

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    wanted = set(types)
    by_type: dict[str, int] = {}
    for job_type in sorted(wanted):
        seen = rows.by_type.get(job_type)
        if not rows.complete and job_type not in rows.guessed:
            seen = _type_rows(conn, rows.state, job_type, seen or 0)
        if seen:
            by_type[job_type] = seen
    others = sum(n for t, n in rows.by_type.items() if t not in wanted)
    if rows.complete:
        return TypeCounts(by_type, others)
    return TypeCounts(by_type, max(others, rows.expected - sum(by_type.values())), True)


def _type_rows(conn: Connection, state: str, job_type: str, seen: int) -> int | None:
    """The planner's estimate of the rows of `job_type` in `state`, never below `seen` (the
    rows of it read); None when none were read and the planner gives its floor (it never
    says 0)."""
    guess = planner_rows(conn, queries.ESTIMATE_ROWS_OF_TYPE, {"state": state, "type": job_type})
    if not seen and guess <= 1:
        return None
    return max(guess, seen)


def count_finished_older(conn: Connection, state: str, age: float, *, exact: bool = False) -> Count:
    """Rows of `state` last updated more than `age` seconds ago (what a prune would delete).

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    # The bound follows the state's rows: the planner takes the state and the age as
    # independent, and the rows of one age can all be of another state.
    limit = read_limit(conn, queries.ESTIMATE_ROWS_OF_STATE, {"state": state}, exact=exact)
    estimate = {"state": state, "age": age}
    row = conn.execute(queries.COUNT_FINISHED, {**estimate, "limit": limit}).fetchone()
    counted = 0 if row is None else int(row[0])
    if limit is None or counted < limit:
        return Count(counted)
    guess = planner_rows(conn, queries.ESTIMATE_FINISHED, estimate)
    return Count(max(guess, counted), estimated=True)
