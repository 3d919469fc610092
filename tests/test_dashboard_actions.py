"""The dashboard's actions (`reactor dashboard --actions`): in a real browser (log in, requeue a
failed row and see it run; refused without a credential, with a read-only one and from a
foreign origin) and through the JSON API, with real Postgres, Redis, reactor and worker."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest

from reactor.http_server import BODY_BYTES_PER_SECOND, MAX_BODY_BYTES, MAX_CLIENTS
from reactor.ops.actions import LOCK_TIMEOUT_SECONDS
from reactor.ops.auth import hash_password
from tests.handlers import SCHEMA
from tests.support.browser import Browser
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.rows import states
from tests.support.servers import free_port
from tests.support.waiting import wait_for
from tests.test_dashboard import chromium  # noqa: F401 - the fixture

OK_ROUTE = "photo.process=tests.handlers.ok"
TOKEN = "t0ken-for-scripts-0123456789"
READ_TOKEN = "read-only-t0ken-0123456789"


@pytest.fixture
def conn(env: Env) -> psycopg.Connection[Any]:
    connection = env.connect()
    connection.execute(SCHEMA)
    return connection


def failed_rows(conn: psycopg.Connection[Any], *photo_ids: str) -> None:
    for photo_id in photo_ids:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error)"
            " VALUES (%s, 'photo.process', 'failed', 1, 'RuntimeError: boom')",
            [photo_id],
        )


def state_of(conn: psycopg.Connection[Any], photo_id: str) -> str:
    row = conn.execute("SELECT state FROM photo_jobs WHERE photo_id = %s", [photo_id]).fetchone()
    assert row is not None
    return str(row[0])


def start_actions_dashboard(spawn: Callable[..., Process], **extra_env: str) -> tuple[Process, str]:
    port = free_port()
    proc = spawn(
        "-m",
        "reactor",
        "dashboard",
        "--actions",
        "--port",
        str(port),
        "--cache-seconds",
        "0",
        "--route",
        OK_ROUTE,
        name="dashboard",
        extra_env=extra_env,
    )
    proc.wait_for_line("dashboard_serving")
    return proc, f"http://127.0.0.1:{port}"


def post(
    url: str, data: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    request = urllib.request.Request(url, body, method="POST", headers=headers or {})
    if not isinstance(data, bytes):
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def foreign_site() -> Iterator[Callable[[str], str]]:
    """A web server on another origin; `page(html)` serves `html` there and returns its URL."""
    pages: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def page(html: str) -> str:
        pages["/attack.html"] = html.encode()
        return f"http://127.0.0.1:{server.server_address[1]}/attack.html"

    yield page
    server.shutdown()
    server.server_close()


def test_in_a_browser_log_in_requeue_a_failed_row_and_see_it_run(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    chromium: str,  # noqa: F811 - the fixture
    tmp_path: Path,
    foreign_site: Callable[[str], str],
) -> None:
    failed_rows(conn, "p1", "p2")
    start_reactor(spawn, "--route", OK_ROUTE)
    worker = spawn("-m", "reactor", "worker", "--route", OK_ROUTE, "--simple", name="worker")
    worker.wait_for_line("Listening on")
    users = f"alice:{hash_password('alice-pw')},bob:{hash_password('bob-pw')}:read-only"
    dashboard, base = start_actions_dashboard(spawn, REACTOR_DASHBOARD_USERS=users)
    browsers: list[Browser] = []

    def browser(name: str, login: tuple[str, str] | None) -> Browser:
        opened = Browser(chromium, tmp_path / name, login)
        browsers.append(opened)
        return opened

    try:
        # No credential: the page itself is refused.
        anonymous = browser("anonymous", None)
        anonymous.goto(base + "/")
        assert "401" in anonymous.text()

        # alice logs in, sees p1's failure and requeues it: it runs, and is done.
        alice = browser("alice", ("alice", "alice-pw"))
        alice.goto(base + "/")
        assert "actions on, as alice" in alice.text()
        alice.click_and_wait('form[data-k="requeue:photo.process:p1"] button')
        assert "requeue photo.process: 1 row changed" in alice.text()
        wait_for(lambda: state_of(conn, "p1") == "done", timeout=30, what="p1 run to done")
        ran = conn.execute("SELECT outcome FROM handler_runs WHERE photo_id = 'p1'").fetchall()
        assert ran == [("ok",)]
        alice.goto(base + "/")
        assert not alice.evaluate(
            "!!document.querySelector('[data-k=\"requeue:photo.process:p1\"]')"
        )
        csrf = alice.evaluate("document.querySelector('input[name=csrf]').value")

        # A page of another origin posting alice's form, with her session's token: refused.
        attack = foreign_site(
            f'<form method="post" action="{base}/actions/requeue">'
            f'<input type="hidden" name="csrf" value="{csrf}">'
            '<input type="hidden" name="type" value="photo.process">'
            '<input type="hidden" name="photo_ids" value="p2"><button>win</button></form>'
        )
        alice.goto(attack)
        alice.click_and_wait("button")
        assert "cross-origin request refused" in alice.text()
        assert state_of(conn, "p2") == "failed"

        # bob may look but not act: no forms, and a POST of his is refused.
        bob = browser("bob", ("bob", "bob-pw"))
        bob.call("Page.setBypassCSP", {"enabled": True}, session=True)  # lets `fetch` run
        bob.goto(base + "/")
        assert "read-only, as bob" in bob.text()
        assert bob.evaluate("document.querySelectorAll('form.act').length") == 0
        status = bob.evaluate(
            "fetch('/actions/requeue', {method: 'POST', headers: {'Content-Type':"
            " 'application/x-www-form-urlencoded'}, body: 'type=photo.process&photo_ids=p2'})"
            ".then(r => r.status)"
        )
        assert status == 403
        assert state_of(conn, "p2") == "failed"

        # A bulk action asks first: requeue every failed row of the type, confirmed.
        alice.goto(base + "/")
        alice.click_and_wait('form[data-k="requeue:photo.process:failed"] button')
        assert "requeue every failed row of type photo.process?" in alice.text()
        assert state_of(conn, "p2") == "failed"
        alice.click_and_wait("#confirm")
        assert "requeue photo.process: 1 row changed" in alice.text()
        wait_for(lambda: state_of(conn, "p2") == "done", timeout=30, what="p2 run to done")
    finally:
        for opened in browsers:
            opened.close()
    # Two actions were taken, each logged with who, what and how many rows; the refusals too.
    logged = [line for line in dashboard.lines if "dashboard_action " in line]
    assert len(logged) == 2, logged
    assert "user=alice action=requeue type=photo.process photo_ids=1 bulk=-" in logged[0]
    assert "user=alice action=requeue type=photo.process photo_ids=0 bulk=failed" in logged[1]
    assert all(line.endswith("rows=1") for line in logged)
    refusals = [line for line in dashboard.lines if "dashboard_action_refused" in line]
    assert any("status=403" in line and "user=bob" in line for line in refusals), refusals


def test_the_json_api_acts_only_with_a_credential_that_may(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    failed_rows(conn, "f1", "f2", "f3")
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('q1', 'photo.process')")
    dashboard, base = start_actions_dashboard(
        spawn, REACTOR_DASHBOARD_TOKEN=TOKEN, REACTOR_DASHBOARD_READ_TOKEN=READ_TOKEN
    )
    pause = {"type": "photo.process"}
    # Without a credential (or a wrong one): 401, page and API alike.
    for headers in ({}, bearer("wrong-token-0123456789")):
        code, answer, _ = post(base + "/api/pause", pause, headers)
        assert code == 401
        assert answer["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(base + "/", timeout=30)
    assert refused.value.code == 401
    read = urllib.request.Request(base + "/api/overview", headers=bearer(READ_TOKEN))
    with urllib.request.urlopen(read, timeout=30) as response:
        assert response.status == 200
    # A read-only credential: 403 on every action.
    for path in ("/api/pause", "/api/requeue", "/api/cancel", "/api/resume"):
        assert post(base + path, pause, bearer(READ_TOKEN))[0] == 403
    # A browser's cross-origin POST, a body that is not JSON, a bad type: refused.
    foreign = {**bearer(TOKEN), "Origin": "http://evil.example"}
    assert post(base + "/api/pause", pause, foreign)[0] == 403
    plain = {**bearer(TOKEN), "Content-Type": "text/plain"}
    assert post(base + "/api/pause", json.dumps(pause).encode(), plain)[0] == 415
    code, _, body = post(base + "/api/pause", {"type": "bad type!"}, bearer(TOKEN))
    assert (code, "bad type" in body) == (400, True)
    form = {**bearer(TOKEN), "Content-Type": "application/x-www-form-urlencoded"}
    code, _, body = post(base + "/actions/pause", b"type=photo.process", form)
    assert (code, "CSRF" in body) == (403, True)
    assert conn.execute("SELECT count(*) FROM reactor_paused_types").fetchone() == (0,)

    # The token may act: each action answers how many rows it changed.
    def act(path: str, data: dict[str, Any]) -> Any:
        code, _, body = post(base + path, data, bearer(TOKEN))
        assert code == 200, body
        return json.loads(body)["rows"]

    assert act("/api/pause", pause) == 1
    assert conn.execute("SELECT paused_by FROM reactor_paused_types").fetchone() == (
        "dashboard:token",
    )
    assert act("/api/resume", pause) == 1
    assert act("/api/requeue", {"type": "photo.process", "photo_ids": ["f1"]}) == 1
    assert act("/api/requeue", {"type": "photo.process", "state": "failed"}) == 2
    assert act("/api/cancel", {"type": "photo.process", "photo_ids": ["f1", "q1"]}) == 2
    assert act("/api/cancel", {"type": "photo.process", "state": "pending"}) == 2
    assert states(conn) == {"cancelled": 4}
    # Six actions, each logged once: the last line may still be on its way from the process.
    dashboard.wait_for_line("action=cancel type=photo.process photo_ids=0 bulk=pending")
    logged = [line for line in dashboard.lines if "dashboard_action " in line]
    assert len(logged) == 6, logged
    assert "bulk=pending rows=2" in logged[-1]


def test_actions_need_a_credential_and_hash_password_makes_one(env: Env) -> None:
    refused = run_cli(env, "dashboard", "--actions")
    assert refused.returncode == 2
    assert "--actions needs a credential" in refused.stderr
    short = run_cli(env, "dashboard", "--hash-password", stdin="s3cret\n")
    assert (short.returncode, short.stderr) == (
        2,
        "reactor: error: give a password of at least 8 characters\n",
    )
    made = run_cli(env, "dashboard", "--hash-password", stdin="s3cret-pw\n")
    assert made.returncode == 0, made.stderr
    hashed = made.stdout.strip()
    assert hashed.startswith("scrypt$") and "s3cret" not in hashed
    from reactor.ops.auth import Credentials, load_credentials

    found: Credentials = load_credentials({"REACTOR_DASHBOARD_USERS": f"carol:{hashed}"})
    good = base64.b64encode(b"carol:s3cret-pw").decode()
    bad = base64.b64encode(b"carol:wrong").decode()
    user = found.identify(f"Basic {good}")
    assert user is not None and (user.name, user.can_act) == ("carol", True)
    assert found.identify(f"Basic {bad}") is None
    broken = run_cli(
        env, "dashboard", "--actions", extra_env={"REACTOR_DASHBOARD_USERS": "carol:nothash"}
    )
    assert broken.returncode == 2
    assert "is not one `reactor dashboard --hash-password` prints" in broken.stderr


# -- a row's form names its row alone ----------------------------------------------------------

#: Photo ids a producer may write that hold line breaks of every kind `str.splitlines` knows
#: (a browser posts LF and CR as CRLF), separators, the form encoding's own characters, and a
#: blank one: each row's form must act on that row and on no other (`IMG_VICTIM`, `decoy`).
ODD_IDS = [
    "decoy\u2028IMG_VICTIM",
    "decoy-ps\u2029IMG_VICTIM",
    "decoy-lf\nIMG_VICTIM",
    "decoy-crlf\r\nIMG_VICTIM",
    "decoy-cr\rIMG_VICTIM",
    "decoy-nel\x85IMG_VICTIM",
    "decoy-vt\x0bIMG_VICTIM\x0c",
    "decoy-rs\x1eIMG_VICTIM\x1c",
    " IMG_VICTIM ",
    "IMG_VICTIM&photo_id=decoy",
    "100%25+IMG_VICTIM",
    "\u2028",
]
#: What is done to each odd row: cancel it (it is pending), then requeue it (cancelled).
CLICKS = [("cancel", "cancelled"), ("requeue", "pending")]
USERS = {"REACTOR_DASHBOARD_USERS": f"alice:{hash_password('alice-pw')}"}
ALICE = {"Authorization": "Basic " + base64.b64encode(b"alice:alice-pw").decode()}


def retried_rows(conn: psycopg.Connection[Any], photo_ids: list[str]) -> None:
    """Pending rows that failed once, due in an hour: each listed with its own cancel form;
    and `decoy` and `IMG_VICTIM`, pending, listed nowhere."""
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) VALUES ('decoy', 'photo.process'),"
        " ('IMG_VICTIM', 'photo.process')"
    )
    for photo_id in photo_ids:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, attempts, last_error, next_retry_at)"
            " VALUES (%s, 'photo.process', 1, 'RuntimeError: once', now() + interval '1 hour')",
            [photo_id],
        )


def states_by_photo(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return dict(conn.execute("SELECT photo_id, state FROM photo_jobs").fetchall())


class Forms(HTMLParser):
    """The action forms of a page as a browser reads them: the hidden fields of each, by its
    `data-k`, with every line break of a value as CRLF (what a browser posts)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: dict[str, list[tuple[str, str]]] = {}
        self._current: list[tuple[str, str]] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if tag == "form" and "data-k" in found:
            self._current = self.forms.setdefault(found["data-k"], [])
        elif tag == "input" and self._current is not None:
            value = re.sub(r"\r\n|\r|\n", "\r\n", found.get("value", ""))
            self._current.append((found["name"], value))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._current = None


def form_post(
    base: str, action: str, fields: list[tuple[str, str]], cookie: str
) -> tuple[int, str]:
    body = urllib.parse.urlencode(fields).encode()
    headers = {
        **ALICE,
        "Cookie": cookie,
        "Content-Type": "application/x-www-form-urlencoded",
        "Origin": base,
    }
    code, _, text = post(f"{base}/actions/{action}", body, headers)
    return code, text


def test_a_rows_form_posted_as_a_browser_posts_it_acts_on_that_row_alone(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    retried_rows(conn, ["decoy\u2028IMG_VICTIM"])
    _, base = start_actions_dashboard(spawn, **USERS)
    request = urllib.request.Request(base + "/", headers=ALICE)
    with urllib.request.urlopen(request, timeout=30) as response:
        cookie = response.headers["Set-Cookie"].split(";")[0]
        forms = Forms(response.read().decode())
    bulk = "cancel:photo.process:pending"
    [fields] = [f for k, f in forms.forms.items() if k.startswith("cancel:") and k != bulk]
    csrf = dict(fields)["csrf"]
    before = states_by_photo(conn)

    code, text = form_post(base, "cancel", fields, cookie)
    assert (code, text.count("cancel photo.process: 1 row changed")) == (200, 1), text
    assert states_by_photo(conn) == {**before, "decoy\u2028IMG_VICTIM": "cancelled"}

    # Forms that name anything but one row as the page writes it are refused, changing nothing.
    conn.execute("UPDATE photo_jobs SET state = 'pending' WHERE photo_id <> 'IMG_VICTIM'")
    before = states_by_photo(conn)
    common = [("csrf", csrf), ("type", "photo.process")]
    for refused in (
        [("photo_ids", "decoy\r\nIMG_VICTIM")],  # a list split on line breaks, once
        [("photo_id", "decoy"), ("photo_id", "IMG_VICTIM")],
        [("photo_id", "IMG_VICTIM"), ("state", "pending")],
        [("photo_id", "decoy\u2028IMG_VICTIM")],  # not encoded as the page encodes it
        [("photo_id", "IMG%5fVICTIM")],
        [("photo_id", "%FF")],
        [("photo_id", "%00")],
    ):
        code, text = form_post(base, "cancel", common + refused, cookie)
        assert code == 400, (refused, code, text)
    assert states_by_photo(conn) == before


def test_in_a_browser_each_rows_form_acts_on_that_row_alone(
    env: Env,
    conn: psycopg.Connection[Any],
    spawn: Callable[..., Process],
    chromium: str,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """Cancel each odd row with its own button, then requeue it with its own button: every
    id comes back from the browser exactly, and nothing else changes."""
    retried_rows(conn, ODD_IDS)
    _, base = start_actions_dashboard(spawn, **USERS)
    alice = Browser(chromium, tmp_path / "alice", ("alice", "alice-pw"))
    try:
        for photo_id, action, after in [(p, a, state) for p in ODD_IDS for a, state in CLICKS]:
            before = states_by_photo(conn)
            alice.goto(base + "/")
            # The row is found by its text as the page shows it (an HTML parser reads CR and
            # CRLF as LF), its button clicked as a person would.
            shown = photo_id.replace("\r\n", "\n").replace("\r", "\n")
            button = (
                "[...document.querySelectorAll('#failures tr')].find(tr =>"
                " tr.querySelector('[data-k=failure-photo]')?.textContent === "
                f"{json.dumps(shown)})?.querySelector('form.act button')"
            )
            assert alice.evaluate(f"{button}?.textContent") == action, (photo_id, action)
            alice.evaluate(f"{button}.setAttribute('data-clicked', '')")
            alice.click_and_wait("[data-clicked]")
            assert f"{action} photo.process: 1 row changed" in alice.text(), (photo_id, action)
            assert states_by_photo(conn) == {**before, photo_id: after}, (photo_id, action)
    finally:
        alice.close()
    assert states_by_photo(conn) == dict.fromkeys(["decoy", "IMG_VICTIM", *ODD_IDS], "pending")


# -- slow bodies and held locks ------------------------------------------------------------------


def post_head(path: str, length: int, headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{headers}\r\n"
    ).encode()


def slow_posts(port: int, headers: str, length: int = 4_000_000) -> list[socket.socket]:
    """`MAX_CLIENTS` connections that each send the head of a POST announcing a `length` body."""
    head = post_head("/api/cancel", length, headers)
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CLIENTS)]
    for sock in slow:
        sock.sendall(head)
    return slow


def trickling(slow: list[socket.socket], stop: threading.Event) -> threading.Thread:
    """Send each socket one byte of its body every 3 s (never silent for the 5 s timeout)."""

    def trickle() -> None:
        while not stop.wait(3.0):
            for sock in slow:
                with contextlib.suppress(OSError):  # the server has closed it
                    sock.sendall(b" ")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    return thread


class Answers:
    """What each socket received until the server closed it, gathered over several looks."""

    def __init__(self, slow: list[socket.socket]) -> None:
        self.slow = slow
        self.received = [b""] * len(slow)
        self.closed: set[int] = set()
        for sock in slow:
            sock.settimeout(0)

    def all_closed(self) -> bool:
        for i, sock in enumerate(self.slow):
            try:
                while i not in self.closed:
                    part = sock.recv(4096)
                    self.received[i] += part
                    if not part:
                        self.closed.add(i)
            except BlockingIOError:  # open, nothing (more) to read yet
                continue
            except OSError:  # reset: closed with our trickled bytes unread
                self.closed.add(i)
        return len(self.closed) == len(self.slow)


def authorized_get(base: str) -> int:
    request = urllib.request.Request(base + "/api/overview", headers=bearer(TOKEN))
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


def test_slow_bodies_without_a_credential_are_answered_from_their_headers(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A POST without a credential gets its 401 before any of its body is read: a crowd of
    them trickling 4 MB bodies holds no place, and an authenticated GET is answered."""
    _, base = start_actions_dashboard(spawn, REACTOR_DASHBOARD_TOKEN=TOKEN)
    stop = threading.Event()
    slow = slow_posts(int(base.rsplit(":", 1)[1]), "")
    thread = trickling(slow, stop)
    try:
        found = Answers(slow)
        wait_for(found.all_closed, timeout=10, what="every slow POST answered")
        statuses = {received.split(b"\r\n")[0] for received in found.received}
        assert statuses == {b"HTTP/1.0 401 Unauthorized"}, found.received
        assert authorized_get(base) == 200
    finally:
        stop.set()
        thread.join(timeout=10)
        for sock in slow:
            sock.close()


@pytest.mark.slow  # waits out deadlines of seconds
def test_slow_bodies_with_a_credential_get_408_at_their_deadline(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """An authenticated POST's body must arrive within the client timeout of connecting plus a
    second per 64 KiB, however it trickles, else it is answered 408; meanwhile those bodies
    still count as being sent, so an authenticated GET closes the oldest of them (unanswered)
    and is answered."""
    deadline = 5.0 + 65536 / BODY_BYTES_PER_SECOND
    _, base = start_actions_dashboard(spawn, REACTOR_DASHBOARD_TOKEN=TOKEN)
    stop = threading.Event()
    slow = slow_posts(int(base.rsplit(":", 1)[1]), f"Authorization: Bearer {TOKEN}\r\n", 65536)
    started = time.monotonic()
    thread = trickling(slow, stop)
    try:
        for _ in range(10):  # while every slow body is still within its time
            assert authorized_get(base) == 200
        found = Answers(slow)
        wait_for(found.all_closed, timeout=deadline + 10, what="the slow bodies cut")
        assert time.monotonic() - started < deadline + 10
        late = [r for r in found.received if r.startswith(b"HTTP/1.0 408 Request Timeout\r\n")]
        assert late and all(r == b"" for r in found.received if r not in late), found.received
        assert late[0].endswith(b"\r\n\r\n408 request timeout: the body did not arrive in time\n")
    finally:
        stop.set()
        thread.join(timeout=10)
        for sock in slow:
            sock.close()


def held_failed_row(env: Env, photo_id: str) -> psycopg.Connection[Any]:
    """A session (a producer's, say) holding `photo_id`'s row with FOR UPDATE, until rollback."""
    holder = env.connect(autocommit=False)
    holder.execute("SELECT 1 FROM photo_jobs WHERE photo_id = %s FOR UPDATE", [photo_id])
    return holder


def test_an_action_blocked_on_a_held_row_answers_409_and_blocks_no_other(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    failed_rows(conn, "A", "B")
    _, base = start_actions_dashboard(spawn, REACTOR_DASHBOARD_TOKEN=TOKEN)
    requeue = base + "/api/requeue"
    holder = held_failed_row(env, "A")
    blocked: dict[str, Any] = {}

    def requeue_a() -> None:
        began = time.monotonic()
        blocked["answer"] = post(
            requeue, {"type": "photo.process", "photo_ids": ["A"]}, bearer(TOKEN)
        )
        blocked["seconds"] = time.monotonic() - began

    thread = threading.Thread(target=requeue_a, daemon=True)
    try:
        thread.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND application_name = 'photo-reactor dashboard'"
        )
        wait_for(
            lambda: conn.execute(waiting).fetchone() == (1,),
            timeout=30,
            what="the requeue of A waiting for its row",
        )
        # Meanwhile, another row's action goes through.
        code, _, body = post(requeue, {"type": "photo.process", "photo_ids": ["B"]}, bearer(TOKEN))
        assert (code, json.loads(body)["rows"]) == (200, 1), body
        assert state_of(conn, "B") == "pending"
        assert "answer" not in blocked  # B went through while A still waited for its row
        thread.join(timeout=LOCK_TIMEOUT_SECONDS + 30)
        code, _, body = blocked["answer"]
        assert code == 409, body
        error = json.loads(body)["error"]
        assert "locked by another session" in error and "nothing was changed" in error, error
        assert blocked["seconds"] < LOCK_TIMEOUT_SECONDS + 5
        assert state_of(conn, "A") == "failed"
    finally:
        holder.rollback()
    code, _, body = post(requeue, {"type": "photo.process", "photo_ids": ["A"]}, bearer(TOKEN))
    assert (code, json.loads(body)["rows"]) == (200, 1), body
    assert state_of(conn, "A") == "pending"


def test_a_refused_post_gets_its_answer_whatever_its_body(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A POST refused on its headers gets its 401 or 403 whole, its 4 MB body unread: the body
    is drained before the connection closes (closed on unread bytes, the connection is reset,
    and the reset can destroy the answer before the client reads it)."""
    _, base = start_actions_dashboard(
        spawn, REACTOR_DASHBOARD_TOKEN=TOKEN, REACTOR_DASHBOARD_READ_TOKEN=READ_TOKEN
    )
    big = json.dumps({"type": "photo.process", "photo_ids": ["x" * 95] * 40_000}).encode()
    assert 3_900_000 < len(big) <= MAX_BODY_BYTES
    json_body = {"Content-Type": "application/json"}
    for _ in range(5):
        for headers, code in (({}, 401), (bearer(READ_TOKEN), 403)):
            got, _, body = post(base + "/api/cancel", big, {**json_body, **headers})
            assert (got, body.startswith(("401 unauthorized", '{"error": "403'))) == (code, True)


def steady_upload(port: int, head: bytes, body: bytes, every: float, pieces: int) -> bytes:
    """Send `head`, then `pieces` 16 KB pieces of `body`, one every `every` seconds (then
    nothing more); the answer, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        began = time.monotonic()
        for i in range(pieces):
            pause = began + i * every - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # the client's pace: the point of the test, not a wait
            sock.sendall(body[i * 16384 : (i + 1) * 16384])
        sock.settimeout(30)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while part := sock.recv(65536):
                answer += part
        return answer


@pytest.mark.slow  # waits out deadlines of seconds
def test_a_slow_steady_body_with_a_credential_is_read_and_a_stalled_one_gets_408(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """A credentialed body may take the client timeout plus a second per 64 KiB: 180 KB sent
    over 3 s with a 2 s timeout is read and acted on; one that stops halfway is answered
    408 once silent for the timeout, and nothing changes."""
    timeout = 2.0
    failed_rows(conn, "photo-00000001")
    _, base = start_actions_dashboard(
        spawn, REACTOR_DASHBOARD_TOKEN=TOKEN, REACTOR_DASHBOARD_CLIENT_TIMEOUT=str(timeout)
    )
    port = int(base.rsplit(":", 1)[1])
    ids = [f"photo-{i:08d}" for i in range(10_000)]
    body = json.dumps({"type": "photo.process", "photo_ids": ids}).encode()
    pieces = -(-len(body) // 16384)
    assert len(body) > 170_000 and pieces == 11
    deadline = timeout + len(body) / BODY_BYTES_PER_SECOND
    head = post_head("/api/requeue", len(body), f"Authorization: Bearer {TOKEN}\r\n")

    began = time.monotonic()
    answer = steady_upload(port, head, body, 0.3, pieces)  # the last piece at 3 s
    assert time.monotonic() - began > timeout
    assert answer.startswith(b"HTTP/1.0 200 OK\r\n"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["rows"] == 1
    assert state_of(conn, "photo-00000001") == "pending"

    conn.execute("UPDATE photo_jobs SET state = 'failed'")
    began = time.monotonic()
    answer = steady_upload(port, head, body, 0.3, pieces // 2)
    assert timeout <= time.monotonic() - began < deadline + 1, answer
    assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n"), answer
    assert state_of(conn, "photo-00000001") == "failed"


def test_a_cancel_that_cannot_reach_redis_is_done_logged_and_warned(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """Redis down after the rows are cancelled: the running jobs are not asked to stop, but the
    cancel is done, so it answers 200 with the rows and a warning (API and form alike), and is
    logged as every action is."""
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) VALUES ('c1', 'photo.process'),"
        " ('c2', 'photo.process')"
    )
    dashboard, base = start_actions_dashboard(
        spawn, **USERS, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"
    )
    code, _, body = post(
        base + "/api/cancel", {"type": "photo.process", "photo_ids": ["c1"]}, ALICE
    )
    assert code == 200, body
    answer = json.loads(body)
    assert answer["rows"] == 1 and "not asked to stop" in answer["warning"], answer
    assert state_of(conn, "c1") == "cancelled"

    request = urllib.request.Request(base + "/", headers=ALICE)
    with urllib.request.urlopen(request, timeout=30) as response:
        cookie = response.headers["Set-Cookie"].split(";")[0]
        csrf = dict(next(iter(Forms(response.read().decode()).forms.values())))["csrf"]
    fields = [("csrf", csrf), ("type", "photo.process"), ("photo_id", "c2")]
    code, text = form_post(base, "cancel", fields, cookie)
    assert code == 200 and "cancel photo.process: 1 row changed" in text, text
    assert "warning:" in text and "not asked to stop" in text, text
    assert state_of(conn, "c2") == "cancelled"
    logged = (
        "dashboard_action user=alice action=cancel type=photo.process photo_ids=1 bulk=- rows=1"
    )
    wait_for(
        lambda: sum(f"{logged} warning=" in line for line in dashboard.lines) == 2,
        what="both cancels logged",
    )


# -- password guesses, stale forms, hostile bodies -----------------------------------------------


def basic(name: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{password}".encode()).decode()


def overview_status(port: int, authorization: str, source: str = "127.0.0.1") -> tuple[int, str]:
    """GET /api/overview from `source`: the status and the Retry-After header ('' if none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/api/overview", headers={"Authorization": authorization})
        response = conn.getresponse()
        response.read()
        return response.status, response.headers.get("Retry-After", "")
    finally:
        conn.close()


def guessing(port: int, threads: int, password: Callable[[int, int], str]) -> Callable[[], None]:
    """`threads` clients sending alice's name with `password(thread, n)` as fast as they are
    answered, from 127.0.0.1, until the returned function is called."""
    stop = threading.Event()

    def guess(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            with contextlib.suppress(OSError, http.client.HTTPException):  # dropped: a guess
                overview_status(port, basic("alice", password(i, n)))

    running = [threading.Thread(target=guess, args=(i,), daemon=True) for i in range(threads)]
    for thread in running:
        thread.start()

    def stopped() -> None:
        stop.set()
        for thread in running:
            thread.join(timeout=30)

    return stopped


#: The longest a request may wait for its answer: a password check or two (tens of ms each),
#: never a queue of them.
ANSWER_SECONDS = 1.0


def answered_in_time(port: int, source: str, seconds: float) -> int:
    """alice's right password from `source` until it is answered 200, within `seconds`, each
    try answered within `ANSWER_SECONDS`: a 503 must say when to retry (and is retried then);
    a dropped connection fails the test. How many tries it took."""
    deadline = time.monotonic() + seconds
    tries = 0
    while True:
        tries += 1
        began = time.monotonic()
        try:
            status, retry_after = overview_status(port, ALICE["Authorization"], source)
        except (OSError, http.client.HTTPException) as exc:
            raise AssertionError(f"the right password was dropped on try {tries}: {exc!r}") from exc
        took = time.monotonic() - began
        assert took < ANSWER_SECONDS, f"try {tries} answered {status} after {took:.2f} s"
        if status == 200:
            return tries
        assert (status, retry_after.isdigit()) == (503, True), (status, retry_after)
        assert time.monotonic() + int(retry_after) < deadline, f"still {status} after {tries}"
        time.sleep(int(retry_after))  # what the server asked for


#: Guessing clients: fewer than the connections served at once, so that the server's own bound
#: (a connection beyond it closes the oldest still sending) is not what is tested.
GUESSERS = MAX_CLIENTS * 3 // 4


@pytest.mark.slow  # a load of 24 clients on two cores: timed, so not beside other tests
def test_a_flood_of_wrong_passwords_locks_no_one_out(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """A wrong password sent again and again costs one check (remembered as wrong), so the
    right one, from the same address, gets through; guesses that differ each time are checked
    one at a time, each address's at most once a second, and never queue: the right password
    from another address is answered 200 within seconds (at worst told to retry first)."""
    _, base = start_actions_dashboard(spawn, **USERS)
    port = int(base.rsplit(":", 1)[1])
    stop = guessing(port, GUESSERS, lambda i, n: "the-same-wrong-password")
    try:
        time.sleep(1.0)  # the flood under way (a client's pace, not a wait for the server)
        assert answered_in_time(port, "127.0.0.1", seconds=5) <= 3
    finally:
        stop()
    stop = guessing(port, GUESSERS, lambda i, n: f"guess-{i}-{n}")
    try:
        time.sleep(1.0)
        assert answered_in_time(port, "127.0.0.2", seconds=5) <= 3
    finally:
        stop()


def test_an_unknown_user_name_costs_the_check_a_known_one_does() -> None:
    """No user enumeration by timing: a wrong password of a name that does not exist takes as
    long as one of a name that does (each a scrypt); a wrong header seen before costs none."""
    from reactor.ops.auth import load_credentials

    found = load_credentials({"REACTOR_DASHBOARD_USERS": f"carol:{hash_password('pw')}"})

    def took(name: str, password: str) -> float:
        began = time.perf_counter()
        assert found.identify(basic(name, password)) is None
        return time.perf_counter() - began

    known = sorted(took("carol", f"wrong-{i}") for i in range(5))[2]
    unknown = sorted(took("mallory", f"wrong-{i}") for i in range(5))[2]
    assert unknown > known / 2, (known, unknown)
    assert took("carol", "wrong-0") < known / 5  # seen before: answered from memory


def test_a_deeply_nested_json_body_gets_a_400_of_one_line(
    env: Env, spawn: Callable[..., Process]
) -> None:
    _, base = start_actions_dashboard(spawn, REACTOR_DASHBOARD_TOKEN=TOKEN)
    headers = {**bearer(TOKEN), "Content-Type": "application/json"}
    for body in (b"[" * 100_000, b'{"type": ' * 50_000):
        code, _, text = post(base + "/api/cancel", body, headers)
        assert (code, text.count("\n")) == (400, 1), (code, text[:300])
        assert "nested too deeply" in json.loads(text)["error"], text


def handler_runs(conn: psycopg.Connection[Any], photo_id: str) -> int:
    row = conn.execute("SELECT count(*) FROM handler_runs WHERE photo_id = %s", [photo_id])
    return int(row.fetchone()[0])  # type: ignore[index]


def test_a_stale_rows_form_changes_nothing(
    env: Env, conn: psycopg.Connection[Any], spawn: Callable[..., Process]
) -> None:
    """A row's form carries the state the page showed (and its token): posted after the row
    moved on (requeued elsewhere and run to done), it answers 409 and the row stays as it is.
    The JSON API takes the same fence, optional: checked when given."""
    failed_rows(conn, "p1", "p2", "p3")
    start_reactor(spawn, "--route", OK_ROUTE)
    worker = spawn("-m", "reactor", "worker", "--route", OK_ROUTE, "--simple", name="worker")
    worker.wait_for_line("Listening on")
    _, base = start_actions_dashboard(spawn, **USERS)
    request = urllib.request.Request(base + "/", headers=ALICE)
    with urllib.request.urlopen(request, timeout=30) as response:
        cookie = response.headers["Set-Cookie"].split(";")[0]
        forms = Forms(response.read().decode())
    shown = forms.forms["requeue:photo.process:p1"]

    code, _, body = post(
        base + "/api/requeue", {"type": "photo.process", "photo_ids": ["p1"]}, ALICE
    )
    assert code == 200, body
    wait_for(lambda: state_of(conn, "p1") == "done", timeout=30, what="p1 run to done")
    code, text = form_post(base, "requeue", shown, cookie)
    assert code == 409, text
    assert text == "409 conflict: photo p1 changed since the page was shown: nothing done\n"
    assert (state_of(conn, "p1"), handler_runs(conn, "p1")) == ("done", 1)

    # In the same state the page showed, but another dispatch of the row (requeued and failed
    # again meanwhile): the token tells them apart.
    shown = forms.forms["requeue:photo.process:p3"]
    assert ("token", "1") in shown
    conn.execute(
        "UPDATE photo_jobs SET prior_attempts = prior_attempts + attempts WHERE photo_id = 'p3'"
    )
    code, text = form_post(base, "requeue", shown, cookie)
    assert code == 409, text
    assert state_of(conn, "p3") == "failed"

    # The API: a fence that no longer holds is refused; one that holds acts; none: as before.
    requeue = base + "/api/requeue"
    for fence in ({"row_state": "done"}, {"token": 7}, {"row_state": "failed", "token": 7}):
        code, _, body = post(
            requeue, {"type": "photo.process", "photo_ids": ["p2"], **fence}, ALICE
        )
        assert code == 409 and "changed since" in json.loads(body)["error"], (fence, body)
    assert state_of(conn, "p2") == "failed"
    code, _, body = post(
        requeue, {"type": "photo.process", "photo_ids": ["p1", "p2"], "token": 1}, ALICE
    )
    assert code == 400, body  # a fence names one row
    code, _, body = post(
        requeue,
        {"type": "photo.process", "photo_ids": ["p2"], "row_state": "failed", "token": 1},
        ALICE,
    )
    assert (code, json.loads(body)["rows"]) == (200, 1), body
