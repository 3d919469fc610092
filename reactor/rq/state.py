"""What RQ holds for an attempt's job, read without unpickling anything.

The sweep asks, through `RqState` and `job_statuses`, which jobs
of `active` rows are gone, failed without an outcome, or orphaned. Everything is read with
plain commands (`HGET` of a job's status or worker name, `TTL` of a worker's key, `LRANGE`
of a queue, RQ's error text through `reactor.rq.job_errors`), in one round trip per call (two
for `workers_gone`): whoever can write to Redis chooses what a
job's pickled fields hold, so the reactor never decodes them. Nothing here writes to Redis.

`RqState`'s reads fail key by key: a key of the wrong type (`SET rq:job:<id> junk`) gives its
job the status `UNREADABLE` (a queue list: its jobs are taken as not orphaned) and is kept in
`take_unreadable()` for the caller to report, so one bad key never hides the others. Whether
a row's RQ worker is gone is decided in one place, `worker_gone_rows`, for the sweep and for
`reactor status` alike.
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
    "UNREADABLE",
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
#: What `RqState.job_statuses` gives for a job whose key cannot be read (not a hash); no RQ
#: status is written in parentheses.
UNREADABLE = b"(unreadable)"


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


def workers_gone(
    client: redis.Redis, refs: Sequence[JobRef], unreadable: dict[str, str] | None = None
) -> list[bool]:
    """For each attempt's job: is the RQ worker that took it gone? That is, the job names a
    worker (RQ stores it when the worker starts the job) and that worker's key no longer
    exists, or has no expiry: a worker renews its key, with an expiry, while it lives (the
    worker classes every heartbeat while they run an attempt), so the key expires only once it
    has stopped (killed, paused, cut off from Redis); a key without one was written by no live
    worker (a work horse that outlived its killed worker counts its job on a key that had
    expired). A job that names no worker (never started) is not counted as gone; nor is one
    whose key cannot be read (noted in `unreadable`, key -> error, when given).

    Raises:
        redis.RedisError: Redis failed.
    """
    if not refs:
        return []
    with client.pipeline(transaction=False) as pipe:
        for ref in refs:
            pipe.hget(Job.key_for(ref.job_id), "worker_name")
        replies = pipe.execute(raise_on_error=False)
    names: list[bytes | None] = [
        _readable(Job.key_for(ref.job_id), reply, None, unreadable)
        for ref, reply in zip(refs, replies, strict=True)
    ]
    known = sorted({name for name in names if name})
    if not known:
        return [False] * len(refs)
    prefix = Worker.redis_worker_namespace_prefix.encode()
    with client.pipeline(transaction=False) as pipe:
        for name in known:
            pipe.ttl(prefix + name)
        # TTL: -2 no key, -1 a key without expiry.
        alive = {name: ttl >= 0 for name, ttl in zip(known, pipe.execute(), strict=True)}
    return [name is not None and name in alive and not alive[name] for name in names]


def worker_gone_rows(
    client: redis.Redis,
    refs: Sequence[JobRef],
    statuses: Sequence[bytes | None],
    unreadable: dict[str, str] | None = None,
) -> list[bool]:
    """ "Worker gone", decided once for the sweep and `reactor status`: for each ref of a row
    that has had no write for `gone_after` (the caller's choice) with its job's status, the
    job was taken by a worker (started, or ended: neither missing, queued nor unreadable) and
    that worker's key is gone (`workers_gone`). The sweep re-dispatches exactly those rows
    (unless they are stale already: rescued as such).

    Raises:
        redis.RedisError: Redis failed.
    """
    taken = [i for i, status in enumerate(statuses) if status not in (None, QUEUED, UNREADABLE)]
    gone = workers_gone(client, [refs[i] for i in taken], unreadable)
    result = [False] * len(refs)
    for i, lost in zip(taken, gone, strict=True):
        result[i] = lost
    return result


def _readable(
    key: str | bytes, reply: object, instead: bytes | None, unreadable: dict[str, str] | None
) -> bytes | None:
    """A pipelined reply, or `instead` when the command failed on its key (noted)."""
    if isinstance(reply, redis.ResponseError):
        if unreadable is not None:
            name = key.decode(errors="backslashreplace") if isinstance(key, bytes) else key
            unreadable[name] = redact(str(reply))
        return instead
    return reply if reply is None or isinstance(reply, bytes) else bytes(str(reply), "utf-8")


class RqState:
    """The sweep's view of RQ: job statuses, RQ's errors, and orphaned jobs."""

    def __init__(self, client: redis.Redis, routes: Mapping[str, Route]) -> None:
        self._client = client
        self._routes = routes
        self._queues: dict[str, Queue] = {}
        # Jobs the last orphan check found `queued` in an intermediate list only.
        self._in_limbo: set[str] = set()
        self._unreadable: dict[str, str] = {}

    def take_unreadable(self) -> dict[str, str]:
        """The keys that reads since the last call could not read (key -> error)."""
        found, self._unreadable = self._unreadable, {}
        return found

    def job_statuses(self, refs: Sequence[JobRef]) -> list[bytes | None]:
        """The RQ status of each attempt's job (None: no such job; `UNREADABLE`: its key is
        not a hash), in one round trip.

        Raises:
            RedisUnavailableError: Redis failed.
        """
        keys = [Job.key_for(ref.job_id) for ref in refs]
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hget(key, "status")
                replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise RedisUnavailableError(
                f"Redis status check failed: {redact(str(exc))}", rows=len(refs)
            ) from exc
        return [
            _readable(key, reply, UNREADABLE, self._unreadable)
            for key, reply in zip(keys, replies, strict=True)
        ]

    def worker_gone_rows(
        self, refs: Sequence[JobRef], statuses: Sequence[bytes | None]
    ) -> list[bool]:
        """`worker_gone_rows` for each ref and its job's status.

        Raises:
            RedisUnavailableError: Redis failed.
        """
        try:
            return worker_gone_rows(self._client, refs, statuses, self._unreadable)
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
        keys = [Job.key_for(ref.job_id) for ref in refs]
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for key in keys:
                    pipe.hget(key, "status")
                for key in lists:
                    pipe.lrange(key, 0, -1)
                replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"Redis queue check failed: {redact(str(exc))}") from exc
        # A list that cannot be read (not a list) holds nothing we can know of: its jobs are
        # taken as listed, hence not orphaned, and the key is reported.
        listed: dict[str, set[bytes] | None] = {}
        for key, ids in zip(lists, replies[len(refs) :], strict=True):
            if isinstance(ids, redis.ResponseError):
                self._unreadable[key] = redact(str(ids))
                listed[key] = None
            else:
                listed[key] = set(ids)
        result = []
        in_limbo: set[str] = set()
        statuses = [
            _readable(key, reply, UNREADABLE, self._unreadable)
            for key, reply in zip(keys, replies[: len(refs)], strict=True)
        ]
        for ref, status in zip(refs, statuses, strict=True):
            member = ref.job_id.encode()
            queue_key, intermediate_key = lists_of[self._routes[ref.type].queue]
            queued, limbo = listed[queue_key], listed[intermediate_key]
            if status != QUEUED or queued is None or limbo is None or member in queued:
                result.append(False)
            elif member in limbo:
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
