"""Counts of rows that may be millions (finished rows: done, failed, cancelled): exact while
they are few, the planner's estimate once they are many, and always saying which.

A count first asks the planner (the table's statistics from its last ANALYZE, scaled by
Postgres to the table's current size; no row is read): an estimate of `TRUST_ESTIMATE_FROM`
rows or more is the answer. Otherwise it reads at most `EXACT_UP_TO` rows: below that it is
exact; a count that reaches it stops there and becomes the planner's estimate, never less than
the rows already seen. So `reactor status`, the dashboard and `reactor prune --dry-run` cost
no more on a table of millions than on one of a hundred thousand; `exact=True` counts every
row (a scan) for whoever needs the figure to the row. Pending and active rows, the hot states,
are always counted exactly elsewhere (they are few, and read through their partial indexes).
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
    "TRUST_ESTIMATE_FROM",
    "Count",
    "count_finished_older",
    "counts_by_type",
    "planner_rows",
    "trusted_estimate",
]

#: A count reads at most this many rows; one that reaches it is the planner's estimate.
EXACT_UP_TO = 100_000

#: An estimate this large is taken without reading rows: statistics ten times too high take a
#: mass delete that no ANALYZE has seen yet (autovacuum's analyze follows one).
TRUST_ESTIMATE_FROM = 10 * EXACT_UP_TO


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


def trusted_estimate(conn: Connection, explain: str, params: Mapping[str, Any]) -> int | None:
    """The planner's estimate of `explain`'s rows (an `EXPLAIN (FORMAT JSON)` statement) when
    it is `TRUST_ESTIMATE_FROM` or more, to be taken as the count; else None (count the rows).

    Raises:
        psycopg.Error: the statement failed (callers run it under `translating`).
    """
    guess = planner_rows(conn, explain, params)
    return guess if guess >= TRUST_ESTIMATE_FROM else None


def counts_by_type(
    conn: Connection, state: str, types: Iterable[str], *, exact: bool = False
) -> tuple[dict[str, int], bool]:
    """Rows of `state` by type, and whether they are estimates. The planner is asked about
    `types` (the caller's known types) and the types the table's statistics list as common;
    an estimate of a type is never below the rows of it already read.

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    limit = None if exact else EXACT_UP_TO
    seen: dict[str, int] = {}
    if exact or trusted_estimate(conn, queries.ESTIMATE_ROWS_OF_STATE, {"state": state}) is None:
        params = {"state": state, "limit": limit}
        seen = {str(t): int(n) for t, n in conn.execute(queries.FINISHED_COUNTS_UP_TO, params)}
        if limit is None or sum(seen.values()) < limit:
            return seen, False
    common = {str(row[0]) for row in conn.execute(queries.COMMON_TYPES)}
    estimated = {}
    for job_type in sorted(set(types) | common | set(seen)):
        guess = planner_rows(
            conn, queries.ESTIMATE_ROWS_OF_TYPE, {"state": state, "type": job_type}
        )
        if job_type not in seen and guess <= 1:
            continue  # the planner's floor (it never says 0), for a type none was read of
        estimated[job_type] = max(guess, seen.get(job_type, 0))
    return estimated, True


def count_finished_older(conn: Connection, state: str, age: float, *, exact: bool = False) -> Count:
    """Rows of `state` last updated more than `age` seconds ago (what a prune would delete).

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    estimate = {"state": state, "age": age}
    if not exact and (trusted := trusted_estimate(conn, queries.ESTIMATE_FINISHED, estimate)):
        return Count(trusted, estimated=True)
    limit = None if exact else EXACT_UP_TO
    row = conn.execute(queries.COUNT_FINISHED, {**estimate, "limit": limit}).fetchone()
    counted = 0 if row is None else int(row[0])
    if limit is None or counted < limit:
        return Count(counted)
    guess = planner_rows(conn, queries.ESTIMATE_FINISHED, estimate)
    return Count(max(guess, counted), estimated=True)
