"""Retention inside `reactor run` (--prune-done-after / --prune-failed-after)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import metric, scrape
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows
from tests.support.servers import free_port
from tests.support.waiting import wait_for


def plant(conn: psycopg.Connection[Any], prefix: str, state: str, count: int, age: str) -> None:
    """`count` finished rows last updated `age` ago (an INSERT keeps the given updated_at)."""
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
        " SELECT %s || i, 'photo.process', %s, 1, now() - %s::interval, now() - %s::interval"
        " FROM generate_series(1, %s) AS i",
        [prefix, state, age, age, count],
    )


def count(conn: psycopg.Connection[Any], prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM photo_jobs WHERE photo_id LIKE %s", [prefix + "%"]
    ).fetchone()
    return int(row[0]) if row else 0


def dispatch_delay(conn: psycopg.Connection[Any], photo_id: str) -> float:
    """Seconds from the insert's commit until the row is claimed."""
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [photo_id])
    committed = time.monotonic()
    wait_for(
        lambda: (
            conn.execute(
                "SELECT state = 'active' FROM photo_jobs WHERE photo_id = %s", [photo_id]
            ).fetchone()
            == (True,)
        ),
        timeout=10,
        interval=0.001,
        what=f"{photo_id} dispatched",
    )
    return time.monotonic() - committed


@pytest.mark.slow
def test_old_rows_disappear_in_batches_while_new_rows_are_dispatched(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    plant(conn, "old-done-", "done", 4000, "8 days")
    plant(conn, "new-done-", "done", 50, "1 hour")
    plant(conn, "old-failed-", "failed", 300, "40 days")
    plant(conn, "new-failed-", "failed", 20, "10 days")
    port = free_port()
    reactor = start_reactor(
        spawn,
        "--prune-done-after",
        "7d",
        "--prune-failed-after",
        "30d",
        "--prune-batch-size",
        "200",
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
    )
    seen: set[int] = set()
    during: list[float] = []
    i = 0
    # Dispatch new rows while the old ones go, 200 at a time.
    while (left := count(conn, "old-done-")) > 0:
        seen.add(left)
        during.append(dispatch_delay(conn, f"during-{i}"))
        i += 1
        assert i < 5000, "pruning never finished"
    wait_for(lambda: count(conn, "old-failed-") == 0, what="old failed rows pruned")
    after = [dispatch_delay(conn, f"after-{j}") for j in range(20)]
    print(
        f"dispatch delay while pruning: median {statistics.median(during) * 1e3:.1f} ms, "
        f"max {max(during) * 1e3:.1f} ms ({len(during)} rows); after: median "
        f"{statistics.median(after) * 1e3:.1f} ms, max {max(after) * 1e3:.1f} ms"
    )
    # Batches, not one DELETE: many intermediate counts, each a multiple of the batch size
    # below the start (nothing else deletes these rows).
    intermediate = {n for n in seen if 0 < n < 4000}
    assert len(intermediate) >= 5, sorted(seen)
    assert all((4000 - n) % 200 == 0 for n in intermediate), sorted(seen)
    # New rows kept flowing during the pruning, each well before the 30 s sweep (that no
    # prune blocks a claim is test_concurrent_prunes_block_no_claim's; latency is bench's).
    assert len(during) >= 5
    assert max(during) < 5.0, sorted(during)
    # Only the old finished rows went; new and pending/active rows stayed.
    assert count(conn, "new-done-") == 50
    assert count(conn, "new-failed-") == 20
    assert count(conn, "during-") == len(during)
    reactor.wait_for_line("rows_pruned done=4000 failed=300")
    text = scrape(port)
    assert metric(text, 'reactor_pruned_total{state="done"}') == 4000
    assert metric(text, 'reactor_pruned_total{state="failed"}') == 300
    # It pruned on a connection of its own, not the work connection.
    assert conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'photo-reactor prune'"
    ).fetchone() == (1,)


#: Every DELETE from photo_jobs waits, at its first row (the batch's rows locked by then),
#: until the test lets go of this advisory lock: prunes held inside their transactions.
GATE = 74_113
GATED_DELETES = f"""
CREATE FUNCTION prune_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({GATE});
    RETURN OLD;
END $$;
CREATE TRIGGER prune_gate BEFORE DELETE ON photo_jobs
    FOR EACH ROW EXECUTE FUNCTION prune_gate();
"""


def held_at_the_gate(conn: psycopg.Connection[Any]) -> int:
    """Sessions of this database waiting for the gate (inside a DELETE of a prune)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE d.datname = current_database() AND l.locktype = 'advisory'"
        "   AND l.objid = %s AND NOT l.granted",
        [GATE],
    ).fetchone()
    return int(row[0]) if row else 0


def test_concurrent_prunes_block_no_claim(env: Env, spawn: Callable[..., Process]) -> None:
    """Two reactors' retention and two `reactor prune` runs, all inside their DELETEs at once
    (held there, their batches' rows locked): rows committed meanwhile are dispatched while
    every prune is still held, and the prunes then finish, deleting each old row once."""
    conn, gate = env.connect(), env.connect()
    plant(conn, "old-done-", "done", 3000, "8 days")
    plant(conn, "old-failed-", "failed", 300, "40 days")
    plant(conn, "new-done-", "done", 50, "1 hour")
    conn.execute(GATED_DELETES)
    gate.execute("SELECT pg_advisory_lock(%s)", [GATE])
    retention = ("--prune-done-after", "7d", "--prune-failed-after", "30d")
    reactors = [
        start_reactor(spawn, *retention, "--prune-batch-size", "200", name=f"reactor-{i}")
        for i in range(2)
    ]
    prunes = [
        spawn(
            "-m",
            "reactor",
            "prune",
            "--done-older-than",
            "7d",
            "--failed-older-than",
            "30d",
            name=f"prune-{i}",
        )
        for i in range(2)
    ]
    wait_for(lambda: held_at_the_gate(conn) == 4, timeout=30, what="four prunes held")
    # Rows of a single-row insert and of a bulk one, both claimed while prunes are held.
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('one', 'photo.process')")
    insert_rows(conn, 20, prefix="during-")
    wait_for(
        lambda: (
            conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'active'").fetchone()
            == (21,)
        ),
        timeout=30,
        what="the new rows dispatched",
    )
    assert held_at_the_gate(conn) == 4, "a prune got through: nothing was held meanwhile"
    assert count(conn, "old-done-") == 3000 and count(conn, "old-failed-") == 300
    gate.execute("SELECT pg_advisory_unlock(%s)", [GATE])
    for prune in prunes:
        assert prune.exit_code(timeout=120) == 0, prune.output()
    wait_for(
        lambda: count(conn, "old-done-") + count(conn, "old-failed-") == 0,
        timeout=60,
        what="the old rows pruned",
    )
    assert count(conn, "new-done-") == 50
    assert count(conn, "during-") == 20 and count(conn, "one") == 1
    for reactor in reactors:
        assert reactor.proc.poll() is None, reactor.output()
        assert "prune_failed" not in reactor.output()


def test_retention_is_off_by_default_and_checks_its_durations(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    plant(conn, "old-done-", "done", 10, "800 days")
    start_reactor(spawn)
    # The reactor has caught up and is idle; no prune connection, nothing deleted.
    assert conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'photo-reactor prune'"
    ).fetchone() == (0,)
    assert count(conn, "old-done-") == 10
    for args, needle in (
        (["--prune-done-after", "soon"], "bad duration 'soon'"),
        (["--prune-done-after", "0s"], "prune ages must be at least 1h"),
        (["--prune-done-after", "7d", "--prune-failed-after", "30m"], "at least 1h"),
        (["--prune-done-after", "7"], "give a number and a unit"),
        (["--prune-failed-after", "30d"], "--prune-failed-after needs --prune-done-after"),
    ):
        result = run_cli(env, "run", *args)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
