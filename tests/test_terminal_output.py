"""What `reactor failures` and `reactor status` print for people reaches a terminal: control
characters from the table (a photo id, a `last_error`, who paused a type, a recorded route)
come out escaped (`\\x1b`, `\\n`, ...), never raw, so a row cannot retitle the operator's
window, hide lines or ring the bell. The real CLI runs in a subprocess."""

from __future__ import annotations

import json
import re

import psycopg
import pytest

from reactor.ops.failures import ERROR_COLUMN_CHARS
from tests.support.cli import run_cli
from tests.support.env import Env

OSC_TITLE = "\x1b]0;pwned\x07"  # sets the terminal's title
CLEAR = "\x1b[2J"  # erases the screen
EVIL_ID = f"img{OSC_TITLE}\r42"
EVIL_ERROR = f"RuntimeError: bad{OSC_TITLE}{CLEAR}\rall good\x07\nsecond line\x9b31m"
# Anything a terminal acts on: C0 controls but the newline that ends each printed line, DEL,
# C1 controls.
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def insert_row(conn: psycopg.Connection[object], photo_id: str, error: str) -> None:
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts, last_error)"
        " VALUES (%s, 'photo.process', 'failed', 1, 1, %s)",
        [photo_id, error],
    )


def test_failures_escape_control_characters(env: Env) -> None:
    conn = env.connect()
    insert_row(conn, EVIL_ID, EVIL_ERROR)
    result = run_cli(env, "failures")
    assert result.returncode == 0, result.stderr
    assert not RAW_CONTROL.search(result.stdout), repr(result.stdout)
    assert "img\\x1b]0;pwned\\x07\\r42" in result.stdout
    assert "RuntimeError: bad\\x1b]0;pwned\\x07" in result.stdout
    assert len(result.stdout.splitlines()) == 2  # the header and one row, one line each
    # JSON carries the text as it is (JSON escapes control characters itself).
    data = json.loads(run_cli(env, "failures", "--json").stdout)
    assert data["failures"][0]["photo_id"] == EVIL_ID
    assert data["failures"][0]["last_error"] == EVIL_ERROR


def test_status_escapes_control_characters(env: Env) -> None:
    conn = env.connect()
    insert_row(conn, "p1", "x")
    conn.execute(
        "INSERT INTO reactor_paused_types (type, paused_by) VALUES ('photo.process', %s)",
        [f"ops{OSC_TITLE}{CLEAR}\r@host"],
    )
    conn.execute(
        "INSERT INTO reactor_routes (type, handler, queue, lock_key, registered_by)"
        " VALUES ('photo.process', %s, %s, 1, 'x')",
        [f"app.jobs.{CLEAR}run", f"q{OSC_TITLE}"],
    )
    result = run_cli(env, "status")
    assert result.returncode == 0, result.stderr
    assert not RAW_CONTROL.search(result.stdout), repr(result.stdout)
    assert "ops\\x1b]0;pwned\\x07\\x1b[2J\\r@host" in result.stdout
    assert "app.jobs.\\x1b[2Jrun" in result.stdout


def test_long_errors_keep_their_end_and_the_cut_says_how_many_more(env: Env) -> None:
    conn = env.connect()
    middle = "x" * (3 * ERROR_COLUMN_CHARS)
    insert_row(conn, "long", f"RuntimeError: start {middle} the useful end")
    for i in range(4):
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error, updated_at)"
            " VALUES (%s, 'photo.process', 'failed', 1, 'old', now() - interval '1 hour')",
            [f"old{i}"],
        )
    result = run_cli(env, "failures", "--limit", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "RuntimeError: start" in lines[1] and lines[1].endswith("the useful end")
    assert "…" in lines[1]
    assert lines[-1] == "… 3 more (--limit to show more)"
    data = json.loads(run_cli(env, "failures", "--limit", "2", "--json").stdout)
    assert len(data["failures"]) == 2 and data["more"] == 3


@pytest.mark.parametrize("limit", ["5", "50"])
def test_no_more_line_when_everything_is_shown(env: Env, limit: str) -> None:
    conn = env.connect()
    for i in range(5):
        insert_row(conn, f"p{i}", "boom")
    result = run_cli(env, "failures", "--limit", limit)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 6 and "more" not in result.stdout


def test_the_attempt_column_lines_up_whatever_the_state() -> None:
    from datetime import datetime, timezone

    from reactor.ops.failures import Failure, Failures, format_failures

    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = [
        Failure("photo.process", photo_id, state, 2, 5, "boom", when, None)
        for photo_id, state in (("a", "failed"), ("b", "cancelled"), ("c", "pending"))
    ]
    lines = format_failures(Failures(rows, 0)).splitlines()
    assert len({line.rindex("2/5") for line in lines[1:]}) == 1, lines
