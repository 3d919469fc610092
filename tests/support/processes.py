"""Child processes of the tests: the environment they get, and `Process`, the one helper for
the long-running ones (reactors, workers, the dashboard), whose output is collected line by
line so a test can wait for a line and show everything when it fails.

Commands that run to completion go through `tests.support.cli.run_cli` instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from reactor.routes import DEMO_ROUTE
from tests.support.paths import ROOT
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.env import Env


def child_environ(**variables: str) -> dict[str, str]:
    """The environment of a child process: this one's without any REACTOR_*, DATABASE_URL or
    REDIS_URL variable (a developer's settings must not leak into a test), with the checkout on
    PYTHONPATH and the demo route named, then `variables`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("REACTOR_", "DATABASE_URL", "REDIS_URL"))
    }
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        # Tests name the demo route (no process falls back to it); override to test others.
        REACTOR_ROUTES=DEMO_ROUTE,
        # A child that hangs is sent SIGABRT (`Process.exit_code`): show where each thread was.
        PYTHONFAULTHANDLER="1",
    )
    env.update(variables)
    return env


class Process:
    """A child process whose output is collected line by line (for waits and for failures)."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # a process group of its own: `kill_all` reaches its children
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float = 20.0) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None and not any(text in line for line in self.lines):
                self._reader.join(timeout=2)  # the last lines may still be on their way
                if not any(text in line for line in self.lines):
                    raise AssertionError(f"{self.name} exited early:\n{self.output()}")
            return any(text in line for line in self.lines)

        wait_for(seen, timeout, what=f"{text!r} from {self.name}")

    def exit_code(self, timeout: float) -> int:
        """Wait for the process to end. If it does not in time, make Python dump every
        thread's stack (SIGABRT with faulthandler on) and fail with its output."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self._reader.join(timeout=2)
            raise AssertionError(
                f"{self.name} still running after {timeout:g} s:\n{self.output()}"
            ) from None

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the process alone (a forking worker's work horse lives on, as it would)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def kill_all(self) -> None:
        """SIGKILL the process and everything it started (a work horse, a pool's workers),
        which would otherwise outlive the test and write to a later test's Redis database."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_reactor(
    spawn: Callable[..., Process], *args: str, name: str = "reactor", **extra_env: str
) -> Process:
    """Start `reactor run` and wait until it listens (or polls) and has caught up."""
    proc = spawn("-m", "reactor", "run", *args, name=name, extra_env=extra_env)
    proc.wait_for_line("reactor_started")
    return proc


def start_worker(
    spawn: Callable[..., Process],
    env: Env,
    *queues: str,
    burst: bool = False,
    extra_args: tuple[str, ...] = (),
    redis_url: str | None = None,
    **extra_env: str,
) -> Process:
    """Start a plain `rq worker` on `queues` (default photo-process). Its own routes, the only
    handlers it runs, are the recorded ones unless REACTOR_ROUTES is given (the jobs of a test
    name the handlers its reactors and sweeps routed)."""
    extra_env.setdefault("REACTOR_ROUTES", "")
    url = redis_url or env.redis_url
    args = ["-m", "rq.cli", "worker", *(queues or ("photo-process",)), "--url", url]
    args += extra_args
    if burst:
        args.append("--burst")
    return spawn(*args, name="worker", extra_env=extra_env)
