"""The Redis databases of the test suite: each test gets the next of databases 1-12, flushed
and marked as the suite's own. On a server the suite was told to use, it refuses to start if
one of them holds keys it did not write (it would flush them). Under pytest-xdist each worker
process cycles through its own share of the twelve, so parallel tests never share one."""

from __future__ import annotations

import itertools
import os

import pytest
import redis

from tests.support.urls import with_path

#: Redis databases the tests use (one per test, in turn), and the key that marks a database as
#: the suite's own: the suite flushes a database only if it is empty or holds this key.
TEST_REDIS_DBS = range(1, 13)
SUITE_MARKER_KEY = "photo-reactor:test-suite"


def _own_share() -> range:
    """This process's databases: all twelve, or one slice per xdist worker (gw0, gw1, ...)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return TEST_REDIS_DBS
    share = TEST_REDIS_DBS[int(worker[2:]) % count :: count]
    if not share:
        raise RuntimeError(
            f"{count} xdist workers are more than the {len(TEST_REDIS_DBS)} Redis databases"
        )
    return share


_next_db = itertools.cycle(_own_share())


def refuse_foreign_redis_data(url: str) -> None:
    """Stop the run if a Redis database the suite would flush holds keys it did not write."""
    for number in TEST_REDIS_DBS:
        client = redis.Redis.from_url(with_path(url, str(number)))
        try:
            foreign = client.dbsize() > 0 and not client.exists(SUITE_MARKER_KEY)
        finally:
            client.close()
        if foreign:
            pytest.exit(
                f"refusing to use REACTOR_TEST_REDIS_URL: its database {number} holds keys "
                f"the test suite did not write (it flushes databases 1-12); give a Redis of "
                f"its own, or unset the variable to let the suite start one",
                returncode=2,
            )


def fresh_redis_db(server_url: str) -> str:
    """The next test database of the Redis at `server_url`, flushed and marked; its URL."""
    url = with_path(server_url, str(next(_next_db)))
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
        client.set(SUITE_MARKER_KEY, "1")
    finally:
        client.close()
    return url
