"""Pausing and resuming job types (`reactor pause` / `reactor resume`).

A paused type is a row in `reactor_paused_types`. Every reactor's claim reads that table in
the claiming statement itself, so a pause holds at once for every reactor, with no cache to
go stale and no extra round trip: rows of a paused type stay `pending` (nothing is lost), the
sweep neither claims nor rescues them, and jobs already in RQ queues still run. Resuming
deletes the row; a trigger then notifies the listening reactors, which dispatch the type's
due rows at once.

A type is accepted when it is well formed and known: routed in this command's configuration
(`--route`/`REACTOR_ROUTES`), present in `photo_jobs`, or already paused. Anything else is
refused, so a typo cannot pause nothing and look like success.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from reactor.errors import ConfigError
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.validate import is_valid_type

__all__ = [
    "PauseResult",
    "PausedType",
    "check_types",
    "pause_types",
    "paused_types",
    "resume_types",
    "who",
]


@dataclass(frozen=True)
class PausedType:
    """One paused type."""

    type: str
    paused_at: datetime
    paused_by: str


@dataclass(frozen=True)
class PauseResult:
    """What a pause or resume changed (`changed`) and what was already so (`unchanged`)."""

    changed: list[str]
    unchanged: list[str]


def who() -> str:
    """`user@host` of this process, recorded as `paused_by`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _check_format(types: Sequence[str]) -> list[str]:
    wanted = list(dict.fromkeys(types))
    if not wanted:
        raise ConfigError("give at least one TYPE")
    for job_type in wanted:
        if not is_valid_type(job_type):
            raise ConfigError(f"bad type {job_type[:200]!r}: must match [A-Za-z0-9_.-]{{1,128}}")
    return wanted


_PAUSE_HINT = "give --route TYPE=... to pause a type before its first row"


def check_types(
    conn: Connection, types: Sequence[str], routed: Collection[str], hint: str = _PAUSE_HINT
) -> list[str]:
    """The distinct types, in order, once each is known to be well formed and known.

    Raises:
        ConfigError: a type is malformed or unknown (no route, no rows, not paused).
        DatabaseError: the lookup failed.
    """
    wanted = _check_format(types)
    unrouted = [t for t in wanted if t not in routed]
    if unrouted:
        with translating("type lookup failed"), conn.transaction():
            known = {row[0] for row in conn.execute(queries.KNOWN_TYPES, {"types": unrouted})}
        unknown = [t for t in unrouted if t not in known]
        if unknown:
            raise ConfigError(
                f"unknown type {unknown[0]!r}: no route, no rows and not paused ({hint})"
            )
    return wanted


def pause_types(
    conn: Connection, types: Sequence[str], routed: Collection[str], paused_by: str
) -> PauseResult:
    """Pause `types` (checked with `check_types`) in one transaction.

    Raises:
        ConfigError: a type is malformed or unknown; nothing was paused.
        DatabaseError: the statement failed; nothing was paused.
    """
    wanted = check_types(conn, types, routed)
    with translating("pause failed"), conn.transaction():
        paused = {
            row[0]
            for row in conn.execute(queries.PAUSE_TYPES, {"types": wanted, "paused_by": paused_by})
        }
    return PauseResult([t for t in wanted if t in paused], [t for t in wanted if t not in paused])


def resume_types(conn: Connection, types: Sequence[str], routed: Collection[str]) -> PauseResult:
    """Resume `types` (checked with `check_types`) in one transaction.

    Raises:
        ConfigError: a type is malformed or unknown; nothing was resumed.
        DatabaseError: the statement failed; nothing was resumed.
    """
    wanted = check_types(conn, types, routed, hint="nothing resumed")
    with translating("resume failed"), conn.transaction():
        resumed = {row[0] for row in conn.execute(queries.RESUME_TYPES, {"types": wanted})}
    return PauseResult([t for t in wanted if t in resumed], [t for t in wanted if t not in resumed])


def paused_types(conn: Connection) -> list[PausedType]:
    """Every paused type, by name. Runs in the caller's transaction, if any.

    Raises:
        psycopg.Error: the query failed (callers translate it with their own context).
    """
    return [PausedType(t, at, by) for t, at, by in conn.execute(queries.PAUSED_TYPES)]
