"""Redis URLs: the one place they are parsed and turned into a client.

Besides redis-py's own schemes (`redis://`, `rediss://`, `unix://`), a Redis run under Sentinel
is named by

    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]

The credentials are the master's, and are also sent to the sentinels unless the query gives
theirs (`?sentinel_username=...&sentinel_password=...`; an empty `sentinel_password=` means the
sentinels take no password). The client asks the sentinels for the master on every new
connection (redis-py's `Sentinel.master_for`), so after a failover the next reconnect reaches
the promoted replica without a restart; that includes the reconnects inside a command's
retries (`SentinelMasterConnection`), so a worker blocked in its dequeue when the master died
follows the promotion within one retry backoff. A malformed URL is a `ConfigError` whose
message never contains a password.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from reactor.errors import ConfigError
from reactor.redact import ambiguous_userinfo, redact

__all__ = [
    "SENTINEL_SCHEME",
    "SENTINEL_SOCKET_TIMEOUT_SECONDS",
    "SentinelMasterConnection",
    "SentinelTarget",
    "client_for",
    "connect_redis",
    "describe_master_not_found",
    "is_sentinel_url",
    "parse_sentinel_url",
]

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
#: A sentinel that does not answer within this long is skipped for the next one.
SENTINEL_SOCKET_TIMEOUT_SECONDS = 1.0
_QUERY_KEYS = frozenset({"sentinel_username", "sentinel_password"})


class SentinelMasterConnection(SentinelManagedConnection):
    """redis-py's connection to the master a sentinel names, which asks the sentinels again
    when a command reconnects it, not only when the pool hands it out.

    redis-py reconnects a connection that a command's retry dropped to the address it had
    (`connect_check_health`), not through `_connect_retry`: after a failover every retry of a
    worker's blocking dequeue went back to the old master, refused or, once it was back as a
    replica, answering READONLY, until the retries were spent (about 35 s).
    """

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            # One try: the command's own retry (with its backoff) is the retry.
            self._connect_retry()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def describe(self) -> str:
        """Sentinel addresses and master name, for messages (no credentials)."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"master {self.master_name!r} at sentinels {hosts}"


def _bad(reason: str) -> ConfigError:
    return ConfigError(f"bad Redis Sentinel URL: {reason}")


def _parse_address(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise _bad(f"bad sentinel address {redact(text)!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _bad("a sentinel address has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(f"bad sentinel port {port_text!r}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a `redis+sentinel://` URL.

    Raises:
        ConfigError: the URL is malformed (the message holds no password).
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SENTINEL_SCHEME:
        raise _bad(f"the scheme must be {SENTINEL_SCHEME}://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if not hosts:
        raise _bad("no sentinel host:port given")
    sentinels = tuple(_parse_address(part) for part in hosts.split(","))
    parts = [unquote(p) for p in path.split("/")] if path else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise _bad("no master name given (…/MASTER_NAME[/DB])")
    if len(parts) > 2:
        raise _bad("the path must be /MASTER_NAME[/DB]")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise _bad(f"the database must be a number, not {parts[1]!r}")
        db = int(parts[1])
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _bad("malformed query string") from None
    unknown = sorted(set(params) - _QUERY_KEYS)
    if unknown:
        raise _bad(f"unknown parameter {unknown[0]!r} (known: {', '.join(sorted(_QUERY_KEYS))})")
    sentinel_username = params.get("sentinel_username", [username or ""])[-1] or None
    sentinel_password = params.get("sentinel_password", [password or ""])[-1] or None
    return SentinelTarget(
        sentinels=sentinels,
        master_name=parts[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=sentinel_username,
        sentinel_password=sentinel_password,
    )


def is_sentinel_url(url: str) -> bool:
    """Whether `url` names a Redis under Sentinel."""
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def client_for(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url` (no I/O yet); `kwargs` go to the connections to Redis itself.

    Raises:
        ConfigError: the URL is malformed.
    """
    if not is_sentinel_url(url):
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError as exc:
            raise ConfigError(f"bad Redis URL: {redact(str(exc))}") from None
    target = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_SOCKET_TIMEOUT_SECONDS,
        "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_SECONDS,
    }
    if target.sentinel_username:
        sentinel_kwargs["username"] = target.sentinel_username
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    # Typed as Any: redis-py releases differ in whether Sentinel is annotated (a type: ignore
    # is needed with one and refused as unused with the other).
    sentinel_class: Any = Sentinel
    sentinel = sentinel_class(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    client: redis.Redis = sentinel.master_for(
        target.master_name,
        db=target.db,
        username=target.username,
        password=target.password,
        **{"connection_class": SentinelMasterConnection, **kwargs},
    )
    return client


def connect_redis(url: str, **kwargs: Any) -> redis.Redis:
    """The reactor's client for `url`, a plain Redis or a `redis+sentinel://` one (no I/O yet):
    `client_for` with a health check of idle connections every 30 s.

    Raises:
        ConfigError: the URL is malformed.
    """
    if ambiguous_userinfo(url):
        raise ConfigError(
            "bad Redis URL: the user name or password holds a raw '@', '/', '?' or '#'; "
            "percent-encode them (e.g. '@' as %40)"
        )
    return client_for(url, **{"health_check_interval": 30, **kwargs})


def describe_master_not_found(url: str, exc: MasterNotFoundError) -> str:
    """One line for a master no sentinel could name: unreachable sentinels or an unknown name."""
    target = parse_sentinel_url(url)
    # redis-py lists each sentinel it could not ask (by its connection, "host=..."); fewer
    # than all means some answered and none of them knows a healthy master of that name.
    refused = str(exc).count("host=")
    if refused >= len(target.sentinels):
        return f"no sentinel answered for {target.describe()}"
    return f"no sentinel that answered knows a healthy {target.describe()}"
