"""A forking worker closes only the descriptors it opened for a job: the outcome pipe's end
once, never a number another connection of the worker process may have taken meanwhile (a
real worker, a real fork, the probing class in `tests.support.fd_probe`)."""

from __future__ import annotations

import subprocess
import sys

from reactor import submit
from tests.support.env import Env
from tests.support.paths import ROOT

ROUTE = "photo.process=tests.handlers.traced"


def test_a_forking_worker_closes_no_descriptor_it_did_not_open_for_the_job(env: Env) -> None:
    """Descriptors the worker process opens while a horse runs (here plain files, as a
    reconnect's socket would be) are still open after the job: the worker closes the outcome
    pipe's end once, not again once its number may be another's."""
    conn = env.connect()
    submit(conn, "p1")
    env.cli_json("sweep", "--route", ROUTE)
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "rq.cli", "worker", "-w", "tests.support.fd_probe.ProbingWorker", "--burst"),
            *("photo-process", "--url", env.redis_url),
        ],
        cwd=ROOT,
        env=env.process_env(REACTOR_ROUTES=ROUTE),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert conn.execute("SELECT state FROM photo_jobs").fetchall() == [("done",)]
    assert "fd_probe probes=16 cut=[]" in done.stderr, done.stderr[-3000:]
