"""The worker side: the RQ entry point every job runs, its fenced lifecycle, the worker classes.

`reactor.worker.perform` is the function dispatched jobs name (`reactor.jobs.ENTRY_POINT`);
the worker classes are `reactor.worker.classes.Worker` and `SimpleWorker` (also reachable as
`reactor.Worker` and `reactor.SimpleWorker`).
"""

from reactor.worker.entry import perform

__all__ = ["perform"]
