"""Hand a batch of claimed attempts to RQ, only if none of its jobs exists yet.

Guarantee: an attempt's job is enqueued at most once. RQ builds the batch's commands
(`Queue.enqueue_many`: RQ stays the author of its job format). A batch of up to
`SCRIPT_MAX_JOBS` jobs, the latency-bound case, goes out in one round trip: one Lua script runs
those commands (built on a pipeline that is never sent) only if none of the batch's job keys
exists, and otherwise writes nothing; a script runs atomically, like MULTI/EXEC, and the claim
is still open, so the round trip saved is taken off the dispatch latency. A larger batch, the
throughput-bound case, is checked with one `EXISTS` and sent as MULTI/EXEC, which runs the
commands natively (replaying them in Lua costs up to 7 % more a job). Either way Redis takes
the whole batch or nothing of it.

When some job of the batch exists (rare), each job's status decides: a job that is alive
(queued, started, scheduled, deferred) was enqueued by an earlier claim whose COMMIT was lost,
and is not enqueued again (RQ would overwrite it and run it twice). A job left over from an
earlier life of the row (finished or failed, kept by RQ for a while, then the row was re-armed
with its attempts reset) is deleted and replaced. The rest go out as one MULTI/EXEC pipeline.
Statuses are read with `HGET` and leftovers deleted by key: the reactor never unpickles
anything from Redis (a job's fields are pickles, and whoever can write to Redis writes them).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import Pipeline
from redis.commands.core import Script
from rq import Queue
from rq.executions import ExecutionRegistry
from rq.job import Job
from rq.queue import EnqueueData
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry
from rq.results import Result

from reactor.errors import ConfigError, EnqueueError
from reactor.job_errors import read_failure_texts
from reactor.jobs import ENTRY_POINT, JobRef
from reactor.redact import ambiguous_userinfo, redact
from reactor.redis_url import client_for
from reactor.routes import Route
from reactor.settings import FAILED_JOB_TTL_SECONDS

__all__ = [
    "ALIVE_STATUSES",
    "FAILED",
    "QUEUED",
    "SCRIPT_MAX_JOBS",
    "STARTED",
    "EnqueueResult",
    "Enqueuer",
    "connect_redis",
]

#: RQ status of a job a worker has taken.
STARTED = b"started"
#: RQ status of a job waiting in its queue.
QUEUED = b"queued"
#: RQ status of a job that raised (or whose work horse died) and will not run again.
FAILED = b"failed"
#: RQ statuses of a job that will still run or is running.
ALIVE_STATUSES = frozenset({b"queued", b"started", b"scheduled", b"deferred", b"rate_limited"})


#: Batches up to this size go out through the script (one round trip, 8-20 % cheaper a job at
#: 1-8 jobs); larger ones through `EXISTS`, then MULTI/EXEC (up to 7 % cheaper a job at 500).
SCRIPT_MAX_JOBS = 100

#: KEYS: the batch's job keys. ARGV: the batch's commands, each as its argument count followed
#: by its arguments. Returns how many of the keys exist; the commands ran only if that is 0.
#: The existence check goes by chunks: Lua's `unpack` is limited to a few thousand values.
_ENQUEUE_IF_NEW = """
local found = 0
for i = 1, #KEYS, 1000 do
  found = found + redis.call('EXISTS', unpack(KEYS, i, math.min(i + 999, #KEYS)))
end
if found > 0 then return found end
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return 0
"""


def connect_redis(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url`, a plain Redis or a `redis+sentinel://` one (no I/O yet).

    Raises:
        ConfigError: the URL is malformed.
    """
    if ambiguous_userinfo(url):
        raise ConfigError(
            "bad Redis URL: the user name or password holds a raw '@', '/', '?' or '#'; "
            "percent-encode them (e.g. '@' as %40)"
        )
    return client_for(url, **{"health_check_interval": 30, **kwargs})


@dataclass(frozen=True)
class EnqueueResult:
    """What one `enqueue` call did."""

    enqueued: int = 0
    already_enqueued: int = 0
    replaced: int = 0
    #: Enqueued jobs by type.
    by_type: Mapping[str, int] = field(default_factory=dict)


class Enqueuer:
    """Enqueues attempts to the RQ queue of their type's route."""

    def __init__(
        self,
        client: redis.Redis,
        routes: Mapping[str, Route],
        *,
        job_timeout_seconds: int | None = None,
    ) -> None:
        self._client = client
        self._routes = routes
        # None: RQ's default (180 s). A timeout is a failed attempt like any exception.
        self._job_timeout = job_timeout_seconds
        self._queues: dict[str, Queue] = {}
        # Jobs the last orphan check found `queued` in an intermediate list only.
        self._in_limbo: set[str] = set()
        self._enqueue_if_new: Script = client.register_script(_ENQUEUE_IF_NEW)

    def prepare(self) -> None:
        """Load the enqueue script now, so a Redis that forbids scripts (ACL) is refused at
        start-up rather than at the first batch.

        Raises:
            redis.RedisError: Redis failed or refused (`NoPermissionError`).
        """
        self._client.script_load(_ENQUEUE_IF_NEW)

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self._client)
        return queue

    def job_statuses(self, refs: Sequence[JobRef]) -> list[bytes | None]:
        """The RQ status of each attempt's job (None: no such job), in one round trip.

        Raises:
            EnqueueError: Redis failed.
        """
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for ref in refs:
                    pipe.hget(Job.key_for(ref.job_id), "status")
                return list(pipe.execute())
        except redis.RedisError as exc:
            raise EnqueueError(
                f"Redis status check failed: {redact(str(exc))}", rows=len(refs)
            ) from exc

    def failure_texts(self, refs: Sequence[JobRef]) -> list[str | None]:
        """The error RQ recorded for each attempt's failed job (None: none), in one round trip,
        read as text (nothing is unpickled).

        Raises:
            EnqueueError: Redis failed.
        """
        try:
            return read_failure_texts(self._client, refs)
        except redis.RedisError as exc:
            raise EnqueueError(
                f"Redis error check failed: {redact(str(exc))}", rows=len(refs)
            ) from exc

    def orphaned(self, refs: Sequence[JobRef]) -> list[bool]:
        """For each ref: is its job `queued` yet out of its queue (a worker took it and died
        before starting it)? A job in no list is; so is one found in RQ's intermediate list
        (where a worker moves a job it is about to start) at this check and at the previous
        one: a live worker starts a job within milliseconds of moving it, while RQ itself
        clears a dead worker's intermediate list only at its maintenance, minutes later. Read
        atomically (MULTI/EXEC), so a job moving between the lists is never missed.

        Each list involved is read once, whole, and looked up in memory: the cost is the
        lists' length plus the refs, where a search per ref (`LPOS`) cost their product, which
        is what a long queue of long-waiting jobs made quadratic (3,000 jobs waiting in a
        queue of 3,000: 9 M comparisons in Redis per sweep).

        Raises:
            EnqueueError: Redis failed.
        """
        if not refs:
            return []
        # Each queue's own list and RQ's intermediate list for it.
        lists_of: dict[str, tuple[str, str]] = {}
        for ref in refs:
            name = self._routes[ref.type].queue
            if name not in lists_of:
                queue = self._queue(name)
                lists_of[name] = (queue.key, queue.intermediate_queue_key)
        lists = sorted({key for pair in lists_of.values() for key in pair})
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for ref in refs:
                    pipe.hget(Job.key_for(ref.job_id), "status")
                for key in lists:
                    pipe.lrange(key, 0, -1)
                replies = pipe.execute()
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis queue check failed: {redact(str(exc))}") from exc
        listed = {key: set(ids) for key, ids in zip(lists, replies[len(refs) :], strict=True)}
        result = []
        in_limbo: set[str] = set()
        for ref, status in zip(refs, replies[: len(refs)], strict=True):
            member = ref.job_id.encode()
            queue_key, intermediate_key = lists_of[self._routes[ref.type].queue]
            if status != QUEUED or member in listed[queue_key]:
                result.append(False)
            elif member in listed[intermediate_key]:
                in_limbo.add(ref.job_id)
                result.append(ref.job_id in self._in_limbo)
            else:
                result.append(True)
        self._in_limbo = in_limbo
        return result

    def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
        """Enqueue the jobs of `refs` that are not already alive in Redis.

        Raises:
            EnqueueError: Redis failed; nothing of this batch was enqueued by this call.
            KeyError: a ref's type has no route (callers only claim routed types).
        """
        if not refs:
            return EnqueueResult()
        by_queue = self._by_queue(refs)
        keys = [Job.key_for(ref.job_id) for ref in refs]
        try:
            if len(refs) > SCRIPT_MAX_JOBS:
                # A backlog's batch: one `EXISTS` is a small part of its time, and MULTI/EXEC
                # runs the commands natively (the script's replay costs up to 7 % more a job).
                written = not self._client.exists(*keys)
                if written:
                    with self._client.pipeline(transaction=True) as pipe:
                        self._add_enqueues(pipe, by_queue)
                        pipe.execute()
            else:
                # A few jobs, the latency-bound case: check and write in one round trip.
                with self._client.pipeline(transaction=False) as plan:
                    self._add_enqueues(plan, by_queue)
                    argv: list[Any] = []
                    for args, _options in plan.command_stack:  # never sent: the script runs them
                        argv.append(len(args))
                        argv.extend(args)
                written = self._enqueue_if_new(keys=keys, args=argv) == 0
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)) from exc
        if not written:
            return self._enqueue_fresh(refs)
        return EnqueueResult(enqueued=len(refs), by_type=Counter(ref.type for ref in refs))

    def _enqueue_fresh(self, refs: Sequence[JobRef]) -> EnqueueResult:
        """Some job of the batch exists: enqueue only the attempts whose job is not alive."""
        statuses = self.job_statuses(refs)
        fresh = [
            ref for ref, status in zip(refs, statuses, strict=True) if status not in ALIVE_STATUSES
        ]
        leftovers = [
            ref
            for ref, status in zip(refs, statuses, strict=True)
            if status is not None and status not in ALIVE_STATUSES
        ]
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for ref in leftovers:
                    # A terminal job of an earlier life of the row holds this id.
                    self._add_delete(pipe, ref)
                self._add_enqueues(pipe, self._by_queue(fresh))
                pipe.execute()
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)) from exc
        return EnqueueResult(
            enqueued=len(fresh),
            already_enqueued=len(refs) - len(fresh),
            replaced=len(leftovers),
            by_type=Counter(ref.type for ref in fresh),
        )

    def _add_delete(self, pipe: Pipeline, ref: JobRef) -> None:
        """Delete a terminal job by its keys, as `Job.delete` does, without reading it:
        `Job.fetch` would unpickle its fields, and whoever can write to Redis chooses them."""
        name = self._routes[ref.type].queue
        queue = self._queue(name)
        bare = Job(ref.job_id, connection=self._client)  # no I/O, nothing read
        pipe.lrem(queue.key, 0, ref.job_id)
        for registry in (
            FinishedJobRegistry(name, connection=self._client),
            FailedJobRegistry(name, connection=self._client),
            CanceledJobRegistry(name, connection=self._client),
        ):
            pipe.zrem(registry.key, ref.job_id)
        pipe.delete(
            bare.key,
            bare.dependents_key,
            bare.dependencies_key,
            Result.get_key(ref.job_id),  # type: ignore[no-untyped-call]
            ExecutionRegistry(ref.job_id, connection=self._client).key,
        )

    def _by_queue(self, refs: Sequence[JobRef]) -> dict[str, list[JobRef]]:
        by_queue: dict[str, list[JobRef]] = defaultdict(list)
        for ref in refs:
            by_queue[self._routes[ref.type].queue].append(ref)
        return by_queue

    def _add_enqueues(self, pipe: Pipeline, by_queue: Mapping[str, list[JobRef]]) -> None:
        for queue_name, batch in by_queue.items():
            self._queue(queue_name).enqueue_many(
                [self._job_data(ref) for ref in batch], pipeline=pipe
            )

    def _job_data(self, ref: JobRef) -> EnqueueData:
        route = self._routes[ref.type]
        return Queue.prepare_data(
            ENTRY_POINT,
            args=(ref.type, ref.photo_id, ref.attempt),
            kwargs={"handler": route.handler},
            job_id=ref.job_id,
            meta=ref.meta(),
            failure_ttl=FAILED_JOB_TTL_SECONDS,
            timeout=self._job_timeout,
            description=f"{route.handler}({ref.photo_id!r}) [{ref.type} attempt {ref.attempt}]",
        )
