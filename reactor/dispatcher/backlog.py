"""The backlog gauges: rows waiting or running per type, the oldest due row's age, the
cancelled rows kept for inspection, and the rows failed in the last 5 minutes (the failure
rate an alert watches: workers export no metrics, their outcomes are rows).

Counting is O(pending + active + cancelled + recently failed rows), so `reactor run` refreshes
these after a sweep round and only when metrics are served, never on the dispatch path. Routed
types are labelled by name and every other type under one label, so the series stay bounded
whatever types the table holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

from reactor.dispatcher.metrics import Metrics
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.routes import Route

__all__ = ["OTHER_TYPES_LABEL", "RECENTLY_FAILED_SECONDS", "refresh_backlog_metrics"]

#: The `type` label of the backlog of every type no route covers.
OTHER_TYPES_LABEL = "(unrouted)"
#: How far back `reactor_recently_failed_rows` counts.
RECENTLY_FAILED_SECONDS = 300.0
#: The states the backlog gauge counts (finished rows are no backlog).
_BACKLOG_STATES = ("pending", "active")


def refresh_backlog_metrics(
    conn: Connection, metrics: Metrics, routes: Mapping[str, Route]
) -> None:
    """Set the backlog, oldest-due, cancelled-rows and recently-failed gauges from one
    read-only transaction.

    Raises:
        DatabaseError, StatementError: as `translating` maps psycopg's errors.
    """
    types = list(routes)
    with translating("backlog query failed", conn), conn.transaction():
        backlog = conn.execute(queries.BACKLOG).fetchall()
        ages = conn.execute(queries.OLDEST_DUE_AGE, {"types": types}).fetchall()
        others = conn.execute(queries.OLDEST_DUE_AGE_OTHERS, {"types": types}).fetchone()
        cancelled_rows = conn.execute(queries.CANCELLED_COUNTS).fetchall()
        failed_rows = conn.execute(
            queries.RECENTLY_FAILED, {"seconds": RECENTLY_FAILED_SECONDS}
        ).fetchall()
    counts: dict[tuple[str, str], int] = {
        (label, state): 0 for label in (*types, OTHER_TYPES_LABEL) for state in _BACKLOG_STATES
    }
    for job_type, state, count in backlog:
        counts[_label(job_type, routes), state] += count
    metrics.backlog.clear()
    for (label, state), count in counts.items():
        metrics.backlog.labels(label, state).set(count)
    for job_type, age in ages:
        metrics.oldest_due_age.labels(job_type).set(age)
    # A type no reactor routes (a typo) waits forever: its age is what an alert can see.
    metrics.oldest_due_age.labels(OTHER_TYPES_LABEL).set(others[0] if others else 0)
    _set_by_type(metrics.cancelled_rows, cancelled_rows, routes)
    _set_by_type(metrics.recently_failed, failed_rows, routes)


def _set_by_type(gauge: Gauge, rows: list[Any], routes: Mapping[str, Route]) -> None:
    """Set `gauge` for every routed type and `OTHER_TYPES_LABEL` from (type, count) rows,
    0 where no row counts one."""
    counts = dict.fromkeys((*routes, OTHER_TYPES_LABEL), 0)
    for job_type, count in rows:
        counts[_label(job_type, routes)] += count
    for label, count in counts.items():
        gauge.labels(label).set(count)


def _label(job_type: str, routes: Mapping[str, Route]) -> str:
    return job_type if job_type in routes else OTHER_TYPES_LABEL
