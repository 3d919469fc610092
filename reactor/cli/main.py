"""The `reactor` command (also `python -m reactor`): the group, and migrate, run and sweep; the
operator commands are in `reactor.cli.ops`, `reactor worker` in `reactor.cli.worker`.

Every setting is a flag and an environment variable; the flag wins. Errors are one line on
stderr with no password and no traceback (unless `--debug`); exit codes: 0 ok, 2 usage or
configuration error (an unreachable database included), 1 runtime failure.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import click

from reactor import __version__
from reactor.cli.logs import configure_logging
from reactor.cli.ops import OPS_COMMANDS
from reactor.cli.options import (
    ReactorGroup,
    database_option,
    duration,
    reactor_settings,
    run_options,
    sweep_options,
)
from reactor.cli.retention import RETENTION_COMMANDS
from reactor.cli.worker import worker_command
from reactor.dispatcher.doorbell import DoorbellMode
from reactor.errors import ConfigError, DatabaseError, StatementError
from reactor.pg import db
from reactor.pg.migrate import load_migrations, unapplied
from reactor.pg.migrate import migrate as apply_migrations
from reactor.redact import redact
from reactor.sdnotify import Notifier
from reactor.settings import (
    DEFAULT_PRUNE_BATCH_SIZE,
)
from reactor.signals import StoppedError, Stopper

__all__ = ["cli", "main"]

logger = logging.getLogger(__name__)


@click.group(cls=ReactorGroup)
@click.version_option(__version__, prog_name="photo-reactor")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    envvar="REACTOR_LOG_LEVEL",
    default="INFO",
    show_default=True,
    show_envvar=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    envvar="REACTOR_LOG_FORMAT",
    default="text",
    show_default=True,
    show_envvar=True,
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, log_level: str, log_format: str) -> None:
    """photo-reactor: dispatch photo_jobs rows from Postgres to RQ."""
    ctx.meta["reactor.debug"] = debug
    configure_logging(log_level, log_format)


@cli.command()
@database_option
@click.option(
    "--sql",
    "print_sql",
    is_flag=True,
    help="Print the SQL of the migrations not applied yet (each file as it is), for another "
    "migration tool to apply, instead of applying them.",
)
@click.option(
    "--all",
    "all_files",
    is_flag=True,
    help="With --sql: every migration, for a new database (connects to none).",
)
def migrate(database_url: str, print_sql: bool, all_files: bool) -> None:
    """Apply the SQL migrations that are not applied yet."""
    if all_files and not print_sql:
        raise click.UsageError("--all goes with --sql")
    if all_files:
        click.echo("".join(m.sql for m in load_migrations()), nl=False)
        return
    try:
        conn = db.connect(
            database_url, autocommit=True, purpose="migrate", read_write=not print_sql
        )
    except (DatabaseError, StatementError) as exc:
        raise ConfigError(str(exc)) from None
    if print_sql:
        with conn:
            pending = unapplied(conn)
        click.echo("".join(m.sql for m in pending), nl=False)
        if not pending:  # to stderr: the SQL goes to a file or psql
            click.echo("reactor: nothing to apply: the database is up to date", err=True)
        return
    with conn:
        result = apply_migrations(conn)
    if result.applied:
        for label in result.applied:
            click.echo(f"applied {label}")
        click.echo(f"database is at schema version {result.version}")
    else:
        click.echo(f"nothing to do: database is already at schema version {result.version}")


@cli.command()
@run_options
@click.option(
    "--prune-done-after",
    callback=duration,
    metavar="DURATION",
    envvar="REACTOR_PRUNE_DONE_AFTER",
    default=None,
    show_envvar=True,
    help="Delete done rows older than this (e.g. 7d), in small batches (default: off).",
)
@click.option(
    "--prune-failed-after",
    callback=duration,
    metavar="DURATION",
    envvar="REACTOR_PRUNE_FAILED_AFTER",
    default=None,
    show_envvar=True,
    help="Also delete failed rows older than this (e.g. 30d; needs --prune-done-after).",
)
@click.option(
    "--prune-batch-size",
    type=click.IntRange(1, 10_000),
    envvar="REACTOR_PRUNE_BATCH_SIZE",
    default=DEFAULT_PRUNE_BATCH_SIZE,
    show_default=True,
    show_envvar=True,
    help="Rows deleted per retention transaction.",
)
@click.option(
    "--archive-after",
    callback=duration,
    metavar="DURATION",
    envvar="REACTOR_ARCHIVE_AFTER",
    default=None,
    show_envvar=True,
    help="Move done, failed and cancelled rows older than this (at least 1h) to "
    "photo_jobs_history, in small batches (default: off; not with --prune-done-after).",
)
@click.option(
    "--drop-history-after",
    callback=duration,
    metavar="DURATION",
    envvar="REACTOR_DROP_HISTORY_AFTER",
    default=None,
    show_envvar=True,
    help="Drop the history months whose every row finished longer ago than this (e.g. 180d).",
)
def run(
    prune_done_after: float | None,
    prune_failed_after: float | None,
    prune_batch_size: int,
    archive_after: float | None,
    drop_history_after: float | None,
    **options: Any,
) -> None:
    """Run the reactor until SIGTERM/SIGINT (a second signal exits at once)."""
    settings = replace(
        reactor_settings(options),
        prune_done_after_seconds=prune_done_after,
        prune_failed_after_seconds=prune_failed_after,
        prune_batch_size=prune_batch_size,
        archive_after_seconds=archive_after,
        drop_history_after_seconds=drop_history_after,
    )
    notifier = Notifier.from_env()  # systemd's, under Type=notify
    stopper = Stopper(on_request=notifier.stopping)
    stopper.install()
    # Imported here: the other commands and every worker start without the dispatcher.
    from reactor.dispatcher.loop import Reactor  # noqa: PLC0415

    reactor = Reactor(settings, stopper=stopper)
    reactor.health.watchdog = notifier  # told of every turn of the loop
    try:
        reactor.start()
    except StoppedError:
        logger.info("reactor_stopped during=start-up")
        return
    notifier.ready()
    reactor.run()


@cli.command()
@sweep_options
@click.pass_context
def sweep(ctx: click.Context, /, **options: Any) -> None:
    """Run one sweep round and print its result as JSON (exit 1 if some rows could not be
    claimed or enqueued: they stay pending)."""
    settings = replace(reactor_settings(options), doorbell=DoorbellMode.POLL_ONLY)
    from reactor.dispatcher.loop import Reactor  # noqa: PLC0415

    reactor = Reactor(settings)
    try:
        reactor.start()
        result = reactor.sweep_once()
    finally:
        reactor.close()
    click.echo(json.dumps(asdict(result)))
    problems = []
    if result.claim_failures:
        problems.append(f"the claim of {_count(result.claim_failures, 'type')} failed")
    if result.claim_refused:
        problems.append(f"{_count(result.claim_refused, 'row')} refused the claim (left pending)")
    if result.enqueue_failures:
        rows = _count(result.enqueue_failures, "row")
        why = "" if result.enqueue_error is None else f": {result.enqueue_error}"
        problems.append(f"{rows} could not be enqueued (no row changed){why}")
    if result.rescue_error is not None and result.rescue_error != result.enqueue_error:
        problems.append(f"the rescue step failed: {result.rescue_error}")
    if problems:
        click.echo(f"reactor: error: {'; '.join(problems)}", err=True)
        ctx.exit(1)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


for _command in (*OPS_COMMANDS, *RETENTION_COMMANDS, worker_command):
    cli.add_command(_command)

_GLOBAL_OPTIONS = frozenset(opt for param in cli.params for opt in param.opts)


def main(args: Sequence[str] | None = None, prog_name: str = "reactor") -> None:
    """Console-script entry point (`args`: the command line, else `sys.argv[1:]`): click's
    own errors (usage, bad option values) are one line too, like ours."""
    try:
        code = cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `reactor`: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        if isinstance(exc, click.NoSuchOption) and exc.option_name in _GLOBAL_OPTIONS:
            hint = f" ({exc.option_name} is a global option: give it before the command)"
        message = redact(exc.format_message()).rstrip(".")
        click.echo(f"reactor: error: {message}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"reactor: error: {redact(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("reactor: aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
