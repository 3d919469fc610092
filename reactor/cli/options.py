"""What the `reactor` commands share: the error-to-exit-code group, the options that several
commands take (each a flag and an environment variable; the flag wins), and the routes,
settings and connection they build from them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from reactor.dispatcher.doorbell import DoorbellMode
from reactor.errors import ConfigError, DatabaseError, ReactorError, StatementError
from reactor.ops import admin
from reactor.pg import db
from reactor.redact import has_password, redact
from reactor.routes import given_routes
from reactor.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_GONE_AFTER_SECONDS,
    DEFAULT_POLL_INTERVAL_SECONDS,
    DEFAULT_REDIS_TIMEOUT_SECONDS,
    DEFAULT_REDIS_URL,
    DEFAULT_STALE_AFTER_SECONDS,
    DEFAULT_SWEEP_INTERVAL_SECONDS,
    ReactorSettings,
)

__all__ = [
    "ReactorGroup",
    "connect_migrated",
    "database_option",
    "duration",
    "gone_option",
    "reactor_settings",
    "redis_option",
    "routes_option",
    "run_options",
    "stale_option",
    "sweep_options",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class ReactorGroup(click.Group):
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


def database_option(func: F) -> F:
    func = click.option(
        "--prepared-statements/--no-prepared-statements",
        envvar=db.PREPARED_STATEMENTS_ENV,
        default=None,
        show_envvar=True,
        expose_value=False,
        callback=_set_prepared_statements,
        help="Let psycopg prepare statements on the server (never behind PgBouncer in "
        "transaction mode before 1.21). Default: on for a direct session to Postgres, off "
        "behind a pooler.",
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


def redis_option(func: F) -> F:
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


def routes_option(func: F) -> F:
    return click.option(
        "--route",
        "routes",
        multiple=True,
        metavar="TYPE=DOTTED.PATH[@QUEUE]",
        help="Route a job type (repeatable; env REACTOR_ROUTES, comma-separated; default: "
        "the routes the reactors recorded in the database).",
    )(func)


def stale_option(func: F) -> F:
    return click.option(
        "--stale-after",
        type=click.FloatRange(min=0, min_open=True),
        envvar="REACTOR_STALE_AFTER",
        default=DEFAULT_STALE_AFTER_SECONDS,
        show_default=True,
        show_envvar=True,
        help="Seconds without heartbeat after which an active row is rescued.",
    )(func)


def gone_option(func: F) -> F:
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


def sweep_options(func: F) -> F:
    """The options of every dispatching command (`sweep`, and `run` with `run_options`)."""
    func = stale_option(func)
    func = gone_option(func)
    func = click.option(
        "--job-timeout",
        type=click.IntRange(min=1),
        envvar="REACTOR_JOB_TIMEOUT",
        default=None,
        show_envvar=True,
        help="Seconds a handler may run before RQ stops it (a failed attempt; default RQ's 180).",
    )(func)
    func = redis_option(func)
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
    return database_option(routes_option(func))


def run_options(func: F) -> F:
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
    return sweep_options(func)


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


def reactor_settings(options: dict[str, Any]) -> ReactorSettings:
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
        routes=given_routes(options["routes"]),
        batch_size=options["batch_size"],
        stale_after_seconds=options["stale_after"],
        gone_after_seconds=options["gone_after"],
        job_timeout_seconds=options["job_timeout"],
        redis_timeout_seconds=options["redis_timeout"],
        **run_only,
    )


def connect_migrated(database_url: str, purpose: str, *, read_write: bool = True) -> db.Connection:
    """A connection for a one-shot command, on a migrated database. Not reaching the
    database is a configuration error (exit 2), as for `run`.

    Raises:
        ConfigError: bad URL, unreachable or unmigrated database.
    """
    try:
        conn = db.connect(database_url, purpose=purpose, read_write=read_write)
    except (DatabaseError, StatementError) as exc:
        raise ConfigError(str(exc)) from None
    try:
        db.check_schema(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def duration(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    """A duration option's seconds (`7d`, `12h`); a bare number is a usage error (exit 2)."""
    if value is None:
        return None
    try:
        return admin.parse_duration(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
