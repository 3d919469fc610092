"""`manage.py reactor ARGS...`: the `reactor` command on `settings.DATABASES["default"]`
(`manage.py reactor status`, `manage.py reactor requeue --failed`). Every argument goes to
`reactor` as it is; the database's settings reach it as `DATABASE_URL` (a libpq conninfo),
in this process only, never on a command line."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from psycopg.conninfo import make_conninfo

from reactor.cli import main

#: Django's own OPTIONS of the postgresql backend, which are not libpq parameters.
_DJANGO_OPTIONS = frozenset(
    {"assume_role", "isolation_level", "pool", "server_side_binding", "cursor_factory"}
)


def conninfo(database: dict[str, Any]) -> str:
    """The libpq conninfo of a Django `DATABASES` entry."""
    params = {
        "dbname": database.get("NAME"),
        "user": database.get("USER"),
        "password": database.get("PASSWORD"),
        "host": database.get("HOST"),
        "port": str(database.get("PORT") or ""),
    }
    extra = {k: v for k, v in database.get("OPTIONS", {}).items() if k not in _DJANGO_OPTIONS}
    return make_conninfo("", **{k: v for k, v in {**params, **extra}.items() if v})


class Command(BaseCommand):
    help = "Run the reactor command on the default database: manage.py reactor status"

    def run_from_argv(self, argv: list[str]) -> None:
        os.environ["DATABASE_URL"] = conninfo(settings.DATABASES["default"])
        main(argv[2:], prog_name=f"{os.path.basename(argv[0])} reactor")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("args", nargs="*")

    def handle(self, *args: Any, **options: Any) -> None:
        self.run_from_argv(["manage.py", "reactor", *args])
