"""Backlog drain: N pending rows -> RQ, against RQ's own ceiling and the old per-row design.

- ours: `Dispatcher.drain` (the reactor's claim -> enqueue -> COMMIT path, batches of 500,
  each full batch's successor claimed ahead on a second connection, as `reactor run` does);
- ceiling: `Queue.enqueue_many` of the same jobs (same function, ids, meta), batches of 500,
  no Postgres at all;
- per-row: the TypeScript sweep this project replaces: select the due ids, one
  `UPDATE ... WHERE (photo_id) IN (...)`, then one `Queue.enqueue` per row, awaited in turn.
The three run side by side in each repetition, in rotating order.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from rq import Queue

from bench.common import Stat, fresh_database, insert_pending, redis_client, reset, table
from reactor.dispatcher.drain import Dispatcher
from reactor.jobs import ENTRY_POINT, JobRef
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer
from reactor.settings import FAILED_JOB_TTL_SECONDS, RESULT_TTL_SECONDS

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
BATCH = 500


def _ours(url: str, rows: int) -> float:
    insert_pending(url, rows)
    client = redis_client()
    with psycopg.connect(url) as conn, psycopg.connect(url) as ahead:
        dispatcher = Dispatcher(Enqueuer(client, ROUTES), ROUTES, batch_size=BATCH)
        started = time.perf_counter()
        result = dispatcher.drain(conn, ["photo.process"], ahead=ahead)
        elapsed = time.perf_counter() - started
    assert result.enqueued == rows, result
    return rows / elapsed


def _ceiling(url: str, rows: int) -> float:
    client = redis_client()
    queue = Queue("photo-process", connection=client)
    refs = [JobRef("photo.process", f"p{i}", 1) for i in range(1, rows + 1)]
    started = time.perf_counter()
    for start in range(0, rows, BATCH):
        queue.enqueue_many(
            [
                Queue.prepare_data(
                    ENTRY_POINT,
                    args=(r.type, r.photo_id, r.token),
                    kwargs={"handler": "reactor.demo.process_photo"},
                    job_id=r.job_id,
                    meta=r.meta(),
                    failure_ttl=FAILED_JOB_TTL_SECONDS,
                    result_ttl=RESULT_TTL_SECONDS,
                    description=f"reactor.demo.process_photo({r.photo_id!r})",
                )
                for r in refs[start : start + BATCH]
            ]
        )
    elapsed = time.perf_counter() - started
    assert client.llen("rq:queue:photo-process") == rows
    return rows / elapsed


def _per_row(url: str, rows: int) -> float:
    insert_pending(url, rows)
    client = redis_client()
    queue = Queue("photo-process", connection=client)
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.perf_counter()
        due = [
            r[0]
            for r in conn.execute(
                "SELECT photo_id FROM photo_jobs WHERE state = 'pending' AND type = 'photo.process'"
                " AND (next_retry_at IS NULL OR next_retry_at < now())"
            )
        ]
        conn.execute(
            "UPDATE photo_jobs SET state = 'active' WHERE photo_id = ANY(%s)"
            " AND type = 'photo.process' AND state = 'pending'",
            [due],
        )
        for photo_id in due:
            ref = JobRef("photo.process", photo_id, 1)
            queue.enqueue(
                ENTRY_POINT,
                ref.type,
                ref.photo_id,
                ref.token,
                handler="reactor.demo.process_photo",
                job_id=ref.job_id,
            )
        elapsed = time.perf_counter() - started
    return rows / elapsed


def run(quick: bool) -> dict[str, Any]:
    rows = 10_000 if quick else 100_000
    reps = 3 if quick else 5
    designs = {"ours": _ours, "ceiling": _ceiling, "per_row": _per_row}
    rates: dict[str, list[float]] = {name: [] for name in designs}
    ratios_ceiling, ratios_per_row = [], []
    with fresh_database() as url:
        for rep in range(reps):
            order = list(designs)[rep % 3 :] + list(designs)[: rep % 3]
            this: dict[str, float] = {}
            for name in order:
                reset(url)
                this[name] = designs[name](url, rows)
                rates[name].append(this[name])
            ratios_ceiling.append(this["ours"] / this["ceiling"])
            ratios_per_row.append(this["ours"] / this["per_row"])
    stats = {name: Stat.of(values) for name, values in rates.items()}
    ratio_c, ratio_p = Stat.of(ratios_ceiling), Stat.of(ratios_per_row)
    return {
        "rows": rows,
        "jobs_per_second": {name: s.as_dict() for name, s in stats.items()},
        "ours_over_ceiling": ratio_c.as_dict(),
        "ours_over_per_row": ratio_p.as_dict(),
        "table": table(
            ["design", f"jobs/s ({rows:,} rows)", "ours ÷ this"],
            [
                [
                    "ours: claim 500 → enqueue → COMMIT, next claim ahead",
                    stats["ours"].fmt(digits=0),
                    "1",
                ],
                [
                    "ceiling: RQ enqueue_many, no Postgres",
                    stats["ceiling"].fmt(digits=0),
                    ratio_c.fmt("×", 2),
                ],
                [
                    "per-row: the replaced TypeScript sweep's design",
                    stats["per_row"].fmt(digits=0),
                    ratio_p.fmt("×", 2),
                ],
            ],
        ),
    }
