"""Operator features: the cost of the pause check in the claim, and of retention on dispatch.

Pause check: the claim (`queries.CLAIM_DUE`) reads `reactor_paused_types` inside its own
statement. Measured here against the same claim without that check, alternating the two on
one connection (each claim rolled back, so both see the same table: pending rows plus a done
history), at batch sizes 1 and 500.

Retention: dispatch latency (COMMIT of a single-row insert -> its job in the RQ queue, one
insert every 10 ms, paced as in the latency benchmark) of a `reactor run` without retention and of
one with `--prune-done-after 7d` while it is deleting a large history of old `done` rows,
alternating the two; the rows it deleted during the measurement are counted, to show the
pruning was running all along.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.common import Reactor, Stat, fresh_database, percentile, reset, table
from bench.latency import _dispatch_round
from reactor.pg import queries

_CHECK = (
    "            AND NOT EXISTS (SELECT FROM reactor_paused_types AS x WHERE x.type = %(type)s)\n"
)


def _claim_cost(url: str, reps: int) -> dict[int, tuple[Stat, Stat]]:
    without = queries.CLAIM_DUE.replace(_CHECK, "")
    assert without != queries.CLAIM_DUE, "the claim's pause check changed: update the benchmark"
    out = {}
    with psycopg.connect(url) as conn:
        for batch in (1, 500):
            times: dict[str, list[float]] = {"with": [], "without": []}
            for rep in range(reps):
                pair = [("with", queries.CLAIM_DUE), ("without", without)]
                for name, query in pair if rep % 2 else reversed(pair):
                    started = time.perf_counter()
                    conn.execute(
                        query, {"type": "photo.process", "limit": batch, "skip": [], "window": None}
                    ).fetchall()
                    times[name].append((time.perf_counter() - started) * 1000)
                    conn.rollback()
            out[batch] = (Stat.of(times["with"]), Stat.of(times["without"]))
    return out


def _old_rows(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM photo_jobs WHERE state = 'done'"
            " AND updated_at < now() - interval '7 days'"
        ).fetchone()
    return int(row[0]) if row else 0


def _top_up(url: str, wanted: int, run: int) -> None:
    missing = wanted - _old_rows(url)
    if missing > 0:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
                " SELECT 'old-' || %s::text || '-' || i, 'photo.process', 'done', 1,"
                "        now() - interval '30 days', now() - interval '30 days'"
                "   FROM generate_series(1, %s) AS i",
                [run, missing],
            )
            conn.execute("VACUUM ANALYZE photo_jobs")


def _latency(url: str, history: int, pairs: int, inserts: int) -> dict[str, Any]:
    delays: dict[str, list[float]] = {"off": [], "on": []}
    pruned: list[int] = []
    for run in range(2 * pairs):
        mode = "on" if run % 2 else "off"
        reset(url)
        _top_up(url, history, run)
        args = ["--prune-done-after", "7d"] if mode == "on" else []
        reactor = Reactor(url, *args).started()
        try:
            time.sleep(1.0)  # pruning under way
            before = _old_rows(url)
            delays[mode] += _dispatch_round(url, inserts, 0.01, f"{mode}{run}")
            if mode == "on":
                pruned.append(before - _old_rows(url))
        finally:
            reactor.stop()
    return {"delays_ms": {k: [d * 1000 for d in v] for k, v in delays.items()}, "pruned": pruned}


def run(quick: bool) -> dict[str, Any]:
    pending, done = (20_000, 50_000) if quick else (100_000, 500_000)
    reps = 200 if quick else 1000
    history, pairs, inserts = (60_000, 1, 150) if quick else (300_000, 3, 300)
    with fresh_database() as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) SELECT 'p' || i, 'photo.process'"
                " FROM generate_series(1, %s) AS i",
                [pending],
            )
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
                " SELECT 'd' || i, 'photo.process', 'done', 1 FROM generate_series(1, %s) AS i",
                [done],
            )
            conn.execute("VACUUM ANALYZE photo_jobs")
        claims = _claim_cost(url, reps)
    with fresh_database() as url:
        latency = _latency(url, history, pairs, inserts)
    rows = [
        [
            f"claim, batch {batch}",
            without.fmt(" ms", 3),
            with_.fmt(" ms", 3),
            f"{with_.median / without.median:.3f}×",
        ]
        for batch, (with_, without) in claims.items()
    ]
    off, on = latency["delays_ms"]["off"], latency["delays_ms"]["on"]
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        rows.append(
            [
                f"dispatch latency {label}",
                f"{percentile(off, q):.2f} ms (no retention)",
                f"{percentile(on, q):.2f} ms (pruning)",
                f"{percentile(on, q) / percentile(off, q):.2f}×",
            ]
        )
    return {
        "claim_ms": {
            str(b): {"with_check": w.as_dict(), "without_check": wo.as_dict()}
            for b, (w, wo) in claims.items()
        },
        "latency": latency,
        "table": table(["what", "without", "with", "with ÷ without"], rows)
        + f"\n\nClaims: {pending:,} pending and {done:,} done rows, {reps} alternating claims"
        f" each. Latency: {pairs} alternating pair(s) of runs, {inserts} inserts each, the"
        f" pruning reactor deleting {history:,} old done rows (deleted during the"
        f" measurements: {', '.join(f'{n:,}' for n in latency['pruned'])}).",
    }
