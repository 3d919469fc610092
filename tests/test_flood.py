"""A flood of notifications naming rows that do not exist, from a role that may only connect,
against a real reactor and two `reactor worker --simple`.

Anyone who can connect to the database may NOTIFY on the reactor's channel. A notification is
only a reason to drain its type, so the flood costs claims that find nothing: the reactor stays
up, no job is written for a row that does not exist, and real rows committed meanwhile run
promptly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.roles import as_role, throwaway_role
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

ROUTE = "photo.process=reactor.demo.process_photo"
FLOOD_SECONDS = 10.0
FLOOD_PER_SECOND = 3000
#: Notifications a statement sends (each statement its own transaction).
FLOOD_CHUNK = 150
REAL_ROW_EVERY_SECONDS = 0.4
#: What a user may expect of a row committed during the flood (the claim is a few ms; the
#: margin is for a loaded two-core machine).
RUN_WITHIN_SECONDS = 10.0


def test_a_flood_of_names_of_absent_rows_stops_nothing_and_creates_no_job(
    env: Env, spawn: Callable[..., Process]
) -> None:
    reactor = start_reactor(spawn, "--route", ROUTE)
    workers = [
        spawn("-m", "reactor", "worker", "--simple", "--route", ROUTE, name=f"worker-{i}")
        for i in range(2)
    ]
    for worker in workers:
        worker.wait_for_line("Listening on")
    sent = [0]
    failures: list[BaseException] = []

    def flood(url: str) -> None:
        try:
            with psycopg.connect(url, autocommit=True) as flooder:
                started = time.monotonic()
                while (elapsed := time.monotonic() - started) < FLOOD_SECONDS:
                    if sent[0] >= elapsed * FLOOD_PER_SECOND:
                        time.sleep(0.005)  # pacing the sender, not waiting for a result
                        continue
                    flooder.execute(
                        "SELECT pg_notify('photo_jobs', 'photo.process fake-' || i)"
                        " FROM generate_series(%s::int, %s::int + %s - 1) AS i",
                        [sent[0], sent[0], FLOOD_CHUNK],
                    )
                    sent[0] += FLOOD_CHUNK
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    conn = env.connect()
    with throwaway_role(env) as role:  # LOGIN only: CONNECT (PUBLIC's), nothing else
        flooding = threading.Thread(target=flood, args=[as_role(env.database_url, role)])
        flooding.start()
        real = 0
        started = time.monotonic()
        while time.monotonic() - started < FLOOD_SECONDS:
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')",
                [f"real-{real}"],
            )
            real += 1
            time.sleep(REAL_ROW_EVERY_SECONDS)  # the insert rate, not a synchronisation
        flooding.join()
    assert not failures, failures
    assert sent[0] >= 0.8 * FLOOD_SECONDS * FLOOD_PER_SECOND, f"the flood sent only {sent[0]}"
    wait_for(
        lambda: (
            conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'done'").fetchone()
            == (real,)
        ),
        timeout=60,
        what="every real row done",
    )
    (slowest,) = conn.execute(
        "SELECT max(extract(epoch FROM updated_at - created_at)) FROM photo_jobs"
    ).fetchone() or (None,)
    assert slowest is not None and float(slowest) < RUN_WITHIN_SECONDS, slowest
    assert reactor.proc.poll() is None, reactor.output()
    for worker in workers:
        assert worker.proc.poll() is None, worker.output()
    fakes = env.redis().keys("rq:job:*fake*")
    assert fakes == [], f"{len(fakes)} jobs for absent rows, e.g. {fakes[:3]}"
    print(f"flood: {sent[0]} names, {real} real rows, slowest {float(slowest):.2f} s")
