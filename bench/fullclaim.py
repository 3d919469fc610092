"""`python -m bench.fullclaim run …`: the `reactor` command with every claim over the whole
range of its type's pending index, as before the low-water marks (`reactor.dispatcher.bounds`):
the "before" side of `python -m bench pressure --before`. The statement is the same one, with
no window (a lower bound of `-infinity`)."""

from __future__ import annotations

from reactor.cli import main
from reactor.dispatcher import bounds


def _always_full(self: bounds.ClaimBounds, job_type: str, now: float) -> float | None:
    return None


setattr(bounds.ClaimBounds, "window", _always_full)  # noqa: B010 - the benchmark's switch
main()
