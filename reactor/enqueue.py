"""Hand a batch of claimed attempts to RQ: one status check, then one atomic pipeline.

Guarantee: an attempt's job is enqueued at most once. Before enqueueing, the status of every
job id of the batch is read in one pipelined round trip; an id whose job is alive (queued,
started, scheduled, deferred) was enqueued by an earlier claim whose COMMIT was lost, and is not
enqueued again (RQ would overwrite it and run it twice). A job left over from an earlier life
of the row (finished or failed, kept by RQ for a while, then the row was re-armed with its
attempts reset) is deleted and replaced. The batch itself goes out as one MULTI/EXEC pipeline
of `Queue.enqueue_many`, so Redis takes all of it or none of it.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import EnqueueData

from reactor.errors import ConfigError, EnqueueError
from reactor.jobs import ENTRY_POINT, JobRef
from reactor.redact import redact
from reactor.routes import Route
from reactor.settings import FAILED_JOB_TTL_SECONDS

__all__ = [
    "ALIVE_STATUSES",
    "QUEUED",
    "STARTED",
    "EnqueueResult",
    "Enqueuer",
    "connect_redis",
]

#: RQ status of a job a worker has taken.
STARTED = b"started"
#: RQ status of a job waiting in its queue.
QUEUED = b"queued"
#: RQ statuses of a job that will still run or is running.
ALIVE_STATUSES = frozenset({b"queued", b"started", b"scheduled", b"deferred", b"rate_limited"})


def connect_redis(url: str) -> redis.Redis:
    """A client for `url` (no I/O yet).

    Raises:
        ConfigError: the URL is malformed.
    """
    try:
        return redis.Redis.from_url(url, health_check_interval=30)
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL: {redact(str(exc))}") from None


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

    def orphaned(self, refs: Sequence[JobRef]) -> list[bool]:
        """For each ref: is its job `queued` yet in neither its queue nor RQ's intermediate
        queue (a worker took it and died before starting it)? Read atomically (MULTI/EXEC), so
        a job moving between the lists is never missed.

        Raises:
            EnqueueError: Redis failed.
        """
        if not refs:
            return []
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for ref in refs:
                    queue = self._queue(self._routes[ref.type].queue)
                    pipe.hget(Job.key_for(ref.job_id), "status")
                    pipe.lpos(queue.key, ref.job_id)
                    pipe.lpos(queue.intermediate_queue_key, ref.job_id)
                replies = pipe.execute()
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis queue check failed: {redact(str(exc))}") from exc
        return [
            replies[i] == QUEUED and replies[i + 1] is None and replies[i + 2] is None
            for i in range(0, len(replies), 3)
        ]

    def _statuses_if_any(self, refs: Sequence[JobRef]) -> list[bytes | None]:
        # Fast path: one EXISTS over all keys (one reply) answers "none of them exists", which
        # is almost always the case; only otherwise read each job's status.
        try:
            found = self._client.exists(*(Job.key_for(ref.job_id) for ref in refs))
        except redis.RedisError as exc:
            raise EnqueueError(
                f"Redis status check failed: {redact(str(exc))}", rows=len(refs)
            ) from exc
        return self.job_statuses(refs) if found else [None] * len(refs)

    def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
        """Enqueue the jobs of `refs` that are not already alive in Redis.

        Raises:
            EnqueueError: Redis failed; nothing of this batch was enqueued by this call.
            KeyError: a ref's type has no route (callers only claim routed types).
        """
        if not refs:
            return EnqueueResult()
        statuses = self._statuses_if_any(refs)
        fresh = [
            ref for ref, status in zip(refs, statuses, strict=True) if status not in ALIVE_STATUSES
        ]
        leftovers = [
            ref.job_id
            for ref, status in zip(refs, statuses, strict=True)
            if status is not None and status not in ALIVE_STATUSES
        ]
        by_queue: dict[str, list[JobRef]] = defaultdict(list)
        for ref in fresh:
            by_queue[self._routes[ref.type].queue].append(ref)
        try:
            for leftover in leftovers:
                # Rare: a terminal job of an earlier life of the row holds this id.
                with contextlib.suppress(NoSuchJobError):  # expired meanwhile: the id is free
                    Job.fetch(leftover, connection=self._client).delete()
            with self._client.pipeline(transaction=True) as pipe:
                for queue_name, batch in by_queue.items():
                    self._queue(queue_name).enqueue_many(
                        [self._job_data(ref) for ref in batch], pipeline=pipe
                    )
                pipe.execute()
        except redis.RedisError as exc:
            raise EnqueueError(f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)) from exc
        return EnqueueResult(
            enqueued=len(fresh),
            already_enqueued=len(refs) - len(fresh),
            replaced=len(leftovers),
            by_type=Counter(ref.type for ref in fresh),
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
