"""`reactor dashboard`: a read-only web page of the table, the reactors and RQ, and its JSON.

`GET /` is an HTML page (Jinja2, autoescaped) that reloads itself every few seconds (meta
refresh); `GET /api/overview` is the same data as JSON (`reactor.ops.overview`). The page
carries everything it needs (inline CSS, server-side SVG charts: no script, no CDN) and is
served with a Content-Security-Policy that forbids every script: even a row whose
`last_error` or photo id holds markup is shown as text. When Postgres cannot be read, both
endpoints answer 503 with the reason (one line, no password, no URL); any other failure gets
a 500 with one such line (`dashboard_request_failed`). The dashboard writes nothing unless
its actions are on (`reactor.ops.actions`: behind a credential).

What it guarantees on a shared host and a big table:
- Without actions it has no credential: it serves beyond loopback (a wildcard or another
  address) only when `REACTOR_DASHBOARD_OPEN=1` says to (one warning line), and otherwise
  refuses to start, naming what to set (`reactor.ops.serving`): anyone who can reach the port
  could read it, sending `Host: localhost`.
- Only requests whose `Host` names it are served (loopback names, the address it is bound to
  unless that is a wildcard, and the names given with `--allowed-host`); any other gets 421,
  so a web page that rebinds its own DNS name to 127.0.0.1 cannot read the dashboard.
- It holds one Postgres connection (reopened after a failure); one read runs at a time and its
  result (or error) serves every request for `cache_seconds`, so any number of concurrent
  requests cost one backend and at most one read per interval.
- At most `MAX_CLIENTS` connections are served at once; a client that has not sent its request
  within `client_timeout` seconds of connecting is dropped, however it trickles (the body of a
  POST that may act: plus a second per 64 KiB, then a 408); when every slot is taken, a new
  connection closes the oldest one still sending (`reactor.http_server`): slow clients cannot
  pile up threads or shut new ones out. A POST its headers settle (no credential, another
  Origin: `Actions.refuse_post`) is answered before its body is read, then drained (`linger`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from reactor.errors import ConfigError, DatabaseError, ReactorError, StatementError
from reactor.http_server import BoundedHTTPServer, body_length
from reactor.ops.actions import Actions
from reactor.ops.charts import per_minute_chart
from reactor.ops.hosts import allowed_hosts, host_of
from reactor.ops.overview import Overview, read_overview
from reactor.ops.serving import MISDIRECTED, Page, check_open, or_500, public_reason
from reactor.ops.status import (
    OTHER_TYPES,
    STATES,
    FinishedCounts,
    read_finished_counts,
    shown_count,
)
from reactor.pg import db
from reactor.routes import Route
from reactor.rq.redis_url import connect_redis
from reactor.validate import quoted_photo_id

__all__ = [
    "DATABASE_CONNECTIONS",
    "DEFAULT_CACHE_SECONDS",
    "DEFAULT_CLIENT_TIMEOUT_SECONDS",
    "DEFAULT_REFRESH_SECONDS",
    "Dashboard",
    "serve_dashboard",
]

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_SECONDS = 5
#: How long one read of the database serves every request.
DEFAULT_CACHE_SECONDS = 2.0
#: How often the count of `done` rows (the most rows of all) is read again.
DONE_COUNTS_SECONDS = 30.0
#: A client that has not sent its request this long after connecting (an allowed POST's body:
#: longer, `reactor.http_server.BODY_BYTES_PER_SECOND`), or is silent this long, is dropped.
DEFAULT_CLIENT_TIMEOUT_SECONDS = 5.0
#: Postgres connections the dashboard holds, however many requests come.
DATABASE_CONNECTIONS = 1
#: How long a request waits for the read in progress before it answers 503.
READ_WAIT_SECONDS = 30.0
#: No script of any origin, no request to anywhere: the page is markup, inline CSS and SVG.
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@dataclass(frozen=True)
class _Read:
    """One read of the overview (or why it failed), and when it was made."""

    at: float
    found: Overview | None
    error: str | None


_PG_OFFSET = re.compile(r"([+-]\d\d)$")


def shown_time(value: object) -> str:
    """Every time on the page in one form, `YYYY-MM-DD HH:MM:SS UTC`, whether it comes as a
    datetime, an ISO string or Postgres's text (`2026-12-02 13:00:00.5+00`); a dash for none."""
    if value is None or value == "":
        return "\N{EN DASH}"
    if isinstance(value, datetime):
        when = value
    else:
        text = str(value)
        try:
            when = datetime.fromisoformat(_PG_OFFSET.sub(r"\1:00", text.replace(" ", "T", 1)))
        except ValueError:
            return text  # 'infinity', or anything else: as it is
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


class Dashboard:
    """Reads the overview and renders it; safe to call from several threads.

    One connection, one read at a time: a request finds the last read if it is younger than
    `cache_seconds`, else waits for the read in progress or makes one.
    """

    def __init__(
        self,
        database_url: str,
        redis_url: str,
        routes: Mapping[str, Route],
        *,
        stale_after_seconds: float,
        refresh_seconds: int = DEFAULT_REFRESH_SECONDS,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
    ) -> None:
        """Raises ConfigError: a URL is malformed (checked here: the servers may be down)."""
        db.check_url(database_url)
        self._database_url = database_url
        self._redis = connect_redis(redis_url)
        self._routes = routes
        self._stale_after = stale_after_seconds
        self._refresh = refresh_seconds
        self._cache_seconds = cache_seconds
        self._conn: db.Connection | None = None
        self._reading = threading.Lock()  # held by the one read in progress
        self._last: _Read | None = None
        self._done_counts: tuple[float, FinishedCounts] | None = None  # (when read, counts)
        self._templates = Environment(
            loader=PackageLoader("reactor", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self._templates.filters["when"] = shown_time
        self._templates.filters["rows"] = shown_count
        self._templates.filters["form_id"] = quoted_photo_id
        self._templates.globals["OTHER_TYPES"] = OTHER_TYPES  # a sum of types: nothing to act on

    def _connection(self) -> tuple[db.Connection, bool]:
        """The dashboard's connection, and whether it was open already."""
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn, True
        self._drop_connection()
        conn = db.connect(self._database_url, purpose="dashboard")
        conn.read_only = True
        self._conn = conn
        return conn, False

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def overview(self) -> Overview:
        """Read the overview now (no cache), on the dashboard's connection.

        Raises:
            ReactorError: Postgres cannot be read (or is not migrated).
        """
        conn, reused = self._connection()
        try:
            return self._overview_on(conn)
        except ReactorError:
            self._drop_connection()
            if not reused:
                raise
        # The kept connection may have died while idle (a server restart): once more, on a
        # new one, so that only a database that is down now answers 503.
        conn, _ = self._connection()
        try:
            return self._overview_on(conn)
        except ReactorError:
            self._drop_connection()
            raise

    def _overview_on(self, conn: db.Connection) -> Overview:
        try:
            db.check_schema(conn)
            return read_overview(
                conn, self._redis, self._routes, self._stale_after, self._recent_done_counts(conn)
            )
        finally:
            # Never left idle in a transaction (it would hold back vacuum) between reads.
            if not conn.closed and not conn.broken:
                try:
                    with db.translating("rollback failed"):
                        conn.rollback()
                except (DatabaseError, StatementError):
                    self._drop_connection()

    def _recent_done_counts(self, conn: db.Connection) -> FinishedCounts:
        """`done` rows by type, read at most every `DONE_COUNTS_SECONDS`: they are most of the
        table (counted up to a bound, then estimated), and a total of finished rows a few
        seconds old tells an operator as much (the per-minute chart stays current)."""
        now = time.monotonic()
        cached = self._done_counts
        if cached is None or now - cached[0] >= DONE_COUNTS_SECONDS:
            types = tuple(sorted(self._routes))
            cached = self._done_counts = (now, read_finished_counts(conn, ("done",), types))
        return cached[1]

    def _fresh(self) -> _Read | None:
        last = self._last
        if last is not None and time.monotonic() - last.at < self._cache_seconds:
            return last
        return None

    def _read(self) -> tuple[Overview | None, str | None]:
        found = self._fresh()
        if found is None:
            if not self._reading.acquire(timeout=READ_WAIT_SECONDS):
                return None, "the dashboard's read of the database is taking too long"
            try:
                found = self._fresh() or self._read_now()  # another request may have read
            finally:
                self._reading.release()
        return found.found, found.error

    def _read_now(self) -> _Read:
        try:
            found = self.overview()
        except ReactorError as exc:
            reason = public_reason(str(exc))
            logger.warning("dashboard_read_failed error=%s", reason)
            self._last = _Read(time.monotonic(), None, reason)
            return self._last
        if found.redis_error is not None:
            found = replace(found, redis_error=public_reason(found.redis_error))
        self._last = _Read(time.monotonic(), found, None)
        return self._last

    def json_page(self) -> Page:
        found, error = self._read()
        if found is None:
            body = {"error": f"postgres unavailable: {error}"}
            return Page(503, _json(body), "application/json")
        return Page(200, _json(found.as_dict()), "application/json")

    def html_page(self, controls: Mapping[str, Any] | None = None) -> Page:
        """The page; with `controls` (`reactor.ops.actions`), its action forms too."""
        found, error = self._read()
        template = self._templates.get_template("dashboard.html")
        if found is None:
            html = template.render(error=f"postgres unavailable: {error}", refresh=self._refresh)
            return Page(503, html.encode(), "text/html; charset=utf-8")
        html = template.render(
            error=None,
            refresh=self._refresh,
            o=found,
            states=STATES,
            totals={s: sum(t.counts[s] for t in found.status.types) for s in STATES},
            estimated={s for t in found.status.types for s in t.estimated},
            charts=_charts(found),
            controls=controls,
        )
        return Page(200, html.encode(), "text/html; charset=utf-8")

    def close(self) -> None:
        # A read still running after the wait keeps its connection: the process is exiting.
        if self._reading.acquire(timeout=READ_WAIT_SECONDS):
            try:
                self._drop_connection()
            finally:
                self._reading.release()
        self._redis.close()


def _json(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, indent=1, default=str) + "\n").encode()


def _charts(found: Overview) -> list[Markup]:
    f = found.finished
    return [
        Markup(per_minute_chart("Done per minute, by type", f.minutes, f.done, stacked=True)),
        Markup(per_minute_chart("Failed per minute, by type", f.minutes, f.failed, stacked=True)),
        Markup(
            per_minute_chart(
                "Attempts (dispatches) taken by the rows finished each minute",
                f.minutes,
                {"attempts": f.attempts} if any(f.attempts) else {},
                stacked=False,
            )
        ),
    ]


def serve_dashboard(
    dashboard: Dashboard,
    host: str,
    port: int,
    *,
    allowed: Iterable[str] = (),
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_SECONDS,
    actions: Actions | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ThreadingHTTPServer:
    """Serve the dashboard on `host:port` from a daemon thread; returns the server. Requests
    whose Host header is not among `allowed_hosts(host, allowed)` get 421. With `actions`,
    every request needs a credential and POSTs run actions (`reactor.ops.actions`).

    Raises:
        ConfigError: the address cannot be bound, or it is not loopback and there is no
            credential (`actions`) nor `REACTOR_DASHBOARD_OPEN=1` in `environ`.
    """
    names = allowed_hosts(host, allowed)
    csp = _CSP if actions is None else _CSP.replace("form-action 'none'", "form-action 'self'")

    class Handler(BaseHTTPRequestHandler):
        # The socket's timeout: a client that sends nothing (or reads nothing) is dropped.
        timeout = client_timeout
        body_read = False  # whether `_post` has read (or tried to read) the body

        def client(self) -> str:
            return str(self.client_address[0])

        def do_GET(self) -> None:
            if server.request_read(self.request):  # else closed already: no one to answer
                self._send(or_500(self.path, self._get))

        def do_POST(self) -> None:
            page = or_500(self.path, self._post)
            if page is not None:  # None: its body did not come, answered 408 or cut
                self._send(page)
                if not self.body_read:  # answered on its headers
                    server.linger(self.request)

        def _get(self) -> Page:
            path = self.path.split("?", 1)[0]
            if host_of(self.headers.get("Host", "")) not in names:  # None: malformed
                # A DNS-rebinding page sends its own name: never answer it with our data.
                page = MISDIRECTED
            elif actions is not None and (
                refused := actions.refuse_read(self.headers, self.client())
            ):
                page = refused
            elif path == "/" and actions is not None:
                controls, cookie = actions.controls(self.headers, self.client())
                page = replace(dashboard.html_page(controls), headers=cookie)
            elif path == "/":
                page = dashboard.html_page()
            elif path == "/api/overview":
                page = dashboard.json_page()
            else:
                page = Page(404, b"not found\n", "text/plain; charset=utf-8")
            return page

        def _post(self) -> Page | None:
            if host_of(self.headers.get("Host", "")) not in names:
                return MISDIRECTED
            if actions is None:
                return Page(405, b"read-only (reactor dashboard --actions)\n", "text/plain")
            if refused := actions.refuse_post(self.path, self.headers, self.client()):
                return refused  # settled by its headers: its body is never read
            self.body_read = True
            body = server.read_body(self.request, self.rfile, body_length(self.headers) or 0)
            if body is None:
                return None
            return actions.post(self.path, self.headers, body, self.client())

        def _send(self, page: Page) -> None:
            self.send_response(page.status)
            self.send_header("Content-Type", page.content_type)
            self.send_header("Content-Length", str(len(page.body)))
            for header, value in page.headers:
                self.send_header(header, value)
            self.send_header("Content-Security-Policy", csp)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(page.body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    try:
        server = BoundedHTTPServer((host, port), Handler, client_timeout)
    except (OSError, OverflowError) as exc:
        raise ConfigError(f"cannot serve the dashboard on {host}:{port}: {exc}") from None
    if actions is None:
        try:
            check_open(str(server.server_address[0]), f"{host}:{port}", environ)
        except ConfigError:
            server.server_close()
            raise
    threading.Thread(target=server.serve_forever, name="reactor-dashboard", daemon=True).start()
    return server
