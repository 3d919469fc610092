"""The CLI's errors and operator commands, as a user meets them: one line, the right exit code.

Every command runs as a real `python -m reactor` subprocess on real Postgres and Redis.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import psycopg
import pytest
from psycopg import sql

from reactor import submit
from reactor.errors import InvalidJobError
from reactor.routes import DEMO_ROUTE
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.roles import as_role, throwaway_role
from tests.support.rows import states
from tests.support.servers import free_port

UNREACHABLE = "postgresql://u:hunter2@127.0.0.1:1/x"


def error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line on stderr of a command that failed with `code`."""
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["p1", "--type", "photo process"], "invalid job type 'photo process'"),
        ([""], "invalid photo id ''"),
        (["p1", "--type", ""], "invalid job type ''"),
    ],
)
def test_submit_refuses_a_bad_type_or_photo_id(env: Env, args: list[str], message: str) -> None:
    line = error_line(run_cli(env, "submit", *args), 2)
    assert line.startswith(f"reactor: error: {message}"), line
    assert states(env.connect()) == {}


def test_submit_api_refuses_before_the_database(env: Env) -> None:
    conn = env.connect()
    conn.close()  # a call that reached the database would fail on the closed connection
    with pytest.raises(InvalidJobError, match="invalid job type 'photo process'"):
        submit(conn, "p1", "photo process")
    with pytest.raises(InvalidJobError, match="invalid photo id ''"):
        submit(conn, "")
    with pytest.raises(InvalidJobError, match="NUL"):
        submit(conn, "p\x001")


@pytest.mark.parametrize(
    "args",
    [
        ["migrate"],
        ["status"],
        ["failures"],
        ["submit", "p1"],
        ["requeue", "p1"],
        ["prune", "--done-older-than", "7d"],
        ["run"],
        ["sweep"],
    ],
)
def test_an_unreachable_database_is_exit_2_for_every_command(env: Env, args: list[str]) -> None:
    line = error_line(run_cli(env, *args, extra_env={"DATABASE_URL": UNREACHABLE}), 2)
    assert line.startswith("reactor: error: cannot connect to Postgres"), line
    assert "hunter2" not in line


def test_a_sweep_that_could_not_enqueue_exits_1(env: Env) -> None:
    conn = env.connect()
    submit(conn, "p1")
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    result = run_cli(env, "sweep", extra_env={"REDIS_URL": nothing_there})
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["enqueue_failures"] == 1
    line = result.stderr.strip().splitlines()[-1]  # after the log's warnings
    assert line.startswith("reactor: error: 1 row could not be enqueued (no row changed): "), line
    assert "Connection refused" in line, line  # why, in the same line
    assert "reactor_started" not in result.stderr
    assert "Traceback" not in result.stderr
    assert "retry" not in result.stderr  # a one-shot sweep retries nothing
    assert states(conn) == {"pending": 1}


def test_sweep_help_lists_only_its_options(env: Env) -> None:
    text = run_cli(env, "sweep", "--help").stdout
    for used in ("--database-url", "--redis-url", "--route", "--batch-size", "--stale-after"):
        assert used in text
    for unused in ("--doorbell", "--sweep-interval", "--poll-interval", "--no-listen", "--metrics"):
        assert unused not in text, unused


def test_requeue_reports_the_ids_it_did_not_find(env: Env) -> None:
    conn = env.connect()
    conn.execute("INSERT INTO photo_jobs (photo_id, type, state) VALUES ('p1', 'a.b', 'failed')")
    result = run_cli(env, "requeue", "p1", "nope", "p1")
    assert json.loads(result.stdout) == {"requeued": 1, "not_found": ["nope"]}
    assert error_line(result, 1) == "reactor: error: no row for: nope"
    assert states(conn) == {"pending": 1}
    typed = run_cli(env, "requeue", "p1", "--type", "x.y")
    assert json.loads(typed.stdout) == {"requeued": 0, "not_found": ["p1"]}
    assert error_line(typed, 1) == "reactor: error: no row of type x.y for: p1"


def test_prune_durations_need_a_unit_and_a_dry_run_deletes_nothing(env: Env) -> None:
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, updated_at) VALUES"
        " ('d1', 'a.b', 'done', now() - interval '8 days'),"
        " ('d2', 'a.b', 'done', now() - interval '1 hour'),"
        " ('f1', 'a.b', 'failed', now() - interval '40 days')"
    )
    for args in (["--done-older-than", "7"], ["--failed-older-than", " 30 "]):
        bare = run_cli(env, "prune", *args)
        assert bare.returncode == 2, bare.stderr
        assert "give a number and a unit (s, m, h, d, w), e.g. 7d" in bare.stderr
        assert len(bare.stderr.strip().splitlines()) == 1, bare.stderr
    from_env = run_cli(env, "run", extra_env={"REACTOR_PRUNE_DONE_AFTER": "7"})
    assert from_env.returncode == 2, from_env.stderr
    assert "give a number and a unit" in from_env.stderr
    dry = run_cli(
        env, "prune", "--done-older-than", "7d", "--failed-older-than", "30d", "--dry-run"
    )
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {
        "would_delete_done": 1,
        "would_delete_failed": 1,
        "would_delete_cancelled": 0,
        "estimated": [],
    }
    assert states(conn) == {"done": 2, "failed": 1}
    done = run_cli(env, "prune", "--done-older-than", "7d")
    assert json.loads(done.stdout) == {
        "deleted_done": 1,
        "deleted_failed": 0,
        "deleted_cancelled": 0,
    }
    assert states(conn) == {"done": 1, "failed": 1}


def test_submit_refuses_blank_ids_and_reads_standard_input_for_a_dash(env: Env) -> None:
    conn = env.connect()
    for blank in ("   ", "\t"):
        result = run_cli(env, "submit", "ok", blank)
        assert result.returncode == 2, result.stderr
        assert "must not be blank" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert states(conn) == {}
    piped = run_cli(env, "submit", "first", "-", stdin="a b\r\n\nc\n")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout) == {"submitted": 3, "unchanged": 0}
    ids = [r[0] for r in conn.execute("SELECT photo_id FROM photo_jobs ORDER BY photo_id")]
    assert ids == ["a b", "c", "first"]


def test_prune_failed_rows_alone_and_neither_is_a_usage_error(env: Env) -> None:
    conn = env.connect()
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep updated_at as given
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, updated_at) VALUES "
            "('d1', 'a.b', 'done', now() - interval '2 hours'),"
            " ('f1', 'a.b', 'failed', now() - interval '2 hours'),"
            " ('f2', 'a.b', 'failed', now()), ('p1', 'a.b', 'pending', now())"
        )
    # Younger than an hour: a job of that row's life may still run, and a photo submitted
    # again would get a new row whose tokens (so job ids) start again at 1.
    young = run_cli(env, "prune", "--failed-older-than", "59m")
    assert young.returncode == 2 and "at least 1h" in young.stderr, young.stderr
    result = run_cli(env, "prune", "--failed-older-than", "1h")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "deleted_done": 0,
        "deleted_failed": 1,
        "deleted_cancelled": 0,
    }
    assert states(conn) == {"done": 1, "failed": 1, "pending": 1}
    neither = run_cli(env, "prune")
    assert neither.returncode == 2
    assert (
        "give --done-older-than, --failed-older-than and/or --cancelled-older-than"
        in neither.stderr
    )
    assert "Traceback" not in neither.stderr


def test_failures_shows_the_latest_failed_and_retried_rows(env: Env) -> None:
    conn: psycopg.Connection[Any] = env.connect()
    long_error = "RuntimeError: " + "x" * 200 + "\nsecond line"
    conn.execute(
        """
        INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts, last_error,
                                next_retry_at, updated_at)
        VALUES ('f1', 'photo.process', 'failed', 5, 5, %(long)s, now() - interval '2 h',
                now() - interval '1 h'),
               ('r1', 'photo.process', 'pending', 2, 5, 'OSError: disk full',
                now() + interval '1 h', now()),
               ('f2', 'other.type', 'failed', 1, 1, 'PermanentError: bad photo', NULL, now()),
               ('ok', 'photo.process', 'pending', 0, 5, NULL, NULL, now()),
               ('d1', 'photo.process', 'done', 1, 5, NULL, NULL, now())
        """,
        {"long": long_error},
    )
    # The touch trigger set updated_at to now(): put f1 back an hour, as inserted, and f2 a
    # minute (newest first is then r1, f2, f1, with no tie).
    conn.execute("ALTER TABLE photo_jobs DISABLE TRIGGER photo_jobs_touch_updated_at")
    conn.execute(
        "UPDATE photo_jobs SET updated_at = now() - interval '1 hour' WHERE photo_id = 'f1'"
    )
    conn.execute(
        "UPDATE photo_jobs SET updated_at = now() - interval '1 minute' WHERE photo_id = 'f2'"
    )
    conn.execute("ALTER TABLE photo_jobs ENABLE TRIGGER photo_jobs_touch_updated_at")

    table = run_cli(env, "failures", "--type", "photo.process")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert len(lines) == 3  # header, r1 (newest), f1
    assert "r1" in lines[1] and "pending" in lines[1] and "2/5" in lines[1]
    assert "OSError: disk full" in lines[1]
    assert "f1" in lines[2] and "failed" in lines[2] and "5/5" in lines[2]
    # One line, cut to fit around an ellipsis: the start and the end of the error show.
    assert lines[2].endswith("x\\nsecond line"), lines[2]
    assert "RuntimeError: xxx" in lines[2] and "x…x" in lines[2]

    data = json.loads(run_cli(env, "failures", "--json", "--limit", "2").stdout)["failures"]
    assert [(f["photo_id"], f["state"], f["attempt"]) for f in data] == [
        ("r1", "pending", 2),
        ("f2", "failed", 1),
    ]
    full = json.loads(run_cli(env, "failures", "--json").stdout)["failures"]
    assert [f["last_error"] for f in full if f["photo_id"] == "f1"] == [long_error]
    # A failed row keeps its last retry's time in the table; it is not shown as a retry.
    assert [f["next_retry_at"] for f in full if f["photo_id"] == "f1"] == [None]

    conn.execute("DELETE FROM photo_jobs WHERE last_error IS NOT NULL")
    assert run_cli(env, "failures").stdout.strip() == "no failed or retried rows"


def test_the_demo_route_is_only_used_where_named() -> None:
    # The test harness names it for its processes; the reactor never defaults to it.
    from reactor.routes import given_routes

    assert given_routes((), {}) == {}
    assert given_routes((), {"REACTOR_ROUTES": " "}) == {}
    assert list(given_routes((), {"REACTOR_ROUTES": DEMO_ROUTE})) == ["photo.process"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["requeue"], "give PHOTO_IDs or --failed (one of them) (see `reactor requeue --help`)"),
        (["prune"], "give --done-older-than, --failed-older-than and/or --cancelled-older-than"),
        (["status", "--log-level", "info"], "--log-level is a global option"),
        (["status", "--stale-after", "soon"], "Invalid value for '--stale-after'"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(env: Env, args: list[str], message: str) -> None:
    line = error_line(run_cli(env, *args), 2)
    assert line.startswith("reactor: error: ") and message in line, line


def test_a_producer_with_the_grants_readme_lists_can_submit(env: Env) -> None:
    with throwaway_role(env) as role:
        url = as_role(env.database_url, role)
        owner = env.connect()
        owner.execute(sql.SQL("GRANT INSERT ON photo_jobs TO {}").format(sql.Identifier(role)))
        line = error_line(run_cli(env, "submit", "p1", extra_env={"DATABASE_URL": url}), 2)
        assert "this role needs SELECT on reactor_migrations" in line, line
        owner.execute(
            sql.SQL(
                "GRANT SELECT ON reactor_migrations TO {0};"
                " GRANT SELECT, UPDATE ON photo_jobs TO {0}"
            ).format(sql.Identifier(role))
        )
        done = run_cli(env, "submit", "p1", "p2", extra_env={"DATABASE_URL": url})
        assert done.returncode == 0, done.stderr
        with psycopg.connect(url, autocommit=True) as producer:
            submit(producer, "p3")  # the API needs no more
        assert states(owner) == {"pending": 3}


@pytest.mark.parametrize(
    ("args", "extra_env"),
    [
        (["--doorbell", "plain"], {"REACTOR_NO_LISTEN": "1"}),
        (["--no-listen", "--doorbell", "adaptive"], {}),
        (["--no-listen"], {"REACTOR_DOORBELL": "plain"}),
    ],
)
def test_no_listen_with_another_doorbell_is_refused(
    env: Env, args: list[str], extra_env: dict[str, str]
) -> None:
    line = error_line(run_cli(env, "run", *args, extra_env=extra_env), 2)
    assert "--no-listen (REACTOR_NO_LISTEN) means --doorbell poll-only" in line, line


def _failed_rows(conn: psycopg.Connection[Any], *photo_ids: str) -> None:
    for photo_id in photo_ids:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES (%s, 'a.b', 'failed')",
            [photo_id],
        )


def _states_of(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return dict(conn.execute("SELECT photo_id, state FROM photo_jobs").fetchall())


def test_standard_input_is_split_at_line_feeds_only(env: Env) -> None:
    """Every other line break Python knows (U+2028, \\x85, \\x0b, \\x1c, a lone \\r) may be
    inside a photo id: only \\n ends a line, and one \\r before it (CRLF) is dropped."""
    conn = env.connect()
    inner = ["cat\u2028dog", "a\x85b", "c\x0bd", "e\x1cf", "g\rh", "i\u2029j"]
    _failed_rows(conn, "cat", "dog", "a", "b", "g", "h", *inner)
    piped = "\n".join(inner[:3]) + "\r\n\r\n" + "\n".join(inner[3:]) + "\n"
    result = run_cli(env, "requeue", "-", stdin=piped)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"requeued": 6, "not_found": []}
    assert _states_of(conn) == {
        **dict.fromkeys(["cat", "dog", "a", "b", "g", "h"], "failed"),
        **dict.fromkeys(inner, "pending"),
    }
    made = run_cli(env, "submit", "-", stdin="new\u2028one\r\nnew\x85two")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout) == {"submitted": 2, "unchanged": 0}
    assert {"new\u2028one", "new\x85two"} <= set(_states_of(conn))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["requeue", "--failed", "--type", "bad!!type"], "invalid job type 'bad!!type'"),
        (["requeue", "f1", "--type", "bad!!type"], "invalid job type 'bad!!type'"),
        (["cancel", "--pending", "--type", "bad!!type"], "invalid job type 'bad!!type'"),
        (["cancel", "p1", "--type", "bad\ntype"], "invalid job type 'bad\\ntype'"),
        (["requeue", "--failed", "--type", "no.such.type"], "unknown type 'no.such.type'"),
        (["cancel", "--pending", "--type", "no.such.type"], "unknown type 'no.such.type'"),
    ],
)
def test_requeue_and_cancel_refuse_a_malformed_or_unknown_type(
    env: Env, args: list[str], message: str
) -> None:
    conn = env.connect()
    _failed_rows(conn, "f1")
    conn.execute("INSERT INTO photo_jobs (photo_id, type, state) VALUES ('p1', 'a.b', 'pending')")
    line = error_line(run_cli(env, *args), 2)
    assert line.startswith(f"reactor: error: {message}"), line
    assert _states_of(conn) == {"f1": "failed", "p1": "pending"}


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["cancel", "--pending", "--type", "a.b"], "cancelled"),  # rows, none pending
        (["requeue", "--failed", "--type", "a.b"], "requeued"),  # rows, none failed
        (["cancel", "--pending", "--type", "photo.process"], "cancelled"),  # routed, no rows
        (["requeue", "--failed", "--type", "photo.process"], "requeued"),
    ],
)
def test_a_known_type_with_nothing_to_do_is_no_error(env: Env, args: list[str], key: str) -> None:
    conn = env.connect()
    conn.execute("INSERT INTO photo_jobs (photo_id, type, state) VALUES ('d1', 'a.b', 'done')")
    result = run_cli(env, *args)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[key] == 0


def test_error_lines_show_each_id_escaped_on_one_line(env: Env) -> None:
    forged = "nope\nreactor: requeued 5 rows OK"
    odd = ["x\u2028y", "\x1b[2Jz", "w\x85v", "  "]
    result = run_cli(env, "requeue", forged, *odd)
    assert json.loads(result.stdout) == {"requeued": 0, "not_found": [forged, *odd]}
    assert error_line(result, 1) == (
        "reactor: error: no row for: nope\\nreactor: requeued 5 rows OK, x\\u2028y, "
        "\\x1b[2Jz, w\\x85v, '  '"
    )
    cancelled = run_cli(env, "cancel", forged)
    assert error_line(cancelled, 1) == (
        "reactor: error: no row for: nope\\nreactor: requeued 5 rows OK"
    )


def test_blank_ids_of_rows_can_be_requeued_and_cancelled(env: Env) -> None:
    """The table holds any id but '' (a row may have come from SQL or an old release): a blank
    one is refused for a new row, never for naming a row that has it."""
    conn = env.connect()
    _failed_rows(conn, " ", "\t")
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state) VALUES ('\u200b', 'a.b', 'pending')"
    )
    requeued = run_cli(env, "requeue", " ", "-", stdin="\t\n")
    assert requeued.returncode == 0, requeued.stderr
    assert json.loads(requeued.stdout) == {"requeued": 2, "not_found": []}
    cancelled = run_cli(env, "cancel", "\u200b", "--type", "a.b")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["cancelled"] == 1
    assert _states_of(conn) == {" ": "pending", "\t": "pending", "\u200b": "cancelled"}
    assert "must not be blank" in error_line(run_cli(env, "submit", " "), 2)
    too_long = error_line(run_cli(env, "requeue", " " * 256), 2)
    assert "256 bytes long, the limit is 255" in too_long, too_long


def test_submit_warns_of_a_type_no_reactor_routes_and_keeps_the_rows(env: Env) -> None:
    conn = env.connect()
    assert run_cli(env, "sweep", "--route", "photo.process=tests.handlers.noop").returncode == 0
    typo = run_cli(env, "submit", "IMG_1", "--type", "photo.proces")
    assert typo.returncode == 0, typo.stderr
    assert json.loads(typo.stdout) == {"submitted": 1, "unchanged": 0}
    assert typo.stderr.strip() == (
        "reactor: warning: no reactor has recorded a route for type 'photo.proces' (routed: "
        "photo.process): its rows stay pending until one does"
    )
    routed = run_cli(env, "submit", "IMG_1", "--type", "photo.process")
    assert routed.returncode == 0 and routed.stderr == "", routed.stderr
    assert states(conn) == {"pending": 2}
