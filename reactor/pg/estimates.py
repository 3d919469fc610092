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
    "count_finished_older",
    "counts_by_type",
    "planner_rows",
    "read_limit",
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


def read_limit(
    conn: Connection, explain: str, params: Mapping[str, Any], *, exact: bool
) -> int | None:
    """How many rows a count reads: every one (`exact`), `SAMPLE_UP_TO` when the planner
    expects `TRUST_ESTIMATE_FROM` or more of `explain` (an `EXPLAIN (FORMAT JSON)` statement),
    else `EXACT_UP_TO`.

    Raises:
        psycopg.Error: the statement failed (callers run it under `translating`).
    """
    if exact:
        return None
    many = planner_rows(conn, explain, params) >= TRUST_ESTIMATE_FROM
    return SAMPLE_UP_TO if many else EXACT_UP_TO


def counts_by_type(
    conn: Connection, state: str, types: Iterable[str], *, exact: bool = False
) -> tuple[dict[str, int], bool]:
    """Rows of `state` by type, and whether they are estimates. The planner is asked about
    `types` (the caller's known types) and the types the table's statistics list as common;
    an estimate of a type is never below the rows of it already read.

    Raises:
        psycopg.Error: a statement failed (callers run it under `translating`).
    """
    limit = read_limit(conn, queries.ESTIMATE_ROWS_OF_STATE, {"state": state}, exact=exact)
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
