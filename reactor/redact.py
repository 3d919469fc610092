"""Remove passwords from text before it reaches a log line or an error message.

Guarantee: any `scheme://user:password@host` (or `scheme://:password@host`) and any libpq
`password=...` keyword (or `xxx_password=...`, e.g. a Sentinel URL's
`sentinel_password=`) in the text comes out with the password replaced by `***`.
"""

from __future__ import annotations

import re

__all__ = ["redact"]

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]*@")
_KEYWORD_PASSWORD = re.compile(
    r"(?P<head>\b(?:[A-Za-z]+_)?password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.I
)


def redact(text: str) -> str:
    """Return `text` with every password in a URL or a `password=` keyword masked."""
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    return _KEYWORD_PASSWORD.sub(r"\g<head>***", text)
