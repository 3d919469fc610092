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
- RQ: jobs waiting and workers per queue, each worker's state and current job.
The database part is one read-only transaction; a Redis failure leaves the RQ part empty with
its reason and the rest intact. RQ's keys are read with plain commands, key by key, never
through RQ's `Worker.all` (which parses every worker hash, so one bad hash failed the whole
read, and removes stale keys: the dashboard writes nothing): a worker key that cannot be read
(not a hash, a name that is not UTF-8) is left out and named in `unreadable`, with why, as is
a queue that is not a list; a worker hash missing its fields shows `?` and no queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from rq import Queue, Worker
from rq.defaults import RQ_KEY_PREFIX
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE

from reactor.errors import RedisUnavailableError
from reactor.ops.failures import Failure, read_failures
from reactor.ops.status import FinishedCounts, Status, read_status
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.redact import redact
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
#: RQ's keys as RQ spells them: its workers' set, a worker's hash (prefix + name), the set
#: of a worker's executions (`job_id:execution_id`), an execution's hash (prefix + member).
_WORKERS_KEY = Worker.redis_workers_keys
_WORKER_PREFIX = Worker.redis_worker_namespace_prefix.encode()
# The template as RQ fills it in (`str.format`: a `{rq}` prefix is written `{{rq}}` in it).
_EXECUTIONS_HEAD, _EXECUTIONS_TAIL = (
    part.encode() for part in WORKER_EXECUTIONS_KEY_TEMPLATE.format("\x00").split("\x00")
)
_EXECUTION_PREFIX = f"{RQ_KEY_PREFIX}:execution:".encode()


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
    waiting: int | None  # None: the queue's key is not a list (named in `unreadable`)
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
    unreadable: list[str] = field(default_factory=list)  # RQ keys left out, with why

    def as_dict(self) -> dict[str, Any]:
        return {
            "generated_at": self.generated_at,
            **self.status.as_dict(),
            "finished_per_minute": asdict(self.finished),
            "failures": [f.as_dict() for f in self.failures],
            "reactors": [asdict(r) for r in self.reactors],
            "queues": [asdict(q) for q in self.queues],
            "redis_error": self.redis_error,
            "unreadable": self.unreadable,
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


def _failure(reply: object) -> str | None:
    """Why a command of a pipeline run with `raise_on_error=False` failed on its key (the
    first line of its error), or None: it did not."""
    if not isinstance(reply, Exception):
        return None
    text = str(reply).strip()
    return redact(text.splitlines()[0] if text else type(reply).__name__)


def _shown(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class _WorkerKey:
    """What one worker's keys hold: its hash's fields, its executions (`job_id:exec_id`)."""

    name: str
    state: bytes | None
    queues: bytes | None
    executions: list[bytes]


def _read_worker(key: bytes, fields: object, executions: object) -> _WorkerKey | str:
    """One worker from its replies, or why it cannot be read."""
    why = _failure(fields) or _failure(executions)
    if not key.startswith(_WORKER_PREFIX):
        return "not an RQ worker's key"
    if why is not None:
        return why
    if not isinstance(fields, list) or not isinstance(executions, (set, list)):
        return "an unexpected reply"
    try:
        name = key.removeprefix(_WORKER_PREFIX).decode()
    except UnicodeDecodeError:
        return "the worker's name is not UTF-8"
    state, queues = fields
    return _WorkerKey(name, state, queues, sorted(executions))


def _workers(client: redis.Redis, unreadable: list[str]) -> list[tuple[WorkerInfo, list[str]]]:
    """Each registered worker that can be read, with its queues' names, in two round trips
    (its hash and its executions' set; then whether those executions are alive); the keys that
    cannot be read go to `unreadable`."""
    with client.pipeline(transaction=False) as pipe:
        pipe.smembers(_WORKERS_KEY)
        [members] = pipe.execute()
    keys: list[bytes] = sorted(members)
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hmget(key, "state", "queues")
            name = key.removeprefix(_WORKER_PREFIX)
            pipe.smembers(_EXECUTIONS_HEAD + name + _EXECUTIONS_TAIL)
        replies = pipe.execute(raise_on_error=False)
    found: list[_WorkerKey] = []
    for key, fields, executions in zip(keys, replies[::2], replies[1::2], strict=True):
        read = _read_worker(key, fields, executions)
        if isinstance(read, str):
            unreadable.append(f"{_shown(key)}: {read}")
        else:
            found.append(read)
    # An execution whose hash has expired (its work horse died) is no current job.
    with client.pipeline(transaction=False) as pipe:
        for worker in found:
            for member in worker.executions:
                pipe.exists(_EXECUTION_PREFIX + member)
        alive = iter(pipe.execute())
    workers = []
    for worker in found:
        current = [m.partition(b":")[0] for m in worker.executions if next(alive)]
        info = WorkerInfo(
            worker.name,
            "?" if worker.state is None else _shown(worker.state),
            _shown(current[0]) if current else None,
        )
        workers.append((info, [q for q in _shown(worker.queues or b"").split(",") if q]))
    return workers


def _queues(
    client: redis.Redis, routes: Mapping[str, Route], unreadable: list[str]
) -> list[QueueInfo]:
    workers: dict[str, list[WorkerInfo]] = {}
    for info, queue_names in _workers(client, unreadable):
        for name in queue_names:
            workers.setdefault(name, []).append(info)
    names = sorted({r.queue for r in routes.values()} | set(workers))
    keys = [Queue(name, connection=client).key for name in names]
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.llen(key)
        lengths = pipe.execute(raise_on_error=False)
    queues = []
    for name, key, length in zip(names, keys, lengths, strict=True):
        why = _failure(length)
        if why is not None:
            unreadable.append(f"{key}: {why}")
        queues.append(
            QueueInfo(
                name,
                None if why is not None else int(length),
                sorted(workers.get(name, []), key=lambda w: w.name),
            )
        )
    return queues


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
    unreadable: list[str] = []
    try:
        with reading():
            queues = _queues(client, routes, unreadable)
    except RedisUnavailableError as exc:
        return Overview(generated, status, finished, failures, reactors, [], str(exc))
    return Overview(generated, status, finished, failures, reactors, queues, None, unreadable)
