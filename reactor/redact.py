"""Remove passwords from text before it reaches a log line, an error message, a row or RQ.

Guarantee: in the text that comes out, `***` stands for the password of
- any `scheme://user:password@host` (or `scheme://:password@host`, up to the last `@` before
  the host, so a raw `@` in the password is masked too);
- any `password=...` or `passwd=...` keyword, whatever its prefix (`PGPASSWORD=`,
  `sentinel_password=`, `db_passwd=`), its value bare or quoted (libpq keywords, environment
  dumps, Python keyword reprs);
- any `'password': ...` / `"passwd": ...` entry of a Python dict repr or a JSON object (keys
  with a prefix too; the value quoted either way, bytes, or bare);
- the fragment that libpq's connection-string parser quotes in its errors (`invalid
  percent-encoded token: "..."`, `unexpected spaces found in "..."`, ...), which is often a
  piece of a malformed password.
A URL whose user name or password holds a raw `@`, `/`, `?` or `#` cannot be parsed without
guessing, and parsers echo the piece they took for a host; `ambiguous_userinfo` tells callers
to refuse it unparsed.
"""

from __future__ import annotations

import re

__all__ = ["ambiguous_userinfo", "has_password", "redact"]

# The scheme is bounded (RFC 3986 sets no limit; real ones are short): unbounded, a long run of
# letters cost a scan to its end from each of its characters, quadratic in the text's length.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]{0,63}://[^:/@\s]*:)[^/\s]*@")
# A word ending in password/passwd (PGPASSWORD, db_passwd), then `=`; the value is a quoted
# string (either quote, backslash escapes) or runs to the next blank.
_KEYWORD_PASSWORD = re.compile(
    r"(?P<head>\b\w*?pass(?:word|wd)\s*=\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)",
    re.I,
)
# A quoted key ending in password/passwd, `:`, then a value as Python's repr or JSON writes
# it: a string in either quote (a repr switches to double quotes when the value holds a
# single one), bytes, or anything bare up to the next `,` or `}`.
_MAPPING_PASSWORD = re.compile(
    r"(?P<head>(?P<q>['\"])\w*?pass(?:word|wd)(?P=q)\s*:\s*)"
    r"(?:b?'(?:[^'\\]|\\.)*'|b?\"(?:[^\"\\]|\\.)*\"|[^,}\s]+)",
    re.I,
)
# libpq's connection-string errors quote the piece they could not parse, which may be part of
# the password. Those whose quote ends the line:
_LIBPQ_TRAILING = re.compile(
    r"(?P<head>(?:invalid percent-encoded token: |forbidden value %00 in percent-encoded value: "
    r"|separator \"=\" in URI query parameter: |invalid URI query parameter: "
    r"|in URI(?: \(expected \":\" or \"/\"\))?: |internal parser routine: "
    r"|invalid connection option )\")[^\n]*\"(?=[ \t]*$)",
    re.M,
)
# ... and those that go on after it.
_LIBPQ_INNER = re.compile(
    r"(?P<head>(?:unexpected spaces found in |missing \"=\" after |invalid integer value )\")"
    r"[^\n]*?\"(?P<tail>, use percent-encoded spaces| in connection info string"
    r"| for connection option)"
)


def _may_hold_password(text: str) -> bool:
    """Whether `text` has what every form above needs: `://`, a `"`, or `pass` in any case
    (casefold maps each character the patterns' IGNORECASE takes for a letter of it, the long
    s U+017F too). Most log lines have none, and these scans cost a tenth of one regex search."""
    return "://" in text or '"' in text or "pass" in text.casefold()


def redact(text: str) -> str:
    """Return `text` with every password it carries in a form above masked."""
    if not _may_hold_password(text):
        return text
    text = _LIBPQ_TRAILING.sub(r'\g<head>***"', text)
    text = _LIBPQ_INNER.sub(r'\g<head>***"\g<tail>', text)
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    text = _MAPPING_PASSWORD.sub(lambda m: f"{m['head']}{m['q']}***{m['q']}", text)
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
