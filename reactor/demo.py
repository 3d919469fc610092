"""The demo handler: a stand-in to replace, routed only where it is named (`scripts/demo`).

It does no photo work. It logs the photo and records its run in the Redis list `DEMO_RUNS_KEY`
(of the Redis the worker serves), so the demo can show every photo flowing end to end. Replace
it with your own handler: a plain function `handler(photo_id)` that is idempotent (it may run
more than once for one photo), raises `reactor.PermanentError` for failures that retrying
cannot fix, and any other exception for failures worth retrying.
"""

from __future__ import annotations

import logging
import os

from rq import get_current_job

__all__ = ["DEMO_RUNS_KEY", "process_photo"]

logger = logging.getLogger(__name__)

#: Redis list that receives one entry "photo_id token pid" per demo run.
DEMO_RUNS_KEY = "photo-reactor:demo:runs"


def process_photo(photo_id: str) -> None:
    """Pretend to process `photo_id`; record the run."""
    job = get_current_job()
    token = job.meta.get("token") if job is not None else None
    logger.info("demo_processed photo_id=%r token=%s", photo_id, token)
    if job is not None:
        job.connection.rpush(DEMO_RUNS_KEY, f"{photo_id} {token} {os.getpid()}")
