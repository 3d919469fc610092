"""The project's exceptions: one base, one subclass per kind of failure, siblings that say what
happened (`DatabaseError`: Postgres unavailable; `StatementError`: a statement failed;
`RedisUnavailableError`: Redis failed or refused; `RedisDataError`: a key holds what the
enqueue cannot write over), since each calls for its own reaction.

Library errors (psycopg, redis-py, rq) are translated into these at the boundary where they
happen, once; callers above that boundary only ever see a `ReactorError`. Each class carries
the process exit code the CLI uses for it (2 for usage/configuration, 1 for runtime).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DatabaseError",
    "InvalidJobError",
    "LockBusyError",
    "MigrationError",
    "PermanentError",
    "ReactorError",
    "RedisDataError",
    "RedisUnavailableError",
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
    """Postgres is unavailable: the connection could not be made, was lost, or the server no
    longer takes writes (the caller reconnects and retries)."""


class StatementError(ReactorError):
    """A statement failed on a healthy connection (bad data, a constraint, a user's trigger):
    running it again will fail again, so the caller isolates it instead of reconnecting."""


class LockBusyError(StatementError):
    """A lock the statement asked for without waiting (`lock_timeout`, `NOWAIT`) is held."""


class RedisUnavailableError(ReactorError):
    """Redis failed or refused a command (down, hung past its timeout, out of memory); what
    was being written was not written: a batch's claim is rolled back."""

    def __init__(self, message: str, *, rows: int = 0) -> None:
        super().__init__(message)
        #: How many rows the failed batch held (they stay as they were).
        self.rows = rows


class RedisDataError(ReactorError):
    """A Redis key that a batch's jobs would write holds a value of another kind (planted, or
    left by something else): nothing of the batch was written and its claim is rolled back.
    Trying again fails again, so the caller leaves out the row whose job key it is, or the
    type whose queue key it is, and the others go on."""

    def __init__(self, message: str, *, key: str, photo_id: str | None = None) -> None:
        super().__init__(message)
        #: The key that holds the wrong kind of value.
        self.key = key
        #: The row whose job key it is; None: a key the batch's queue shares.
        self.photo_id = photo_id


class InvalidJobError(ReactorError):
    """A job given to `submit()` is malformed (empty or too long photo id, bad type)."""

    exit_code = 2


class MigrationError(ReactorError):
    """A migration could not be applied."""


class PermanentError(Exception):
    """Raised by a handler for a failure that retrying cannot fix: the row goes to `failed`.

    It does not derive from `ReactorError` on purpose: it is part of the handler API, raised by
    user code, never by the reactor.
    """
