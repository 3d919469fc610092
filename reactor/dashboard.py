"""`reactor dashboard`: a read-only web page of the table, the reactors and RQ, and its JSON.

`GET /` is an HTML page (Jinja2, autoescaped) that reloads itself every few seconds with a
meta refresh; `GET /api/overview` is the same data as JSON (see `reactor.overview`). The page
carries everything it needs (inline CSS, server-side SVG charts: no script, no CDN), so it
works offline, and it is served with a Content-Security-Policy that forbids every script:
even a row whose `last_error` or photo id holds markup is shown as text. Each request reads
the database on a short-lived connection of its own; when Postgres cannot be read, both
endpoints answer 503 with the reason (one line, no password, no URL). The dashboard writes
nothing, anywhere.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from reactor import db
from reactor.charts import per_minute_chart
from reactor.errors import ConfigError, ReactorError
from reactor.overview import Overview, read_overview
from reactor.redact import redact
from reactor.redis_url import connect_redis
from reactor.routes import Route

__all__ = ["DEFAULT_DASHBOARD_PORT", "DEFAULT_REFRESH_SECONDS", "Dashboard", "serve_dashboard"]

logger = logging.getLogger(__name__)

DEFAULT_DASHBOARD_PORT = 9180
DEFAULT_REFRESH_SECONDS = 5

#: No script of any origin, no request to anywhere: the page is markup, inline CSS and SVG.
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")
_STATES = ("pending", "active", "done", "failed")


def public_reason(text: str) -> str:
    """One line fit for a page: no password, no connection URL."""
    lines = text.strip().splitlines()
    return _URL.sub("<url>", redact(lines[0] if lines else "unknown error"))


@dataclass(frozen=True)
class Page:
    """One response."""

    status: int
    body: bytes
    content_type: str


class Dashboard:
    """Reads the overview and renders it; safe to call from several threads."""

    def __init__(
        self,
        database_url: str,
        redis_url: str,
        routes: Mapping[str, Route],
        *,
        stale_after_seconds: float,
        refresh_seconds: int = DEFAULT_REFRESH_SECONDS,
    ) -> None:
        """Raises:
        ConfigError: a URL is malformed (checked here: the servers may be down).
        """
        try:
            psycopg.conninfo.conninfo_to_dict(database_url)
        except psycopg.ProgrammingError:
            raise ConfigError("bad database URL (not shown: it may hold a password)") from None
        self._database_url = database_url
        self._redis = connect_redis(redis_url)
        self._routes = routes
        self._stale_after = stale_after_seconds
        self._refresh = refresh_seconds
        self._templates = Environment(
            loader=PackageLoader("reactor", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )

    def overview(self) -> Overview:
        """Raises:
        ReactorError: Postgres cannot be read (or is not migrated).
        """
        conn = db.connect(self._database_url, purpose="dashboard")
        with conn:
            db.check_schema(conn)
            conn.read_only = True
            return read_overview(conn, self._redis, self._routes, self._stale_after)

    def _read(self) -> tuple[Overview | None, str | None]:
        try:
            found = self.overview()
        except ReactorError as exc:
            logger.warning("dashboard_read_failed error=%s", public_reason(str(exc)))
            return None, public_reason(str(exc))
        if found.redis_error is not None:
            found = replace(found, redis_error=public_reason(found.redis_error))
        return found, None

    def json_page(self) -> Page:
        found, error = self._read()
        if found is None:
            body = {"error": f"postgres unavailable: {error}"}
            return Page(503, _json(body), "application/json")
        return Page(200, _json(found.as_dict()), "application/json")

    def html_page(self) -> Page:
        found, error = self._read()
        template = self._templates.get_template("dashboard.html")
        if found is None:
            html = template.render(error=f"postgres unavailable: {error}", refresh=self._refresh)
            return Page(503, html.encode(), "text/html; charset=utf-8")
        html = template.render(
            error=None,
            refresh=self._refresh,
            o=found,
            states=_STATES,
            totals={s: sum(t.counts[s] for t in found.status.types) for s in _STATES},
            charts=_charts(found),
        )
        return Page(200, html.encode(), "text/html; charset=utf-8")

    def close(self) -> None:
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


def serve_dashboard(dashboard: Dashboard, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the dashboard on `host:port` from a daemon thread; returns the server.

    Raises:
        ConfigError: the address cannot be bound.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/":
                page = dashboard.html_page()
            elif path == "/api/overview":
                page = dashboard.json_page()
            else:
                page = Page(404, b"not found\n", "text/plain; charset=utf-8")
            self.send_response(page.status)
            self.send_header("Content-Type", page.content_type)
            self.send_header("Content-Length", str(len(page.body)))
            self.send_header("Content-Security-Policy", _CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(page.body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except (OSError, OverflowError) as exc:
        raise ConfigError(f"cannot serve the dashboard on {host}:{port}: {exc}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="reactor-dashboard", daemon=True).start()
    return server
