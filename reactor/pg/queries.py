"""Every SQL statement the reactor runs at runtime, by name: loaded once, at import, from
`queries.sql` beside this module (each block opens with `-- name: NAME`; the comments that
follow that line say what the statement does and guarantees, and stay out of the text sent).

Values are always bound parameters; nothing is assembled from strings. The claim and
re-dispatch queries lock with `FOR UPDATE SKIP LOCKED` so any number of reactors can run at
once, and they pick rows by `ctid = ANY(ARRAY(...))`: that shape keeps its plan at every batch
size and table shape, where `(key) IN (SELECT ...)` flips to a hash join over the whole table.
The pending index is on (type, coalesce(next_retry_at, created_at)); each pending query filters
on one type and orders by that expression, so it is one index range scan.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = [
    "APPLIED_VERSIONS",
    "ATTEMPT_DONE",
    "ATTEMPT_FAILED",
    "ATTEMPT_HEARTBEAT",
    "ATTEMPT_RECHECK",
    "ATTEMPT_RETRY",
    "ATTEMPT_START",
    "BACKLOG",
    "CLAIM_DUE",
    "CLAIM_NOTIFIED",
    "COUNT_FINISHED",
    "CURRENT_MINUTE",
    "DATABASE_NOW",
    "DONE_COUNTS",
    "DOORBELL_ARM",
    "DOORBELL_HOLDERS",
    "DOORBELL_RELEASE",
    "DOORBELL_TRY_ARM",
    "FAILURES",
    "FAILURES_COUNT",
    "FINISHED_BY_MINUTE",
    "FORGET_DEAD_ROUTES",
    "FOUND_PHOTO_IDS",
    "KIT_ADVANCE",
    "KIT_SUBMITTED",
    "KNOWN_TYPES",
    "LEDGER_EXISTS",
    "LEDGER_PROBLEM",
    "LISTEN",
    "LIST_ACTIVE",
    "LIVE_ROUTE_CONFLICTS",
    "LOCK_ROUTES",
    "MAY_INSERT_ROWS",
    "MIGRATION_LOCK",
    "MIGRATION_UNLOCK",
    "NEXT_DUE_IN",
    "OLDEST_DUE_AGE",
    "PAUSED_TYPES",
    "PAUSE_TYPES",
    "PENDING_TYPES",
    "PING",
    "PRUNE_FINISHED",
    "QUIET_ACTIVE",
    "REACTOR_SESSIONS",
    "RECORDED_ROUTES",
    "RECORD_ROUTE",
    "REDISPATCH",
    "REQUEUE_FAILED",
    "REQUEUE_PHOTOS",
    "RESUME_TYPES",
    "ROUTES_KEPT",
    "ROUTES_LOCK_KEEP",
    "ROUTES_LOCK_OWNER",
    "ROUTES_LOCK_TIMEOUT",
    "ROUTES_LOCK_TRY",
    "ROUTES_STOPPED",
    "ROUTES_UNLOCK",
    "SCHEMA_VERSION",
    "SEARCH_PATH_NOW",
    "SERVER_READ_ONLY",
    "SET_IDLE_IN_TRANSACTION_TIMEOUT",
    "SET_LOCAL_SEARCH_PATH",
    "SET_LOCK_TIMEOUT",
    "SET_SEARCH_PATH",
    "STATUS_COUNTS",
    "STATUS_PER_TYPE",
    "SUBMIT_MANY",
    "WARM_UP_ROW",
]

_NAME_LINE = re.compile(r"^-- name: ([A-Z][A-Z0-9_]*)$", re.MULTILINE)


def _load() -> dict[str, str]:
    """The statements of queries.sql by name. A file whose names are not exactly `__all__` (a
    statement missing, doubled or unknown) stops the import: no process starts on it."""
    text = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _NAME_LINE.split(text)[1:]  # name, block, name, block, ...
    statements: dict[str, str] = {}
    for name, block in zip(parts[::2], parts[1::2], strict=True):
        lines = block.strip("\n").split("\n")
        while lines and lines[0].startswith("--"):  # what it does: for the reader
            lines.pop(0)
        while lines and (not lines[-1].strip() or lines[-1].startswith("--")):  # next heading
            lines.pop()
        if name in statements or not lines:
            raise RuntimeError(f"queries.sql: statement {name} is doubled or empty")
        statements[name] = "\n".join(lines).strip() + "\n"
    if set(statements) != set(__all__):
        differ = sorted(set(statements) ^ set(__all__))
        raise RuntimeError(f"queries.sql: names differ from queries.__all__: {differ}")
    return statements


_STATEMENTS = _load()

CLAIM_DUE = _STATEMENTS["CLAIM_DUE"]
CLAIM_NOTIFIED = _STATEMENTS["CLAIM_NOTIFIED"]
NEXT_DUE_IN = _STATEMENTS["NEXT_DUE_IN"]
LIST_ACTIVE = _STATEMENTS["LIST_ACTIVE"]
REDISPATCH = _STATEMENTS["REDISPATCH"]
PENDING_TYPES = _STATEMENTS["PENDING_TYPES"]
BACKLOG = _STATEMENTS["BACKLOG"]
OLDEST_DUE_AGE = _STATEMENTS["OLDEST_DUE_AGE"]
LOCK_ROUTES = _STATEMENTS["LOCK_ROUTES"]
ROUTES_LOCK_TRY = _STATEMENTS["ROUTES_LOCK_TRY"]
ROUTES_KEPT = _STATEMENTS["ROUTES_KEPT"]
ROUTES_LOCK_KEEP = _STATEMENTS["ROUTES_LOCK_KEEP"]
ROUTES_LOCK_OWNER = _STATEMENTS["ROUTES_LOCK_OWNER"]
ROUTES_STOPPED = _STATEMENTS["ROUTES_STOPPED"]
ROUTES_LOCK_TIMEOUT = _STATEMENTS["ROUTES_LOCK_TIMEOUT"]
ROUTES_UNLOCK = _STATEMENTS["ROUTES_UNLOCK"]
LIVE_ROUTE_CONFLICTS = _STATEMENTS["LIVE_ROUTE_CONFLICTS"]
FORGET_DEAD_ROUTES = _STATEMENTS["FORGET_DEAD_ROUTES"]
RECORD_ROUTE = _STATEMENTS["RECORD_ROUTE"]
RECORDED_ROUTES = _STATEMENTS["RECORDED_ROUTES"]
FOUND_PHOTO_IDS = _STATEMENTS["FOUND_PHOTO_IDS"]
FAILURES = _STATEMENTS["FAILURES"]
FAILURES_COUNT = _STATEMENTS["FAILURES_COUNT"]
PAUSE_TYPES = _STATEMENTS["PAUSE_TYPES"]
RESUME_TYPES = _STATEMENTS["RESUME_TYPES"]
PAUSED_TYPES = _STATEMENTS["PAUSED_TYPES"]
KNOWN_TYPES = _STATEMENTS["KNOWN_TYPES"]
PRUNE_FINISHED = _STATEMENTS["PRUNE_FINISHED"]
COUNT_FINISHED = _STATEMENTS["COUNT_FINISHED"]
CURRENT_MINUTE = _STATEMENTS["CURRENT_MINUTE"]
FINISHED_BY_MINUTE = _STATEMENTS["FINISHED_BY_MINUTE"]
REACTOR_SESSIONS = _STATEMENTS["REACTOR_SESSIONS"]
LEDGER_PROBLEM = _STATEMENTS["LEDGER_PROBLEM"]
SET_IDLE_IN_TRANSACTION_TIMEOUT = _STATEMENTS["SET_IDLE_IN_TRANSACTION_TIMEOUT"]
SERVER_READ_ONLY = _STATEMENTS["SERVER_READ_ONLY"]
LISTEN = _STATEMENTS["LISTEN"]
SET_LOCK_TIMEOUT = _STATEMENTS["SET_LOCK_TIMEOUT"]
PING = _STATEMENTS["PING"]
DOORBELL_TRY_ARM = _STATEMENTS["DOORBELL_TRY_ARM"]
DOORBELL_ARM = _STATEMENTS["DOORBELL_ARM"]
DOORBELL_RELEASE = _STATEMENTS["DOORBELL_RELEASE"]
DOORBELL_HOLDERS = _STATEMENTS["DOORBELL_HOLDERS"]
LEDGER_EXISTS = _STATEMENTS["LEDGER_EXISTS"]
APPLIED_VERSIONS = _STATEMENTS["APPLIED_VERSIONS"]
SCHEMA_VERSION = _STATEMENTS["SCHEMA_VERSION"]
SET_SEARCH_PATH = _STATEMENTS["SET_SEARCH_PATH"]
MIGRATION_LOCK = _STATEMENTS["MIGRATION_LOCK"]
MIGRATION_UNLOCK = _STATEMENTS["MIGRATION_UNLOCK"]
DATABASE_NOW = _STATEMENTS["DATABASE_NOW"]
STATUS_COUNTS = _STATEMENTS["STATUS_COUNTS"]
DONE_COUNTS = _STATEMENTS["DONE_COUNTS"]
STATUS_PER_TYPE = _STATEMENTS["STATUS_PER_TYPE"]
QUIET_ACTIVE = _STATEMENTS["QUIET_ACTIVE"]
REQUEUE_FAILED = _STATEMENTS["REQUEUE_FAILED"]
REQUEUE_PHOTOS = _STATEMENTS["REQUEUE_PHOTOS"]
ATTEMPT_START = _STATEMENTS["ATTEMPT_START"]
ATTEMPT_RECHECK = _STATEMENTS["ATTEMPT_RECHECK"]
ATTEMPT_HEARTBEAT = _STATEMENTS["ATTEMPT_HEARTBEAT"]
ATTEMPT_DONE = _STATEMENTS["ATTEMPT_DONE"]
ATTEMPT_FAILED = _STATEMENTS["ATTEMPT_FAILED"]
ATTEMPT_RETRY = _STATEMENTS["ATTEMPT_RETRY"]
SUBMIT_MANY = _STATEMENTS["SUBMIT_MANY"]
MAY_INSERT_ROWS = _STATEMENTS["MAY_INSERT_ROWS"]
WARM_UP_ROW = _STATEMENTS["WARM_UP_ROW"]
KIT_SUBMITTED = _STATEMENTS["KIT_SUBMITTED"]
KIT_ADVANCE = _STATEMENTS["KIT_ADVANCE"]
SEARCH_PATH_NOW = _STATEMENTS["SEARCH_PATH_NOW"]
SET_LOCAL_SEARCH_PATH = _STATEMENTS["SET_LOCAL_SEARCH_PATH"]
