"""One Django migration per SQL file of `sql/`: each runs the packaged file as it is, unless the
ledger says it is applied already (by `reactor migrate` or psql), so either tool may migrate a
database first and the other then finds nothing to do.

Before a file runs, the ledger is checked as `reactor migrate` checks it (a ledger the
migrating role did not make is refused: its triggers would run with that role's rights). The
files set their own `search_path` for their transaction; Django's migration goes on in that
transaction (it records itself there), so the session's is put back after each file.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from reactor.errors import MigrationError
from reactor.pg import queries
from reactor.pg.migrate import SEARCH_PATH, load_migrations
from reactor.producer import sync_executor

__all__ = ["MODELS_STATE", "sql_migration"]

#: The migration that puts the app's models in Django's state (no SQL), and the SQL version it
#: follows: later SQL migrations depend on it too, so the app's migrations keep a single leaf.
MODELS_STATE = "0022_photo_job_models"
_MODELS_STATE_AFTER = 21


def _module_name(version: int) -> str:
    found = next(m for m in load_migrations() if m.version == version)
    return f"{found.version:04d}_{found.name}"


def sql_migration(module: str) -> type[migrations.Migration]:
    """The Django migration of the SQL file that `module` (a migration module's `__name__`,
    `...migrations.0001_create_photo_jobs`) is named after.

    Raises:
        MigrationError: no SQL file has that name.
    """
    label = module.rpartition(".")[2]
    found = [m for m in load_migrations() if f"{m.version:04d}_{m.name}" == label]
    if not found:
        raise MigrationError(f"no SQL migration named {label}.sql")
    version, sql = found[0].version, found[0].sql

    def apply(apps: Any, schema_editor: Any) -> None:
        execute = sync_executor(schema_editor.connection)
        saved = execute(queries.SEARCH_PATH_NOW, {})[1][0][0]
        execute(queries.SET_LOCAL_SEARCH_PATH, {"search_path": SEARCH_PATH})
        problem = execute(queries.LEDGER_PROBLEM, {})[1][0][0]
        if problem is not None:
            raise MigrationError(
                f"refusing to migrate: public.reactor_migrations {problem}; run the "
                "migrations as the role that owns the schema, on a ledger it created"
            )
        applied: set[int] = set()
        if execute(queries.LEDGER_EXISTS, {})[1][0][0]:
            applied = {int(row[0]) for row in execute(queries.APPLIED_VERSIONS, {})[1]}
        if version not in applied:
            schema_editor.execute(sql, params=None)
        execute(queries.SET_LOCAL_SEARCH_PATH, {"search_path": saved})

    dependencies = [("reactor", _module_name(version - 1))] if version > 1 else []
    if version > _MODELS_STATE_AFTER:
        dependencies.append(("reactor", MODELS_STATE))
    attributes = {
        "dependencies": dependencies,
        "operations": [migrations.RunPython(apply)],
    }
    return type("Migration", (migrations.Migration,), attributes)
