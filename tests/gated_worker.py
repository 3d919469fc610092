"""A worker class for tests that hold a work horse between its handler and RQ's bookkeeping."""

from __future__ import annotations

from typing import Any

from rq.job import Job
from rq.queue import Queue

from reactor import Worker
from tests.handlers import wait_for_gate


class BookkeepingGatedWorker(Worker):
    """`reactor.Worker` whose horse, after the handler, waits for gate `bookkeeping` before
    RQ records the job's success: what the worker process does meanwhile shows."""

    def handle_job_success(self, job: Job, queue: Queue, *args: Any, **kwargs: Any) -> None:
        wait_for_gate("bookkeeping")
        super().handle_job_success(job, queue, *args, **kwargs)
