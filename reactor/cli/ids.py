"""Photo ids on the command line: read from standard input (`-`) without splitting an id, and
named in an error line that stays one line, whatever an id holds."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import click

from reactor.ops.terminal import visible
from reactor.validate import is_blank

__all__ = ["report_missing", "with_stdin"]


def report_missing(missing: list[str], job_type: str | None) -> None:
    """One error line naming the ids with no row, each escaped (a blank one quoted)."""
    kind = "" if job_type is None else f" of type {job_type}"
    shown = ", ".join(_shown(photo_id) for photo_id in missing)
    click.echo(f"reactor: error: no row{kind} for: {shown}", err=True)


def _shown(photo_id: str) -> str:
    if is_blank(photo_id):
        return repr(photo_id)
    return visible(photo_id)


def with_stdin(photo_ids: tuple[str, ...]) -> Iterator[str]:
    """The ids, with `-` replaced by the lines of standard input (read once): a line ends at a
    line feed alone, one CR before it is dropped (CRLF files), empty lines are skipped. Every
    other line break Python knows (CR alone, U+2028, U+0085, VT, FS...) may be inside an id."""
    for photo_id in photo_ids:
        if photo_id != "-":
            yield photo_id
            continue
        # UTF-8 whatever the locale, as the table holds ids; undecodable bytes are refused
        # by the id check (as lone surrogates).
        text = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
        yield from filter(None, (line.removesuffix("\r") for line in text.split("\n")))
