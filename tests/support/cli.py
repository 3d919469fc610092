"""Running a `reactor` command to completion, the one way the tests do it: a real child
process (`python -m reactor` from the checkout, unless told another program), in the test's
environment, with its exit code, stdout and stderr for the test to check.

Long-running commands (`reactor run`, `reactor worker`, `reactor dashboard`) are started with
the `spawn` fixture instead (`tests.support.processes.Process`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.paths import ROOT
from tests.support.processes import child_environ

if TYPE_CHECKING:
    from tests.support.env import Env

#: The CLI of the checkout.
REACTOR = (sys.executable, "-m", "reactor")


def run_cli(
    env: Env | None,
    *args: str,
    extra_env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    program: Sequence[str] = REACTOR,
    cwd: Path = ROOT,
    timeout: float = 120,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `reactor ARGS...` to completion (with `stdin` as its standard input, if given); its
    `returncode`, `stdout` and `stderr`.

    The child's environment is `env.process_env()` (the test's DATABASE_URL and REDIS_URL, the
    demo route, no other REACTOR_ variable), or without `env` the same minus the two URLs, with
    `extra_env` on top; `environ`, if given, is the whole environment instead. A command still
    running after `timeout` seconds fails the test.
    """
    if environ is None:
        extra = dict(extra_env or {})
        environ = env.process_env(**extra) if env is not None else child_environ(**extra)
    else:
        assert extra_env is None, "extra_env adds to the test's environment, not to `environ`"
    return subprocess.run(
        [*program, *args],
        env=dict(environ),
        capture_output=True,
        text=True,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        cwd=cwd,
        timeout=timeout,
    )


def cli_json(env: Env, *args: str) -> dict[str, Any]:
    """Run `reactor ARGS...` against `env`; its JSON output (exit 0 required)."""
    result = run_cli(env, *args)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


#: The environment of a process that follows the recorded routes (none given).
NO_ROUTES = {"REACTOR_ROUTES": ""}


def cli_without_routes(env: Env, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """`run_cli` with no REACTOR_ROUTES: the command uses its flags or the recorded routes."""
    return run_cli(env, *args, extra_env={**NO_ROUTES, **extra_env})


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single line a command printed, having exited with `code` (no traceback)."""
    out = (result.stdout + result.stderr).strip()
    assert result.returncode == code, out
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in out
    return out
