"""Stop requests: SIGTERM/SIGINT handling and an interruptible sleep.

The first signal asks the reactor to stop after the batch in hand (a warm shutdown); a second
one exits the process at once (cold), which is safe by design: an enqueued-but-uncommitted
batch is found alive in Redis by the next claim and not enqueued twice. Waits select on a
self-pipe, so a stop request ends any wait immediately instead of at its next timeout.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable
from types import FrameType

__all__ = ["StoppedError", "Stopper"]


class StoppedError(Exception):
    """A stop was asked for before the work began (during the start-up's retries)."""


class Stopper:
    """A stop flag with a file descriptor that becomes readable when it is set."""

    def __init__(self, on_request: Callable[[], None] | None = None) -> None:
        #: Called once, at the first stop request (`reactor run` tells systemd it stops).
        self._on_request = on_request
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.requested = False
        self._signals = 0

    def fileno(self) -> int:
        """Readable once a stop was requested (for `select`)."""
        return self._read_fd

    def should_stop(self) -> bool:
        """Whether a stop was requested (a callable for loops that check between steps)."""
        return self.requested

    def request(self) -> None:
        """Ask for a warm stop."""
        if not self.requested and self._on_request is not None:
            self._on_request()
        self.requested = True
        with contextlib.suppress(BlockingIOError):  # the pipe already holds a wake-up byte
            os.write(self._write_fd, b"x")

    def install(self) -> None:
        """Route SIGTERM and SIGINT to this stopper (main thread only)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            os.write(2, b"photo-reactor: second signal, exiting at once\n")
            os._exit(1)
        self.request()

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less if a stop is requested; return whether it was."""
        if not self.requested and seconds > 0:
            select.select([self._read_fd], [], [], seconds)
        return self.requested

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)
