"""Who else may create objects where a session's names resolve.

Postgres resolves a call to the function or operator whose argument types match best, in any
schema of the search_path: a `format(text, text)` in `public` wins over pg_catalog's
`format(text, VARIADIC "any")` wherever the schemas stand. The statements in queries.sql name
pg_catalog where that could happen, but a schema others may write to is still theirs to fill
(and its tables the next names to take over), so `reactor run` says so at start, once per such
schema: `schema_writable_by_others schema=public roles=...`. Superusers, the owner of
photo_jobs and the roles that are members of it are trusted already and left out.
"""

from __future__ import annotations

import logging

from reactor.errors import StatementError
from reactor.pg import queries
from reactor.pg.db import Connection, abandon, translating

__all__ = ["SHOWN_ROLES", "untrusted_writers", "warn_untrusted_writers"]

logger = logging.getLogger(__name__)

#: Roles named in a warning line; more are counted.
SHOWN_ROLES = 10


def untrusted_writers(conn: Connection) -> list[tuple[str, list[str]]]:
    """The schemas of `conn`'s search_path that untrusted roles may create in, with those roles
    (none: nothing to worry about). Reads only; ends the transaction it opened.

    Raises:
        DatabaseError: the connection failed.
        StatementError: the catalogs could not be read.
    """
    with translating("search_path check failed", conn):
        rows = conn.execute(queries.SEARCH_PATH_WRITERS).fetchall()
        if not conn.autocommit:
            conn.rollback()
    return [(str(schema), [str(role) for role in roles]) for schema, roles in rows]


def warn_untrusted_writers(conn: Connection) -> None:
    """Log one warning per schema of `conn`'s search_path that untrusted roles may create in.
    A check that cannot run is only noted at debug level: it must not stop a start.

    Raises:
        DatabaseError: the connection failed.
    """
    try:
        found = untrusted_writers(conn)
    except StatementError as exc:
        abandon(conn)
        logger.debug("search_path_check_skipped error=%s", exc)
        return
    for schema, roles in found:
        named = ",".join(_shown(role) for role in roles[:SHOWN_ROLES])
        more = f"(+{len(roles) - SHOWN_ROLES})" if len(roles) > SHOWN_ROLES else ""
        logger.warning(
            "schema_writable_by_others schema=%s roles=%s%s (functions they create there may"
            " run with this reactor's rights: revoke CREATE on it from them, or from PUBLIC)",
            _shown(schema),
            named,
            more,
        )


def _shown(name: str) -> str:
    """A name for a log line: as it is, or its repr if it holds a character a terminal acts on."""
    return name if name.isprintable() else repr(name)
