"""Remove passwords from text before it reaches a log line or an error message.

Guarantee: any `scheme://user:password@host` (or `scheme://:password@host`, up to the last `@`
before the host, so a raw `@` in the password is masked too) and any libpq `password=...`
keyword (or `xxx_password=...`, e.g. a Sentinel URL's `sentinel_password=`) in the text comes
out with the password replaced by `***`. A URL whose user name or password holds a raw `@`,
`/`, `?` or `#` cannot be parsed without guessing, and parsers echo the piece they took for a
host; `ambiguous_userinfo` tells callers to refuse it unparsed.
"""

from __future__ import annotations

import re

__all__ = ["ambiguous_userinfo", "has_password", "redact"]

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^/\s]*@")
_KEYWORD_PASSWORD = re.compile(
    r"(?P<head>\b(?:[A-Za-z]+_)?password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.I
)


def redact(text: str) -> str:
    """Return `text` with every password in a URL or a `password=` keyword masked."""
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    return _KEYWORD_PASSWORD.sub(r"\g<head>***", text)


def has_password(text: str) -> bool:
    """Whether `text` (a URL or a libpq keyword string) carries a password."""
    return bool(_URL_PASSWORD.search(text) or _KEYWORD_PASSWORD.search(text))


def ambiguous_userinfo(url: str) -> bool:
    """Whether a `scheme://...` URL has an `@` that is not the single one ending its user
    name and password (a raw `@`, `/`, `?` or `#` in the password): then a parser splits it in
    the wrong place and may print part of the password as a host, a port or a database."""
    _, sep, rest = url.partition("://")
    if not sep:
        return False
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    authority, _, path = rest.partition("/")
    return "@" in path or authority.count("@") > 1
