"""`SystemdNotify`: the worker classes' side of systemd's notify protocol (`reactor.sdnotify`).
A mixin of `reactor.Worker` and `reactor.SimpleWorker`; with no `NOTIFY_SOCKET` it does nothing.

- `READY=1` when RQ's work loop first waits for a job (after `check_startup` and RQ's start);
- `WATCHDOG=1` at each renewal of the worker's RQ key: RQ's loop renews it before every wait
  for a job, and while an attempt runs the heartbeat thread renews it at every beat, so a
  worker whose loop is stuck (Redis not answering, a start waiting on a lock) goes silent;
  with the watchdog on, the wait for a job is cut to half its interval so an idle worker
  keeps renewing. The beat must then come at least every half interval (`reactor worker`
  refuses a `WatchdogSec` shorter than two heartbeats);
- `STOPPING=1` when a warm shutdown is asked for (the running job still finishes).

Only the worker process sends (a forked work horse inherits the notifier and stays silent).
"""

from __future__ import annotations

from typing import Any

from rq.worker.base import BaseWorker

from reactor.sdnotify import Notifier

__all__ = ["SystemdNotify"]


class SystemdNotify(BaseWorker):
    """Put before RQ's worker class in the bases."""

    _systemd: Notifier | None = None
    _ready_sent = False

    @property
    def systemd(self) -> Notifier:
        if self._systemd is None:
            self._systemd = Notifier.from_env()
        return self._systemd

    @property
    def dequeue_timeout(self) -> int:
        rq_timeout = super().dequeue_timeout
        if self.systemd.watchdog_seconds is None:
            return rq_timeout
        return max(1, min(rq_timeout, int(self.systemd.max_wait())))

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> Any:
        if not self._ready_sent:
            self._ready_sent = True
            self.systemd.ready()
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if self._ready_sent:  # RQ's start renews the key too, before READY
            self.systemd.alive()

    def handle_warm_shutdown_request(self) -> None:
        self.systemd.stopping()
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]
