"""`scripts/test` as a developer runs it: pytest options alone keep the default run (the tests
not marked slow, on three processes); a test path, node id, `-m` or `-k` selects instead.

Sub-runs of the real script; they only collect tests, or run one pure test, so no server starts.
And `scripts/demo` as a new user runs it, with an application's settings exported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Queue

from tests.support.env import Env
from tests.support.paths import ROOT

UNIT_TEST = "tests/test_units.py::test_route_parsing"


def scripts_test(*args: str) -> str:
    # Never the caller's named servers; the virtual environment stays the caller's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACTOR_TEST_")}
    result = subprocess.run(
        [str(ROOT / "scripts" / "test"), *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def collected(*args: str) -> set[str]:
    out = scripts_test("--co", "-q", "-p", "no:cacheprovider", *args)
    return {line for line in out.splitlines() if "::" in line}


@pytest.mark.slow
def test_pytest_options_alone_keep_the_default_selection() -> None:
    slow = collected("-m", "slow")
    default = collected("-x")
    assert slow and default
    assert not default & slow
    # A node id is pytest's selection, slow or not.
    one_slow = min(slow)
    assert collected(one_slow) == {one_slow}


@pytest.mark.slow  # a pytest session of its own, on three processes
def test_pytest_options_alone_keep_the_three_processes(tmp_path: Path) -> None:
    # `--lf` with a cache that names one failed test: an option, which runs just that test.
    cache = tmp_path / "v" / "cache"
    cache.mkdir(parents=True)
    (cache / "lastfailed").write_text(f'{{"{UNIT_TEST}": true}}')
    out = scripts_test("--lf", "-o", f"cache_dir={tmp_path}")
    assert "3 workers [1 item]" in out, out
    assert "1 passed" in out, out


def run_demo(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`scripts/demo.py --photos 3` in `environ`, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--photos", "3"],
        env=environ,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.slow  # servers of its own, a reactor and a worker
def test_the_demo_leaves_an_applications_servers_and_settings_alone(env: Env) -> None:
    """`scripts/demo` with an application's DATABASE_URL, REDIS_URL and REACTOR_ settings
    exported (the quickstart exports them): it runs on servers of its own, with its own route,
    and writes nothing to the application's."""
    before = set(redis.Redis.from_url(env.redis_url).keys())  # the suite's own marker
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    environ.update(
        DATABASE_URL=env.database_url,
        REDIS_URL=env.redis_url,
        REACTOR_HANDLER_PREFIXES="myapp",  # would refuse the demo's handler
        REACTOR_ROUTES="photo.process=myapp.photos.process",
    )
    result = run_demo(environ)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo: 3 of 3 photos done" in result.stdout
    conn = env.connect()
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (0,)
    assert set(redis.Redis.from_url(env.redis_url).keys()) == before


def test_the_demo_refuses_a_redis_whose_queue_another_deployment_uses(env: Env) -> None:
    """On a Redis database where another deployment's workers serve `photo-process`, the
    demo's jobs went to them (and theirs to the demo's worker): 1 of 20 done after two minutes,
    with no reason given. It now refuses at once, in one line."""
    client = redis.Redis.from_url(env.redis_url)
    Queue("photo-process", connection=client).enqueue("os.getpid")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    environ.update(DEMO_DATABASE_URL=env.database_url, DEMO_REDIS_URL=env.redis_url)
    result = run_demo(environ)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "demo: queue photo-process on DEMO_REDIS_URL already has 1 jobs: another deployment"
        " uses this Redis database; name one nothing else uses"
    )
    conn = env.connect()
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (0,)
