"""Asking RQ workers to stop the started jobs of cancelled rows (`reactor cancel`).

A job is stopped with RQ's own stop-job command (`rq.command.send_command`, what
`send_stop_job_command` sends), published to the worker the job names. The job's status and
worker are read with plain `HGET`s, never by loading the job (its pickled fields are never
decoded). A forking worker kills the work horse; a `SimpleWorker` has none to kill, so its
handler runs to the end. Either way the attempt's outcome is fenced off by the row's state:
stopping only saves the work. A job that is not started (queued) is left alone: its fenced
start refuses it. A job whose worker name is not UTF-8 is passed over: RQ names its workers
with text, so no worker listens on such a name (and the other jobs are still stopped).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from rq.command import send_command
from rq.job import Job

from reactor.jobs import JobRef
from reactor.rq.state import STARTED, reading

__all__ = ["stop_started"]


def stop_started(client: redis.Redis, refs: Sequence[JobRef]) -> int:
    """Send the stop-job command for each of these attempts' jobs that a worker has started;
    how many were sent (a worker that finished the job meanwhile ignores it).

    Raises:
        RedisUnavailableError: Redis failed (the rows stay cancelled; outcomes are fenced off).
    """
    if not refs:
        return 0
    # Redis errors leave as RedisUnavailableError (the rows stay cancelled either way).
    with reading(), client.pipeline(transaction=False) as pipe:
        for ref in refs:
            pipe.hmget(Job.key_for(ref.job_id), "status", "worker_name")
        found: list[list[bytes | None]] = pipe.execute()
    sent = 0
    for ref, (status, worker) in zip(refs, found, strict=True):
        if status != STARTED or not worker:
            continue
        try:
            name = worker.decode()
        except UnicodeDecodeError:
            continue  # written by hand: no RQ worker has that name, none to stop
        with reading():
            send_command(client, name, "stop-job", job_id=ref.job_id)
        sent += 1
    return sent
