"""A forking worker that takes descriptors in the worker process while each job runs, as a
connection opened during a job would (a reconnect, an exporter's new connection), and reports
after the job which of them were closed under it: `fd_probe probes=N cut=[...]` on stderr."""

from __future__ import annotations

import os
import sys

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

import reactor

#: Descriptors taken: the lowest free numbers, which include any the worker freed for the job.
PROBES = 16


class ProbingWorker(reactor.Worker):
    _probes: tuple[int, ...] = ()

    def monitor_work_horse(self, job: Job, queue: Queue, execution: Execution) -> None:
        # After the fork, while the horse runs.
        self._probes = tuple(os.open(os.devnull, os.O_RDONLY) for _ in range(PROBES))
        super().monitor_work_horse(job, queue, execution)

    def execute_job(self, job: Job, queue: Queue) -> None:
        super().execute_job(job, queue)
        probes, self._probes = self._probes, ()
        cut = []
        for fd in probes:
            try:
                os.fstat(fd)
            except OSError:
                cut.append(fd)
            else:
                os.close(fd)
        print(f"fd_probe probes={len(probes)} cut={cut}", file=sys.stderr, flush=True)
