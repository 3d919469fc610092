"""A reference worker class for `python -m bench workers`: RQ's SimpleWorker with the worker
classes' renewal of the worker key (`reactor.worker_key`) and nothing else, so that what the
lifecycle costs can be told from what that renewal saves."""

from __future__ import annotations

import rq.worker

from reactor.worker_key import KeyRenewal


class RenewingSimpleWorker(KeyRenewal, rq.worker.SimpleWorker):
    """RQ's SimpleWorker, renewing its key as `reactor.SimpleWorker` does."""
