"""What `reactor status` and `/metrics` say about vacuum of `photo_jobs` (a snapshot held open
on another connection, named and growing; autovacuum turned off for the table; a role that
cannot see other roles' sessions, told so in one line), and the finished rows' counts of
`status`, the dashboard's page and `prune --dry-run` on a table of more rows than they read
(the planner's estimate, said so; exact on request), and `status` on a table of thousands of
types (named up to a bound, the rest summed). The dashboard's figures are checked with its other
figures, in tests/test_dashboard.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from reactor.ops.dashboard import Dashboard
from reactor.ops.status import MAX_OTHER_TYPES_NAMED, OTHER_TYPES, read_status
from reactor.pg import estimates, queries
from reactor.pg.estimates import EXACT_UP_TO, Count
from reactor.pg.history import count_history
from reactor.routes import parse_routes
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import metric, scrape
from tests.support.processes import Process, start_reactor
from tests.support.roles import as_role, throwaway_role
from tests.support.servers import free_port
from tests.support.vacuum import server_autovacuum_off
from tests.support.waiting import wait_for

HOLDER_APP = "horizon-holder"


@pytest.fixture
def held_snapshot(env: Env) -> Iterator[psycopg.Connection[Any]]:
    """A session idle in a REPEATABLE READ transaction that has read the table (so its
    snapshot exists and holds the horizon), as the test's own role."""
    conn = psycopg.connect(env.database_url, application_name=HOLDER_APP)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("SELECT count(*) FROM photo_jobs").fetchone()
    try:
        yield conn
    finally:
        conn.close()


def _offs(settings: list[str]) -> str:
    return ", ".join(f"{s} = off" for s in settings)


def _postgres(env: Env, *args: str) -> dict[str, Any]:
    found: dict[str, Any] = env.cli_json("status", "--json", *args)["postgres"]
    return found


def test_a_snapshot_held_open_is_named_and_ages_in_status_and_metrics(
    env: Env, spawn: Callable[..., Process], held_snapshot: psycopg.Connection[Any]
) -> None:
    pid = held_snapshot.info.backend_pid
    conn = env.connect()
    # Transactions after the snapshot, so that it holds the horizon back by some.
    for _ in range(3):
        conn.execute("SELECT pg_current_xact_id()")
    first = _postgres(env)
    holder = first["xmin_horizon_holder"]
    assert (holder["kind"], holder["name"]) == ("backend", str(pid)), first
    assert holder["state"] == "idle in transaction"
    assert holder["application_name"] == HOLDER_APP
    assert holder["database"] == env.database_name
    assert holder["age_xids"] >= 3
    assert first["hidden_sessions"] == 0
    assert first["xmin_horizon_age_seconds"] == pytest.approx(holder["age_seconds"], abs=0.01)
    wait_for(
        lambda: _postgres(env)["xmin_horizon_age_seconds"] > first["xmin_horizon_age_seconds"],
        what="the horizon's age growing",
    )
    text = run_cli(env, "status").stdout
    assert (
        f"xmin horizon held back by pid {pid} (idle in transaction, application"
        f" '{HOLDER_APP}', database {env.database_name}, role {conn.info.user}):" in text
    ), text

    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "1")

    def age() -> float:
        return metric(scrape(port), "reactor_xmin_horizon_age_seconds", 0)

    seen = wait_for(age, timeout=20, what="the horizon's age after a sweep")
    wait_for(lambda: age() > seen, timeout=20, what="the exported age growing")
    text = scrape(port)
    assert metric(text, 'reactor_xmin_horizon_age_xids{holder="backend"}') >= 3
    assert metric(text, 'reactor_xmin_horizon_age_xids{holder="replication_slot"}') == 0
    assert metric(text, "reactor_xmin_horizon_hidden_sessions") == 0

    # Its end lets the horizon go: the reactor's own transactions last milliseconds.
    held = age()
    held_snapshot.rollback()
    wait_for(lambda: age() < min(held, 1.0), timeout=20, what="the horizon released")
    assert (_postgres(env)["xmin_horizon_holder"] or {}).get("name") != str(pid)


def test_autovacuum_off_for_the_table_is_reported(env: Env, spawn: Callable[..., Process]) -> None:
    conn = env.connect()
    server_off = server_autovacuum_off(conn)
    on = 0 if server_off else 1  # what the gauge says while the table's own setting is on
    before = _postgres(env)
    assert before["autovacuum_enabled"] is not server_off and before["autovacuum_off"] == server_off
    shown = "; autovacuum on" if not server_off else f"AUTOVACUUM OFF ({_offs(server_off)})"
    assert shown in run_cli(env, "status").stdout
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "1")

    def enabled() -> float:
        return metric(scrape(port), "reactor_table_autovacuum_enabled", -1)

    wait_for(lambda: enabled() == on, timeout=20, what="autovacuum's state, exported")
    conn.execute("ALTER TABLE photo_jobs SET (autovacuum_enabled = off)")
    # Dead tuples, three in four, that nothing may remove while the snapshot is held.
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state) SELECT 'd' || i, 'photo.idle', 'done'"
        " FROM generate_series(1, 200) AS i"
    )
    conn.execute(
        "DELETE FROM photo_jobs WHERE photo_id IN (SELECT 'd' || i FROM generate_series(1, 150) i)"
    )
    after = _postgres(env)
    assert after["autovacuum_enabled"] is False
    assert after["autovacuum_off"] == [*server_off, "photo_jobs.autovacuum_enabled"]
    text = run_cli(env, "status").stdout
    expected = _offs([*server_off, "photo_jobs.autovacuum_enabled"])
    assert f"AUTOVACUUM OFF ({expected})" in text, text
    wait_for(lambda: enabled() == 0, timeout=20, what="autovacuum off, exported")

    def share() -> float:
        return float(_postgres(env)["dead_share"] or 0)

    wait_for(lambda: share() > 0.5, timeout=20, what="the dead tuples counted")
    wait_for(
        lambda: metric(scrape(port), "reactor_table_dead_tuple_ratio") > 0.5,
        timeout=20,
        what="the dead share exported",
    )
    conn.execute("ALTER TABLE photo_jobs RESET (autovacuum_enabled)")
    assert _postgres(env)["autovacuum_off"] == server_off
    wait_for(lambda: enabled() == on, timeout=20, what="the table's setting back, exported")


def test_a_listener_stuck_in_a_transaction_shows_as_the_notify_queue_filling(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """Any role that can connect may LISTEN and stay in one transaction while notifications
    pile up in the server's queue; full, every transaction that notifies fails at COMMIT (the
    producers' inserts too). `status` and `/metrics` say how full it is."""
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--sweep-interval", "1")
    assert _postgres(env)["notify_queue_usage"] == 0
    with psycopg.connect(env.database_url) as stuck, env.connect() as sender:
        stuck.execute("LISTEN some_channel")
        stuck.commit()
        stuck.execute("SELECT 1")  # in a transaction from now on: it reads nothing
        sender.execute(
            "SELECT pg_notify('some_channel', repeat('x', 7000) || i)"
            " FROM generate_series(1, 300) AS i"
        )
        usage = _postgres(env)["notify_queue_usage"]
        assert usage > 0
        wait_for(
            lambda: metric(scrape(port), "reactor_notify_queue_usage_ratio") > 0,
            timeout=20,
            what="the NOTIFY queue's use, exported",
        )


def test_a_role_without_pg_monitor_is_told_so_in_one_line(
    env: Env, held_snapshot: psycopg.Connection[Any]
) -> None:
    """Other roles' sessions show no state or start (and, on some server versions, no xmin)
    without pg_read_all_stats: `status` says the horizon is unknown and what to grant, in one
    line, and exits 0; with pg_monitor it names the holder and its age."""
    conn = env.connect()
    with throwaway_role(env) as role:
        database, grantee = sql.Identifier(env.database_name), sql.Identifier(role)
        for grant in (
            "GRANT CONNECT ON DATABASE {database} TO {grantee}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {grantee}",
        ):
            conn.execute(sql.SQL(grant).format(database=database, grantee=grantee))
        url = {"DATABASE_URL": as_role(env.database_url, role)}
        done = run_cli(env, "status", extra_env=url)
        assert done.returncode == 0, done.stderr
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("xmin horizon")]
        assert line.startswith("xmin horizon: unknown: ")
        assert f"(grant pg_monitor to {role})" in line
        hidden = run_cli(env, "status", "--json", extra_env=url)
        assert hidden.returncode == 0, hidden.stderr
        shown = json.loads(hidden.stdout)["postgres"]
        assert shown["hidden_sessions"] >= 1 and shown["role"] == role
        assert shown["xmin_horizon_age_seconds"] == 0  # no start seen: a lower bound
        conn.execute(sql.SQL("GRANT pg_monitor TO {}").format(grantee))
        seen = run_cli(env, "status", extra_env=url)
        assert seen.returncode == 0, seen.stderr
        assert (
            f"xmin horizon held back by pid {held_snapshot.info.backend_pid}"
            " (idle in transaction," in seen.stdout
        ), seen.stdout
        assert env.cli_json("status", "--json")["postgres"]["hidden_sessions"] == 0


@pytest.mark.slow  # a large table: 120,000 rows
def test_many_finished_rows_are_estimated_and_said_so(env: Env) -> None:
    """Past `EXACT_UP_TO` rows of a state, status and prune --dry-run give the planner's
    estimate and say so (`≈`, `estimated`); small states stay exact, and --exact counts all."""
    conn = env.connect()
    many = EXACT_UP_TO + 20_000
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
        " SELECT 'd' || i, 'photo.process', 'done', 1, now() - interval '30 days',"
        "        now() - interval '30 days' FROM generate_series(1, %s) AS i",
        [many],
    )
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error) VALUES"
        " ('f1', 'photo.process', 'failed', 5, 'boom'), ('p1', 'photo.process', 'pending', 0,"
        " NULL), ('p2', 'photo.thumb', 'pending', 0, NULL)"
    )
    conn.execute("ANALYZE photo_jobs")

    status = env.cli_json("status", "--json")
    by_type = {t["type"]: t for t in status["types"]}
    process = by_type["photo.process"]
    assert process["estimated"] == ["done"]
    assert process["counts"]["done"] == pytest.approx(many, rel=0.1)
    assert (process["counts"]["pending"], process["counts"]["failed"]) == (1, 1)
    assert by_type["photo.thumb"]["counts"]["pending"] == 1
    text = run_cli(env, "status").stdout
    assert "\N{ALMOST EQUAL TO} 1" in text and "planner's estimate" in text, text
    board = Dashboard(
        env.database_url,
        env.redis_url,
        parse_routes(["photo.process=reactor.demo.process_photo"]),
        stale_after_seconds=300,
    )
    try:
        html = board.html_page().body.decode()
    finally:
        board.close()
    cell = re.search(r'data-k="count:photo.process:done" title="([^"]*)">([^<]*)<', html)
    assert cell is not None, html
    assert cell.group(1).startswith("the planner's estimate: ")
    assert cell.group(2).startswith("\N{ALMOST EQUAL TO} 1") and cell.group(2).endswith("k")
    assert 'id="estimated"' in html
    assert 'data-k="count:photo.process:pending">1<' in html  # exact
    exact = {t["type"]: t for t in env.cli_json("status", "--json", "--exact")["types"]}
    assert exact["photo.process"]["counts"]["done"] == many
    assert exact["photo.process"]["estimated"] == []

    dry = env.cli_json("prune", "--done-older-than", "7d", "--failed-older-than", "1d", "--dry-run")
    assert dry["estimated"] == ["done"]
    assert dry["would_delete_done"] == pytest.approx(many, rel=0.1)
    assert dry["would_delete_failed"] == 0
    counted = env.cli_json("prune", "--done-older-than", "7d", "--dry-run", "--exact")
    assert (counted["would_delete_done"], counted["estimated"]) == (many, [])
    # Below the bound, the count is exact.
    few = env.cli_json("prune", "--done-older-than", "40d", "--dry-run")
    assert (few["would_delete_done"], few["estimated"]) == (0, [])


def test_a_count_the_planner_expects_large_reads_a_sample_and_stale_statistics_show(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the planner expects `TRUST_ESTIMATE_FROM` rows or more of a state or of the
    history, a count reads at most `SAMPLE_UP_TO` of them: reaching that takes the estimate,
    fewer is exact. So neither statistics left stale by a mass change nor a planner that takes
    a state and an age as independent can report rows that are not there. Shown with both
    bounds lowered."""
    conn = env.connect()
    plant = (
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
        " SELECT 'd' || i, 'photo.process', 'done', 1, now() - interval '30 days',"
        "        now() - interval '30 days' FROM generate_series(1, 3000) AS i"
    )
    conn.execute(plant)
    assert run_cli(env, "archive", "--older-than", "1d").returncode == 0  # into the history
    conn.execute(plant)
    assert conn.execute("SELECT count(*) FROM photo_jobs_history").fetchone() == (3000,)
    conn.execute("ANALYZE photo_jobs")
    conn.execute("ANALYZE photo_jobs_history")

    def counts(age_days: int = 7, exact: bool = False) -> tuple[Any, ...]:
        with conn.transaction():
            read = estimates.read_state_rows(conn, "done", exact=exact)
            found = estimates.counts_by_type(conn, read, ["photo.process"])
            done = (found.by_type, found.estimated)
            older = estimates.count_finished_older(conn, "done", age_days * 86400.0, exact=exact)
            history, _months = count_history(conn, exact=exact)
        return done, older, history

    # The default bounds: about 3,000 expected, under `TRUST_ESTIMATE_FROM`: counted exactly.
    assert counts() == (({"photo.process": 3000}, False), Count(3000), Count(3000))
    monkeypatch.setattr(estimates, "TRUST_ESTIMATE_FROM", 2_000)
    monkeypatch.setattr(estimates, "SAMPLE_UP_TO", 500)
    (by_type, guessed), older, history = counts()  # the reads stop at 500: estimates
    assert guessed and by_type["photo.process"] == pytest.approx(3000, rel=0.2), by_type
    assert older.estimated and older.rows == pytest.approx(3000, rel=0.2), older
    assert history.estimated and history.rows == pytest.approx(3000, rel=0.2), history
    # No done row is 40 days old: the sample finds none, whatever the planner guesses.
    assert counts(age_days=40)[1] == Count(0)
    # Every row deleted, the statistics not updated: the samples find none.
    conn.execute("DELETE FROM photo_jobs_history")
    conn.execute("DELETE FROM photo_jobs")
    expected = estimates.planner_rows(conn, queries.ESTIMATE_ROWS_OF_STATE, {"state": "done"})
    assert expected >= 2_000, "the statistics still expect the deleted rows"
    nothing: tuple[Any, ...] = (({}, False), Count(0), Count(0))
    assert counts() == nothing
    assert counts(exact=True) == nothing


def test_junk_types_are_summed_past_a_bound_and_routed_ones_always_named(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of types (an INSERT-only role can make them) cost `status` a bounded output
    and a bounded number of statements: the routed and paused types and the
    `MAX_OTHER_TYPES_NAMED` others with the most rows waiting are named, the rest summed in one
    `(other types)` entry that says how many it sums; so too when finished rows are estimated
    (one estimate per named or common type, not per type)."""
    conn = env.connect()
    junk = 3000
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) SELECT 'p', 'junk.' || i"
        " FROM generate_series(1, %s) AS i",
        [junk],
    )
    # Unrouted types with more rows waiting than any junk type: named first.
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) SELECT 'b' || i, 'busy.' || (i % 3)"
        " FROM generate_series(1, 30) AS i"
    )
    # A routed type without a row and a paused one with one row: named whatever else is there.
    conn.execute(
        "INSERT INTO reactor_routes (type, handler, queue, lock_key, registered_by)"
        " VALUES ('photo.routed', 'reactor.demo.process_photo', 'default', 1, 'x')"
    )
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('p', 'photo.paused')")
    conn.execute("INSERT INTO reactor_paused_types (type, paused_by) VALUES ('photo.paused', 'x')")
    named_junk = MAX_OTHER_TYPES_NAMED - 3  # after busy.0, busy.1, busy.2
    folded = junk - named_junk

    shown = run_cli(env, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout) < 20_000
    status = json.loads(shown.stdout)
    by_type = {t["type"]: t for t in status["types"]}
    assert len(by_type) == 2 + MAX_OTHER_TYPES_NAMED + 1
    assert by_type["photo.routed"]["routed"] and by_type["photo.paused"]["paused"]
    assert {f"busy.{i}" for i in range(3)} < set(by_type)
    assert status["types"][-1]["type"] == OTHER_TYPES
    other = by_type[OTHER_TYPES]
    assert other["counts"]["pending"] == folded and not other["routed"]
    assert other["oldest_due_age_seconds"] is not None
    assert (status["other_types"], status["other_unrouted_types"]) == (folded, folded)
    assert len(status["unrouted_types"]) == MAX_OTHER_TYPES_NAMED + 1  # and photo.paused
    assert sum(t["counts"]["pending"] for t in status["types"]) == junk + 30 + 1
    text = run_cli(env, "status").stdout
    assert len(text) < 6_000 and len(text.splitlines()) < MAX_OTHER_TYPES_NAMED + 12, text
    assert f"{folded} types not named" in text and f"{folded} more in {OTHER_TYPES}" in text

    # Finished rows of every type, more than a count reads: estimated, type by type only for
    # the types named and those the statistics list as common.
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " SELECT 'd' || i, 'junk.' || (i %% %s + 1), 'done', 1 FROM generate_series(1, %s) AS i",
        [junk, 2 * junk],
    )
    conn.execute("ANALYZE photo_jobs")
    monkeypatch.setattr(estimates, "EXACT_UP_TO", 1_000)
    asked: list[str] = []

    def planner_rows(conn: Any, explain: str, params: Any) -> int:
        asked.append(explain)
        return counted(conn, explain, params)

    counted = estimates.planner_rows
    monkeypatch.setattr(estimates, "planner_rows", planner_rows)
    with conn.transaction():
        found = read_status(conn, 300)
    assert len(found.types) == 2 + MAX_OTHER_TYPES_NAMED + 1
    assert found.types[-1].type == OTHER_TYPES and found.types[-1].estimated == ["done"]
    assert found.other_types == folded
    done = sum(t.counts["done"] for t in found.types)
    assert done == pytest.approx(2 * junk, rel=0.2), [(t.type, t.counts) for t in found.types]
    assert 0 < len(asked) < 300, len(asked)  # 3,000 and more: one per type
