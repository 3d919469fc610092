"""What `reactor dashboard`'s server answers besides its pages (`reactor.ops.dashboard`): the
one-line 500 of a request that failed unexpectedly, the 421 of a foreign Host, and whether it
may serve on its address at all without a credential.

- A request that raises gets a 500 with one line saying why (no password, no URL), logged as
  `dashboard_request_failed` a few times a second at most: never a connection closed on it.
- Without a credential (no `--actions`) the dashboard is open to whoever reaches its port, and
  the Host check does not stop a client that sends `Host: localhost`: on an address that is not
  loopback it starts only when `REACTOR_DASHBOARD_OPEN=1` says so (one warning line), else it
  refuses, naming what to set.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from reactor.errors import ConfigError
from reactor.ops.actions import Reply
from reactor.ops.terminal import visible
from reactor.redact import redact
from reactor.throttle import LogThrottle

__all__ = ["MISDIRECTED", "Page", "check_open", "or_500", "public_reason"]

# The dashboard's own lines, wherever the code that writes them lives.
logger = logging.getLogger("reactor.ops.dashboard")

_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")
#: Set to 1, the dashboard serves without a credential beyond loopback.
OPEN_VARIABLE = "REACTOR_DASHBOARD_OPEN"


def public_reason(text: str) -> str:
    """One line fit for a page: no password, no connection URL."""
    lines = text.strip().splitlines()
    return _URL.sub("<url>", redact(lines[0] if lines else "unknown error"))


#: One response, a page's or an action's.
Page = Reply


def _loopback(address: str) -> bool:
    """Whether the bound `address` (an IP address, as the socket reports it) is this host's
    alone."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_open(address: str, shown: str, environ: Mapping[str, str]) -> None:
    """May a dashboard without a credential serve on the bound `address` (`shown`: as given)?
    Loopback: yes. Else only when `environ` sets `REACTOR_DASHBOARD_OPEN=1`, said in a warning.

    Raises:
        ConfigError: it may not (one line naming the settings that would do).
    """
    if _loopback(address):
        return
    if environ.get(OPEN_VARIABLE, "").strip() != "1":
        raise ConfigError(
            f"refusing to serve the dashboard without a credential on {shown}, beyond loopback "
            "(anyone reaching it could read it): add --actions with REACTOR_DASHBOARD_READ_TOKEN "
            f"(or REACTOR_DASHBOARD_TOKEN, REACTOR_DASHBOARD_USERS), or set {OPEN_VARIABLE}=1 "
            "to serve it open"
        )
    logger.warning(
        "dashboard_open_to_network address=%s: no credential, anyone reaching it reads it (%s=1)",
        shown,
        OPEN_VARIABLE,
    )


#: Requests that failed unexpectedly, logged: a few a second at most (anyone may send them).
_failed_log = LogThrottle(burst=5, interval_seconds=10.0)

_P = TypeVar("_P", bound=Page | None)


def or_500(path: str, build: Callable[[], _P]) -> _P | Page:
    """The page `build` makes; if it raises, a 500 with one line saying why (logged), so the
    client gets an answer instead of a connection closed on it."""
    try:
        return build()
    except Exception as exc:  # whatever it is: answered and logged, never a dropped connection
        reason = visible(f"{type(exc).__name__}: {public_reason(str(exc))}")
        if _failed_log.allow():
            logger.error(
                "dashboard_request_failed path=%s error=%s suppressed=%d",
                visible(path.split("?", 1)[0][:200]),
                reason,
                _failed_log.suppressed(),
                exc_info=exc if logger.isEnabledFor(logging.DEBUG) else None,
            )
        if path.startswith("/api/"):
            body = json.dumps({"error": f"internal error: {reason}"}) + "\n"
            return Page(500, body.encode(), "application/json")
        return Page(500, f"500 internal error: {reason}\n".encode(), "text/plain; charset=utf-8")


MISDIRECTED = Page(
    421,
    b"421 misdirected request: this Host is not the dashboard's "
    b"(reactor dashboard --allowed-host NAME allows a name)\n",
    "text/plain; charset=utf-8",
)
