"""A flood of notifications naming rows that do not exist, against a real reactor and worker.

Anyone who can connect to the database may NOTIFY on the reactor's channel. Each name costs a
job only while the named rows' budget lasts (the job is withdrawn at the claim), so the flood
leaves no lasting cost, and real rows committed meanwhile still run promptly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from rq.registry import FinishedJobRegistry

from tests.support.env import Env
from tests.support.metrics import metric, scrape
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.servers import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

ROUTE = "photo.process=reactor.demo.process_photo"
FLOOD_SECONDS = 8.0
FLOOD_MAX_NOTIFICATIONS = 200_000
REAL_ROWS = 30
#: What a user may expect of a row committed during the flood (the reactor's claim is a few
#: ms; the margin is for a loaded two-core machine).
RUN_WITHIN_SECONDS = 10.0


def test_a_flood_of_names_of_absent_rows_costs_little_and_real_rows_still_run(
    env: Env, spawn: Callable[..., Process]
) -> None:
    port = free_port()
    start_reactor(spawn, "--route", ROUTE, "--metrics-port", str(port))
    worker = start_worker(
        spawn, env, extra_args=("--worker-class", "reactor.SimpleWorker"), REACTOR_ROUTES=ROUTE
    )
    worker.wait_for_line("Listening on")
    sent = [0]
    stop = threading.Event()

    def flood() -> None:
        with env.connect() as flooder:
            deadline = time.monotonic() + FLOOD_SECONDS
            while time.monotonic() < deadline and sent[0] < FLOOD_MAX_NOTIFICATIONS:
                if stop.is_set():
                    return
                flooder.execute(
                    "SELECT pg_notify('photo_jobs', 'photo.process ghost-' || i)"
                    " FROM generate_series(%s::int, %s::int + 499) AS i",
                    [sent[0], sent[0]],
                )
                sent[0] += 500

    flooding = threading.Thread(target=flood, daemon=True)
    flooding.start()
    conn = env.connect()
    try:
        for i in range(REAL_ROWS):
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [f"r{i}"]
            )
            stop.wait(FLOOD_SECONDS / REAL_ROWS / 2)
    finally:
        flooding.join()
    assert sent[0] >= 10_000, f"the flood sent only {sent[0]} notifications"
    wait_for(
        lambda: (
            conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'done'").fetchone()
            == (REAL_ROWS,)
        ),
        timeout=120,
        what="every real row done",
    )
    (slowest,) = conn.execute(
        "SELECT max(extract(epoch FROM updated_at - created_at)) FROM photo_jobs"
    ).fetchone() or (None,)
    assert slowest is not None and float(slowest) < RUN_WITHIN_SECONDS, slowest
    withdrawn = metric(scrape(port), "reactor_named_withdrawn_total")
    # Jobs made for absent rows: withdrawn at the claim, or taken first by the worker, which
    # found no row and finished them.
    taken = [
        job_id
        for job_id in FinishedJobRegistry("photo-process", connection=env.redis()).get_job_ids()
        if "ghost" in job_id
    ]
    made = withdrawn + len(taken)
    assert 0 < made < 1_000, f"{made} jobs for {sent[0]} names of absent rows"
    print(
        f"flood: {sent[0]} names, {made:.0f} jobs for absent rows ({withdrawn:.0f} withdrawn),"
        f" slowest {slowest:.2f} s"
    )
    # The worker heard of the few it took before their withdrawal, in a throttled log.
    skipped = [line for line in worker.lines if "row missing" in line]
    assert len(skipped) <= 10, skipped[:3]
