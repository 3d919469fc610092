"""Job functions for `python -m bench workers`, in a module that imports nothing heavy, so a
forked work horse that imports it per job pays (almost) nothing for it."""

from __future__ import annotations

import time

#: The Redis list `stamp` appends "<photo_id> <unix time>" to.
STARTED_KEY = "bench:started"


def noop(photo_id: str) -> None:
    """Does nothing."""


def stamp(photo_id: str) -> None:
    """Records when the handler started (wall clock), in the job's own Redis connection."""
    started = time.time()
    from rq import get_current_job  # noqa: PLC0415 - already imported by any RQ worker

    job = get_current_job()
    assert job is not None
    job.connection.rpush(STARTED_KEY, f"{photo_id} {started!r}")
