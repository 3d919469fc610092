"""Input that used to reach the driver is refused first, with the project's one-line errors
(`InvalidJobError`, exit 2), and submit()'s counts are true in psycopg's pipeline mode.
"""

from __future__ import annotations

import subprocess

import pytest

from reactor import submit, submit_many
from reactor.errors import InvalidJobError
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.rows import states


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_counts_are_true_inside_a_pipeline(env: Env) -> None:
    conn = env.connect(autocommit=False)
    with conn.transaction(), conn.pipeline():
        assert submit_many(conn, ["a", "b", "c"]) == 3
        assert submit(conn, "d") is True
        assert submit(conn, "a") is False
        assert submit_many(conn, ["a", "e"]) == 1
    assert states(conn) == {"pending": 5}


@pytest.mark.parametrize(
    ("photo_id", "max_attempts", "message"),
    [
        ("p1", 2**31, "max_attempts must be an integer from 1 to 1,000,000"),
        ("p1", 1_000_001, "max_attempts must be an integer from 1 to 1,000,000"),
        ("a\udc80", None, "not valid Unicode text"),
        ("\u200b", None, "must not be blank"),
        ("\u2060\ufeff ", None, "must not be blank"),
        ("\u3000", None, "must not be blank"),
    ],
)
def test_bad_input_is_refused_before_the_driver(
    env: Env, photo_id: str, max_attempts: int | None, message: str
) -> None:
    conn = env.connect()
    with pytest.raises(InvalidJobError, match=message):
        submit(conn, photo_id, max_attempts=max_attempts)
    assert states(conn) == {}


def test_the_commands_refuse_out_of_range_values_with_exit_2(env: Env) -> None:
    line = _one_line(run_cli(env, "submit", "--max-attempts", "3000000000", "p1"), 2)
    assert "--max-attempts" in line and "1000000" in line, line
    line = _one_line(run_cli(env, "prune", "--done-older-than", "1000000000w", "--dry-run"), 2)
    assert "at most 36500d" in line, line
    line = _one_line(run_cli(env, "submit", "-", stdin="ok\n\u200b\n"), 2)
    assert "must not be blank" in line, line
    assert states(env.connect()) == {}


def test_requeue_reads_ids_from_standard_input(env: Env) -> None:
    conn = env.connect()
    submit_many(conn, ["p1", "p2", "p3"])
    conn.execute("UPDATE photo_jobs SET state = 'failed', attempts = 1")
    done = run_cli(env, "requeue", "-", stdin="p1\n\np2\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"requeued": 2, "not_found": []}'
    found = dict(conn.execute("SELECT photo_id, state FROM photo_jobs").fetchall())
    assert found == {"p1": "pending", "p2": "pending", "p3": "failed"}
