"""Server URLs of the test suite: switching a URL's database, and refusing any server that is
not on this machine (tests never touch anything else)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

import pytest


def assert_loopback(url: str) -> None:
    """Stop the run (a usage error) unless `url` names a loopback address or a local socket."""
    host = urlsplit(url).hostname or ""
    if host in ("", "localhost") or host.startswith("/"):
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise pytest.UsageError(f"refusing to test against a non-loopback server: {host}")


def with_path(url: str, path: str) -> str:
    """`url` with its path (the Postgres database, or the Redis db number) replaced."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + path, parts.query, ""))
