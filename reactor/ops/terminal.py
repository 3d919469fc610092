"""Text from the table made safe to print on a terminal, for the commands' tables.

A photo id, a `last_error` or who paused a type is whatever someone wrote into the database:
an escape sequence in it would reach the operator's terminal and act there (retitle the
window, erase lines, fake output). Guarantee: `visible` returns one line with no character a
terminal acts on (C0 and C1 controls, DEL), no Unicode line or paragraph separator (which
ends a line for a log shipper) and no bidirectional override; each comes out as its Python
escape (`\\x1b`, `\\n`, `\\u2028`), so it is seen, not obeyed. `shorten` cuts a line to a
width keeping its head and its end (where an error's cause usually is).
JSON output needs neither: `json.dumps` escapes control characters itself.
"""

from __future__ import annotations

import re

__all__ = ["shorten", "visible"]

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """`text` on one line, every control character shown as its escape."""
    return _UNSAFE.sub(_escape, text)


def shorten(line: str, width: int) -> str:
    """`line` if it fits in `width` characters, else its head and its tail around `…`."""
    if len(line) <= width:
        return line
    head = (width - 1) // 2
    return line[:head] + "…" + line[len(line) - (width - 1 - head) :]
