"""`reactor failures`: why rows failed, without psql.

The latest `failed` rows and the rows that failed at least once and are retried (`pending` or
`active` with a `last_error`), newest first, with their attempt, `last_error` and when. The
table for people shows the first line of each error, cut to fit; JSON carries it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg

from reactor import queries
from reactor.db import Connection, describe_error
from reactor.errors import DatabaseError

__all__ = ["Failure", "format_failures", "read_failures"]

#: Characters of `last_error` the table shows (JSON has it all).
ERROR_COLUMN_CHARS = 80


@dataclass(frozen=True)
class Failure:
    """One row that failed (for good, or for now)."""

    type: str
    photo_id: str
    state: str
    attempt: int
    max_attempts: int
    last_error: str | None
    updated_at: datetime
    next_retry_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["updated_at"] = self.updated_at.isoformat()
        data["next_retry_at"] = self.next_retry_at.isoformat() if self.next_retry_at else None
        return data


def read_failures(conn: Connection, job_type: str | None, limit: int) -> list[Failure]:
    """The latest `limit` failed and retried rows (of `job_type`, if given).

    Raises:
        DatabaseError: the query failed.
    """
    try:
        with conn.transaction():
            rows = conn.execute(queries.FAILURES, {"type": job_type, "limit": limit}).fetchall()
    except psycopg.Error as exc:
        raise DatabaseError(f"failures query failed: {describe_error(exc)}") from exc
    return [Failure(*row) for row in rows]


def _one_line(text: str | None, width: int) -> str:
    lines = (text or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def format_failures(failures: list[Failure]) -> str:
    """A table for people: one line per row."""
    if not failures:
        return "no failed or retried rows"
    header = f"{'when (UTC)':<19}  {'type':<16} {'photo_id':<20} {'state':<7} {'attempt':>7}  error"
    lines = [header]
    for f in failures:
        when = f.updated_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(
            f"{when:<19}  {f.type:<16} {f.photo_id:<20} {f.state:<7} "
            f"{f'{f.attempt}/{f.max_attempts}':>7}  {_one_line(f.last_error, ERROR_COLUMN_CHARS)}"
        )
    return "\n".join(lines)
