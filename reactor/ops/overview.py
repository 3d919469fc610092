"""What the dashboard shows, read in one pass: the table, the reactors' sessions, RQ.

Every figure comes from a source that holds it; only finished rows, once there are many, are
the planner's estimate (said so: `reactor.ops.status`):
- per type: `reactor status` (rows by state, the oldest due row's age, the next retry, stale
  active rows, paused), and what holds back vacuum of the table (`reactor.pg.vacuum`);
- per minute over the last hour: rows that finished (now `done` or `failed`) by the minute of
  their last update, and the attempts those rows took (each attempt was one dispatch). A row
  re-submitted or pruned since is no longer counted; dispatches of rows not finished yet are
  not in the table (the reactors' `reactor_dispatched_total` metric counts those);
- the last failures (`last_error`, passwords masked even in rows written before the masking
  knew their form; attempt), the paused types;
- the reactors' connections from `pg_stat_activity` and whether one holds the doorbell;
- RQ: jobs waiting and workers (`Worker.all`) per queue.
The database part is one read-only transaction; a Redis failure leaves the RQ part empty with
its reason and the rest intact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from rq import Queue, Worker

from reactor.errors import RedisUnavailableError
from reactor.ops.failures import Failure, read_failures
from reactor.ops.status import FinishedCounts, Status, read_status
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.routes import Route
from reactor.rq.state import reading
from reactor.validate import MAX_ERROR_CHARS

__all__ = [
    "CHART_MINUTES",
    "Finished",
    "Overview",
    "QueueInfo",
    "ReactorSession",
    "WorkerInfo",
    "read_overview",
]

#: Minutes shown by the per-minute charts.
CHART_MINUTES = 60
#: Failures listed.
FAILURES_SHOWN = 20


@dataclass(frozen=True)
class Finished:
    """Rows finished per minute over the last `CHART_MINUTES`, oldest minute first."""

    minutes: list[str]
    done: dict[str, list[int]]
    failed: dict[str, list[int]]
    attempts: list[int]


@dataclass(frozen=True)
class ReactorSession:
    pid: int
    role: str
    client_addr: str | None
    since: str
    armed: bool


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    state: str
    current_job: str | None


@dataclass(frozen=True)
class QueueInfo:
    name: str
    waiting: int
    workers: list[WorkerInfo]


@dataclass(frozen=True)
class Overview:
    """Everything on the page (and in the JSON endpoint)."""

    generated_at: str
    status: Status
    finished: Finished
    failures: list[Failure]
    reactors: list[ReactorSession]
    queues: list[QueueInfo] = field(default_factory=list)
    redis_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "generated_at": self.generated_at,
            **self.status.as_dict(),
            "finished_per_minute": asdict(self.finished),
            "failures": [f.as_dict() for f in self.failures],
            "reactors": [asdict(r) for r in self.reactors],
            "queues": [asdict(q) for q in self.queues],
            "redis_error": self.redis_error,
        }


def _finished(conn: Connection, last: datetime) -> Finished:
    slots = [last - timedelta(minutes=CHART_MINUTES - 1 - i) for i in range(CHART_MINUTES)]
    index = {slot: i for i, slot in enumerate(slots)}
    done: dict[str, list[int]] = {}
    failed: dict[str, list[int]] = {}
    attempts = [0] * CHART_MINUTES
    for minute, job_type, state, count, tries in conn.execute(
        queries.FINISHED_BY_MINUTE, {"minute": last}
    ):
        i = index.get(minute)
        if i is None:  # updated_at in the future (clock skew between writers): not charted
            continue
        series = done if state == "done" else failed
        series.setdefault(job_type, [0] * CHART_MINUTES)[i] += int(count)
        attempts[i] += int(tries)
    return Finished(
        [slot.isoformat() for slot in slots],
        dict(sorted(done.items())),
        dict(sorted(failed.items())),
        attempts,
    )


def _queues(client: redis.Redis, routes: Mapping[str, Route]) -> list[QueueInfo]:
    workers: dict[str, list[WorkerInfo]] = {}
    for worker in Worker.all(connection=client):
        info = WorkerInfo(worker.name, worker.get_state(), worker.get_current_job_id())
        for name in worker.queue_names():
            workers.setdefault(name, []).append(info)
    names = sorted({r.queue for r in routes.values()} | set(workers))
    return [
        QueueInfo(
            name,
            Queue(name, connection=client).count,
            sorted(workers.get(name, []), key=lambda w: w.name),
        )
        for name in names
    ]


def read_overview(
    conn: Connection,
    client: redis.Redis,
    routes: Mapping[str, Route],
    stale_after_seconds: float,
    done_counts: FinishedCounts | None = None,
) -> Overview:
    """Read everything the dashboard shows (`done_counts`: see `read_status`).

    Raises:
        DatabaseError: Postgres failed (Redis failures are reported in `redis_error`).
    """
    status = read_status(conn, stale_after_seconds, done_counts=done_counts)
    # The routes given to the dashboard, else those the reactors recorded (status lists them).
    routes = routes or {r.route.type: r.route for r in status.routes}
    with translating("dashboard query failed"), conn.transaction():
        row = conn.execute(queries.CURRENT_MINUTE).fetchone()
        assert row is not None
        now, minute = row
        finished = _finished(conn, minute)
        failures = read_failures(
            conn, None, FAILURES_SHOWN, count_more=False, error_chars=MAX_ERROR_CHARS
        ).rows
        reactors = [
            ReactorSession(int(pid), role, addr, since.isoformat(), bool(armed))
            for pid, role, addr, since, armed in conn.execute(queries.REACTOR_SESSIONS)
        ]
    generated = now.isoformat()
    try:
        with reading():
            queues = _queues(client, routes)
    except RedisUnavailableError as exc:
        return Overview(generated, status, finished, failures, reactors, [], str(exc))
    return Overview(generated, status, finished, failures, reactors, queues)
