"""The Host names the dashboard answers to (a DNS-rebinding guard): loopback names, the
address it is bound to unless that is a wildcard, and the names given to `--allowed-host`;
a request naming any other host gets 421."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from reactor.errors import ConfigError

__all__ = ["LOOPBACK_NAMES", "allowed_hosts", "host_of", "parse_allowed_host"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?$")


def _normal_host(name: str) -> str:
    """A host name or IP address as the Host check compares it: lower case, no trailing dot,
    an IPv6 address without brackets and in its compressed form."""
    name = name.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def parse_allowed_host(text: str) -> str:
    """A name given to `--allowed-host`: a host name or an IP address (an IPv6 one in brackets
    or not), without scheme, port or path.

    Raises:
        ConfigError: anything else.
    """
    name = _normal_host(text)
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if not _HOST_NAME.match(name) or ".." in name:
            raise ConfigError(
                f"bad --allowed-host {text!r}: give a host name or an IP address, "
                "without scheme, port or path"
            ) from None
    return name


def host_of(header: str) -> str | None:
    """The host part of a Host header (`name`, `name:port`, `[v6]`, `[v6]:port`); None when
    it is malformed."""
    header = header.strip()
    if header.startswith("["):
        host, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        host, _, port = header.partition(":")
        if port and not port.isdigit():
            return None
    return _normal_host(host) if host else None


def allowed_hosts(bound: str, extra: Iterable[str]) -> frozenset[str]:
    """The Host names the dashboard answers to: loopback names, the bound address unless it
    is a wildcard, and `extra` (already checked by `parse_allowed_host`)."""
    names = set(LOOPBACK_NAMES) | {_normal_host(n) for n in extra}
    if _normal_host(bound) not in _WILDCARDS:
        names.add(_normal_host(bound))
    return frozenset(names)
