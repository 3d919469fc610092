"""systemd's notify protocol, for `reactor run` and `reactor worker` under `Type=notify`.

When systemd starts a service with `NOTIFY_SOCKET` set, the service sends it datagrams of
`KEY=VALUE` lines: `READY=1` once it is up, `WATCHDOG=1` while it lives (with `WatchdogSec=`,
systemd passes `WATCHDOG_USEC` and restarts a service that stays silent that long), and
`STOPPING=1` as it begins to shut down. The protocol is one `sendto` on a Unix datagram socket
(a path, or a name in the abstract namespace when it starts with `@`), so it is written here.

`Notifier` guarantees: with no `NOTIFY_SOCKET` every call does nothing; a send that fails is
logged once and never raises (the service must not die of its supervisor's socket); `alive()`
sends `WATCHDOG=1` only when the watchdog is on and meant for this process (`WATCHDOG_PID`),
at most once per quarter interval, and the caller's loop must call it at least every
`max_wait()` (half the interval) so that systemd hears from it at least every half interval.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier"]

logger = logging.getLogger(__name__)


class Notifier:
    """The notify socket of this process, if systemd gave one."""

    def __init__(self, address: str | None, watchdog_seconds: float | None) -> None:
        self._address: str | bytes | None = None
        if address:
            # The abstract namespace: a leading NUL instead of '@'.
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
        #: The watchdog's interval, None when off.
        self.watchdog_seconds = watchdog_seconds if self._address else None
        self._last_watchdog = float("-inf")
        self._failed = False
        self._pid = os.getpid()  # a forked child (a work horse) sends nothing

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """From `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` (as `sd_watchdog_enabled`
        reads them: a watchdog for another pid, or a value that is not a positive number,
        is off)."""
        env = os.environ if environ is None else environ
        seconds: float | None = None
        pid = env.get("WATCHDOG_PID", "")
        if not pid or (pid.isdigit() and int(pid) == os.getpid()):
            usec = env.get("WATCHDOG_USEC", "")
            if usec.isdigit() and int(usec) > 0:
                seconds = int(usec) / 1_000_000
        return cls(env.get("NOTIFY_SOCKET") or None, seconds)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self) -> None:
        self._send(b"READY=1\nSTATUS=running")

    def stopping(self) -> None:
        self._send(b"STOPPING=1")

    def max_wait(self) -> float:
        """How long the caller's loop may go without calling `alive()` (inf: any)."""
        return float("inf") if self.watchdog_seconds is None else self.watchdog_seconds / 2

    def alive(self) -> None:
        """The caller's loop has turned: `WATCHDOG=1`, unless one went out a quarter interval
        ago or less (a busy loop turns thousands of times a second)."""
        if self.watchdog_seconds is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_seconds / 4:
            self._last_watchdog = now
            self._send(b"WATCHDOG=1")

    def _send(self, message: bytes) -> None:
        if self._address is None or os.getpid() != self._pid:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.warning("sdnotify_failed error=%s (systemd is not told)", exc)
