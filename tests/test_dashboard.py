"""`reactor dashboard`: the page and the JSON endpoint over plain HTTP (every figure, markup
from the table escaped, 503 when Postgres is down, no password shown), read-only grants and
refused writes, the page's rendering in a real headless browser, and bad input.

The browser is Debian's `chromium`; the fixture installs it with apt-get when it is missing
and skips (saying why) only when that is impossible.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from psycopg import sql
from rq import Worker

from reactor.http_server import MAX_CLIENTS
from reactor.ops.dashboard import DATABASE_CONNECTIONS
from reactor.ops.status import MAX_OTHER_TYPES_NAMED, OTHER_TYPES
from reactor.pg.migrate import migrate
from tests.support.cli import run_cli
from tests.support.doorbell import armed_by
from tests.support.env import Env
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.roles import as_role, throwaway_role
from tests.support.servers import PostgresServer, RedisServer, free_port
from tests.support.sockets import listening_addresses
from tests.support.vacuum import server_autovacuum_off
from tests.support.waiting import wait_for

TITLE = "photo-reactor dashboard"
# Markup in a photo id and in a last_error: either would change the page if it ran or were
# parsed as HTML (a new title, an attribute on <body>, a new element).
EVIL_ID = "<script>document.body.setAttribute('data-pwned','1')</script>"
EVIL_ERROR = (
    "ValueError: <script>document.title='pwned'</script>"
    '<img src=x onerror="document.title=\'pwned-img\'"><b id="injected-b">bold</b> & more'
)
IDLE_ROUTE = "photo.idle=reactor.demo.process_photo@photo-idle"


# -- the browser ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of a Chromium binary, installed from Debian's packages when missing."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and apt-get cannot install it (not root/Debian)")
    for step in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        done = subprocess.run(
            step,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:
            pytest.skip(f"cannot install chromium: {' '.join(step)} failed: {done.stderr[-300:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium, but no chromium binary is on PATH")
    return found


def browse(chromium: str, url: str, tmp_path: Path, *extra: str) -> str:
    """Load `url` in headless Chromium (scripts allowed by the browser); its stdout."""
    result = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--window-size=1400,2200",
            *extra,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


class Page(HTMLParser):
    """The rendered DOM: texts of `data-k` elements, the title, every attribute seen."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.values: dict[str, list[str]] = {}
        self.title = ""
        self.attributes: list[tuple[str, str | None]] = []
        self.ids: list[str] = []
        self._open: list[tuple[str, str | None]] = []  # (tag, data-k)
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.attributes.extend(attrs)
        self.ids.extend(v for k, v in attrs if k == "id" and v)
        if tag in ("br", "img", "meta", "rect", "path", "circle", "line", "use"):
            return
        self._open.append((tag, dict(attrs).get("data-k")))
        key = self._open[-1][1]
        if key is not None:
            self.values.setdefault(key, []).append("")

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._open and self._open[-1][0] == "title" and not self.title:
            self.title = data
        for _, key in self._open:
            if key is not None:
                self.values[key][-1] += data

    def one(self, key: str) -> str:
        found = self.values.get(key)
        assert found and len(found) == 1, (key, found)
        return found[0].strip()


# -- the data ------------------------------------------------------------------------------


def seed(conn: psycopg.Connection[Any]) -> None:
    """Rows of several types and states, finished at several minutes of the last hour."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # keep updated_at as given
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error, next_retry_at,"
            " created_at, updated_at) VALUES"
            " ('due-1', 'photo.process', 'pending', 0, NULL, NULL, now() - interval '90 s', now()),"
            " ('due-2', 'photo.process', 'pending', 0, NULL, NULL, now() - interval '30 s', now()),"
            " ('later', 'photo.process', 'pending', 1, 'TimeoutError: slow', now() + interval '1 hour',"
            "  now() - interval '10 min', now() - interval '9 min'),"
            " ('busy', 'photo.process', 'active', 1, NULL, NULL, now(), now()),"
            " ('stale', 'photo.process', 'active', 2, NULL, NULL, now() - interval '2 h',"
            "  now() - interval '1 h'),"
            " ('thumb-1', 'photo.thumb', 'pending', 0, NULL, NULL, now() - interval '5 s', now()),"
            " ('thumb-2', 'photo.thumb', 'pending', 0, NULL, NULL, now() - interval '5 s', now()),"
            " (%s, 'photo.thumb', 'failed', 5, %s, NULL, now() - interval '1 h',"
            "  now() - interval '3 min'),"
            " ('old-fail', 'photo.process', 'failed', 5, 'RuntimeError: old', now() - interval '3 h',"
            "  now() - interval '3 h', now() - interval '2 h')",
            [EVIL_ID, EVIL_ERROR],
        )
        # Done rows spread over the last 40 minutes (1-3 attempts), and some older ones.
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
            " SELECT 'd' || i, CASE WHEN i % 3 = 0 THEN 'photo.thumb' ELSE 'photo.process' END,"
            "        'done', 1 + i % 3, now() - interval '2 h',"
            "        now() - make_interval(mins => i % 40, secs => i % 7)"
            "   FROM generate_series(1, 120) AS i"
        )
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, created_at, updated_at)"
            " SELECT 'old' || i, 'photo.process', 'done', 1, now() - interval '3 h',"
            "        now() - interval '2 h' FROM generate_series(1, 30) AS i"
        )
    conn.execute("INSERT INTO reactor_paused_types (type, paused_by) VALUES ('photo.thumb', 'ops')")


def table_counts(conn: psycopg.Connection[Any]) -> dict[tuple[str, str], int]:
    return {
        (t, s): int(n)
        for t, s, n in conn.execute("SELECT type, state, count(*) FROM photo_jobs GROUP BY 1, 2")
    }


def finished_last_hour(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
    """(done rows, failed rows, their attempts) charted: finished in the last 60 minutes."""
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'failed'),"
        "       coalesce(sum(attempts), 0)"
        "  FROM photo_jobs WHERE state IN ('done', 'failed')"
        "   AND updated_at >= date_trunc('minute', now()) - interval '59 minutes'"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def start_dashboard(
    spawn: Callable[..., Process],
    *args: str,
    database_url: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[Process, str]:
    port = free_port()
    extra = dict(extra_env or {})
    if database_url is not None:
        extra["DATABASE_URL"] = database_url
    proc = spawn(
        "-m",
        "reactor",
        "dashboard",
        "--port",
        str(port),
        *args,
        name="dashboard",
        extra_env=extra,
    )
    proc.wait_for_line("dashboard_serving")
    return proc, f"http://127.0.0.1:{port}"


def get(url: str) -> tuple[int, str, dict[str, str]]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


# -- tests ---------------------------------------------------------------------------------


def serve_seeded(env: Env, spawn: Callable[..., Process]) -> tuple[psycopg.Connection[Any], str]:
    """The seeded table, a reactor (routed to a type without rows: it leaves the seeded rows
    alone), an RQ worker and a dashboard; the connection and the dashboard's base URL."""
    conn = env.connect()
    seed(conn)
    start_reactor(spawn, "--route", IDLE_ROUTE)
    wait_for(lambda: armed_by(conn), what="the reactor arming its doorbell")
    start_worker(spawn, env, "photo-idle")
    wait_for(lambda: Worker.all(connection=env.redis()), what="the RQ worker registering")
    _, base = start_dashboard(spawn, "--route", IDLE_ROUTE)
    return conn, base


def test_the_page_matches_the_table_and_escapes_its_markup(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """The HTML as served (plain HTTP, no browser: the page has no script, so what the server
    sends is the document): every figure, the charts, and markup from the table as text."""
    conn, base = serve_seeded(env, spawn)
    status, html, headers = get(base + "/")
    assert status == 200, html
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "script-src" not in headers["Content-Security-Policy"]
    assert headers["Content-Security-Policy"].startswith("default-src 'none';")
    page = Page(html)

    # Numbers: every (type, state) cell equals the table, and so do the totals.
    counts = table_counts(conn)
    types = sorted({t for t, _ in counts} | {"photo.idle"})
    for job_type in types:
        for state in ("pending", "active", "done", "failed"):
            shown = page.one(f"count:{job_type}:{state}")
            assert shown == str(counts.get((job_type, state), 0)), (job_type, state)
    for state in ("pending", "active", "done", "failed"):
        total = sum(n for (_, s), n in counts.items() if s == state)
        assert page.one(f"total:{state}") == str(total)
    assert page.one("stale:photo.process") == "1"
    assert page.one("stale:photo.thumb") == "0"
    assert page.one("autovacuum") == ("OFF" if server_autovacuum_off(conn) else "on")
    assert float(page.one("horizon-age").removesuffix(" s")) >= 0
    assert "estimated" not in page.ids  # every count exact on a small table
    oldest = float(page.one("oldest:photo.process").split()[0])
    assert 90 <= oldest < 200  # due-1 was due 90 s before the seeding
    assert page.one(
        "retry:photo.process"
    ).startswith(
        str(
            conn.execute(
                "SELECT min(next_retry_at)::text FROM photo_jobs WHERE photo_id = 'later'"
            ).fetchone()[0]  # type: ignore[index]
        )[:19]
    )
    assert page.one("paused:photo.thumb") == "photo.thumb"

    # Charts: three SVGs, whose bars add up to what the table holds for the last hour.
    charts = html.split("<svg")[1:]
    assert len(charts) == 3
    done, failed, attempts = finished_last_hour(conn)
    assert done > 0 and failed > 0
    bar_sums = [
        sum(int(v) for v in re.findall(r'<desc class="value">(\d+)</desc>', chart))
        for chart in charts
    ]
    assert bar_sums == [done, failed, attempts]
    assert "photo.thumb" in charts[0] and "photo.process" in charts[0]  # the legend

    # Failures: newest first, the markup escaped: read back as text, character for character,
    # and none of it an element or an attribute of the document.
    assert page.values["failure-error"][0] == EVIL_ERROR
    assert page.values["failure-photo"][0] == EVIL_ID
    assert "TimeoutError: slow" in page.values["failure-error"]
    assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=" in html and "&amp; more" in html
    assert "<script" not in html.lower() and "<img" not in html.lower()
    assert page.title == TITLE
    assert "injected-b" not in page.ids
    assert not any(name in ("data-pwned", "onerror") for name, _ in page.attributes)

    # Reactors and RQ.
    assert sorted(page.values["reactor-role"]) == ["listener", "work"]
    assert any("armed" in v for v in page.values["reactor-armed"])
    assert page.one("waiting:photo-idle") == "0"
    assert Worker.all(connection=env.redis())[0].name in page.one("workers:photo-idle")


@pytest.mark.slow
def test_the_page_in_a_browser_renders_and_runs_none_of_the_markup(
    env: Env, spawn: Callable[..., Process], chromium: str, tmp_path: Path
) -> None:
    """What only a browser shows (the figures and the escaping are checked over plain HTTP
    above): the page renders, and the DOM the browser built, scripts allowed by the browser,
    holds the table's markup as text, with nothing of it run."""
    conn, base = serve_seeded(env, spawn)
    screenshot = tmp_path / "dashboard.png"
    browse(chromium, base + "/", tmp_path, f"--screenshot={screenshot}")
    assert screenshot.stat().st_size > 20_000
    dom = browse(chromium, base + "/", tmp_path, "--dump-dom")
    page = Page(dom)
    assert page.title == TITLE
    assert page.one("total:pending") == str(
        sum(n for (_, s), n in table_counts(conn).items() if s == "pending")
    )
    assert len(dom.split("<svg")[1:]) == 3
    assert page.values["failure-error"][0] == EVIL_ERROR
    assert page.values["failure-photo"][0] == EVIL_ID
    assert "injected-b" not in page.ids
    assert not any(name in ("data-pwned", "onerror") for name, _ in page.attributes)


def test_the_json_endpoint_reports_the_table(env: Env, spawn: Callable[..., Process]) -> None:
    conn = env.connect()
    seed(conn)
    client = env.redis()
    client.rpush("rq:queue:photo-process", "job-a", "job-b")  # two jobs waiting
    # A session idle in a transaction whose snapshot holds the xmin horizon back.
    holder = psycopg.connect(env.database_url, application_name="horizon-holder")
    env.cleanups.append(holder.close)
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    holder.execute("SELECT count(*) FROM photo_jobs").fetchone()
    _, base = start_dashboard(spawn)
    status, body, headers = get(base + "/api/overview")
    assert status == 200, body
    assert headers["Content-Type"] == "application/json"
    data = json.loads(body)

    counts = table_counts(conn)
    shown = {(t["type"], state): n for t in data["types"] for state, n in t["counts"].items() if n}
    assert shown == counts
    by_type = {t["type"]: t for t in data["types"]}
    assert by_type["photo.process"]["stale_active"] == 1
    assert by_type["photo.thumb"]["paused"] is True
    assert by_type["photo.process"]["paused"] is False
    assert by_type["photo.thumb"]["routed"] is False
    assert [(p["type"], p["paused_by"]) for p in data["paused_types"]] == [("photo.thumb", "ops")]

    per_minute = data["finished_per_minute"]
    assert len(per_minute["minutes"]) == 60
    done, failed, attempts = finished_last_hour(conn)
    assert sum(sum(v) for v in per_minute["done"].values()) == done
    assert sum(sum(v) for v in per_minute["failed"].values()) == failed
    assert sum(per_minute["attempts"]) == attempts
    # Per minute and type, too: the newest minute of photo.thumb's done rows.
    expected = dict(
        conn.execute(
            "SELECT to_char(date_trunc('minute', updated_at) AT TIME ZONE 'UTC',"
            "               'YYYY-MM-DD\"T\"HH24:MI'), count(*)"
            "  FROM photo_jobs WHERE state = 'done' AND type = 'photo.thumb'"
            "   AND updated_at >= date_trunc('minute', now()) - interval '59 minutes'"
            " GROUP BY 1"
        ).fetchall()
    )
    thumbs = {
        minute[:16]: n
        for minute, n in zip(per_minute["minutes"], per_minute["done"]["photo.thumb"], strict=True)
        if n
    }
    assert thumbs == expected

    failures = data["failures"]
    assert [f["photo_id"] for f in failures] == [EVIL_ID, "later", "old-fail"]
    assert failures[0]["last_error"] == EVIL_ERROR
    assert (failures[0]["attempt"], failures[0]["max_attempts"]) == (5, 5)
    assert failures[1]["state"] == "pending" and failures[1]["next_retry_at"] is not None
    assert failures[2]["state"] == "failed" and failures[2]["next_retry_at"] is None
    assert data["reactors"] == []
    queues = {q["name"]: q for q in data["queues"]}
    assert queues["photo-process"]["waiting"] == 2
    assert queues["photo-process"]["workers"] == []
    assert data["redis_error"] is None

    vacuum = data["postgres"]
    held = vacuum["xmin_horizon_holder"]
    assert (held["name"], held["state"]) == (str(holder.info.backend_pid), "idle in transaction")
    assert held["application_name"] == "horizon-holder"
    assert vacuum["xmin_horizon_age_seconds"] == pytest.approx(held["age_seconds"], abs=0.01)
    assert vacuum["xmin_horizon_age_seconds"] > 0
    server_off = server_autovacuum_off(holder)
    assert (vacuum["hidden_sessions"], vacuum["autovacuum_enabled"]) == (0, not server_off)
    assert vacuum["autovacuum_off"] == server_off and vacuum["live_tuples"] >= 0


@pytest.fixture
def postgres_gone(spawn: Callable[..., Process]) -> str:
    """A dashboard whose Postgres (password-protected, a server of the test's own) answered
    once and then stopped; the dashboard's base URL."""
    server = PostgresServer(password="dash-secret-pw")
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            migrate(conn)
        _, base = start_dashboard(spawn, "--cache-seconds", "0", database_url=server.url)
        assert get(base + "/api/overview")[0] == 200
    finally:
        server.stop()
    return base


@pytest.mark.slow  # a fault test: a Postgres of its own, stopped
def test_503_with_the_reason_when_postgres_is_down(env: Env, postgres_gone: str) -> None:
    for path in ("/api/overview", "/"):
        status, body, _headers = get(postgres_gone + path)
        assert status == 503, body
        assert "dash-secret-pw" not in body and "postgresql://" not in body
        assert "postgres unavailable: cannot connect to Postgres" in body
    status, body, _ = get(postgres_gone + "/api/overview")
    assert list(json.loads(body)) == ["error"]
    status, html, _ = get(postgres_gone + "/")
    page = Page(html)
    assert page.title == TITLE
    assert page.one("error").startswith("postgres unavailable: cannot connect to Postgres")
    assert "count:" not in html  # no figures from an earlier read


@pytest.mark.slow  # a fault test: a Postgres of its own, stopped
def test_the_503_page_in_a_browser(
    env: Env, postgres_gone: str, chromium: str, tmp_path: Path
) -> None:
    page = Page(browse(chromium, postgres_gone + "/", tmp_path, "--dump-dom"))
    assert page.title == TITLE
    assert page.one("error").startswith("postgres unavailable: cannot connect to Postgres")


def test_redis_down_leaves_the_rest_of_the_page(env: Env, spawn: Callable[..., Process]) -> None:
    conn = env.connect()
    seed(conn)
    _, base = start_dashboard(spawn, "--redis-url", f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    status, body, _ = get(base + "/api/overview")
    assert status == 200
    data = json.loads(body)
    assert data["queues"] == [] and "refused" in data["redis_error"].lower()
    assert "hunter2" not in body
    assert sum(t["counts"]["done"] for t in data["types"]) == 150


def test_unrouted_types_past_the_bound_are_counted_on_the_page(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """Pending rows of more unrouted types than are named: the page names the busiest and says
    how many more are summed in `(other types)`, as `reactor status` does."""
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) SELECT 'p', 'junk.' || i"
        " FROM generate_series(1, %s) AS i",
        [MAX_OTHER_TYPES_NAMED + 10],
    )
    _, base = start_dashboard(spawn)
    status, html, _ = get(base + "/")
    assert status == 200, html
    shown = Page(html).one("unrouted")
    assert shown.endswith(f", 10 more in {OTHER_TYPES}"), shown
    assert len(shown.split(", ")) == MAX_OTHER_TYPES_NAMED + 1
    assert json.loads(get(base + "/api/overview")[1])["other_unrouted_types"] == 10


def test_bad_rq_keys_are_named_and_leave_the_page_whole(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """Worker keys RQ's `Worker.all` cannot read (it raised, and the page went unanswered),
    keys of the wrong type and a queue that is not a list: the page and its JSON are served,
    the readable workers listed, each key that cannot be read named (none written to)."""
    conn = env.connect()
    seed(conn)
    client = env.redis()
    start_worker(spawn, env, "photo-idle")
    [real] = wait_for(lambda: Worker.all(connection=client), what="the RQ worker registering")
    client.hset("rq:worker:evil", "pid", "junk")  # no state, no queues: listed nowhere
    client.set("rq:worker:wrongtype", "junk")
    client.hset(b"rq:worker:\xffname", mapping={"state": "idle", "queues": "photo-idle"})
    client.hset(
        "rq:worker:busy",
        mapping={"state": "busy", "queues": "photo-idle,,photo-odd", "pid": "x", "birth": "y"},
    )
    client.sadd("rq:worker:busy:executions", "job-1:e1", "job-0:gone")  # job-0's expired
    client.hset("rq:execution:job-1:e1", "created_at", "junk")
    client.hset("rq:worker:noexec", mapping={"state": "idle", "queues": "photo-idle"})
    client.set("rq:worker:noexec:executions", "junk")
    client.set("rq:queue:photo-odd", "junk")
    client.sadd(
        "rq:workers",
        "rq:worker:evil",
        "rq:worker:wrongtype",
        b"rq:worker:\xffname",
        "rq:worker:busy",
        "rq:worker:noexec",
        "rq:worker:expired",  # its key is gone: listed nowhere
        "not-a-worker",
    )
    planted = [b"rq:workers", b"rq:queue:photo-odd", b"rq:execution:job-1:e1"] + [
        b"rq:worker:" + name + suffix
        for name in (b"evil", b"wrongtype", b"\xffname", b"busy", b"noexec")
        for suffix in (b"", b":executions")
    ]
    before = {k: client.dump(k) for k in planted}
    _, base = start_dashboard(spawn, "--route", IDLE_ROUTE, "--cache-seconds", "0")

    status, body, _ = get(base + "/api/overview")
    assert status == 200, body
    data = json.loads(body)
    assert data["redis_error"] is None
    queues = {q["name"]: q for q in data["queues"]}
    workers: list[dict[str, Any]] = [
        {"name": "busy", "state": "busy", "current_job": "job-1"},
        {"name": real.name, "state": "idle", "current_job": None},
    ]
    assert queues["photo-idle"]["workers"] == sorted(workers, key=lambda w: str(w["name"]))
    assert (queues["photo-idle"]["waiting"], queues["photo-odd"]["waiting"]) == (0, None)
    wrong = "WRONGTYPE Operation against a key holding the wrong kind of value"
    assert sorted(data["unreadable"]) == [
        "not-a-worker: not an RQ worker's key",
        f"rq:queue:photo-odd: {wrong}",
        "rq:worker:\\xffname: the worker's name is not UTF-8",
        f"rq:worker:noexec: {wrong}",
        f"rq:worker:wrongtype: {wrong}",
    ]
    status, html, _ = get(base + "/")
    assert status == 200, html
    page = Page(html)
    assert page.one("waiting:photo-odd") == "unreadable"
    assert "busy (busy: job-1)" in page.one("workers:photo-idle")
    assert sorted(page.values["unreadable"]) == sorted(data["unreadable"])
    # Nothing written: RQ's own read would have removed the stale members of both sets.
    assert {k: client.dump(k) for k in planted} == before


def test_a_request_that_fails_unexpectedly_gets_a_500_of_one_line(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever fails while a page is built or an action runs, the client gets a 500 saying
    why in one line (no password, no URL), never a connection closed on it."""
    from reactor.ops.actions import Actions, Reply
    from reactor.ops.auth import load_credentials
    from reactor.ops.dashboard import Dashboard, serve_dashboard
    from reactor.ops.overview import Overview

    class Broken(Dashboard):
        def overview(self) -> Overview:
            raise ValueError("unexpected at postgresql://app:s3cret@db/app\nand more")

    class BrokenActions(Actions):
        def post(self, path: str, headers: Message, body: bytes | None, client: str) -> Reply:
            raise KeyError("boom")

    token = "t0ken-for-scripts-0123456789"
    credentials = load_credentials({"REACTOR_DASHBOARD_TOKEN": token})
    board = Broken(env.database_url, env.redis_url, {}, stale_after_seconds=300)
    acting = BrokenActions(env.database_url, env.redis_url, {}, credentials)

    def answer(base: str, path: str, body: bytes | None) -> str:
        sent = urllib.request.Request(base + path, body)
        sent.add_header("Authorization", f"Bearer {token}")
        sent.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(sent, timeout=30)
        text = failed.value.read().decode()
        assert failed.value.code == 500, (path, text)
        assert text.count("\n") == 1 and "s3cret" not in text, text
        return text

    try:
        for actions in (None, acting):
            server = serve_dashboard(board, "127.0.0.1", 0, actions=actions)
            base = f"http://127.0.0.1:{server.server_address[1]}"
            try:
                page = answer(base, "/", None)
                assert page.startswith("500 internal error: ValueError: unexpected at <url>")
                api = json.loads(answer(base, "/api/overview", None))
                assert api["error"].startswith("internal error: ValueError: unexpected at")
                if actions is not None:
                    assert "KeyError: 'boom'" in answer(base, "/api/pause", b"{}")
            finally:
                server.shutdown()
                server.server_close()
    finally:
        board.close()
    logged = [
        r.getMessage() for r in caplog.records if "dashboard_request_failed" in r.getMessage()
    ]
    assert len(logged) == 5 and not any("s3cret" in line for line in logged), logged


def request(base: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send `method path` with `body` to the dashboard at `base`; status and body."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_it_never_writes_and_runs_on_read_only_grants(
    env: Env, spawn: Callable[..., Process], private_redis: RedisServer
) -> None:
    """The dashboard is read-only: a role with CONNECT and SELECT only (README's grants) and a
    Redis user allowed read commands only serve the whole page, and every writing method is
    refused on every path, leaving the table and Redis as they were."""
    conn = env.connect()
    seed(conn)
    admin = redis.Redis.from_url(private_redis.url)
    env.cleanups.append(admin.close)
    admin.rpush("rq:queue:photo-process", "job-a", "job-b")
    admin.sadd("rq:queues", "rq:queue:photo-process")
    admin.acl_setuser(
        "dashboard",
        enabled=True,
        passwords=["+dash-redis-pw"],
        keys=["*"],
        commands=["-@all", "+@read", "+@connection"],
    )
    redis_url = f"redis://dashboard:dash-redis-pw@127.0.0.1:{private_redis.port}/0"
    with throwaway_role(env) as role:
        database, grantee = sql.Identifier(env.database_name), sql.Identifier(role)
        for grant in (
            "REVOKE CONNECT ON DATABASE {database} FROM PUBLIC",
            "GRANT CONNECT ON DATABASE {database} TO {grantee}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {grantee}",
        ):
            conn.execute(sql.SQL(grant).format(database=database, grantee=grantee))
        before = (table_dump(conn), redis_dump(admin))
        _, base = start_dashboard(
            spawn,
            "--cache-seconds",
            "0",
            database_url=as_role(env.database_url, role),
            extra_env={"REDIS_URL": redis_url},
        )
        status, body, _ = get(base + "/api/overview")
        assert status == 200, body
        data = json.loads(body)
        assert data["redis_error"] is None, data["redis_error"]
        assert {q["name"]: q["waiting"] for q in data["queues"]}["photo-process"] == 2
        shown = {(t["type"], s): n for t in data["types"] for s, n in t["counts"].items() if n}
        assert shown == table_counts(conn)
        # Without pg_monitor, other roles' snapshots are hidden (this test's own session is
        # one): said so, in one line, not a failure.
        assert data["postgres"]["hidden_sessions"] >= 1
        page_status, html, _ = get(base + "/")
        assert page_status == 200
        assert f"grant pg_monitor to {role}" in Page(html).one("horizon-holder")
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            for path in ("/", "/api/overview", "/api/pause", "/nothing"):
                code, answer = request(base, method, path, b'{"type": "photo.process"}')
                assert code in (405, 501), (method, path, code, answer)
                assert b"photo.process" not in answer, (method, path)
        assert get(base + "/api/overview")[0] == 200  # still serving
        assert (table_dump(conn), redis_dump(admin)) == before


def table_dump(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Every row of every table of the schema, in order."""
    dump: list[tuple[Any, ...]] = []
    for (table,) in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
    ).fetchall():
        rows = conn.execute(
            sql.SQL("SELECT * FROM {} ORDER BY 1, 2").format(sql.Identifier(table))
        ).fetchall()
        dump.append((table, *sorted(map(repr, rows))))
    return dump


def redis_dump(client: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key of the Redis database, with its serialized value."""
    return {key: client.dump(key) for key in client.scan_iter()}


def test_bad_input_is_one_line_and_exit_2(env: Env) -> None:
    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, "dashboard", *args, extra_env=extra)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run("--port", str(port))
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines() == [
        f"reactor: error: cannot serve the dashboard on 127.0.0.1:{port}: "
        "[Errno 98] Address already in use"
    ]
    secret_url = "postgresql://u:hunter2@127.0.0.1:5432/x?nosuchoption=1"
    bad_url = run(DATABASE_URL=secret_url)
    assert bad_url.returncode == 2
    assert len(bad_url.stderr.strip().splitlines()) == 1, bad_url.stderr
    assert "hunter2" not in bad_url.stderr and "postgresql://" not in bad_url.stderr
    bad_host = run("--host", "no.such.host.invalid")
    assert bad_host.returncode == 2 and len(bad_host.stderr.strip().splitlines()) == 1


# -- a shared host, a busy page -------------------------------------------------------------


def get_with_host(port: int, host_header: str | None, path: str = "/api/overview") -> int:
    """GET `path` from 127.0.0.1:`port` with the given Host header (None: no Host at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host_header is not None:
            conn.putheader("Host", host_header)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def dashboard_backends(conn: psycopg.Connection[Any], *, waiting: bool = False) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'photo-reactor dashboard'"
        " AND (NOT %s OR wait_event_type = 'Lock')",
        [waiting],
    ).fetchone()
    assert row is not None
    return int(row[0])


def threads_of(proc: Process) -> int:
    return len(os.listdir(f"/proc/{proc.proc.pid}/task"))


def test_foreign_host_headers_are_refused(env: Env, spawn: Callable[..., Process]) -> None:
    # Given in the environment, as a deployment would (a flag works the same).
    allowed = {"REACTOR_DASHBOARD_ALLOWED_HOSTS": "dash.internal,[fd00::7]"}
    _, base = start_dashboard(spawn, extra_env=allowed)
    port = int(base.rsplit(":", 1)[1])
    for host in (
        "localhost",
        f"localhost:{port}",
        "LOCALHOST.",
        f"127.0.0.1:{port}",
        f"[::1]:{port}",
        "dash.internal",
        "dash.internal:443",
        "[fd00::7]:80",
    ):
        assert get_with_host(port, host) == 200, host
    foreign: tuple[str | None, ...] = (
        "evil.example",
        f"evil.example:{port}",
        "127.0.0.1.evil.example",
        "localhost.evil.example",
        "dash.internal.evil.example",
        "127.0.0.2",
        "localhost:notaport",
        None,
    )
    for name in foreign:
        for path in ("/api/overview", "/", "/nothing"):
            assert get_with_host(port, name, path) == 421, (name, path)

    # The address it is bound to is allowed without being named (a wildcard is not a name).
    bound_port = free_port()
    spawn(
        "-m",
        "reactor",
        "dashboard",
        "--host",
        "127.0.0.2",
        "--port",
        str(bound_port),
        name="dashboard-127.0.0.2",
    ).wait_for_line("dashboard_serving")
    conn = http.client.HTTPConnection("127.0.0.2", bound_port, timeout=30)
    for host, expected in ((f"127.0.0.2:{bound_port}", 200), ("localhost", 200), ("x.y", 421)):
        conn.putrequest("GET", "/api/overview", skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        assert response.status == expected, host
        conn.close()

    bad = run_cli(env, "dashboard", "--allowed-host", "http://evil.example/")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "reactor: error: bad --allowed-host 'http://evil.example/': give a host name or an "
        "IP address, without scheme, port or path"
    ]


def test_it_binds_loopback_unless_told_otherwise(env: Env, spawn: Callable[..., Process]) -> None:
    """The kernel's view of its listening socket: 127.0.0.1 by default (connecting to
    127.0.0.1 cannot tell that from a wildcard bind), the --host address otherwise (another
    loopback address here: the reader tells them apart)."""
    proc, base = start_dashboard(spawn)
    port = int(base.rsplit(":", 1)[1])
    assert listening_addresses(proc.proc.pid) == {("127.0.0.1", port)}
    other_port = free_port()
    other = spawn(
        "-m",
        "reactor",
        "dashboard",
        "--host",
        "127.0.0.2",
        "--port",
        str(other_port),
        name="dashboard-127.0.0.2",
    )
    other.wait_for_line("dashboard_serving")
    assert listening_addresses(other.proc.pid) == {("127.0.0.2", other_port)}


def test_concurrent_requests_share_one_postgres_connection(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    seed(conn)
    # No cache: every request would read the database; the connection is the bound.
    proc, base = start_dashboard(spawn, extra_env={"REACTOR_DASHBOARD_CACHE_SECONDS": "0"})
    requests = 30
    idle_threads = threads_of(proc)
    seen = [0]
    sampling = threading.Event()

    def sample() -> None:
        with psycopg.connect(env.database_url, autocommit=True) as watcher:
            while not sampling.is_set():
                seen[0] = max(seen[0], dashboard_backends(watcher))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with env.connect(autocommit=False) as locker, ThreadPoolExecutor(requests) as pool:
            # Every read blocks on the table until the lock goes: the requests pile up.
            locker.execute("LOCK TABLE photo_jobs IN ACCESS EXCLUSIVE MODE")
            replies = [pool.submit(get, base + "/api/overview") for _ in range(requests)]
            wait_for(
                lambda: threads_of(proc) >= idle_threads + requests,
                timeout=30,
                what="every request in the dashboard",
            )
            wait_for(
                lambda: dashboard_backends(conn, waiting=True) >= 1,
                timeout=30,
                what="a read waiting on the lock",
            )
            wait_for(
                lambda: dashboard_backends(conn) == dashboard_backends(conn, waiting=True),
                timeout=30,
                what="every backend the dashboard opened waiting on the lock",
            )
            locker.rollback()
            answers = [reply.result(timeout=120) for reply in replies]
    finally:
        sampling.set()
        sampler.join()
    assert [status for status, _, _ in answers] == [200] * requests
    counts = table_counts(conn)
    for _, body, _ in answers:
        data = json.loads(body)
        shown = {(t["type"], s): n for t in data["types"] for s, n in t["counts"].items() if n}
        assert shown == counts
    assert 1 <= seen[0] <= DATABASE_CONNECTIONS, seen[0]
    assert dashboard_backends(conn) == DATABASE_CONNECTIONS  # kept for the next request


def test_one_read_serves_every_request_for_the_cache_interval(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    seed(conn)
    _, cached = start_dashboard(spawn, "--cache-seconds", "3600")
    _, uncached = start_dashboard(spawn, "--cache-seconds", "0")
    first = json.loads(get(cached + "/api/overview")[1])
    before = json.loads(get(uncached + "/api/overview")[1])
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('new-1', 'photo.process')")
    again = json.loads(get(cached + "/api/overview")[1])
    after = json.loads(get(uncached + "/api/overview")[1])

    def pending(data: dict[str, Any]) -> int:
        return sum(t["counts"]["pending"] for t in data["types"])

    assert again == first  # the same read, to the timestamp
    assert pending(after) == pending(before) + 1 == pending(first) + 1
    assert after["generated_at"] > before["generated_at"]
    assert pending(after) == sum(n for (_, s), n in table_counts(conn).items() if s == "pending")


def test_an_idle_client_is_dropped_after_the_timeout(
    env: Env, spawn: Callable[..., Process]
) -> None:
    timeout = 1.0
    _, base = start_dashboard(spawn, extra_env={"REACTOR_DASHBOARD_CLIENT_TIMEOUT": str(timeout)})
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as idle:
        idle.settimeout(timeout + 20)  # the deadline: the server closes it well before
        assert idle.recv(1) == b""  # EOF: the server closed it, having received nothing
    assert get(base + "/api/overview")[0] == 200


def test_a_client_beyond_the_limit_closes_the_oldest_idle_one(
    env: Env, spawn: Callable[..., Process]
) -> None:
    proc, base = start_dashboard(spawn, extra_env={"REACTOR_DASHBOARD_CLIENT_TIMEOUT": "120"})
    port = int(base.rsplit(":", 1)[1])
    idle_threads = threads_of(proc)
    extra = 10
    # Accepted in the order they connect (the listen queue is first in, first out).
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CLIENTS + extra)]
    try:
        for sock in sockets:
            sock.settimeout(0)

        def closed() -> list[int]:
            found = []
            for i, sock in enumerate(sockets):
                try:
                    if sock.recv(1) == b"":
                        found.append(i)
                except BlockingIOError:  # open, nothing to read
                    continue
                except ConnectionResetError:
                    found.append(i)
            return found

        wait_for(lambda: len(closed()) == extra, timeout=30, what="the oldest sockets closed")
        assert closed() == list(range(extra))
        wait_for(
            lambda: threads_of(proc) <= idle_threads + MAX_CLIENTS,
            timeout=30,
            what="the closed clients' threads gone",
        )
        # Every place is held by an idle client, and a new one is still served.
        assert get(base + "/api/overview")[0] == 200
    finally:
        for sock in sockets:
            sock.close()


def test_slow_clients_shut_no_one_out(env: Env, spawn: Callable[..., Process]) -> None:
    """More slow clients than slots, each sending a header line every 3 s (never silent for
    the 5 s client timeout): every other request is still answered, and each slow client is
    dropped once it has not sent a whole request within the timeout of connecting."""
    timeout = 5.0
    _, base = start_dashboard(spawn)
    port = int(base.rsplit(":", 1)[1])
    stop = threading.Event()
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CLIENTS + 1)]
    dropped: dict[int, bool] = {}

    def trickle() -> None:
        for sock in slow:
            sock.sendall(b"GET /api/overview HTTP/1.1\r\n")
        while not stop.wait(3.0):
            for i, sock in enumerate(slow):
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    dropped[i] = True

    started = threading.Thread(target=trickle, daemon=True)
    started.start()
    try:
        answered = 0
        for _ in range(20):  # about 2 s of requests while the slow ones hold on
            status, _body, _ = get(base + "/api/overview")
            assert status == 200
            answered += 1

        def all_dropped() -> bool:
            for i, sock in enumerate(slow):
                sock.settimeout(0)
                try:
                    if sock.recv(1024) == b"":
                        dropped[i] = True
                except BlockingIOError:
                    continue
                except OSError:
                    dropped[i] = True
            return len(dropped) == len(slow)

        wait_for(all_dropped, timeout=timeout + 10, what="the slow clients dropped")
        assert answered == 20
    finally:
        stop.set()
        started.join(timeout=10)
        for sock in slow:
            sock.close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """urllib must talk to 127.0.0.1 directly, whatever the environment's proxy settings."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield


def test_the_done_count_is_read_at_most_every_thirty_seconds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting `done` rows scans the table, the other figures are index reads: the dashboard
    keeps its done count for `DONE_COUNTS_SECONDS` while every other figure is read anew."""
    from reactor.ops import dashboard
    from reactor.routes import parse_routes

    conn = env.connect()
    board = dashboard.Dashboard(
        env.database_url,
        env.redis_url,
        parse_routes(["photo.process=reactor.demo.process_photo"]),
        stale_after_seconds=300,
    )

    def counts() -> dict[str, int]:
        (only,) = [t for t in board.overview().status.types if t.type == "photo.process"]
        return dict(only.counts)

    try:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES ('d1', 'photo.process', 'done')"
        )
        assert counts()["done"] == 1
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES"
            " ('d2', 'photo.process', 'done'), ('p1', 'photo.process', 'pending')"
        )
        assert (counts()["done"], counts()["pending"]) == (1, 1)
        monkeypatch.setattr(dashboard, "DONE_COUNTS_SECONDS", 0.0)
        assert counts()["done"] == 2
    finally:
        board.close()


def test_it_refuses_to_serve_beyond_loopback_without_a_credential_unless_told(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """Read-only and open on a wildcard address, anyone who can reach the port (sending `Host:
    localhost`) reads everything: it refuses to start, in one line naming what to set."""
    refused = run_cli(env, "dashboard", "--host", "0.0.0.0", "--port", str(free_port()), timeout=20)
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "refusing to serve the dashboard without a credential on 0.0.0.0" in line, line
    assert "REACTOR_DASHBOARD_READ_TOKEN" in line and "REACTOR_DASHBOARD_OPEN=1" in line, line
    # Told to serve it open: it does, and says so once.
    port = free_port()
    told = spawn(
        "-m", "reactor", "dashboard", "--host", "0.0.0.0", "--port", str(port),
        name="dashboard-open", extra_env={"REACTOR_DASHBOARD_OPEN": "1"},
    )  # fmt: skip
    told.wait_for_line("dashboard_serving")
    assert sum("dashboard_open_to_network" in line for line in told.lines) == 1, told.lines
    assert get_with_host(port, "localhost") == 200
    # Behind a credential it needs no such word.
    guarded = spawn(
        "-m", "reactor", "dashboard", "--actions", "--host", "0.0.0.0", "--port",
        str(free_port()), name="dashboard-guarded",
        extra_env={"REACTOR_DASHBOARD_READ_TOKEN": "read-only-t0ken-0123456789"},
    )  # fmt: skip
    guarded.wait_for_line("dashboard_serving")
    assert not any("dashboard_open_to_network" in line for line in guarded.lines)


def test_a_client_that_resets_its_connection_leaves_no_traceback(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A client gone mid-answer (a reset: SO_LINGER 0) is nothing to report: no traceback on
    stderr (which would bypass logging and break `--log-format json`)."""
    port = free_port()
    proc = spawn(
        "-m", "reactor", "--log-format", "json", "--log-level", "debug", "dashboard",
        "--port", str(port), name="dashboard",
    )  # fmt: skip
    proc.wait_for_line("dashboard_serving")
    base = f"http://127.0.0.1:{port}"
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.close()
    assert get(base + "/api/overview")[0] == 200
    # One debug line each (`http_client_gone`), and nothing else: no traceback.
    wait_for(
        lambda: sum("http_client_gone" in line for line in proc.lines) == 20,
        what="every reset connection handled",
    )
    assert all(line.startswith("{") for line in proc.lines), proc.output()
