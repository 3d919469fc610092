"""`reactor failures`: why rows failed, without psql.

The latest `failed` and `cancelled` rows (a cancelled row's `last_error` says who cancelled
it) and the rows that failed at least once and are retried (`pending` or `active` with a
`last_error`), newest first, with their attempt, `last_error` and when, and
how many more rows there are beyond the limit. The table for people shows each row on one
line: its texts with control characters escaped (`reactor.ops.terminal`) and passwords masked
(rows written by older releases or by hand were not), the error cut to fit around an
ellipsis, so its start and its end (where the cause usually is) both show. JSON carries the
texts whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from reactor.ops.terminal import shorten, visible
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.redact import redact

__all__ = ["Failure", "Failures", "format_failures", "read_failures"]

#: Characters of `last_error` the table shows (JSON has it all).
ERROR_COLUMN_CHARS = 80


@dataclass(frozen=True)
class Failure:
    """One row that failed (for good, or for now); `last_error` with passwords masked."""

    type: str
    photo_id: str
    state: str
    attempt: int
    max_attempts: int
    last_error: str | None
    updated_at: datetime
    next_retry_at: datetime | None
    #: The row's token (`prior_attempts + attempts`): which dispatch of the row this is.
    token: int | None = None

    def as_dict(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["updated_at"] = self.updated_at.isoformat()
        data["next_retry_at"] = self.next_retry_at.isoformat() if self.next_retry_at else None
        return data


@dataclass(frozen=True)
class Failures:
    """The rows listed, and how many more the limit left out."""

    rows: list[Failure]
    more: int

    def as_dict(self) -> dict[str, Any]:
        return {"failures": [r.as_dict() for r in self.rows], "more": self.more}


def read_failures(
    conn: Connection,
    job_type: str | None,
    limit: int,
    *,
    count_more: bool = True,
    error_chars: int | None = None,
) -> Failures:
    """The latest `limit` failed, cancelled and retried rows (of `job_type`, if given;
    `last_error` cut to `error_chars`, if given), and how many more there are (counted, with
    `count_more`, only when the limit is reached).

    Raises:
        DatabaseError: a query failed.
    """
    params = {"type": job_type, "limit": limit, "error_chars": error_chars}
    with translating("failures query failed"), conn.transaction():
        rows = conn.execute(queries.FAILURES, params).fetchall()
        total = len(rows)
        if count_more and total == limit:
            found = conn.execute(queries.FAILURES_COUNT, params).fetchone()
            total = int(found[0]) if found else total
    listed = [
        Failure(t, p, s, a, m, None if e is None else redact(e), u, n, int(k))
        for t, p, s, a, m, e, u, n, k in rows
    ]
    return Failures(listed, max(0, total - len(rows)))


def _cell(text: str) -> str:
    return visible(redact(text))


def format_failures(failures: Failures) -> str:
    """A table for people: one line per row, then how many more rows there are."""
    if not failures.rows:
        return "no failed or retried rows"
    header = f"{'when (UTC)':<19}  {'type':<16} {'photo_id':<20} {'state':<9} {'attempt':>7}  error"
    lines = [header]
    for f in failures.rows:
        when = f.updated_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        error = shorten(_cell((f.last_error or "").strip()), ERROR_COLUMN_CHARS)
        lines.append(
            f"{when:<19}  {_cell(f.type):<16} {_cell(f.photo_id):<20} {f.state:<9} "
            f"{f'{f.attempt}/{f.max_attempts}':>7}  {error}"
        )
    if failures.more:
        lines.append(f"… {failures.more} more (--limit to show more)")
    return "\n".join(lines)
