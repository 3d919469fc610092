"""Sweep cost vs history: one sweep round beside 0, 1 M and 5 M `done` rows.

The table holds 100,000 pending rows scheduled for later (so the round claims nothing and the
figure is the cost of looking), plus the `done` history. A sweep round is everything
`Sweeper.run_once()` does: claim due rows, rescue stale active rows, check active rows' jobs,
list unrouted types. Beside it, the backlog-metrics refresh that follows a sweep when metrics
are served: it counts pending and active rows, so it is O(backlog) by nature.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.common import Stat, fresh_database, insert_pending, redis_client, table
from reactor.dispatcher.backlog import refresh_backlog_metrics
from reactor.dispatcher.drain import Dispatcher
from reactor.dispatcher.sweep import Sweeper
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer
from reactor.rq.state import RqState

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])


def _rounds(url: str, reps: int) -> tuple[list[float], list[float]]:
    client = redis_client()
    with psycopg.connect(url) as conn:
        dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=500)
        sweeper = Sweeper(
            dispatcher,
            RqState(client, ROUTES),
            ROUTES,
            batch_size=500,
            stale_after_seconds=300,
        )
        sweeper.run_once(conn)  # warm caches and plans
        timings, refresh = [], []
        for _ in range(reps):
            started = time.perf_counter()
            result = sweeper.run_once(conn)
            timings.append((time.perf_counter() - started) * 1000)
            assert result.claimed == 0, result
            started = time.perf_counter()
            refresh_backlog_metrics(conn, sweeper.metrics, ROUTES)
            refresh.append((time.perf_counter() - started) * 1000)
    return timings, refresh


def run(quick: bool) -> dict[str, Any]:
    reps = 5 if quick else 11
    pending = 100_000
    histories = [0, 200_000] if quick else [0, 1_000_000, 5_000_000]
    results: dict[str, Any] = {}
    stats: dict[int, Stat] = {}
    refreshes: dict[int, Stat] = {}
    with fresh_database() as url:
        insert_pending(url, pending, prefix="later", next_retry_at="2999-01-01")
        have = 0
        for history in histories:
            if history > have:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(
                        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
                        " SELECT 'd' || i, 'photo.process', 'done', 1"
                        " FROM generate_series(%s::int + 1, %s::int) i",
                        [have, history],
                    )
                    conn.execute("VACUUM ANALYZE photo_jobs")
                have = history
            rounds, refresh = _rounds(url, reps)
            stats[history], refreshes[history] = Stat.of(rounds), Stat.of(refresh)
            results[str(history)] = {
                "sweep_round_ms": stats[history].as_dict(),
                "backlog_metrics_refresh_ms": refreshes[history].as_dict(),
            }
    base = stats[histories[0]].median
    rows = [
        [
            f"{h:,}",
            stats[h].fmt(" ms", 2),
            f"{stats[h].median / base:.2f}×",
            refreshes[h].fmt(" ms", 2),
        ]
        for h in histories
    ]
    return {
        "pending_rows": pending,
        "round_ms_by_done_rows": results,
        "ratio_largest_over_empty": stats[histories[-1]].median / base,
        "table": table(
            [
                "done rows",
                f"one sweep round ({pending:,} pending, none due)",
                "÷ empty history",
                "backlog-metrics refresh (not part of the round)",
            ],
            rows,
        ),
    }
