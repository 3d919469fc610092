"""The suite never flushes or writes into data it did not create.

Sub-runs of pytest (through `scripts/test`, as a developer runs it) against a Redis server
this test starts and fills with keys in several databases, as someone's local Redis would be.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.servers import RedisServer

#: The sub-run's test writes the servers it got here (only when the variable is set).
REPORT_VARIABLE = "REACTOR_TEST_ISOLATION_REPORT"
SELF = "tests/test_isolation.py::test_a_test_writes_only_into_its_own_redis_db"


def test_a_test_writes_only_into_its_own_redis_db(env: Env, pg_server_url: str) -> None:
    client = env.redis()
    client.set("written-by-a-test", "1")
    assert client.get("written-by-a-test") == b"1"
    report = os.environ.get(REPORT_VARIABLE)
    if report:
        Path(report).write_text(json.dumps({"redis": env.redis_url, "postgres": pg_server_url}))


@pytest.fixture
def someones_redis() -> Iterator[RedisServer]:
    """A Redis server standing for someone's local Redis."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()


def fill(server: RedisServer, dbs: list[int]) -> dict[int, dict[str, bytes]]:
    data = {}
    for number in dbs:
        client = redis.Redis.from_url(server.url.replace("/0", f"/{number}"))
        client.set(f"someones-key-{number}", f"value {number}")
        client.rpush(f"someones-list-{number}", "a", "b")
        data[number] = dump(client)
        client.close()
    return data


def dump(client: redis.Redis) -> dict[str, bytes]:
    return {str(key): client.dump(key) or b"" for key in sorted(client.keys())}


def contents(server: RedisServer, dbs: list[int]) -> dict[int, dict[str, bytes]]:
    found = {}
    for number in dbs:
        client = redis.Redis.from_url(server.url.replace("/0", f"/{number}"))
        found[number] = dump(client)
        client.close()
    return found


def scripts_test(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACTOR_")}
    env.update(variables, **{REPORT_VARIABLE: str(tmp_path / "report.json")})
    return subprocess.run(
        [str(ROOT / "scripts" / "test"), "-q", "-p", "no:cacheprovider", SELF],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_a_redis_holding_someones_keys_is_refused_and_left_untouched(
    someones_redis: RedisServer,
    pg_server_url: str,
    tmp_path: Path,
) -> None:
    server = someones_redis
    before = fill(server, [0, 3, 7, 14])
    result = scripts_test(
        tmp_path, REACTOR_TEST_REDIS_URL=server.url, REACTOR_TEST_DATABASE_URL=pg_server_url
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to use REACTOR_TEST_REDIS_URL: its database 3 holds keys" in result.stdout
    assert not (tmp_path / "report.json").exists()
    assert contents(server, [0, 3, 7, 14]) == before


def test_a_named_redis_is_used_only_in_the_suites_databases(
    someones_redis: RedisServer,
    pg_server_url: str,
    tmp_path: Path,
) -> None:
    server = someones_redis
    before = fill(server, [0, 13, 14, 15])
    result = scripts_test(
        tmp_path, REACTOR_TEST_REDIS_URL=server.url, REACTOR_TEST_DATABASE_URL=pg_server_url
    )
    assert result.returncode == 0, result.stdout + result.stderr
    used = json.loads((tmp_path / "report.json").read_text())["redis"]
    assert urlsplit(used).port == server.port
    assert 1 <= int(urlsplit(used).path.strip("/")) <= 12
    assert contents(server, [0, 13, 14, 15]) == before


@pytest.mark.slow  # servers of its own, started from the binaries
def test_without_urls_the_suite_starts_servers_of_its_own(
    someones_redis: RedisServer, tmp_path: Path
) -> None:
    server = someones_redis
    dbs = list(range(16))
    before = fill(server, dbs)
    result = scripts_test(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    # Neither the usual local ports nor the server holding someone's data.
    assert urlsplit(report["redis"]).port not in (6379, server.port)
    assert urlsplit(report["postgres"]).port != 5432
    assert contents(server, dbs) == before
