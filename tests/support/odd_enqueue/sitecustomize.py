"""Put on PYTHONPATH by tests/test_robustness.py: the first `ODD_ENQUEUE_FAILURES` batches a
`reactor run` process enqueues raise an exception of a type nothing in the reactor expects
(what a library might raise), before anything reaches Redis. The reactor's own code is not
touched: its enqueue is wrapped from outside, at interpreter start."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

FAILURES = int(os.environ.get("ODD_ENQUEUE_FAILURES", "0"))


class OddLibraryError(Exception):
    """Of no class the reactor knows."""


if FAILURES:
    from reactor.rq import enqueue as _enqueue

    _real = _enqueue.Enqueuer.enqueue
    _left = [FAILURES]

    def _odd(self: _enqueue.Enqueuer, refs: Sequence[Any]) -> Any:
        if refs and _left[0] > 0:
            _left[0] -= 1
            raise OddLibraryError(f"injected, {_left[0]} more to come")
        return _real(self, refs)

    _enqueue.Enqueuer.enqueue = _odd  # type: ignore[method-assign]
