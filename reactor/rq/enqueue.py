"""Hand a batch of attempts to RQ, only if none of its jobs exists yet.

Guarantee: an attempt's job is enqueued at most once. RQ builds the batch's commands
(`Queue.enqueue_many`: RQ stays the author of its job format). A batch of up to
`SCRIPT_MAX_JOBS` jobs, the latency-bound case, goes out in one round trip: one Lua script runs
those commands (built on a pipeline that is never sent) only if none of the batch's job keys
exists, and otherwise writes nothing; a script runs atomically, like MULTI/EXEC, and the claim
is still open, so the round trip saved is taken off the dispatch latency. A larger batch, the
throughput-bound case, is checked with `EXISTS` under WATCH of its job keys and sent as
MULTI/EXEC, which runs the commands natively (replaying them in Lua costs more a job; figures
in bench/README.md): a job written between the check and the write (a request of an earlier
try that timed out, landing late) makes EXEC write nothing. Either way Redis takes the whole
batch or nothing of it.

When some job of the batch exists (rare), each job's status decides: a job that is alive
(queued, started, scheduled, deferred) was enqueued by an earlier claim whose COMMIT was lost,
and is not enqueued again (RQ would overwrite it and run it twice). A job that already ended
(finished or failed: it ran while the claim that enqueued it was rolled back, found the row
not at its token and did nothing) is deleted and replaced. The rest go out as one MULTI/EXEC
pipeline, the jobs to be written watched as above (and every status read again if one
changed). Statuses are read with `HGET` (`reactor.rq.state`), and an ended job is deleted with
RQ's `Job.delete` on a job object made from its id: the reactor never unpickles anything from
Redis (a job's fields are pickles, and whoever can write to Redis writes them).

This module only writes jobs; reading what RQ holds for the sweep is `reactor.rq.state`, and
the Redis client comes from `reactor.rq.redis_url.connect_redis`.
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
from rq.job import Job
from rq.queue import EnqueueData

from reactor.errors import EnqueueError
from reactor.jobs import ENTRY_POINT, JobRef, short_id
from reactor.redact import redact
from reactor.routes import Route
from reactor.rq.state import ALIVE_STATUSES, job_statuses
from reactor.settings import FAILED_JOB_TTL_SECONDS, RESULT_TTL_SECONDS

__all__ = ["SCRIPT_MAX_JOBS", "EnqueueResult", "Enqueuer"]

#: Tries of the careful path when a job it is about to write changes meanwhile, before it gives
#: up (the batch is rolled back and claimed again).
WATCH_TRIES = 3
#: Batches up to this size go out through the script (one round trip: cheaper for a few jobs);
#: larger ones through `EXISTS`, then MULTI/EXEC (cheaper for a backlog's batch).
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


@dataclass(frozen=True)
class EnqueueResult:
    """What one `enqueue` call did."""

    enqueued: int = 0
    already_enqueued: int = 0
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
        self._enqueue_if_new: Script = client.register_script(_ENQUEUE_IF_NEW)

    def prepare(self) -> None:
        """Load the enqueue script now, so a Redis that forbids scripts (ACL) is refused at
        start-up rather than at the first batch.

        Raises:
            redis.RedisError: Redis failed or refused (`NoPermissionError`).
        """
        self._client.script_load(_ENQUEUE_IF_NEW)

    def warm_up(self) -> None:
        """Build a job of every route on a pipeline that is never sent, and run the script on
        an empty batch (it writes nothing), so the first batch pays for neither.

        Raises:
            redis.RedisError: Redis failed.
        """
        refs = [JobRef(job_type, "warm-up", 1) for job_type in self._routes]
        with self._client.pipeline(transaction=False) as plan:
            self._add_enqueues(plan, self._by_queue(refs))
        self._enqueue_if_new(keys=[], args=[])

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self._client)
        return queue

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
                # runs the commands natively (cheaper than the script's replay).
                written = self._write_if_new(keys, by_queue)
            else:
                # A few jobs, the latency-bound case: check and write in one round trip.
                written = self._script_write(keys, by_queue)
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)) from exc
        if not written:
            return self._enqueue_fresh(refs)
        return EnqueueResult(enqueued=len(refs), by_type=Counter(ref.type for ref in refs))

    def _script_write(self, keys: list[str], by_queue: Mapping[str, list[JobRef]]) -> bool:
        """Write the batch with the enqueue script, in one round trip, if none of `keys`
        exists. False: some key exists, and nothing was written."""
        with self._client.pipeline(transaction=False) as plan:
            self._add_enqueues(plan, by_queue)
            argv: list[Any] = []
            for args, _options in plan.command_stack:  # never sent: the script runs them
                argv.append(len(args))
                argv.extend(args)
        return bool(self._enqueue_if_new(keys=keys, args=argv) == 0)

    def _write_if_new(self, keys: list[str], by_queue: Mapping[str, list[JobRef]]) -> bool:
        """Write the batch with MULTI/EXEC if none of `keys` exists, checked with EXISTS under
        WATCH: a write of one of them in between (a request of an earlier try that timed out,
        landing late) makes EXEC write nothing. False: some key exists, or the write was
        aborted (a key changed; redis-py also reports a connection lost under WATCH so), and
        the careful path decides job by job."""
        with self._client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(*keys)  # type: ignore[no-untyped-call]
                if pipe.exists(*keys):
                    return False
                pipe.multi()
                self._add_enqueues(pipe, by_queue)
                pipe.execute()
            except redis.WatchError:
                return False
        return True

    def _enqueue_fresh(self, refs: Sequence[JobRef]) -> EnqueueResult:
        """Some job of the batch exists: enqueue only the attempts whose job is not alive.
        Only the jobs to be written are watched (alive ones change all the time: their workers
        write to them), and their statuses read again under WATCH: a job written in between
        makes this try write nothing, and the next one reads every status again."""
        try:
            for _ in range(WATCH_TRIES):
                statuses = job_statuses(self._client, refs)
                fresh = [
                    (ref, status)
                    for ref, status in zip(refs, statuses, strict=True)
                    if status not in ALIVE_STATUSES
                ]
                if self._write_fresh(fresh):
                    break
            else:
                raise EnqueueError(
                    "Redis enqueue failed: the batch's jobs kept changing (or Redis failed "
                    "under WATCH)",
                    rows=len(refs),
                )
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)) from exc
        return EnqueueResult(
            enqueued=len(fresh),
            already_enqueued=len(refs) - len(fresh),
            by_type=Counter(ref.type for ref, _ in fresh),
        )

    def _write_fresh(self, fresh: list[tuple[JobRef, bytes | None]]) -> bool:
        """Replace the leftovers and enqueue the missing jobs of `fresh` (each with the status
        read before), if none of them changed since; False if one did (nothing written)."""
        if not fresh:
            return True
        refs = [ref for ref, _ in fresh]
        with self._client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(*(Job.key_for(ref.job_id) for ref in refs))  # type: ignore[no-untyped-call]
                if job_statuses(self._client, refs) != [status for _, status in fresh]:
                    return False
                pipe.multi()
                for ref, status in fresh:
                    if status is not None:
                        # A terminal job of an earlier life of the row holds this id.
                        self._add_delete(pipe, ref)
                self._add_enqueues(pipe, self._by_queue(refs))
                pipe.execute()
            except redis.WatchError:
                return False
        return True

    def _add_delete(self, pipe: Pipeline, ref: JobRef) -> None:
        """Delete a job with RQ's `Job.delete`, on a job object made from its id alone:
        `Job.fetch` would unpickle its fields, and whoever can write to Redis chooses them."""
        bare = Job(ref.job_id, connection=self._client)  # no I/O, nothing read
        bare.origin = self._routes[ref.type].queue
        bare.delete(pipeline=pipe)

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
            args=(ref.type, ref.photo_id, ref.token),
            kwargs={"handler": route.handler},
            job_id=ref.job_id,
            meta=ref.meta(),
            failure_ttl=FAILED_JOB_TTL_SECONDS,
            result_ttl=RESULT_TTL_SECONDS,
            timeout=self._job_timeout,
            description=f"{route.handler}({short_id(ref.photo_id)}) [{ref.type} #{ref.token}]",
        )
