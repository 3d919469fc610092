"""Apply the SQL migrations of `sql/` to a database, each in its own transaction.

The files are the same ones a person runs with `psql -X -v ON_ERROR_STOP=1 -1 -f FILE`: each
records its own version in `reactor_migrations` before changing anything, so `psql` and
`reactor migrate` agree on what is applied and nothing is ever applied twice. `reactor migrate`
additionally holds a session advisory lock, so concurrent runs wait for each other and the later
ones find nothing left to do; while it waits it logs who holds the lock (any role may take an
advisory key: a session squatting it is named, not waited for in silence). Before any file
runs, the session's search_path is pinned and an existing ledger that the migrations did not
make (another owner, triggers, rules, policies, unexpected columns) is refused: migrations
often run as a superuser. The files ship inside the wheel (as `reactor/sql`), so this works
from an installed package, not only from a checkout.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg

from reactor.errors import DatabaseError, MigrationError
from reactor.pg import queries
from reactor.pg.db import Connection, describe_error

__all__ = [
    "CURRENT_SCHEMA_FILE",
    "MIGRATION_LOCK_KEY",
    "SEARCH_PATH",
    "MigrateResult",
    "Migration",
    "load_migrations",
    "migrate",
    "unapplied",
]

#: The current schema in one file beside the migrations, for new databases (not a migration).
CURRENT_SCHEMA_FILE = "schema.sql"
#: Advisory lock held by `reactor migrate` while it applies files ("phmigr" in ASCII).
MIGRATION_LOCK_KEY = 0x7068_6D69_6772
#: How often a waiting `reactor migrate` tries the lock again.
LOCK_POLL_SECONDS = 0.2
#: The search_path of a migrating session: objects are created in `public`; names resolve in
#: pg_catalog first (implicitly, as it is not listed), then public, temporary objects last.
SEARCH_PATH = "public, pg_temp"

logger = logging.getLogger(__name__)

_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


@dataclass(frozen=True)
class Migration:
    """One file of `sql/`."""

    version: int
    name: str
    sql: str


@dataclass(frozen=True)
class MigrateResult:
    """What a `migrate` call did."""

    applied: tuple[str, ...]
    version: int


def _sql_files() -> list[tuple[str, str]]:
    """(name, text) of every file of the migrations folder."""
    packaged = resources.files("reactor") / "sql"
    if packaged.is_dir():
        return [(entry.name, entry.read_text("utf-8")) for entry in packaged.iterdir()]
    # A checkout or an editable install: the files live at the top of the repository.
    checkout = Path(__file__).resolve().parents[2] / "sql"
    if checkout.is_dir():
        return [(entry.name, entry.read_text("utf-8")) for entry in checkout.iterdir()]
    raise MigrationError("migration files not found (neither reactor/sql nor ./sql)")


def load_migrations() -> list[Migration]:
    """All migrations, in version order.

    Raises:
        MigrationError: the files are missing, misnamed, or their versions have a gap.
    """
    found: list[Migration] = []
    for name, text in _sql_files():
        if not name.endswith(".sql") or name == CURRENT_SCHEMA_FILE:
            continue
        match = _NAME.fullmatch(name)
        if not match:
            raise MigrationError(f"migration file {name!r} is not named NNNN_verb_object.sql")
        found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise MigrationError("migration versions must run 1, 2, 3, ... without gaps")
    if not found:
        raise MigrationError("no migration files found")
    return found


def _applied_versions(conn: Connection) -> set[int]:
    row = conn.execute(queries.LEDGER_EXISTS).fetchone()
    if row is None or not row[0]:
        return set()
    return {row[0] for row in conn.execute(queries.APPLIED_VERSIONS)}


def unapplied(conn: Connection) -> list[Migration]:
    """The migrations not applied to `conn`'s database yet, in order (for another migration
    tool to apply: `reactor migrate --sql`).

    Raises:
        MigrationError: the files are missing or misnamed.
        DatabaseError: the connection failed.
    """
    migrations = load_migrations()
    try:
        conn.execute(queries.SET_SEARCH_PATH, {"search_path": SEARCH_PATH})
        done = _applied_versions(conn)
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot read the applied migrations: {describe_error(exc)}") from exc
    return [m for m in migrations if m.version not in done]


def _take_lock(conn: Connection) -> None:
    """Wait for the migration lock, saying who holds it (once per holder): another `reactor
    migrate`, or any session at all, since every role may take an advisory key."""
    params = {"key": MIGRATION_LOCK_KEY}
    told: tuple[Any, ...] | None = None
    while not _fetch_flag(conn.execute(queries.MIGRATION_LOCK, params).fetchone()):
        holder = conn.execute(queries.MIGRATION_LOCK_HOLDER, params).fetchone()
        if holder is not None and tuple(holder) != told:
            told = tuple(holder)
            pid, role, application = told
            logger.warning(
                "migration_lock_waiting holder_pid=%s role=%r application=%r (another reactor"
                " migrate, or a session holding its key: pg_terminate_backend(%s) ends it)",
                pid,
                role,
                application,
                pid,
            )
        time.sleep(LOCK_POLL_SECONDS)


def _fetch_flag(row: Any) -> bool:
    return row is not None and row[0] is True


def migrate(conn: Connection) -> MigrateResult:
    """Apply every migration not yet applied; `conn` must be in autocommit mode.

    Raises:
        MigrationError: a migration failed (it was rolled back whole).
        DatabaseError: the connection failed.
    """
    migrations = load_migrations()
    applied: list[str] = []
    try:
        # Whatever the role's search_path (a schema named after it, one another role can
        # write to), the files' names resolve in pg_catalog, then public.
        conn.execute(queries.SET_SEARCH_PATH, {"search_path": SEARCH_PATH})
        _take_lock(conn)
        try:
            row = conn.execute(queries.LEDGER_PROBLEM).fetchone()
            if row is not None and row[0] is not None:
                raise MigrationError(
                    f"refusing to migrate: public.reactor_migrations {row[0]}; run the "
                    "migrations as the role that owns the schema, on a ledger it created"
                )
            done = _applied_versions(conn)
            for migration in migrations:
                if migration.version in done:
                    continue
                label = f"{migration.version:04d}_{migration.name}"
                try:
                    with conn.transaction():
                        # No parameters: psycopg sends the file as one simple query, so it may
                        # hold several statements, exactly as psql runs it.
                        conn.execute(migration.sql.encode("utf-8"))
                except psycopg.errors.DatabaseError as exc:
                    raise MigrationError(
                        f"migration {label} failed: {describe_error(exc)}"
                    ) from exc
                applied.append(label)
            version = max(_applied_versions(conn), default=0)
        finally:
            if not conn.closed:
                conn.execute(queries.MIGRATION_UNLOCK, {"key": MIGRATION_LOCK_KEY})
    except psycopg.OperationalError as exc:
        raise DatabaseError(f"migration aborted: {describe_error(exc)}") from exc
    return MigrateResult(tuple(applied), version)
