"""Pausing and resuming job types: a running reactor, the sweep, the CLI and `reactor status`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from tests.support.cli import run_cli
from tests.support.doorbell import armed_by
from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.waiting import wait_for

ROUTES = (
    "--route",
    "photo.process=reactor.demo.process_photo",
    "--route",
    "photo.thumb=reactor.demo.process_photo",
)


def by_type(conn: psycopg.Connection[Any]) -> dict[tuple[str, str], int]:
    """Row count by (type, state)."""
    return {
        (t, s): int(n)
        for t, s, n in conn.execute("SELECT type, state, count(*) FROM photo_jobs GROUP BY 1, 2")
    }


def insert(conn: psycopg.Connection[Any], job_type: str, prefix: str, count: int) -> None:
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type)"
        " SELECT %s || i, %s FROM generate_series(1, %s) AS i",
        [prefix, job_type, count],
    )


def test_a_paused_type_stays_pending_while_others_flow_and_resume_dispatches_at_once(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    # A long sweep interval: whatever is dispatched below is dispatched by the claim path.
    start_reactor(spawn, *ROUTES, "--sweep-interval", "600")
    assert env.cli_json("pause", *ROUTES, "photo.thumb") == {
        "paused": ["photo.thumb"],
        "already_paused": [],
    }
    # Both types in one transaction: a drain that claims the one would claim the other too.
    with conn.transaction():
        insert(conn, "photo.thumb", "t", 30)
        insert(conn, "photo.process", "a", 30)
    wait_for(lambda: by_type(conn).get(("photo.process", "active")) == 30, what="process flows")
    # The other type keeps flowing, through notifications and polls, while thumbs wait.
    for batch in range(5):
        insert(conn, "photo.process", f"b{batch}-", 10)
        wait_for(
            lambda n=40 + 10 * batch: by_type(conn).get(("photo.process", "active")) == n,  # type: ignore[misc]
            what="process rows inserted after the pause",
        )
    # One sweep round (the same drain and rescue) skips the paused type too.
    assert env.cli_json("sweep", *ROUTES)["claimed"] == 0
    assert by_type(conn)[("photo.thumb", "pending")] == 30
    assert ("photo.thumb", "active") not in by_type(conn)

    # Resume while the reactor sleeps armed: the resume's notification wakes it.
    wait_for(lambda: armed_by(conn), what="the idle reactor arming its doorbell")
    resumed = time.monotonic()
    assert env.cli_json("resume", *ROUTES, "photo.thumb") == {
        "resumed": ["photo.thumb"],
        "not_paused": [],
    }
    wait_for(
        lambda: by_type(conn).get(("photo.thumb", "active")) == 30,
        timeout=5,
        interval=0.005,
        what="thumbs dispatched after the resume",
    )
    # Far sooner than the 600 s sweep: a notification, not a timer, dispatched them.
    assert time.monotonic() - resumed < 5


def test_a_pause_holds_for_a_running_reactor_and_across_reactors(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    first = start_reactor(spawn, *ROUTES, "--sweep-interval", "600", name="first")
    start_reactor(
        spawn, *ROUTES, "--doorbell", "poll-only", "--poll-interval", "0.05", name="second"
    )
    insert(conn, "photo.thumb", "before", 5)
    wait_for(lambda: by_type(conn).get(("photo.thumb", "active")) == 5, what="thumbs flow")
    # Paused with plain SQL, as another tool would: no reactor is told, yet none dispatches.
    conn.execute("INSERT INTO reactor_paused_types (type) VALUES ('photo.thumb')")
    insert(conn, "photo.thumb", "after", 20)
    insert(conn, "photo.process", "p", 20)
    wait_for(lambda: by_type(conn).get(("photo.process", "active")) == 20, what="process flows")
    # The poll-only reactor drains every 50 ms: give it many rounds to get it wrong.
    polls = 0

    def polled_enough() -> bool:
        nonlocal polls
        polls += 1
        assert by_type(conn)[("photo.thumb", "pending")] == 20
        return polls >= 40

    wait_for(polled_enough, interval=0.05, what="many polls with the type paused")
    assert first.proc.poll() is None
    conn.execute("DELETE FROM reactor_paused_types WHERE type = 'photo.thumb'")
    wait_for(lambda: by_type(conn).get(("photo.thumb", "active")) == 25, what="resumed by SQL")


def test_stale_rows_of_a_paused_type_are_not_rescued_until_it_resumes(env: Env) -> None:
    conn = env.connect()
    with conn.transaction():
        # Bypass the updated_at trigger: a row whose worker went silent long ago.
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
            " VALUES ('stale', 'photo.thumb', 'active', 1, now() - interval '1 hour')"
        )
    env.cli_json("pause", *ROUTES, "photo.thumb")
    result = env.cli_json("sweep", *ROUTES, "--stale-after", "60")
    assert (result["lost"], result["rescued"], result["rescue_failed"]) == (0, 0, 0)
    assert conn.execute("SELECT state, attempts FROM photo_jobs").fetchall() == [("active", 1)]
    env.cli_json("resume", *ROUTES, "photo.thumb")
    assert env.cli_json("sweep", *ROUTES, "--stale-after", "60")["lost"] == 1
    assert conn.execute("SELECT state, attempts FROM photo_jobs").fetchall() == [("active", 2)]


def test_pause_cli_checks_types_and_status_shows_them(env: Env) -> None:
    conn = env.connect()
    insert(conn, "photo.legacy", "x", 2)  # rows but no route: known
    for args, needle in (
        (("pause", "bad type!"), "bad type 'bad type!'"),
        (("pause", "photo.process", "x" * 129), "bad type"),
        (("pause", "photo.nosuch"), "unknown type 'photo.nosuch'"),
        (
            ("resume", "photo.nosuch"),
            "unknown type 'photo.nosuch': no route, no rows and not paused (nothing resumed)",
        ),
    ):
        result = run_cli(env, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # No type at all: click's usage error (exit 2).
    assert run_cli(env, "pause").returncode == 2
    assert conn.execute("SELECT count(*) FROM reactor_paused_types").fetchone() == (0,)

    # Routed (the default demo route), or only present in the table: both accepted.
    assert env.cli_json("pause", "photo.process", "photo.legacy") == {
        "paused": ["photo.process", "photo.legacy"],
        "already_paused": [],
    }
    assert env.cli_json("pause", "photo.legacy") == {
        "paused": [],
        "already_paused": ["photo.legacy"],
    }
    # A type routed in this command's configuration may be paused before its first row.
    assert env.cli_json("pause", "--route", "photo.new=reactor.demo.process_photo", "photo.new")[
        "paused"
    ] == ["photo.new"]
    status = env.cli_json("status", "--json")
    assert [p["type"] for p in status["paused_types"]] == [
        "photo.legacy",
        "photo.new",
        "photo.process",
    ]
    assert all("@" in p["paused_by"] for p in status["paused_types"])
    flags = {t["type"]: t["paused"] for t in status["types"]}
    assert flags == {"photo.legacy": True, "photo.new": True, "photo.process": True}
    text = run_cli(env, "status").stdout
    assert "PAUSED" in text.splitlines()[1]
    assert "paused: photo.new since " in text
    # Resuming a paused type that has no route and no row any more is still allowed.
    assert env.cli_json("resume", "photo.new", "photo.process") == {
        "resumed": ["photo.new", "photo.process"],
        "not_paused": [],
    }
    assert env.cli_json("resume", "photo.process") == {
        "resumed": [],
        "not_paused": ["photo.process"],
    }


def test_a_pause_time_no_datetime_holds_still_reads(env: Env) -> None:
    """A role that may write reactor_paused_types could set `paused_at` to 'infinity' or a
    year past 9999: `reactor status` failed on it ("timestamp too large") and the dashboard
    answered 503."""
    conn = env.connect()
    insert(conn, "photo.far", "f", 1)
    insert(conn, "photo.old", "o", 1)
    conn.execute(
        "INSERT INTO reactor_paused_types (type, paused_by, paused_at) VALUES"
        " ('photo.far', 'x', '294276-01-01'), ('photo.old', 'x', '4713-01-01 BC')"
    )
    status = env.cli_json("status", "--json")
    assert [(p["type"], p["paused_at"][:4]) for p in status["paused_types"]] == [
        ("photo.far", "9998"),
        ("photo.old", "0002"),
    ]
    text = run_cli(env, "status")
    assert text.returncode == 0, text.stderr
    assert "paused: photo.far since 9998-12-3" in text.stdout
