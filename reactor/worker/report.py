"""The pipe a forked work horse reports its handler's outcome through, seen from the worker
process.

The pipe is made before the fork; the horse writes one report (`Handoff.report`) when the
handler has returned or raised, then records the job in Redis and exits. The worker process
reads the report at two points:

- `wait` while the horse runs: it returns as soon as the report has arrived or the horse has
  ended, so that the worker can send the `done` write while the horse still does RQ's
  bookkeeping and exits, instead of after it;
- `collect` once the horse has been reaped: the whole report (None if there was none).

Guarantees:
- the worker never blocks on a descriptor the horse no longer writes: a process the handler
  forked may hold the write end after the horse's exit, so `wait` watches the horse itself (a
  pidfd) beside the pipe, and every read is non-blocking;
- the worker's copy of the write end is closed once, right after the fork (a number closed
  twice may by then be another connection's);
- where pidfds are missing (not Linux, or a kernel before 5.3) `wait` returns at once and
  `collect` reads the report as before: only the overlap is lost.
"""

from __future__ import annotations

import contextlib
import os
import select

from reactor.worker.entry import decode_outcome
from reactor.worker.lifecycle import Outcome

__all__ = ["ReportPipe"]


class ReportPipe:
    """One attempt's report pipe, from `os.pipe()` before the fork to `collect()`."""

    def __init__(self) -> None:
        self.read_fd, write_fd = os.pipe()
        self.write_fd: int | None = write_fd
        self._data = b""
        self._waited = False

    def forked(self) -> None:
        """In the parent after the fork: drop our write end, so the horse's exit ends it."""
        write_fd, self.write_fd = self.write_fd, None
        if write_fd is not None:
            with contextlib.suppress(OSError):
                os.close(write_fd)

    def wait(self, horse_pid: int) -> Outcome | None:
        """Until the horse reported or ended (once; an exception raised by a signal handler,
        such as RQ's monitoring alarm, leaves it to be called again). The outcome if the whole
        report is in, else None."""
        if self._waited or self.write_fd is not None:
            return None
        try:
            horse = os.pidfd_open(horse_pid)
        except (AttributeError, OSError):
            self._waited = True
            return None
        try:
            poller = select.poll()
            poller.register(self.read_fd, select.POLLIN)
            poller.register(horse, select.POLLIN)
            poller.poll()
        finally:
            os.close(horse)
        self._waited = True
        self._read()
        # A report is one write well under the pipe's atomic size, or a longer error that
        # `collect` completes: only a whole one decodes.
        return decode_outcome(self._data) if self._data else None

    def collect(self) -> Outcome | None:
        """Once the horse has been reaped: its report (None: none, or not whole), and the
        pipe closed."""
        self.forked()  # no fork took place: the write end is still ours
        self._read()
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        data, self._data = self._data, b""
        return decode_outcome(data) if data else None

    def _read(self) -> None:
        os.set_blocking(self.read_fd, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.read_fd, 65536):
                self._data += chunk
