"""Passwords in the forms people and libraries write them are masked on every path an error
takes: the row's `last_error`, the worker's log, the traceback RQ stores with the job,
`reactor failures`, and the CLI's own one-line errors (a malformed DATABASE_URL, whose parse
error psycopg words with a piece of the password).

Each form is raised by a real handler run by a real worker; nothing is mocked."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from rq.job import Job

from reactor import submit
from reactor.jobs import job_id
from reactor.redact import redact
from tests.secret_handlers import FORMS, SECRET_HEAD, SECRET_TAIL
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process, start_worker
from tests.support.servers import free_port

ROUTE = "photo.process=tests.secret_handlers.leak"


def assert_no_secret(text: str, where: str) -> None:
    assert SECRET_TAIL not in text and SECRET_HEAD not in text, f"{where}: {text}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("env PGPASSWORD=s3cret PGHOST=db", "env PGPASSWORD=*** PGHOST=db"),
        ("REDIS_PASSWORD='a b' x", "REDIS_PASSWORD=*** x"),
        ('password="a b" x', "password=*** x"),
        ("user=app passwd=s3cret", "user=app passwd=***"),
        ("{'host': 'db', 'password': 's3cret'}", "{'host': 'db', 'password': '***'}"),
        ("{'password': \"it's\", 'x': 1}", "{'password': '***', 'x': 1}"),
        ('{"user": "app", "password": "s\\"3"}', '{"user": "app", "password": "***"}'),
        ("{'db_passwd': b'raw', 'port': 5432}", "{'db_passwd': '***', 'port': 5432}"),
        ("{'password': 12345}", "{'password': '***'}"),
        ('invalid percent-encoded token: "s3cret%zz"', 'invalid percent-encoded token: "***"'),
        (
            'unexpected spaces found in "s3 cret", use percent-encoded spaces (%20) instead',
            'unexpected spaces found in "***", use percent-encoded spaces (%20) instead',
        ),
        ('missing "=" after "s3cret" in connection info string', None),
        ('invalid connection option "cret"', 'invalid connection option "***"'),
        ("no password here: passwords are masked", "no password here: passwords are masked"),
        # Any case the patterns' IGNORECASE matches gets past the quick check before them.
        ("PaSsWoRd=s3cret x", "PaSsWoRd=*** x"),
        ("pa\u017f\u017fword=s3cret x", "pa\u017f\u017fword=*** x"),
        ("HTTPS://u:s3cret@host/x", "HTTPS://u:***@host/x"),
        (
            "Worker w1: photo-process: photo_2eprocess-t2-1",
            "Worker w1: photo-process: photo_2eprocess-t2-1",
        ),
    ],
)
def test_redact_forms(text: str, expected: str | None) -> None:
    masked = redact(text)
    if expected is None:
        assert "s3cret" not in masked, masked
    else:
        assert masked == expected


@pytest.mark.parametrize("worker", ["rq worker -w reactor.Worker", "reactor worker --simple"])
def test_each_form_is_masked_on_every_path(
    env: Env, spawn: Callable[..., Process], worker: str
) -> None:
    conn = env.connect()
    for photo_id in FORMS:
        submit(conn, photo_id, max_attempts=1)
    swept = env.cli_json("sweep", "--route", ROUTE)
    assert swept["enqueued"] == len(FORMS)
    routes = {"REACTOR_ROUTES": ROUTE}
    if worker.startswith("rq"):
        proc = start_worker(
            spawn, env, burst=True, extra_args=("--worker-class", "reactor.Worker"), **routes
        )
    else:
        proc = spawn(
            "-m", "reactor", "worker", "--simple", "--burst", name="worker", extra_env=routes
        )
    assert proc.proc.wait(timeout=120) == 0, proc.output()

    rows: dict[str, Any] = dict(
        conn.execute("SELECT photo_id, last_error FROM photo_jobs WHERE state = 'failed'")
    )
    assert sorted(rows) == sorted(FORMS)
    for photo_id, error in rows.items():
        assert_no_secret(error, f"last_error of {photo_id}")
        assert "***" in error, error
        result = Job.fetch(
            job_id("photo.process", photo_id, 1), connection=env.redis()
        ).latest_result()
        assert result is not None and result.exc_string
        assert_no_secret(result.exc_string, f"RQ's stored exception of {photo_id}")
    assert "***" in proc.output()
    assert_no_secret(proc.output(), "the worker's log")

    table = run_cli(env, "failures", "--limit", "50")
    as_json = run_cli(env, "failures", "--json")
    assert table.returncode == as_json.returncode == 0, table.stderr + as_json.stderr
    assert all(photo_id in table.stdout for photo_id in FORMS)
    assert_no_secret(table.stdout + table.stderr, "reactor failures")
    assert_no_secret(as_json.stdout + as_json.stderr, "reactor failures --json")


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app:{SECRET_HEAD}{SECRET_TAIL}%zz@127.0.0.1/app",
        f"postgresql://app:{SECRET_HEAD} {SECRET_TAIL}@127.0.0.1/app",
        f"host=127.0.0.1 password={SECRET_HEAD} {SECRET_TAIL}=x",
    ],
)
def test_a_malformed_database_url_shows_no_piece_of_its_password(env: Env, url: str) -> None:
    for command in (["status"], ["failures"], ["dashboard", "--port", "0"]):
        result = run_cli(env, *command, extra_env={"DATABASE_URL": url}, timeout=60)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "bad database URL" in result.stderr, result.stderr
        assert_no_secret(result.stdout + result.stderr, " ".join(command))
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_rows_written_unmasked_are_masked_when_shown(
    env: Env, spawn: Callable[..., Process]
) -> None:
    # As a release that did not know these forms wrote them.
    secret = SECRET_HEAD + SECRET_TAIL
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts, last_error)"
        " VALUES ('old', 'photo.process', 'failed', 1, 1, %s)",
        [f"RuntimeError: { ({'password': secret})!r} PGPASSWORD={secret}"],
    )
    for args in (["failures"], ["failures", "--json"]):
        shown = run_cli(env, *args)
        assert shown.returncode == 0 and "old" in shown.stdout, shown.stderr
        assert_no_secret(shown.stdout, " ".join(args))
    port = free_port()
    board = spawn("-m", "reactor", "dashboard", "--port", str(port), name="dashboard")
    board.wait_for_line("dashboard_serving")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/overview", timeout=30) as page:
        body = page.read().decode()
    assert "PGPASSWORD=***" in body
    assert_no_secret(body, "the dashboard")


def test_redaction_stays_linear_on_a_long_word() -> None:
    """Every error text passes through `redact` (a traceback always holds a `"`). The URL
    form's unbounded scheme made a 200,000-letter word cost a scan from each of its letters:
    a worker stuck in it for minutes, its heartbeats starved (10,000 letters 0.13 s, 40,000
    2.9 s before); now the whole text takes milliseconds. The bound here is far from both."""
    text = 'File "h.py", ValueError: ' + "A" * 200_000 + " postgresql://u:sekret@h/db"
    began = time.perf_counter()
    assert redact(text).endswith(" postgresql://u:***@h/db")
    assert time.perf_counter() - began < 2.0
