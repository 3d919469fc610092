"""The project's exceptions: one base, one subclass per kind of failure.

Library errors (psycopg, redis-py, rq) are translated into these at the boundary where they
happen, once; callers above that boundary only ever see a `ReactorError`. Each class carries
the process exit code the CLI uses for it (2 for usage/configuration, 1 for runtime).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DatabaseError",
    "EnqueueError",
    "InvalidJobError",
    "LockBusyError",
    "MigrationError",
    "PermanentError",
    "ReactorError",
    "SchemaError",
    "StatementError",
]


class ReactorError(Exception):
    """photo-reactor failed."""

    exit_code = 1


class ConfigError(ReactorError):
    """A setting is wrong: a bad URL, an unknown route, an unreachable server at start-up."""

    exit_code = 2


class SchemaError(ConfigError):
    """The database is not migrated to the version this release needs."""


class DatabaseError(ReactorError):
    """A Postgres operation failed at runtime (the caller reconnects and retries)."""


class InvalidJobError(ReactorError):
    """A job given to `submit()` is malformed (empty or too long photo id, bad type)."""

    exit_code = 2


class StatementError(DatabaseError):
    """A statement failed on a healthy connection (bad data, a constraint, a user's trigger):
    running it again will fail again, so the caller isolates it instead of reconnecting."""


class LockBusyError(StatementError):
    """A lock the statement asked for without waiting (`lock_timeout`, `NOWAIT`) is held."""


class EnqueueError(ReactorError):
    """Handing a batch to Redis/RQ failed; the claim was rolled back."""

    def __init__(self, message: str, *, rows: int = 0) -> None:
        super().__init__(message)
        #: How many rows the failed batch held (they stay as they were).
        self.rows = rows


class MigrationError(ReactorError):
    """A migration could not be applied."""


class PermanentError(Exception):
    """Raised by a handler for a failure that retrying cannot fix: the row goes to `failed`.

    It does not derive from `ReactorError` on purpose: it is part of the handler API, raised by
    user code, never by the reactor.
    """
