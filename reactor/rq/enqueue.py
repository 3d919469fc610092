"""Hand a batch of attempts to RQ: all of it or nothing, never an attempt's job twice.

RQ builds the batch's commands (`Queue.enqueue_many` on a pipeline that is never sent: RQ
stays the author of its job format), and one Lua script runs them, in one round trip, whatever
the batch's size. Redis does not undo what a script wrote before an error inside it, so the
script first checks everything that could fail: every key a command writes must hold the kind
of value that command writes, or nothing (`rq:queue:photo-process` set to a string makes the
script refuse the batch, writing nothing: a `BadKeysError` naming every such key of the batch,
and the claim rolls back; naming them all lets one failed batch leave out all its bad rows).
Only then does it write. A script runs atomically, and the claim is still open, so a
job is never written half.

Guarantee: an attempt's job is enqueued at most once. A job that is already *enqueued* — in
its queue (or in RQ's intermediate list, taken by a worker that has not marked it started
yet) with status `queued`, or `started` — was enqueued by an earlier claim whose COMMIT was
lost, and is left as it is (RQ would overwrite it and run it twice). Any other job at that id
(finished or failed: it ran while the claim that enqueued it was rolled back, and found the
row not at its token; a bare hash; a `queued` job in no list) is deleted (with its entries in
the queue's finished and failed registries, and its id in the queue's list, which a hash
written by someone else may have left there) and written again, so its id is queued once.
The script decides this
under the same atomicity, so nothing can change between the check and the write. It reads
only statuses and list positions: the reactor never unpickles anything from Redis (a job's
fields are pickles, and whoever can write to Redis writes them).

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
from redis.sentinel import MasterNotFoundError
from rq import Queue
from rq.job import Job
from rq.queue import EnqueueData
from rq.serializers import PickleSerializer

from reactor.errors import ConfigError, RedisDataError, RedisUnavailableError
from reactor.jobs import ENTRY_POINT, JobRef, short_id
from reactor.redact import redact
from reactor.routes import Route
from reactor.rq.redis_url import describe_master_not_found
from reactor.settings import FAILED_JOB_TTL_SECONDS, RESULT_TTL_SECONDS

__all__ = ["BadKeysError", "EnqueueResult", "Enqueuer"]

#: ARGV: the number of jobs n and of queues m; for each queue the keys of its list, RQ's
#: intermediate list and its finished and failed registries (an ended job replaced leaves
#: them); for each job its key, id and queue (0 to m - 1); then the commands, each as (owner,
#: argument count, arguments...): owner 0 is shared by the batch (RQ's set of queues), owner i
#: belongs to job i. Returns the indexes (from 1) of the jobs already enqueued, whose commands
#: it did not run; or, writing nothing, `wrong-kind` then (key, kind held, kind wanted) for each
#: key of the batch that holds another kind of value. Each key's type is read once (a batch's
#: jobs share their queue's keys).
_ENQUEUE = """
local kinds = {HSET = 'hash', HMSET = 'hash', RPUSH = 'list', LPUSH = 'list', SADD = 'set'}
local held, wrong, named = {}, {'wrong-kind'}, {}
local function kind_of(key)
  local kind = held[key]
  if kind == nil then
    kind = redis.call('TYPE', key).ok
    held[key] = kind
  end
  return kind
end
local function check(key, kind)
  local found = kind_of(key)
  if found ~= 'none' and found ~= kind and not named[key] then
    named[key] = true
    wrong[#wrong + 1] = key
    wrong[#wrong + 1] = found
    wrong[#wrong + 1] = kind
  end
end
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
for at = 3, 2 + 4 * m, 4 do
  check(ARGV[at], 'list')
  check(ARGV[at + 1], 'list')
  check(ARGV[at + 2], 'zset')
  check(ARGV[at + 3], 'zset')
end
local jobs = 3 + 4 * m
local first = jobs + 3 * n
local i = first
while i <= #ARGV do
  local argc = tonumber(ARGV[i + 1])
  local command = string.upper(ARGV[i + 2])
  local kind = kinds[command]
  if not kind then error('unexpected command ' .. command .. ' from RQ: nothing written') end
  check(ARGV[i + 3], kind)
  i = i + 2 + argc
end
for at = jobs, first - 1, 3 do check(ARGV[at], 'hash') end
if #wrong > 1 then return wrong end
local skip, enqueued, ended = {}, {}, {}
for j = 1, n do
  local at = jobs + 3 * (j - 1)
  local key, id = ARGV[at], ARGV[at + 1]
  local lists = 3 + 4 * tonumber(ARGV[at + 2])
  if kind_of(key) ~= 'none' then
    local status = redis.call('HGET', key, 'status')
    if status == 'started' or (status == 'queued' and
        (redis.call('LPOS', ARGV[lists], id) or redis.call('LPOS', ARGV[lists + 1], id))) then
      skip[j] = true
      enqueued[#enqueued + 1] = j
    else
      ended[#ended + 1] = {key, id, lists}
    end
  end
end
for _, job in ipairs(ended) do
  redis.call('DEL', job[1])
  redis.call('LREM', ARGV[job[3]], 0, job[2])
  redis.call('ZREM', ARGV[job[3] + 2], job[2])
  redis.call('ZREM', ARGV[job[3] + 3], job[2])
end
i = first
while i <= #ARGV do
  local owner, argc = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if owner == 0 or not skip[owner] then redis.call(unpack(ARGV, i + 2, i + 1 + argc)) end
  i = i + 2 + argc
end
return enqueued
"""


#: How the script's reply starts when it refused the batch for keys of the wrong kind.
_WRONG_KIND = "wrong-kind"


class BadKeysError(RedisDataError):
    """Keys of a batch that hold another kind of value than its commands write: nothing of the
    batch was written. `key` and `photo_id` are the first's: a key the batch's queue shares,
    when one is (its type cannot flow: `photo_id` None), else the first row's job key."""

    def __init__(self, wrong: Mapping[str, str], refs: Sequence[JobRef]) -> None:
        ref_of = {Job.key_for(ref.job_id): ref for ref in refs}
        owned = [k for k in wrong if k in ref_of]
        #: Each row whose job key holds the wrong kind of value, and why (its own key).
        self.rows = tuple((ref_of[k], _refusal(k, wrong[k])) for k in owned)
        #: The keys no single row owns (a queue's list or registries, RQ's set of queues).
        self.shared = tuple(k for k in wrong if k not in ref_of)
        key = (self.shared or owned)[0]
        more = f" (and {len(wrong) - 1} other key(s) of the batch)" if len(wrong) > 1 else ""
        super().__init__(
            _refusal(key, wrong[key], more),
            key=key,
            photo_id=None if self.shared else self.rows[0][0].photo_id,
        )


def _refusal(key: str, held: str, more: str = "") -> str:
    return f"Redis key {key} holds {held}{more}: no job of the batch written"


def _wrong_kinds(reply: Sequence[Any]) -> dict[str, str]:
    """The script's refusal (key, kind held, kind wanted, ...) as {key: "a string, not a hash"}."""
    words = [w.decode("utf-8", "replace") if isinstance(w, bytes) else str(w) for w in reply]
    return {
        words[at]: f"a {words[at + 1]}, not a {words[at + 2]}" for at in range(1, len(words), 3)
    }


class _Job(Job):
    """RQ's job, built without RQ's per-job check that its own default (pickle) serializer
    has `dumps` and `loads`, a `typing` protocol check that is slow on Python 3.11
    (bench/README.md, *Backlog drain*). Any other serializer is checked as RQ does."""

    def __init__(
        self,
        id: str | None = None,  # noqa: A002 - RQ's parameter name
        connection: Any = None,
        serializer: Any = None,
    ) -> None:
        super().__init__(id, connection, None if serializer is PickleSerializer else serializer)


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
        self._lists_of: dict[str, tuple[str, str, str, str]] = {}
        self._script: Script = client.register_script(_ENQUEUE)

    def prepare(self, redis_url: str) -> None:
        """Check that Redis answers, load the enqueue script (so a Redis that forbids scripts
        is refused at start-up rather than at the first batch) and warm up (`warm_up`).

        Raises:
            ConfigError: what a retry cannot fix: Redis refused our credentials or the script
                (ACL), or no sentinel knows the master (`redis_url` names them).
            RedisUnavailableError: Redis did not answer (not fatal: drains retry).
        """
        try:
            self._client.ping()
            self._client.script_load(_ENQUEUE)
            self.warm_up()
        except MasterNotFoundError as exc:
            # Sentinels all unreachable, or none knows the master's name: a set-up error.
            raise ConfigError(
                f"Redis Sentinel: {describe_master_not_found(redis_url, exc)}"
            ) from None
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            raise ConfigError(f"Redis refused us: {redact(str(exc))}") from None
        except redis.RedisError as exc:
            raise RedisUnavailableError(redact(str(exc))) from exc

    def warm_up(self) -> None:
        """Build a job of every route on a pipeline that is never sent, and run the script on
        an empty batch (it writes nothing), so the first batch pays for neither.

        Raises:
            redis.RedisError: Redis failed.
        """
        self._arguments([JobRef(job_type, "warm-up", 1) for job_type in self._routes])
        self._script(keys=[], args=[0, 0])

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self._client, job_class=_Job)
        return queue

    def _lists(self, name: str) -> tuple[str, str, str, str]:
        """The keys of a queue's list, RQ's intermediate list, and its finished and failed
        registries."""
        lists = self._lists_of.get(name)
        if lists is None:
            queue = self._queue(name)
            lists = self._lists_of[name] = (
                queue.key,
                queue.intermediate_queue_key,
                queue.finished_job_registry.key,
                queue.failed_job_registry.key,
            )
        return lists

    def enqueue(self, refs: Sequence[JobRef]) -> EnqueueResult:
        """Enqueue the jobs of `refs` that are not already enqueued (see the module
        docstring), all in one script run.

        Raises:
            RedisUnavailableError: Redis failed or refused the batch; nothing of it was written.
            BadKeysError: keys the batch writes hold another kind of value (every such key is
                named); likewise.
            KeyError: a ref's type has no route (callers only claim routed types).
        """
        if not refs:
            return EnqueueResult()
        try:
            # Building the jobs may ask Redis too (RQ reads the server's version once).
            refs, argv = self._arguments(refs)
            skipped = self._script(keys=[], args=argv)
        except redis.RedisError as exc:
            raise RedisUnavailableError(
                f"Redis enqueue failed: {redact(str(exc))}", rows=len(refs)
            ) from exc
        if skipped and skipped[0] in (_WRONG_KIND, _WRONG_KIND.encode()):
            raise BadKeysError(_wrong_kinds(skipped), refs)
        left = {int(index) - 1 for index in skipped}
        written = [ref for index, ref in enumerate(refs) if index not in left]
        return EnqueueResult(
            enqueued=len(written),
            already_enqueued=len(left),
            by_type=Counter(ref.type for ref in written),
        )

    def _arguments(self, refs: Sequence[JobRef]) -> tuple[list[JobRef], list[Any]]:
        """The refs in the script's order, and the script's ARGV for them."""
        by_queue = self._by_queue(refs)
        ordered = [ref for batch in by_queue.values() for ref in batch]
        by_queue_index = {name: index for index, name in enumerate(by_queue)}
        owner_of: dict[str, int] = {}
        argv: list[Any] = [len(ordered), len(by_queue)]
        for name in by_queue:
            argv += self._lists(name)
        for index, ref in enumerate(ordered, start=1):
            key = Job.key_for(ref.job_id)
            owner_of[key] = owner_of[ref.job_id] = index
            argv += [key, ref.job_id, by_queue_index[self._routes[ref.type].queue]]
        with self._client.pipeline(transaction=False) as plan:
            self._add_enqueues(plan, by_queue)
            for args, _options in plan.command_stack:  # never sent: the script runs them
                # A job's hash is keyed by it; its push names it last; the rest is shared.
                owner = owner_of.get(str(args[1]), owner_of.get(str(args[-1]), 0))
                argv += [owner, len(args), *args]
        return ordered, argv

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
