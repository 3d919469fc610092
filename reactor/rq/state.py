"""What RQ holds for an attempt's job, read without unpickling anything.

The sweep asks, through `RqState` and `job_statuses`, which jobs
of `active` rows are gone, failed without an outcome, or orphaned. Everything is read with
plain commands (`HGET` of a job's status or worker name, `EXISTS` of a worker's key, `LRANGE`
of a queue, RQ's error text through `reactor.rq.job_errors`), in one round trip per call (two
for `workers_gone`): whoever can write to Redis chooses what a
job's pickled fields hold, so the reactor never decodes them. Nothing here writes to Redis.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import redis
from rq import Queue
from rq.job import Job
from rq.worker import Worker

from reactor.errors import RedisUnavailableError
from reactor.jobs import JobRef
from reactor.redact import redact
from reactor.routes import Route
from reactor.rq.job_errors import read_failure_texts

__all__ = [
    "ALIVE_STATUSES",
    "FAILED",
    "QUEUED",
    "STARTED",
    "RqState",
    "job_statuses",
    "reading",
    "workers_gone",
]

#: RQ status of a job a worker has taken.
STARTED = b"started"
#: RQ status of a job waiting in its queue.
QUEUED = b"queued"
#: RQ status of a job that raised (or whose work horse died) and will not run again.
FAILED = b"failed"
#: RQ statuses of a job that will still run or is running.
ALIVE_STATUSES = frozenset({b"queued", b"started", b"scheduled", b"deferred", b"rate_limited"})


def job_statuses(client: redis.Redis, refs: Sequence[JobRef]) -> list[bytes | None]:
    """The RQ status of each attempt's job (None: no such job), in one round trip.

    Raises:
        RedisUnavailableError: Redis failed.
    """
    try:
        with client.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.hget(Job.key_for(ref.job_id), "status")
            return list(pipe.execute())
    except redis.RedisError as exc:
        raise RedisUnavailableError(
            f"Redis status check failed: {redact(str(exc))}", rows=len(refs)
        ) from exc


def workers_gone(client: redis.Redis, refs: Sequence[JobRef]) -> list[bool]:
    """For each attempt's job: is the RQ worker that took it gone? That is, the job names a
    worker (RQ stores it when the worker starts the job) and that worker's key no longer
    exists: a worker renews its key while it lives (the worker classes every heartbeat while
    they run an attempt), so the key expires only once it has stopped (killed, paused, cut off
    from Redis). A job that names no worker (never started) is not counted as gone.

    Raises:
        redis.RedisError: Redis failed.
    """
    if not refs:
        return []
    with client.pipeline(transaction=False) as pipe:
        for ref in refs:
            pipe.hget(Job.key_for(ref.job_id), "worker_name")
        names: list[bytes | None] = pipe.execute()
    known = sorted({name for name in names if name})
    if not known:
        return [False] * len(refs)
    prefix = Worker.redis_worker_namespace_prefix.encode()
    with client.pipeline(transaction=False) as pipe:
        for name in known:
            pipe.exists(prefix + name)
        alive = dict(zip(known, pipe.execute(), strict=True))
    return [name is not None and name in alive and not alive[name] for name in names]


class RqState:
    """The sweep's view of RQ: job statuses, RQ's errors, and orphaned jobs."""

    def __init__(self, client: redis.Redis, routes: Mapping[str, Route]) -> None:
        self._client = client
        self._routes = routes
        self._queues: dict[str, Queue] = {}
        # Jobs the last orphan check found `queued` in an intermediate list only.
        self._in_limbo: set[str] = set()

    def job_statuses(self, refs: Sequence[JobRef]) -> list[bytes | None]:
        """The RQ status of each attempt's job (None: no such job), in one round trip.

        Raises:
            RedisUnavailableError: Redis failed.
        """
        return job_statuses(self._client, refs)

    def workers_gone(self, refs: Sequence[JobRef]) -> list[bool]:
        """`workers_gone` for each ref.

        Raises:
            RedisUnavailableError: Redis failed.
        """
        try:
            return workers_gone(self._client, refs)
        except redis.RedisError as exc:
            raise RedisUnavailableError(
                f"Redis worker check failed: {redact(str(exc))}", rows=len(refs)
            ) from exc

    def failure_texts(self, refs: Sequence[JobRef]) -> list[str | None]:
        """The error RQ recorded for each attempt's failed job (None: none), in one round trip,
        read as text (nothing is unpickled).

        Raises:
            RedisUnavailableError: Redis failed.
        """
        try:
            return read_failure_texts(self._client, refs)
        except redis.RedisError as exc:
            raise RedisUnavailableError(
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
        lists' length plus the refs, where a search per ref (`LPOS`) would cost their product
        (quadratic for a long queue of long-waiting jobs).

        Raises:
            RedisUnavailableError: Redis failed.
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
            raise RedisUnavailableError(f"Redis queue check failed: {redact(str(exc))}") from exc
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

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self._client)
        return queue


@contextmanager
def reading() -> Iterator[None]:
    """For the operator tools' reads of RQ (status, dashboard): a Redis error inside leaves
    as a `RedisUnavailableError` whose message is the error's first line, redacted.

    Raises:
        RedisUnavailableError: Redis failed.
    """
    try:
        yield
    except redis.RedisError as exc:
        text = str(exc).strip()
        raise RedisUnavailableError(redact(text.splitlines()[0] if text else repr(exc))) from exc
