"""`manage.py reactor ARGS...`: the `reactor` command on `settings.DATABASES["default"]`
(`manage.py reactor status`, `manage.py reactor requeue --failed`). Every argument goes to
`reactor` as it is; the database's settings reach it as `DATABASE_URL` (a libpq conninfo),
in this process only, never on a command line.

`call_command("reactor", "status", "--json")` does the same in the calling process: every
argument goes to `reactor` (none is read as Django's), its output to the command's `stdout` and
`stderr`; it returns when `reactor` exits 0 and raises `CommandError` (its `returncode` that
exit code) otherwise. `DATABASE_URL` and the logging set-up `reactor` makes are put back
after it."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
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


@contextlib.contextmanager
def _in_this_call(database_url: str) -> Iterator[None]:
    """`DATABASE_URL` set, and the root logger's set-up kept, for one in-process run of
    `reactor` (its CLI configures the root logger: the host process's own must come back)."""
    saved_url = os.environ.get("DATABASE_URL")
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    os.environ["DATABASE_URL"] = database_url
    try:
        yield
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        if saved_url is None:
            os.environ.pop("DATABASE_URL", None)
        else:
            os.environ["DATABASE_URL"] = saved_url


class _Verbatim(io.TextIOBase):
    """A text stream onto a command's `OutputWrapper`, whose `write` would end every piece
    `reactor` writes (an empty one too) with a line break."""

    def __init__(self, out: Any) -> None:
        self._out = out

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._out.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self._out.flush()


class Command(BaseCommand):
    help = "Run the reactor command on the default database: manage.py reactor status"

    def run_from_argv(self, argv: list[str]) -> None:
        os.environ["DATABASE_URL"] = conninfo(settings.DATABASES["default"])
        main(argv[2:], prog_name=f"{os.path.basename(argv[0])} reactor")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse = parser.parse_args

        def every_argument_to_reactor(args: Any = None, namespace: Any = None) -> Any:
            # call_command parses its arguments here: all are reactor's, as on manage.py's
            # command line (run_from_argv), so `--json` is not refused as an unknown option.
            parsed = parse([], namespace)
            parsed.args = [str(a) for a in args or ()]
            return parsed

        parser.parse_args = every_argument_to_reactor
        return parser

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("args", nargs="*")

    def handle(self, *args: Any, **options: Any) -> None:
        code: Any = 0
        with (
            _in_this_call(conninfo(settings.DATABASES["default"])),
            contextlib.redirect_stdout(_Verbatim(self.stdout)),
            contextlib.redirect_stderr(_Verbatim(self.stderr)),
        ):
            try:
                main(list(args), prog_name="manage.py reactor")
            except SystemExit as exc:  # the CLI always exits: a caller wants a return
                code = exc.code
        if code not in (0, None):
            returncode = code if isinstance(code, int) else 1
            raise CommandError(f"reactor exited {code}", returncode=returncode)
