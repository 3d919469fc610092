"""The history of finished rows (sql/0020, `reactor archive`, `reactor run --archive-after`),
against a real Postgres: finished rows move out of photo_jobs batch by batch into monthly
partitions of photo_jobs_history, whole months leave by a drop, an archived photo can be
requeued (its token going on) or submitted again, a role that may not create the partitions
moves nothing, and the migration takes no lock on photo_jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from reactor import submit
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import metric, scrape
from tests.support.paths import ROOT
from tests.support.processes import Process, start_reactor
from tests.support.roles import as_role, throwaway_role
from tests.support.servers import free_port
from tests.support.waiting import wait_for

TYPE = "photo.process"
COLUMNS = (
    "photo_id, type, state, attempts, max_attempts, prior_attempts, last_error, created_at,"
    " traceparent, tracestate"
)


def plant(conn: psycopg.Connection[Any], prefix: str, state: str, count: int, age: str) -> None:
    """`count` rows in `state` last updated `age` ago, with a token of 3 (prior 1 + 2)."""
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, prior_attempts, last_error,"
        " traceparent, created_at, updated_at)"
        " SELECT %s || i, %s, %s, 2, 1, 'boom ' || i,"
        " '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',"
        " now() - %s::interval - interval '1 minute', now() - %s::interval"
        " FROM generate_series(1, %s) AS i",
        [prefix, TYPE, state, age, age, count],
    )


def live(conn: psycopg.Connection[Any], prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM photo_jobs WHERE photo_id LIKE %s", [prefix + "%"]
    ).fetchone()
    return int(row[0]) if row else 0


def archived(conn: psycopg.Connection[Any], prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM photo_jobs_history WHERE photo_id LIKE %s", [prefix + "%"]
    ).fetchone()
    return int(row[0]) if row else 0


def partitions(conn: psycopg.Connection[Any]) -> list[str]:
    return [
        str(r[0])
        for r in conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'photo_jobs_history'::regclass ORDER BY 1"
        )
    ]


def month_of(conn: psycopg.Connection[Any], age: str) -> str:
    row = conn.execute(
        "SELECT 'photo_jobs_history_' || to_char((now() - %s::interval) AT TIME ZONE 'UTC',"
        " 'YYYY_MM')",
        [age],
    ).fetchone()
    assert row is not None
    return str(row[0])


def archive(env: Env, *args: str) -> dict[str, Any]:
    result = run_cli(env, "archive", *args)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def misplaced(conn: psycopg.Connection[Any]) -> int:
    """History rows outside their month's partition."""
    row = conn.execute(
        "SELECT count(*) FROM photo_jobs_history"
        " WHERE tableoid::regclass::text <> 'photo_jobs_history_'"
        " || to_char(finished_at AT TIME ZONE 'UTC', 'YYYY_MM')"
    ).fetchone()
    return int(row[0]) if row else -1


def test_archive_moves_old_finished_rows_whole_into_their_months(env: Env) -> None:
    conn = env.connect()
    plant(conn, "old-done-", "done", 1200, "40 days")
    plant(conn, "older-failed-", "failed", 30, "70 days")
    plant(conn, "old-cancelled-", "cancelled", 20, "40 days")
    plant(conn, "new-done-", "done", 10, "2 hours")
    plant(conn, "active-", "active", 5, "90 days")
    before = {
        tuple(r)
        for r in conn.execute(
            f"SELECT {COLUMNS}, updated_at FROM photo_jobs WHERE state <> 'active'"
            " AND updated_at < now() - interval '1 day'"
        )
    }

    dry = archive(env, "--older-than", "1d", "--dry-run")
    assert dry == {
        "would_move_done": 1200,
        "would_move_failed": 30,
        "would_move_cancelled": 20,
        "would_drop": [],
        "estimated": [],
    }, dry
    assert archived(conn, "") == 0 and partitions(conn) == []

    moved = archive(env, "--older-than", "1d")
    assert moved == {"moved_done": 1200, "moved_failed": 30, "moved_cancelled": 20, "dropped": []}
    # Each row is in exactly one table, whole: the history holds the rows as they were.
    after = {
        tuple(r) for r in conn.execute(f"SELECT {COLUMNS}, finished_at FROM photo_jobs_history")
    }
    assert after == before
    assert live(conn, "old-") == 0 and live(conn, "older-") == 0
    assert live(conn, "new-done-") == 10 and live(conn, "active-") == 5
    # A partition for each month holding rows, and for this month and the next; each row in
    # its own.
    names = partitions(conn)
    assert month_of(conn, "70 days") in names and month_of(conn, "40 days") in names
    assert month_of(conn, "-1 month") == names[-1]
    assert misplaced(conn) == 0
    # Status counts the history apart.
    status = run_cli(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    history = json.loads(status.stdout)["history"]
    assert history == {"rows": 1250, "estimated": False, "months": len(names)}, history


def test_old_months_leave_by_a_drop_and_the_rest_stay(env: Env) -> None:
    conn = env.connect()
    plant(conn, "ancient-", "done", 50, "400 days")
    plant(conn, "recent-", "done", 50, "10 days")
    plant(conn, "queued-", "pending", 5, "500 days")
    archive(env, "--older-than", "1d")
    old_month = month_of(conn, "400 days")
    assert old_month in partitions(conn)
    # Before any ANALYZE the statistics say 0; --exact counts the month's rows.
    exact = archive(env, "--drop-history-after", "180d", "--dry-run", "--exact")
    assert {"partition": old_month, "estimated_rows": 0, "rows": 50} in exact["would_drop"]
    conn.execute("ANALYZE photo_jobs_history")

    dry = archive(env, "--drop-history-after", "180d", "--dry-run")
    would = [m["partition"] for m in dry["would_drop"]]
    assert old_month in would and month_of(conn, "10 days") not in would, dry
    assert {"partition": old_month, "estimated_rows": 50} in dry["would_drop"], dry

    done = archive(env, "--drop-history-after", "180d")
    assert [m["partition"] for m in done["dropped"]] == would, done
    assert archived(conn, "ancient-") == 0 and archived(conn, "recent-") == 50
    assert old_month not in partitions(conn)
    assert live(conn, "queued-") == 5  # the queue table is not touched


def test_an_archived_photo_is_requeued_with_its_token_going_on(env: Env) -> None:
    conn = env.connect()
    plant(conn, "gone-", "failed", 3, "3 days")
    archive(env, "--older-than", "1d")
    assert live(conn, "gone-") == 0

    result = run_cli(env, "requeue", "gone-1", "gone-2", "never-was")
    assert result.returncode == 1
    assert result.stdout.strip() == '{"requeued": 2, "not_found": ["never-was"]}', result.stdout
    assert "no row for: never-was" in result.stderr
    rows = conn.execute(
        "SELECT photo_id, state, attempts, prior_attempts, last_error IS NULL FROM photo_jobs"
        " WHERE photo_id LIKE 'gone-%' ORDER BY 1"
    ).fetchall()
    assert rows == [("gone-1", "pending", 0, 3, True), ("gone-2", "pending", 0, 3, True)]
    assert archived(conn, "gone-") == 3  # the record of the archived life stays
    # Requeued again while the row is back: the row is re-armed, no second row is made.
    conn.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = 'gone-1'")
    again = run_cli(env, "requeue", "gone-1")
    assert again.returncode == 0 and '"requeued": 1' in again.stdout, again.stdout
    assert live(conn, "gone-1") == 1


def test_an_archived_photo_submitted_again_gets_a_new_row(env: Env) -> None:
    conn = env.connect()
    plant(conn, "again-", "done", 1, "3 days")
    archive(env, "--older-than", "1d")
    with conn.transaction():
        assert submit(conn, "again-1", TYPE) is True
    row = conn.execute(
        "SELECT state, attempts, prior_attempts FROM photo_jobs WHERE photo_id = 'again-1'"
    ).fetchone()
    assert row == ("pending", 0, 0)
    assert archived(conn, "again-") == 1


def test_a_role_that_may_not_create_the_partitions_moves_nothing(env: Env) -> None:
    conn = env.connect()
    plant(conn, "kept-", "done", 20, "3 days")
    with throwaway_role(env) as role:
        conn.execute(
            sql.SQL(
                "GRANT SELECT, DELETE ON photo_jobs TO {r};"
                " GRANT SELECT, INSERT ON photo_jobs_history TO {r};"
                " GRANT SELECT ON reactor_migrations TO {r};"
                " GRANT CREATE ON SCHEMA public TO {r}"
            ).format(r=sql.Identifier(role))
        )
        result = run_cli(
            env,
            "archive",
            "--older-than",
            "1d",
            extra_env={"DATABASE_URL": as_role(env.database_url, role)},
        )
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "must be owner" in lines[0], result.stderr
    assert live(conn, "kept-") == 20 and archived(conn, "kept-") == 0


def test_rows_of_any_age_cost_a_partition_each_and_a_year_bc_stays(env: Env) -> None:
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, created_at, updated_at) VALUES"
        " ('y1900', %(t)s, 'done', '1900-01-15 00:00Z', '1900-01-15 00:00Z'),"
        " ('y10', %(t)s, 'done', now() - interval '10 years', now() - interval '10 years'),"
        " ('bc', %(t)s, 'failed', '0044-03-15 00:00Z BC', '0044-03-15 00:00Z BC')",
        {"t": TYPE},
    )
    plant(conn, "recent-", "cancelled", 5, "3 days")
    moved = archive(env, "--older-than", "1d")
    assert moved == {"moved_done": 2, "moved_failed": 0, "moved_cancelled": 5, "dropped": []}
    names = partitions(conn)
    assert "photo_jobs_history_1900_01" in names and month_of(conn, "10 years") in names
    # The months holding rows, the cutoff's, this one and the next: not one per month since 1900.
    assert len(names) <= 6, names
    # No partition can be named for a year BC: its row stays, and a prune deletes it.
    assert live(conn, "bc") == 1 and archived(conn, "bc") == 0
    pruned = run_cli(env, "prune", "--failed-older-than", "1d")
    assert pruned.returncode == 0, pruned.stderr
    assert live(conn, "bc") == 0


def plant_months(conn: psycopg.Connection[Any], prefix: str, months: int) -> None:
    """`months` done rows, one a month (UTC) from January 1900 on (an INSERT-only role can)."""
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, created_at, updated_at)"
        " SELECT %s || i, %s, 'done', at, at FROM generate_series(0, %s - 1) AS i,"
        " LATERAL (SELECT timestamptz '1900-01-15 00:00Z' + make_interval(months => i)) AS m(at)",
        [prefix, TYPE, months],
    )


def test_rows_over_more_months_than_a_round_makes_are_archived_round_by_round(
    env: Env,
) -> None:
    """Rows in 300 months (more than the 120 a round makes partitions for) went nowhere: every
    batch of the oldest rows met a month without its partition, each run failed having moved 0
    rows, and the recent rows stayed behind them for good. Each run now moves the rows of the
    next 120 months and says how many are left; the third moves the rest, recent rows too."""
    conn = env.connect()
    plant_months(conn, "month-", 300)
    plant(conn, "recent-", "done", 50, "2 days")

    outcomes = [run_cli(env, "archive", "--older-than", "1h") for _ in range(3)]

    # The first two runs stop at the round's 120 months, saying so; the history grows by
    # at most that (and the months of the cutoff, of now and of the next) a run.
    for result, left in zip(outcomes[:2], (230, 110), strict=True):
        assert result.returncode == 1, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "archive stopped after 120 rows" in lines[0], lines[0]
        assert f"{left} rows left" in lines[0], lines[0]
    assert outcomes[2].returncode == 0, outcomes[2].stderr
    assert json.loads(outcomes[2].stdout)["moved_done"] == 110, outcomes[2].stdout
    assert live(conn, "month-") == 0 and archived(conn, "month-") == 300
    assert live(conn, "recent-") == 0 and archived(conn, "recent-") == 50
    names = partitions(conn)
    assert names[0] == "photo_jobs_history_1900_01" and "photo_jobs_history_1924_12" in names
    assert len(names) <= 300 + 3, len(names)
    assert misplaced(conn) == 0


def test_the_reactor_says_how_many_rows_a_round_left(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    plant_months(conn, "month-", 300)
    plant(conn, "recent-", "done", 50, "2 days")
    port = free_port()
    reactor = start_reactor(spawn, "--archive-after", "1h", "--metrics-port", str(port))
    reactor.wait_for_line("archive_deferred rows_left=230 ")
    reactor.wait_for_line("rows_archived done=120 ")
    assert archived(conn, "month-") == 120
    assert metric(scrape(port), 'reactor_archived_total{state="done"}') == 120
    assert metric(scrape(port), "reactor_archive_rows_left") == 230


def test_a_state_that_cannot_be_archived_holds_back_no_other(env: Env) -> None:
    conn = env.connect()
    plant(conn, "done-", "done", 30, "3 days")
    plant(conn, "failed-", "failed", 10, "3 days")
    plant(conn, "cancelled-", "cancelled", 20, "3 days")
    plant(conn, "ancient-", "done", 5, "800 days")
    archive(env, "--older-than", "400d")
    assert archived(conn, "ancient-") == 5
    # A user's trigger on the history refuses failed rows: their batch fails on a healthy
    # connection.
    conn.execute(
        "CREATE FUNCTION refuse_failed() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN IF NEW.state = 'failed' THEN RAISE EXCEPTION 'no failed rows here';"
        " END IF; RETURN NEW; END$$;"
        " CREATE TRIGGER refuse_failed BEFORE INSERT ON photo_jobs_history"
        " FOR EACH ROW EXECUTE FUNCTION refuse_failed()"
    )
    try:
        result = run_cli(env, "archive", "--older-than", "1d", "--drop-history-after", "365d")
    finally:
        conn.execute(
            "DROP TRIGGER refuse_failed ON photo_jobs_history; DROP FUNCTION refuse_failed()"
        )
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no failed rows here" in lines[0], result.stderr
    assert "(50 rows archived, 10 rows left)" in lines[0], result.stderr
    assert archived(conn, "done-") == 30 and archived(conn, "cancelled-") == 20
    assert live(conn, "failed-") == 10 and archived(conn, "failed-") == 0
    # The drop ran all the same.
    assert month_of(conn, "800 days") not in partitions(conn)


def test_the_reactor_archives_and_drops_on_its_own(env: Env, spawn: Callable[..., Process]) -> None:
    conn = env.connect()
    plant(conn, "aged-", "done", 700, "2 days")
    plant(conn, "aged-failed-", "failed", 40, "2 days")
    plant(conn, "ancient-", "done", 10, "800 days")
    plant(conn, "young-", "done", 10, "10 minutes")
    port = free_port()
    reactor = start_reactor(
        spawn,
        "--archive-after",
        "1d",
        "--drop-history-after",
        "365d",
        "--prune-batch-size",
        "200",
        "--metrics-port",
        str(port),
    )
    reactor.wait_for_line("rows_archived done=710 failed=40 cancelled=0")
    # Only months that held rows got a partition: the 800-day-old month is the one to drop.
    reactor.wait_for_line(f"history_dropped partitions={month_of(conn, '800 days')}")
    assert live(conn, "aged-") == 0 and live(conn, "young-") == 10
    assert archived(conn, "aged-") == 740 and archived(conn, "ancient-") == 0
    assert partitions(conn)[0] == month_of(conn, "2 days")
    text = scrape(port)
    assert metric(text, 'reactor_archived_total{state="done"}') == 710
    assert metric(text, 'reactor_archived_total{state="failed"}') == 40
    assert metric(text, "reactor_history_months_dropped_total") == 1


def test_archive_after_below_an_hour_or_with_prune_is_refused(env: Env) -> None:
    short = run_cli(env, "archive", "--older-than", "30m")
    assert short.returncode == 2 and "at least 1h" in short.stderr, short.stderr
    both = run_cli(env, "run", "--archive-after", "1d", "--prune-done-after", "7d")
    assert both.returncode == 2, both.stderr
    assert "--prune-done-after or --archive-after" in both.stderr, both.stderr


def test_the_migration_takes_no_lock_on_photo_jobs(empty_database: str) -> None:
    """0020 applied while another session holds photo_jobs in ACCESS EXCLUSIVE mode (which
    conflicts with every lock, a plain read's included) completes: nothing in it waits for a
    lock on the queue table, however big or busy."""
    url = empty_database
    migration = next((ROOT / "sql").glob("0020_*.sql"))
    for path in sorted((ROOT / "sql").glob("[0-9]*.sql")):
        if path == migration:
            break
        done = subprocess.run(
            ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(path)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, (path, done.stderr)
    holder = psycopg.connect(url)
    holder.execute("LOCK TABLE photo_jobs IN ACCESS EXCLUSIVE MODE")
    outcome: dict[str, subprocess.CompletedProcess[str]] = {}

    def apply() -> None:
        outcome["psql"] = subprocess.run(
            ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-1", "-q", "-d", url, "-f", str(migration)],
            capture_output=True,
            text=True,
            env={**os.environ, "PGOPTIONS": "-c lock_timeout=10s"},
        )

    applying = threading.Thread(target=apply)
    applying.start()
    try:
        wait_for(lambda: "psql" in outcome, timeout=30, what="0020 applied")
    finally:
        holder.rollback()
        holder.close()
        applying.join()
    assert outcome["psql"].returncode == 0, outcome["psql"].stderr
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT max(version) FROM reactor_migrations").fetchone() == (20,)


def test_a_requeued_archived_photo_goes_on_from_its_highest_token(env: Env) -> None:
    """Two archived lives of one photo, the later by its clock holding the lower token: the
    photo comes back with a token above both, so no job id of either life repeats."""
    conn = env.connect()
    for prior, age in ((5, "3 days"), (1, "2 days")):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, prior_attempts,"
            " created_at, updated_at) VALUES ('lives-1', %s, 'failed', 2, %s,"
            " now() - %s::interval - interval '1 minute', now() - %s::interval)",
            [TYPE, prior, age, age],
        )
        archive(env, "--older-than", "1d")
    assert archived(conn, "lives-") == 2

    assert run_cli(env, "requeue", "lives-1").returncode == 0
    row = conn.execute(
        "SELECT state, attempts, prior_attempts FROM photo_jobs WHERE photo_id = 'lives-1'"
    ).fetchone()
    assert row == ("pending", 0, 7)
