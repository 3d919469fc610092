"""The `reactor` command (also `python -m reactor`): migrate, run, sweep, status, failures,
pause, resume, requeue, prune, submit, dashboard.

Every setting is a flag and an environment variable; the flag wins. Errors are one line on
stderr with no password and no traceback (unless `--debug`); exit codes: 0 ok, 2 usage or
configuration error (an unreachable database included), 1 runtime failure.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from reactor import __version__
from reactor.cli.logs import configure_logging
from reactor.dispatcher.doorbell import DoorbellMode
from reactor.dispatcher.loop import Reactor
from reactor.errors import ConfigError, DatabaseError, ReactorError
from reactor.ops import admin
from reactor.ops.failures import format_failures, read_failures
from reactor.ops.pause import pause_types, resume_types, who
from reactor.ops.status import format_status, read_status
from reactor.pg import db
from reactor.pg.migrate import migrate as apply_migrations
from reactor.pg.registry import load_routes
from reactor.producer import DEFAULT_JOB_TYPE, submit_many
from reactor.redact import has_password, redact
from reactor.routes import Route, parse_handler_prefixes, parse_routes
from reactor.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_GONE_AFTER_SECONDS,
    DEFAULT_POLL_INTERVAL_SECONDS,
    DEFAULT_PRUNE_BATCH_SIZE,
    DEFAULT_REDIS_TIMEOUT_SECONDS,
    DEFAULT_REDIS_URL,
    DEFAULT_STALE_AFTER_SECONDS,
    DEFAULT_SWEEP_INTERVAL_SECONDS,
    ReactorSettings,
)
from reactor.signals import Stopper
from reactor.validate import validate_job

__all__ = ["cli", "main"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class _Group(click.Group):
    """Turns `ReactorError` (and any unexpected error) into one line and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ReactorError as exc:
            if ctx.meta.get("reactor.debug"):
                raise
            click.echo(f"reactor: error: {redact(str(exc))}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if ctx.meta.get("reactor.debug"):
                raise
            click.echo(f"reactor: error: {type(exc).__name__}: {redact(str(exc))}", err=True)
            ctx.exit(1)


def _warn_password_flag(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A password given as a flag is visible to every local user (`ps`): say so, once."""
    source = ctx.get_parameter_source(param.name or "")
    if value and source is ParameterSource.COMMANDLINE and has_password(value):
        logger.warning(
            "password_on_command_line option=%s (visible to other users in ps; put the URL "
            "in %s instead)",
            param.opts[0],
            param.envvar,
        )
    return value


def _set_prepared_statements(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    db.set_prepared_statements(value)


def _database_option(func: F) -> F:
    func = click.option(
        "--prepared-statements/--no-prepared-statements",
        envvar=db.PREPARED_STATEMENTS_ENV,
        default=None,
        show_envvar=True,
        expose_value=False,
        callback=_set_prepared_statements,
        help="Let psycopg prepare statements on the server (never behind PgBouncer in "
        "transaction mode). Default: on for `reactor run` when it LISTENs (it needs a "
        "direct session anyway), off otherwise.",
    )(func)
    return click.option(
        "--database-url",
        envvar="DATABASE_URL",
        default="",
        show_envvar=True,
        callback=_warn_password_flag,
        help="Postgres URL (default: libpq defaults, PG* variables, local socket); a "
        "multi-host URL (postgresql://db1,db2/app) connects to the host that takes writes.",
    )(func)


def _redis_option(func: F) -> F:
    return click.option(
        "--redis-url",
        envvar="REDIS_URL",
        default=DEFAULT_REDIS_URL,
        show_default=True,
        show_envvar=True,
        callback=_warn_password_flag,
        help="Redis URL of the RQ queues (or redis+sentinel://[[USER]:PASSWORD@]HOST:PORT"
        "[,HOST:PORT...]/MASTER_NAME[/DB]).",
    )(func)


def _routes_option(func: F) -> F:
    return click.option(
        "--route",
        "routes",
        multiple=True,
        metavar="TYPE=DOTTED.PATH[@QUEUE]",
        help="Route a job type (repeatable; env REACTOR_ROUTES, comma-separated; default: "
        "the routes the reactors recorded in the database).",
    )(func)


def _stale_option(func: F) -> F:
    return click.option(
        "--stale-after",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_STALE_AFTER",
        default=DEFAULT_STALE_AFTER_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds without heartbeat after which an active row is rescued.",
    )(func)


def _gone_option(func: F) -> F:
    return click.option(
        "--gone-after",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_GONE_AFTER",
        default=DEFAULT_GONE_AFTER_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds without heartbeat after which an active row whose RQ worker is gone "
        "(its worker key expired) is rescued.",
    )(func)


def _sweep_options(func: F) -> F:
    """The options of every dispatching command (`sweep`, and `run` with `_run_options`)."""
    func = _stale_option(func)
    func = _gone_option(func)
    func = click.option(
        "--job-timeout",
        type=click.IntRange(min=1),
        envvar="REACTOR_JOB_TIMEOUT",
        default=None,
        show_envvar=True,
        help="Seconds a handler may run before RQ stops it (a failed attempt; default RQ's 180).",
    )(func)
    func = _redis_option(func)
    func = click.option(
        "--redis-timeout",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_REDIS_TIMEOUT",
        default=DEFAULT_REDIS_TIMEOUT_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds to wait for Redis to connect or answer a command (a claim's row locks "
        "are held meanwhile).",
    )(func)
    func = click.option(
        "--batch-size",
        type=click.IntRange(1, 10_000),
        envvar="REACTOR_BATCH_SIZE",
        default=DEFAULT_BATCH_SIZE,
        show_default=True,
        show_envvar=True,
        help="Rows claimed and enqueued per transaction.",
    )(func)
    return _database_option(_routes_option(func))


def _run_options(func: F) -> F:
    """The options only the long-running `reactor run` uses."""
    func = click.option(
        "--sweep-interval",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_SWEEP_INTERVAL",
        default=DEFAULT_SWEEP_INTERVAL_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds between fallback sweeps (± 10 % jitter).",
    )(func)
    func = click.option(
        "--doorbell",
        type=click.Choice([m.value for m in DoorbellMode]),
        envvar="REACTOR_DOORBELL",
        default=DoorbellMode.ADAPTIVE.value,
        show_default=True,
        show_envvar=True,
        help="adaptive: writers notify only while the reactor is idle; plain: writers always "
        "notify; poll-only: no LISTEN connection, drain every --poll-interval.",
    )(func)
    func = click.option(
        "--poll-interval",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_POLL_INTERVAL",
        default=DEFAULT_POLL_INTERVAL_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds between drains in poll-only mode.",
    )(func)
    func = click.option(
        "--no-listen",
        is_flag=True,
        envvar="REACTOR_NO_LISTEN",
        show_envvar=True,
        help="Same as --doorbell poll-only (for PgBouncer in transaction mode).",
    )(func)
    func = click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        envvar="REACTOR_METRICS_PORT",
        default=None,
        show_envvar=True,
        help="Serve /metrics and /healthz on this port (run only; default: off).",
    )(func)
    func = click.option(
        "--metrics-host",
        envvar="REACTOR_METRICS_HOST",
        default="127.0.0.1",
        show_default=True,
        show_envvar=True,
        help="Address the metrics server binds.",
    )(func)
    return _sweep_options(func)


def resolve_routes(
    flags: tuple[str, ...], env: Mapping[str, str] | None = None
) -> dict[str, Route]:
    """Routes from the flags, else from REACTOR_ROUTES; empty when neither names one (the
    reactor then uses the routes recorded in the database, never a built-in one)."""
    env = os.environ if env is None else env
    texts = list(flags) or [env.get("REACTOR_ROUTES", "")]
    if not any(t.strip() for t in texts):
        return {}
    return dict(parse_routes(texts))


def _doorbell_conflict(options: dict[str, Any]) -> None:
    """`--no-listen` and a `--doorbell` other than poll-only, both asked for: neither wins
    silently.

    Raises:
        ConfigError: both were given (as flags or in the environment).
    """
    ctx = click.get_current_context(silent=True)
    if ctx is None or not options["no_listen"] or options["doorbell"] == "poll-only":
        return
    if ctx.get_parameter_source("doorbell") in (
        ParameterSource.COMMANDLINE,
        ParameterSource.ENVIRONMENT,
    ):
        raise ConfigError(
            f"--no-listen (REACTOR_NO_LISTEN) means --doorbell poll-only, but --doorbell "
            f"(REACTOR_DOORBELL) is {options['doorbell']}: give one of them"
        )


def _settings(options: dict[str, Any]) -> ReactorSettings:
    run_only: dict[str, Any] = {}
    if "doorbell" in options:
        _doorbell_conflict(options)
        run_only = {
            "sweep_interval_seconds": options["sweep_interval"],
            "doorbell": DoorbellMode.POLL_ONLY
            if options["no_listen"]
            else DoorbellMode(options["doorbell"]),
            "poll_interval_seconds": options["poll_interval"],
            "metrics_port": options["metrics_port"],
            "metrics_host": options["metrics_host"],
        }
    return ReactorSettings(
        database_url=options["database_url"],
        redis_url=options["redis_url"],
        routes=resolve_routes(options["routes"]),
        batch_size=options["batch_size"],
        stale_after_seconds=options["stale_after"],
        gone_after_seconds=options["gone_after"],
        job_timeout_seconds=options["job_timeout"],
        redis_timeout_seconds=options["redis_timeout"],
        **run_only,
    )


def _connect(database_url: str, purpose: str, *, read_write: bool = True) -> db.Connection:
    """A connection for a one-shot command, on a migrated database. Not reaching the
    database is a configuration error (exit 2), as for `run`.

    Raises:
        ConfigError: bad URL, unreachable or unmigrated database.
    """
    try:
        conn = db.connect(database_url, purpose=purpose, read_write=read_write)
    except DatabaseError as exc:
        raise ConfigError(str(exc)) from None
    try:
        db.check_schema(conn)
    except BaseException:
        conn.close()
        raise
    return conn


@click.group(cls=_Group)
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
@_database_option
def migrate(database_url: str) -> None:
    """Apply the SQL migrations that are not applied yet."""
    try:
        conn = db.connect(database_url, autocommit=True, purpose="migrate")
    except DatabaseError as exc:
        raise ConfigError(str(exc)) from None
    with conn:
        result = apply_migrations(conn)
    if result.applied:
        for label in result.applied:
            click.echo(f"applied {label}")
        click.echo(f"database is at schema version {result.version}")
    else:
        click.echo(f"nothing to do: database is already at schema version {result.version}")


def _duration(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    """A duration option's seconds (`7d`, `12h`); a bare number is a usage error (exit 2)."""
    if value is None:
        return None
    try:
        return admin.parse_duration(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@_run_options
@click.option(
    "--prune-done-after",
    callback=_duration,
    metavar="DURATION",
    envvar="REACTOR_PRUNE_DONE_AFTER",
    default=None,
    show_envvar=True,
    help="Delete done rows older than this (e.g. 7d), in small batches (default: off).",
)
@click.option(
    "--prune-failed-after",
    callback=_duration,
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
def run(
    prune_done_after: float | None,
    prune_failed_after: float | None,
    prune_batch_size: int,
    **options: Any,
) -> None:
    """Run the reactor until SIGTERM/SIGINT (a second signal exits at once)."""
    settings = replace(
        _settings(options),
        prune_done_after_seconds=prune_done_after,
        prune_failed_after_seconds=prune_failed_after,
        prune_batch_size=prune_batch_size,
    )
    if settings.listen:
        # LISTEN needs a session of its own on the server (no transaction pooler in between),
        # so preparing statements is safe, and it saves the claim's planning on every wake-up.
        db.prefer_prepared_statements()
    stopper = Stopper()
    stopper.install()
    reactor = Reactor(settings, stopper=stopper)
    reactor.start()
    reactor.run()


@cli.command()
@_sweep_options
@click.pass_context
def sweep(ctx: click.Context, /, **options: Any) -> None:
    """Run one sweep round and print its result as JSON (exit 1 if some rows could not be
    enqueued: they stay pending)."""
    settings = replace(_settings(options), doorbell=DoorbellMode.POLL_ONLY)
    reactor = Reactor(settings)
    try:
        reactor.start()
        result = reactor.sweep_once()
    finally:
        reactor.close()
    click.echo(json.dumps(asdict(result)))
    if result.enqueue_failures:
        rows = result.enqueue_failures
        click.echo(
            f"reactor: error: {rows} row{'s' if rows != 1 else ''} could not be enqueued "
            "(no row changed; see the log)",
            err=True,
        )
        ctx.exit(1)


#: `reactor status` gives up on a Redis that does not answer within this long (seconds), and
#: prints the rest.
STATUS_REDIS_TIMEOUT_SECONDS = 5.0


@cli.command()
@_database_option
@_redis_option
@_stale_option
@_gone_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(
    database_url: str, redis_url: str, stale_after: float, gone_after: float, as_json: bool
) -> None:
    """Show counts by type and state, backlog age, retries, stale rows and rows whose RQ worker
    is gone, the routes the reactors use, unrouted types."""
    from reactor.rq.redis_url import connect_redis  # noqa: PLC0415 - only this command's Redis

    client = connect_redis(
        redis_url,
        socket_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
        socket_connect_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
    )
    try:
        with _connect(database_url, "status", read_write=False) as conn:
            result = read_status(conn, stale_after, client=client, gone_after_seconds=gone_after)
    finally:
        client.close()
    click.echo(json.dumps(result.as_dict()) if as_json else format_status(result))


@cli.command()
@_database_option
@click.option("--type", "job_type", default=None, help="Only rows of this type.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Rows shown."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (errors in full).")
def failures(database_url: str, job_type: str | None, limit: int, as_json: bool) -> None:
    """Show the latest failed and retried rows: attempt, last_error, when."""
    with _connect(database_url, "failures", read_write=False) as conn:
        found = read_failures(conn, job_type, limit)
    click.echo(json.dumps(found.as_dict()) if as_json else format_failures(found))


@cli.command()
@_database_option
@_routes_option
@click.argument("types", nargs=-1, required=True)
def pause(database_url: str, routes: tuple[str, ...], types: tuple[str, ...]) -> None:
    """Stop dispatching TYPE... on every reactor (rows stay pending; running jobs finish)."""
    with _connect(database_url, "pause") as conn:
        result = pause_types(conn, types, _known_routes(conn, routes), who())
    click.echo(json.dumps({"paused": result.changed, "already_paused": result.unchanged}))


@cli.command()
@_database_option
@_routes_option
@click.argument("types", nargs=-1, required=True)
def resume(database_url: str, routes: tuple[str, ...], types: tuple[str, ...]) -> None:
    """Dispatch TYPE... again (listening reactors start at once)."""
    with _connect(database_url, "resume") as conn:
        result = resume_types(conn, types, _known_routes(conn, routes))
    click.echo(json.dumps({"resumed": result.changed, "not_paused": result.unchanged}))


def _known_routes(conn: db.Connection, flags: tuple[str, ...]) -> dict[str, Route]:
    """The routes named on the command line, else those the reactors recorded."""
    return resolve_routes(flags) or dict(load_routes(conn))


@cli.command()
@_database_option
@click.argument("photo_ids", nargs=-1)
@click.option("--failed", "all_failed", is_flag=True, help="Requeue every failed row.")
@click.option("--type", "job_type", default=None, help="Only rows of this type.")
@click.pass_context
def requeue(
    ctx: click.Context,
    database_url: str,
    photo_ids: tuple[str, ...],
    all_failed: bool,
    job_type: str | None,
) -> None:
    """Move done/failed rows back to pending (attempts 0): PHOTO_ID... or --failed.
    Photo ids with no row are reported (exit 1); the others are requeued."""
    if bool(photo_ids) == all_failed:
        raise click.UsageError("give PHOTO_IDs or --failed (one of them)")
    missing: list[str] = []
    with _connect(database_url, "requeue") as conn:
        if all_failed:
            moved = admin.requeue_failed(conn, job_type)
        else:
            missing = admin.missing_photo_ids(conn, photo_ids, job_type)
            moved = admin.requeue_photos(conn, photo_ids, job_type)
    click.echo(json.dumps({"requeued": moved, "not_found": missing}))
    if missing:
        kind = "" if job_type is None else f" of type {job_type}"
        click.echo(f"reactor: error: no row{kind} for: {', '.join(missing)}", err=True)
        ctx.exit(1)


@cli.command()
@_database_option
@click.option("--done-older-than", callback=_duration, metavar="DURATION", help="e.g. 7d, 12h.")
@click.option("--failed-older-than", callback=_duration, metavar="DURATION", help="e.g. 30d.")
@click.option("--dry-run", is_flag=True, help="Count the rows it would delete; delete nothing.")
def prune(
    database_url: str,
    done_older_than: float | None,
    failed_older_than: float | None,
    dry_run: bool,
) -> None:
    """Delete done and/or failed rows older than a duration, in batches (give one or both)."""
    if done_older_than is None and failed_older_than is None:
        raise click.UsageError("give --done-older-than, --failed-older-than, or both")
    with _connect(database_url, "prune", read_write=not dry_run) as conn:
        result = admin.prune(
            conn,
            done_older_than=done_older_than,
            failed_older_than=failed_older_than,
            dry_run=dry_run,
        )
    verb = "would_delete" if dry_run else "deleted"
    click.echo(json.dumps({f"{verb}_done": result.done, f"{verb}_failed": result.failed}))


def _with_stdin(photo_ids: tuple[str, ...]) -> Iterator[str]:
    """The ids, with `-` replaced by the lines of standard input (read once)."""
    for photo_id in photo_ids:
        if photo_id != "-":
            yield photo_id
            continue
        for line in sys.stdin.read().splitlines():
            if line:
                yield line


@cli.command("submit")
@_database_option
@click.argument("photo_ids", nargs=-1, required=True)
@click.option("--type", "job_type", default=DEFAULT_JOB_TYPE, show_default=True)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=None,
    help="Attempts before a row fails (new rows: 5; re-armed rows keep theirs).",
)
def submit_command(
    database_url: str, photo_ids: tuple[str, ...], job_type: str, max_attempts: int | None
) -> None:
    """Submit photos (one transaction): new rows, or done/failed rows re-armed. `-` reads
    photo ids from standard input, one a line (empty lines are skipped)."""
    photo_ids = tuple(dict.fromkeys(_with_stdin(photo_ids)))
    for photo_id in photo_ids:
        validate_job(photo_id, job_type)
    with _connect(database_url, "submit") as conn, conn.transaction():
        submitted = submit_many(conn, photo_ids, job_type, max_attempts=max_attempts)
    click.echo(json.dumps({"submitted": submitted, "unchanged": len(photo_ids) - submitted}))


@cli.command()
@_database_option
@_routes_option
@_stale_option
@_redis_option
@click.option(
    "--host",
    envvar="REACTOR_DASHBOARD_HOST",
    default="127.0.0.1",
    show_default=True,
    show_envvar=True,
    help="Address to bind.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    envvar="REACTOR_DASHBOARD_PORT",
    default=9180,
    show_default=True,
    show_envvar=True,
    help="Port the dashboard listens on.",
)
@click.option(
    "--refresh",
    type=click.IntRange(1, 3600),
    default=5,
    show_default=True,
    help="Seconds between page reloads.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    envvar="REACTOR_DASHBOARD_ALLOWED_HOSTS",
    show_envvar=True,
    help="A name the dashboard answers to in the Host header, besides localhost, 127.0.0.1, "
    "[::1] and the --host address (repeatable; the variable is comma-separated). Requests "
    "naming any other host get 421.",
)
@click.option(
    "--cache-seconds",
    type=click.FloatRange(0, 3600),
    envvar="REACTOR_DASHBOARD_CACHE_SECONDS",
    default=2.0,
    show_default=True,
    show_envvar=True,
    help="How long one read of the database serves every request (0: read for each).",
)
@click.option(
    "--client-timeout",
    type=click.FloatRange(0.1, 3600),
    envvar="REACTOR_DASHBOARD_CLIENT_TIMEOUT",
    default=5.0,
    show_default=True,
    show_envvar=True,
    help="Seconds a client may stay silent before the dashboard drops it.",
)
def dashboard(**options: Any) -> None:
    """Serve a read-only web page of the table, the reactors and RQ (and /api/overview)."""
    try:
        from reactor.ops.dashboard import (  # noqa: PLC0415
            Dashboard,
            parse_allowed_host,
            serve_dashboard,
        )
    except ImportError as exc:
        raise ConfigError(
            f"reactor dashboard needs {exc.name}: pip install 'photo-reactor[dashboard]'"
        ) from None
    allowed = [
        parse_allowed_host(name)
        for given in options["allowed_hosts"]
        for name in given.split(",")
        if name.strip()
    ]
    board = Dashboard(
        options["database_url"],
        options["redis_url"],
        resolve_routes(options["routes"]),
        stale_after_seconds=options["stale_after"],
        refresh_seconds=options["refresh"],
        cache_seconds=options["cache_seconds"],
    )
    stopper = Stopper()
    stopper.install()
    server = serve_dashboard(
        board,
        options["host"],
        options["port"],
        allowed=allowed,
        client_timeout=options["client_timeout"],
    )
    bound_host, bound_port = server.server_address[:2]
    logger.info("dashboard_serving url=http://%s:%d/", bound_host, bound_port)
    while not stopper.sleep(3600):
        pass
    server.shutdown()
    server.server_close()
    board.close()


# -- reactor worker --------------------------------------------------------------------------

#: Retries of one Redis command by `reactor worker` before it gives up (with backoff to 2 s).
WORKER_REDIS_RETRIES = 20
#: Pause before `reactor worker` starts RQ's work loop again after it quit on an error.
WORKER_RESTART_SECONDS = 1.0
#: Before its work loop, `reactor worker` checks that Redis answers within this many seconds,
#: and while it does not, says so (at once, then at most every `WORKER_REDIS_WAIT_LOG_SECONDS`)
#: and asks again with backoff up to `WORKER_REDIS_WAIT_MAX_SECONDS` apart: a worker started
#: before its Redis waits for it, where RQ's own retries ran silent for half a minute.
WORKER_REDIS_CHECK_SECONDS = 5.0
WORKER_REDIS_WAIT_MAX_SECONDS = 5.0
WORKER_REDIS_WAIT_LOG_SECONDS = 30.0


@cli.command("worker")
@_database_option
@_routes_option
@_redis_option
@click.option("--simple", is_flag=True, help="Run jobs in this process (no fork per job).")
@click.option("--burst", is_flag=True, help="Quit when the queues are empty.")
@click.option("--name", default=None, help="Worker name in RQ (default: random).")
@click.option(
    "--max-jobs", type=click.IntRange(min=1), default=None, help="Quit after this many jobs."
)
@click.option(
    "--handler-prefix",
    "handler_prefixes",
    multiple=True,
    metavar="MODULE",
    help="Import handlers only from this module (repeatable; default: REACTOR_HANDLER_PREFIXES,"
    " comma-separated; none: no limit).",
)
@click.option(
    "-q", "--quiet", is_flag=True, help="Log warnings and errors only (as --log-level warning)."
)
@click.argument("queues", nargs=-1)
def worker_command(**options: Any) -> None:
    """Run an RQ worker on QUEUES (default: the routed ones) with the lifecycle in this process.

    It runs only its own routes' handlers (--route, REACTOR_ROUTES, else the recorded ones).
    Retry and heartbeat settings come from REACTOR_RETRY_BASE_SECONDS,
    REACTOR_RETRY_MAX_SECONDS and REACTOR_HEARTBEAT_SECONDS.
    """
    import redis  # noqa: PLC0415 - the other commands do not need RQ's worker machinery
    from redis.backoff import ExponentialWithJitterBackoff  # noqa: PLC0415
    from redis.retry import Retry  # noqa: PLC0415

    from reactor.rq.redis_url import connect_redis  # noqa: PLC0415
    from reactor.settings import WorkerSettings  # noqa: PLC0415
    from reactor.worker.classes import RQ_DEFAULT_QUEUE, SimpleWorker, Worker  # noqa: PLC0415

    if options["quiet"]:
        logging.getLogger().setLevel(logging.WARNING)
    given = resolve_routes(options["routes"])
    routed = given
    if not routed:
        with _connect(options["database_url"], "worker") as conn:
            routed = dict(load_routes(conn))
    # With no queue and no route yet, the worker waits for a reactor to record its routes.
    names = list(options["queues"]) or sorted({route.queue for route in routed.values()})
    names = names or [RQ_DEFAULT_QUEUE]
    settings = replace(WorkerSettings.from_env(), database_url=options["database_url"])
    if options["handler_prefixes"]:
        prefixes = parse_handler_prefixes(options["handler_prefixes"])
        settings = replace(settings, handler_prefixes=prefixes)
    worker_class = SimpleWorker if options["simple"] else Worker
    # Rides out a Redis restart or a Sentinel failover (about 40 s of retries) instead of
    # exiting on the first connection error outside the blocking dequeue.
    retry = Retry(ExponentialWithJitterBackoff(base=0.2, cap=2), WORKER_REDIS_RETRIES)
    _wait_for_redis(options["redis_url"])  # RQ's worker talks to Redis as it is made
    instance = worker_class(
        names,
        name=options["name"],
        connection=connect_redis(options["redis_url"], retry=retry),
        # Given none, the worker follows the recorded routes (read again when they change).
        routes=given or None,
        settings=settings,
    )
    instance.check_startup()
    # RQ sets its loggers to INFO unless told a level: its lines follow --log-level too.
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    failed = False
    while True:
        try:
            if failed:
                # The failed loop's teardown may not have recorded the worker's death: RQ's
                # start would then take this worker for a live one of the same name.
                instance.register_death()  # type: ignore[no-untyped-call]
                failed = False
            instance.work(burst=options["burst"], max_jobs=options["max_jobs"], logging_level=level)
        except redis.RedisError as exc:
            stopped = instance._stop_requested or instance._shutdown_requested_date is not None
            refused = isinstance(
                exc, (redis.AuthenticationError, redis.exceptions.NoPermissionError)
            )
            if refused or options["burst"] or options["max_jobs"] or stopped:
                raise click.ClickException(f"Redis: {redact(str(exc))}") from None
            # Redis failed RQ's start or teardown too (down past the retries, refusing writes
            # when full): like a quit of its loop, ridden out by a long-running worker.
            failed = True
            logger.warning(
                "worker_restarting in=%.0fs (Redis failed RQ's work loop: %s)",
                WORKER_RESTART_SECONDS,
                redact(str(exc)),
            )
            time.sleep(WORKER_RESTART_SECONDS)
            continue
        # A stop while busy sets the flag; one while idle only the date (RQ then ends the
        # loop by raising StopRequested inside it).
        stopped = instance._stop_requested or instance._shutdown_requested_date is not None
        if options["burst"] or options["max_jobs"] or stopped:
            return
        # RQ's work loop quits on any error it does not expect (a Redis error that outlived
        # the retries, a blocked read cut by a failover): a long-running worker starts it again.
        logger.warning("worker_restarting in=%.0fs (RQ's work loop quit)", WORKER_RESTART_SECONDS)
        time.sleep(WORKER_RESTART_SECONDS)


def _wait_for_redis(url: str) -> None:
    """Return once Redis answers a PING, saying so while it does not (see
    `WORKER_REDIS_CHECK_SECONDS`)."""
    import redis  # noqa: PLC0415
    from redis.backoff import NoBackoff  # noqa: PLC0415
    from redis.retry import Retry  # noqa: PLC0415

    from reactor.rq.redis_url import connect_redis  # noqa: PLC0415

    probe = connect_redis(
        url,
        retry=Retry(NoBackoff(), 0),
        socket_connect_timeout=WORKER_REDIS_CHECK_SECONDS,
        socket_timeout=WORKER_REDIS_CHECK_SECONDS,
    )
    pause, said, failures = 0.5, -WORKER_REDIS_WAIT_LOG_SECONDS, 0
    try:
        while True:
            try:
                probe.ping()
            except (redis.AuthenticationError, redis.ResponseError) as exc:
                # Redis answered, and refused: waiting will not change that.
                raise ConfigError(f"Redis refused the worker: {redact(str(exc))}") from None
            except redis.RedisError as exc:
                failures += 1
                now = time.monotonic()
                if now - said >= WORKER_REDIS_WAIT_LOG_SECONDS:
                    said = now
                    logger.warning(
                        "worker_redis_unavailable error=%s tries=%d (waiting for Redis; jobs "
                        "wait there)",
                        redact(str(exc)),
                        failures,
                    )
                time.sleep(pause)
                pause = min(WORKER_REDIS_WAIT_MAX_SECONDS, pause * 2)
                continue
            if failures:
                logger.info("worker_redis_available tries=%d", failures)
            return
    finally:
        probe.close()


_GLOBAL_OPTIONS = frozenset(opt for param in cli.params for opt in param.opts)


def main() -> None:
    """Console-script entry point: click's own errors (usage, bad option values) are one line
    too, like ours."""
    try:
        code = cli.main(prog_name="reactor", standalone_mode=False)
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
