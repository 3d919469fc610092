"""`KeyRenewal`: RQ's renewals of a worker's own key, in one round trip and no more often than
needed. A mixin of `reactor.Worker` and `reactor.SimpleWorker`.

RQ renews a worker's key (`last_heartbeat`, the key's TTL and its executions' TTL) four times a
job: with its suspension check, before and after the dequeue, and after the job, each but the
first as three commands, one round trip each. Here each renewal is one round trip, and a
default one (TTL `worker_ttl` + 60 s) that this class would send itself is left out when the
last default one went out less than `RENEWAL_SECONDS` ago and neither a renewal with another
TTL nor a job came since (a job's start sets the job's own, shorter TTL, in the forked horse
for the forking class, unseen by this process). Renewals that ride in RQ's own pipelines (its
suspension check) are always sent. The first default renewal after a job is left to the next
one in such a pipeline: RQ's work loop renews right after the job and again in the suspension
check that follows at once; should another default renewal come first, it is sent. Guarantee:
whenever RQ is about to wait for a job, the key has the TTL RQ would give it;
`last_heartbeat` is at most `RENEWAL_SECONDS` older. While the subclass runs an attempt
(`_busy_key_ttl` not None), every renewal gives the key that shorter TTL instead, so a worker
that dies mid-job leaves a key that expires soon (`reactor.rq.state.workers_gone`), where RQ's
TTL for a job (the job's timeout + 60 s in-process) kept it for minutes.
"""

from __future__ import annotations

import time
from typing import Any

from rq.job import Job
from rq.queue import Queue
from rq.worker.base import BaseWorker

__all__ = ["RENEWAL_SECONDS", "KeyRenewal"]

#: A default renewal this soon after the last one is left out.
RENEWAL_SECONDS = 1.0

_NEVER = float("-inf")


class KeyRenewal(BaseWorker):
    """Put before RQ's worker class in the bases."""

    _renewed_at = _NEVER  # when this class last sent a default renewal (monotonic)
    _after_job = False  # a job ended and no renewal came since
    _owed = False  # the default renewal after a job was left to the next pipelined one

    def _busy_key_ttl(self) -> int | None:
        """The key's TTL while an attempt runs (None: RQ's own)."""
        return None

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        busy = self._busy_key_ttl()
        if busy is not None:
            timeout = busy
        now = time.monotonic()
        if pipeline is not None:
            super().heartbeat(timeout, pipeline)  # sent with RQ's own commands, at once
            self._renewed_at = now if timeout is None else _NEVER
            self._after_job = self._owed = False
            return
        if timeout is None and self._after_job and not self._owed:
            self._after_job, self._owed = False, True
            return
        if timeout is None and not self._owed and now - self._renewed_at < RENEWAL_SECONDS:
            return
        with self.connection.pipeline(transaction=False) as batch:
            super().heartbeat(timeout, batch)
            batch.execute()
        self._renewed_at = now if timeout is None else _NEVER
        self._after_job = self._owed = False

    def execute_job(self, job: Job, queue: Queue) -> None:
        # The job's start renews the key with the job's TTL: a default renewal must follow.
        self._renewed_at = _NEVER
        try:
            super().execute_job(job, queue)
        finally:
            self._after_job = True
