"""Deleting old finished rows in batches: the one loop behind `reactor prune` and the retention
thread of `reactor run`.

Each batch is its own short transaction that deletes at most `batch_size` rows of one state,
oldest first, with `FOR UPDATE SKIP LOCKED` (one range of the finished-rows index): it never
holds many locks or a long transaction, never waits behind a claim, and several pruners at once
skip each other's rows. A failed batch keeps its rows; the batches before it stay deleted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.estimates import Count, count_finished_older

__all__ = ["PRUNED_STATES", "PruneResult", "count_finished", "prune_finished"]

#: The states a prune deletes, each with its own age.
PRUNED_STATES = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class PruneResult:
    """Rows deleted (or, counted without deleting, that would be), and in how many batches."""

    done: int = 0
    failed: int = 0
    batches: int = 0
    cancelled: int = 0
    #: The states whose figure is the planner's estimate (a dry run's count of many rows).
    estimated: tuple[str, ...] = ()


def prune_finished(
    conn: Connection,
    ages: Iterable[tuple[str, float]],
    batch_size: int,
    *,
    pause_seconds: float = 0.0,
    stop: threading.Event | None = None,
    on_batch: Callable[[str, int], None] | None = None,
) -> PruneResult:
    """Delete the rows of each (state, age) last updated more than `age` seconds ago, batch by
    batch until a batch comes back short or `stop` is set, waiting `pause_seconds` between
    batches; `on_batch(state, rows)` is told of each batch.

    Raises:
        DatabaseError: a batch failed (its rows are kept; the message says how many went).
    """
    deleted = dict.fromkeys(PRUNED_STATES, 0)
    batches = 0
    for state, age in ages:
        while stop is None or not stop.is_set():
            total = sum(deleted.values())
            with translating(f"prune failed after {total} rows"), conn.transaction():
                count = conn.execute(
                    queries.PRUNE_FINISHED, {"state": state, "age": age, "limit": batch_size}
                ).rowcount
            batches += 1
            deleted[state] += count
            if on_batch is not None and count:
                on_batch(state, count)
            if count < batch_size:
                break
            if stop is not None:
                stop.wait(pause_seconds)
    return PruneResult(deleted["done"], deleted["failed"], batches, deleted["cancelled"])


def count_finished(conn: Connection, state: str, age: float, *, exact: bool = False) -> Count:
    """Rows of `state` last updated more than `age` seconds ago (what a prune would delete):
    exact up to `reactor.pg.estimates.EXACT_UP_TO`, the planner's estimate beyond (`exact`:
    every row counted).

    Raises:
        DatabaseError: the count failed.
    """
    with translating(f"cannot count {state} rows"):
        return count_finished_older(conn, state, age, exact=exact)
