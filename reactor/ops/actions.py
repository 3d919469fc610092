"""The dashboard's actions (`reactor dashboard --actions`): requeue, cancel, pause and resume,
from the page (forms) and from scripts (`POST /api/requeue|cancel|pause|resume`, JSON).

Each action runs the CLI's own function (`reactor.ops.admin` requeue, `reactor.ops.cancel`,
`reactor.ops.pause`) on a connection of its own, opened for the action and closed after it, at
most `MAX_ACTING` at once (a bound on the dashboard's Postgres connections); so the role needs
what those commands need, and the read-only connection of the page is never written on. Every
action is logged (`dashboard_action`) with who, what and how many rows; a cancel whose rows are
cancelled but whose running jobs Redis could not be asked to stop answers 200 with a `warning`.

An action on photo ids, a pause, a resume is one transaction whose lock waits end after
`LOCK_TIMEOUT_SECONDS` (`SET LOCAL`): a row held elsewhere (`SELECT ... FOR UPDATE`) gets a 409,
nothing changed, and holds up no other action. A bulk action skips locked rows.

Who may act (`reactor.ops.auth`): every request needs a credential when actions are on (401
without one; 503 with Retry-After while its password cannot be checked: another check is
running, or its address sent a wrong one a moment ago); a read-only credential may look but
gets 403 on every action. A POST is judged on its headers (`refuse_post`) before any of its
body is read: a client that may not act holds no place while it sends one. Against forged
requests from other sites:
- an action is a POST, never a GET;
- a POST whose `Origin` is not this dashboard's (`http://` or `https://` + the request's Host,
  itself one of the allowed hosts), or whose `Sec-Fetch-Site` says another site, is refused (403);
- a form carries the CSRF token of its session (an HMAC of the `reactor_session` cookie, which
  is HttpOnly and SameSite=Strict) and a bulk one (every failed or pending row of a type) first
  shows a confirmation page; the JSON API accepts only `application/json`, which no other
  site's page can send here without a CORS preflight, which this server never grants.

What a request asks is read and checked by `reactor.ops.action_requests`: a form names one
row (its photo id encoded so that it comes back exactly) or one state, never a list; a row's
form carries the row's state and token as the page showed them, and acts only on a row still
so (`reactor.ops.fenced`), else answers 409 and changes nothing. Lists of ids go through the
JSON API, where that fence is optional (with one photo id).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import logging
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from typing import Any

from reactor.errors import (
    ConfigError,
    DatabaseError,
    InvalidJobError,
    LockBusyError,
    RedisUnavailableError,
)
from reactor.http_server import body_length
from reactor.ops import admin
from reactor.ops.action_requests import (
    MAX_PHOTO_IDS,
    RefusedError,
    Request,
    request_from_form,
    request_from_json,
)
from reactor.ops.auth import CheckBusyError, Credentials, User
from reactor.ops.cancel import StopNotSentError, cancel_pending, cancel_photos
from reactor.ops.fenced import RowChangedError, cancel_row, requeue_row
from reactor.ops.pause import pause_types, resume_types
from reactor.ops.terminal import visible
from reactor.pg import db, queries
from reactor.pg.registry import routes_in_use
from reactor.redact import redact
from reactor.routes import Route
from reactor.rq.redis_url import connect_redis
from reactor.throttle import LogThrottle

__all__ = ["ACTIONS", "Actions", "Reply"]

logger = logging.getLogger(__name__)

#: Refused actions logged: a few a second at most (anyone who can reach the port can try).
_refused_log = LogThrottle(burst=20, interval_seconds=10.0)

ACTIONS = ("requeue", "cancel", "pause", "resume")
COOKIE = "reactor_session"
#: How long an action waits for a lock that another session holds.
LOCK_TIMEOUT_SECONDS = 3.0
#: Actions run at once (each on a connection of its own), and how long one waits for its turn.
MAX_ACTING = 4
ACTING_WAIT_SECONDS = 10.0
_LOCK_TIMEOUT_MS = round(LOCK_TIMEOUT_SECONDS * 1000)
_LOCKED = "409 conflict: a row this action needs is locked by another session: nothing was changed"


@dataclass(frozen=True)
class Reply:
    """One response: status, body, content type and extra headers."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()


def _text(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, (message + "\n").encode(), "text/plain; charset=utf-8", headers)


def _json_reply(status: int, data: Mapping[str, Any]) -> Reply:
    return Reply(status, (json.dumps(data) + "\n").encode(), "application/json")


@contextmanager
def _waits_bounded(conn: db.Connection) -> Iterator[None]:
    """One transaction whose lock waits end after `LOCK_TIMEOUT_SECONDS` (a 409: all of it
    rolled back); the CLI's functions run in it, their transactions as its savepoints."""
    timeout = {"timeout": f"{round(LOCK_TIMEOUT_SECONDS * 1000)}ms"}
    try:
        with db.translating("action failed", conn), conn.transaction():
            conn.execute(queries.SET_LOCAL_LOCK_TIMEOUT, timeout)
            yield
    except LockBusyError:
        raise RefusedError(409, _LOCKED) from None


class Actions:
    """Authentication, the checks against forged requests, and the actions themselves."""

    def __init__(
        self,
        database_url: str,
        redis_url: str,
        routes: Mapping[str, Route],
        credentials: Credentials,
    ) -> None:
        self._database_url = database_url
        self._redis_url = redis_url
        self._routes = routes
        self._credentials = credentials
        self._secret = secrets.token_bytes(32)  # CSRF tokens live as long as the process
        self._acting = threading.BoundedSemaphore(MAX_ACTING)

    # -- who ------------------------------------------------------------------------------

    def _unauthorized(self) -> Reply:
        scheme = 'Basic realm="reactor dashboard", charset="UTF-8"'
        if not self._credentials.basic:
            scheme = 'Bearer realm="reactor dashboard"'
        return _text(401, "401 unauthorized: log in", (("WWW-Authenticate", scheme),))

    def user(self, headers: Message, client: str) -> User | Reply:
        """Who sent a request from address `client`; else its answer: 401, or 503 while its
        password cannot be checked (`reactor.ops.auth`)."""
        try:
            user = self._credentials.identify(headers.get("Authorization"), client)
        except CheckBusyError as exc:
            # 503, not 401: a 401 makes a browser ask for the password again (as if the right
            # one were wrong) and a script give up; a 503 with Retry-After says "try again" to
            # a person and to retrying clients (curl --retry, urllib3's Retry).
            retry = (("Retry-After", str(exc.retry_after)),)
            return _text(503, "503 busy: a password is being checked; retry in a second", retry)
        return self._unauthorized() if user is None else user

    def refuse_read(self, headers: Message, client: str) -> Reply | None:
        """401 (or 503) for a GET without a valid credential, else None (any may look)."""
        user = self.user(headers, client)
        return user if isinstance(user, Reply) else None

    def controls(
        self, headers: Message, client: str
    ) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
        """What the page needs to show its forms (the session's CSRF token, whether the user
        may act), and the Set-Cookie header of a new session when the request had none."""
        found = self.user(headers, client)  # remembered by `refuse_read`: no check again
        user = None if isinstance(found, Reply) else found
        session = _cookie(headers)
        extra: tuple[tuple[str, str], ...] = ()
        if session is None:
            session = secrets.token_urlsafe(24)
            cookie = f"{COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict"
            extra = (("Set-Cookie", cookie),)
        name = user.name if user is not None else ""
        can_act = user is not None and user.can_act
        return {"csrf": self._csrf(session, name), "can_act": can_act, "user": name}, extra

    def _csrf(self, session: str, user: str) -> str:
        return hmac.new(self._secret, f"{session}\0{user}".encode(), hashlib.sha256).hexdigest()

    # -- POST -----------------------------------------------------------------------------

    def refuse_post(self, path: str, headers: Message, client: str) -> Reply | None:
        """Why a POST is refused on its headers alone, or None: its body may be read."""
        checked = self._checked(path, headers, client)
        return checked if isinstance(checked, Reply) else None

    def _checked(self, path: str, headers: Message, client: str) -> Reply | tuple[str, bool, User]:
        """The action, whether through the API, and the user; or why the POST is refused."""
        path = path.split("?", 1)[0]
        api = path.startswith("/api/")
        action = path.removeprefix("/api/" if api else "/actions/")
        if not path.startswith(("/api/", "/actions/")) or action not in ACTIONS:
            return _text(404, "not found")
        user = self.user(headers, client)
        if isinstance(user, Reply):
            return user
        try:
            _check_origin(headers)
            if not user.can_act:
                raise RefusedError(403, f"403 forbidden: {user.name} may only look")
            if body_length(headers) is None:
                raise RefusedError(400, "a body with a Content-Length (at most 4 MiB) is needed")
            if api and headers.get_content_type() != "application/json":
                raise RefusedError(415, "the API takes application/json")
        except RefusedError as exc:
            return _refusal(exc, api, user, path)
        return action, api, user

    def post(self, path: str, headers: Message, body: bytes, client: str) -> Reply:
        """Answer one POST: the action's result, or why it was refused."""
        path = path.split("?", 1)[0]
        checked = self._checked(path, headers, client)
        if isinstance(checked, Reply):
            return checked
        action, api, user = checked
        try:
            if api:
                request = request_from_json(action, body)
            else:
                fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
                session = _cookie(headers)
                given = fields.get("csrf", [""])[0]
                if session is None or not hmac.compare_digest(
                    given, self._csrf(session, user.name)
                ):
                    raise RefusedError(
                        403, "403 forbidden: the form's CSRF token is not this session's"
                    )
                request = request_from_form(action, fields)
                if request.bulk_state and fields.get("confirm", [""])[0] != "yes":
                    return _confirmation(request, given)
            rows, warning = self._run(request, user)
        except RefusedError as exc:
            return _refusal(exc, api, user, path)
        if api:
            done = {"action": action, "type": request.job_type, "rows": rows}
            return _json_reply(200, done if warning is None else {**done, "warning": warning})
        return _result(request, rows, warning)

    def _run(self, request: Request, user: User) -> tuple[int, str | None]:
        """Rows changed, and what went wrong after they were (None: nothing)."""
        by, warning = f"dashboard:{user.name}", None
        if not self._acting.acquire(timeout=ACTING_WAIT_SECONDS):
            raise RefusedError(503, f"{MAX_ACTING} actions are running: nothing was changed")
        try:
            with db.connect(self._database_url, purpose="dashboard") as conn:
                db.check_schema(conn)
                rows = _ACTS[request.action](self, conn, request, by)
        except StopNotSentError as exc:  # every row is cancelled: an action done, and logged
            rows, warning = exc.result.cancelled, redact(str(exc).splitlines()[0])
        except RowChangedError as exc:
            shown = visible(exc.photo_id[:200])
            raise RefusedError(
                409, f"409 conflict: photo {shown} changed since the page was shown: nothing done"
            ) from None
        except (ConfigError, InvalidJobError) as exc:
            raise RefusedError(400, str(exc)) from None
        except (DatabaseError, RedisUnavailableError) as exc:
            raise RefusedError(
                503, redact(str(exc).splitlines()[0] if str(exc) else "failed")
            ) from None
        finally:
            self._acting.release()
        logger.log(
            logging.INFO if warning is None else logging.WARNING,
            "dashboard_action user=%s action=%s type=%s photo_ids=%d bulk=%s rows=%d%s",
            user.name,
            request.action,
            request.job_type,
            len(request.photo_ids),
            request.bulk_state or "-",
            rows,
            "" if warning is None else f" warning={warning}",
        )
        return rows, warning

    def _requeue(self, conn: db.Connection, r: Request, by: str) -> int:
        if r.bulk_state:
            return admin.requeue_failed(conn, r.job_type)
        if r.fence is not None:
            try:
                return requeue_row(
                    conn, r.photo_ids[0], r.job_type, r.fence, lock_timeout_ms=_LOCK_TIMEOUT_MS
                )
            except LockBusyError:
                raise RefusedError(409, _LOCKED) from None
        with _waits_bounded(conn):
            return admin.requeue_photos(conn, r.photo_ids, r.job_type)

    def _cancel(self, conn: db.Connection, r: Request, by: str) -> int:
        if r.bulk_state:
            return cancel_pending(conn, r.job_type, by).cancelled
        client = connect_redis(self._redis_url, socket_timeout=5, socket_connect_timeout=5)
        try:
            if r.fence is not None:
                fence, photo_id = r.fence, r.photo_ids[0]
                return cancel_row(
                    conn,
                    client,
                    photo_id,
                    r.job_type,
                    fence,
                    by=by,
                    lock_timeout_ms=_LOCK_TIMEOUT_MS,
                ).cancelled
            # One batch: a row held past the timeout rolls all of it back (a 409).
            return cancel_photos(
                conn,
                client,
                r.photo_ids,
                r.job_type,
                by,
                batch_size=MAX_PHOTO_IDS,
                lock_timeout_ms=_LOCK_TIMEOUT_MS,
            ).cancelled
        except LockBusyError:
            raise RefusedError(409, _LOCKED) from None
        finally:
            client.close()

    def _pause(self, conn: db.Connection, r: Request, by: str) -> int:
        with _waits_bounded(conn):
            return len(pause_types(conn, [r.job_type], self._known_routes(conn), by).changed)

    def _resume(self, conn: db.Connection, r: Request, by: str) -> int:
        with _waits_bounded(conn):
            return len(resume_types(conn, [r.job_type], self._known_routes(conn)).changed)

    def _known_routes(self, conn: db.Connection) -> Mapping[str, Route]:
        return self._routes or dict(routes_in_use(conn))


_ACTS: dict[str, Callable[[Actions, db.Connection, Request, str], int]] = {
    "requeue": Actions._requeue,
    "cancel": Actions._cancel,
    "pause": Actions._pause,
    "resume": Actions._resume,
}


def _refusal(exc: RefusedError, api: bool, user: User, path: str) -> Reply:
    if _refused_log.allow():
        logger.warning(
            "dashboard_action_refused user=%s path=%s status=%d why=%s suppressed=%d",
            user.name,
            path,
            exc.status,
            exc,
            _refused_log.suppressed(),
        )
    return _json_reply(exc.status, {"error": str(exc)}) if api else _text(exc.status, str(exc))


def _cookie(headers: Message) -> str | None:
    for part in (headers.get("Cookie") or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and 16 <= len(value) <= 64:
            return value
    return None


def _check_origin(headers: Message) -> None:
    origin = headers.get("Origin")
    host = headers.get("Host", "")
    if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
        raise RefusedError(403, f"403 forbidden: cross-origin request refused ({origin[:100]})")
    if headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
        raise RefusedError(403, "403 forbidden: cross-origin request refused (Sec-Fetch-Site)")


_PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8">'
    "<title>photo-reactor dashboard</title></head><body>{}</body></html>"
)


def _confirmation(r: Request, csrf: str) -> Reply:
    what = f"{r.action} every {r.bulk_state} row of type {r.job_type}"
    fields = {"csrf": csrf, "type": r.job_type, "state": r.bulk_state or "", "confirm": "yes"}
    hidden = "".join(
        f'<input type="hidden" name="{k}" value="{html.escape(v)}">' for k, v in fields.items()
    )
    body = (
        f'<p id="confirm-what">{html.escape(what)}?</p>'
        f'<form method="post" action="/actions/{r.action}">{hidden}'
        '<button id="confirm">yes, do it</button></form> <a href="/">no, back</a>'
    )
    return Reply(200, _PAGE.format(body).encode(), "text/html; charset=utf-8")


def _result(r: Request, rows: int, warning: str | None) -> Reply:
    text = f"{r.action} {r.job_type}: {rows} row{'' if rows == 1 else 's'} changed"
    body = f'<p id="result">{html.escape(text)}</p><p><a id="back" href="/">back</a></p>'
    if warning is not None:
        body = f'<p id="warning">warning: {html.escape(warning)}</p>{body}'
    return Reply(200, _PAGE.format(body).encode(), "text/html; charset=utf-8")
