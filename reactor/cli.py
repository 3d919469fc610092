"""The `reactor` command (also `python -m reactor`): migrate, run, sweep, status, requeue, prune,
submit.

Every setting is a flag and an environment variable; the flag wins. Errors are one line on
stderr with no password and no traceback (unless `--debug`); exit codes: 0 ok, 2 usage or
configuration error, 1 runtime failure.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any, TypeVar

import click

from reactor import __version__, admin, db
from reactor.doorbell import DoorbellMode
from reactor.errors import ReactorError
from reactor.logs import configure_logging
from reactor.loop import Reactor
from reactor.migrate import migrate as apply_migrations
from reactor.producer import DEFAULT_JOB_TYPE, submit
from reactor.redact import redact
from reactor.routes import DEMO_ROUTE, Route, parse_routes
from reactor.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_POLL_INTERVAL_SECONDS,
    DEFAULT_REDIS_URL,
    DEFAULT_STALE_AFTER_SECONDS,
    DEFAULT_SWEEP_INTERVAL_SECONDS,
    ReactorSettings,
)
from reactor.signals import Stopper
from reactor.status import format_status, read_status

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


def _database_option(func: F) -> F:
    return click.option(
        "--database-url",
        envvar="DATABASE_URL",
        default="",
        show_envvar=True,
        help="Postgres URL (default: libpq defaults, PG* variables, local socket).",
    )(func)


def _routes_option(func: F) -> F:
    return click.option(
        "--route",
        "routes",
        multiple=True,
        metavar="TYPE=DOTTED.PATH[@QUEUE]",
        help=f"Route a job type (repeatable; env REACTOR_ROUTES, comma-separated; "
        f"default {DEMO_ROUTE}).",
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


def _dispatch_options(func: F) -> F:
    func = _stale_option(func)
    func = click.option(
        "--redis-url",
        envvar="REDIS_URL",
        default=DEFAULT_REDIS_URL,
        show_default=True,
        show_envvar=True,
        help="Redis URL of the RQ queues.",
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
        "--job-timeout",
        type=click.IntRange(min=1),
        envvar="REACTOR_JOB_TIMEOUT",
        default=None,
        show_envvar=True,
        help="Seconds a handler may run before RQ stops it (a failed attempt; default RQ's 180).",
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
        default="0.0.0.0",
        show_default=True,
        show_envvar=True,
        help="Address the metrics server binds.",
    )(func)
    return _database_option(_routes_option(func))


def resolve_routes(
    flags: tuple[str, ...], env: Mapping[str, str] | None = None
) -> dict[str, Route]:
    """Routes from the flags, else from REACTOR_ROUTES, else the demo route."""
    env = os.environ if env is None else env
    texts = list(flags) or [env.get("REACTOR_ROUTES", "")]
    if not any(t.strip() for t in texts):
        texts = [DEMO_ROUTE]
    return dict(parse_routes(texts))


def _settings(options: dict[str, Any]) -> ReactorSettings:
    return ReactorSettings(
        database_url=options["database_url"],
        redis_url=options["redis_url"],
        routes=resolve_routes(options["routes"]),
        batch_size=options["batch_size"],
        sweep_interval_seconds=options["sweep_interval"],
        stale_after_seconds=options["stale_after"],
        doorbell=DoorbellMode.POLL_ONLY
        if options["no_listen"]
        else DoorbellMode(options["doorbell"]),
        poll_interval_seconds=options["poll_interval"],
        metrics_port=options["metrics_port"],
        metrics_host=options["metrics_host"],
        job_timeout_seconds=options["job_timeout"],
    )


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
    conn = db.connect(database_url, autocommit=True, purpose="migrate")
    with conn:
        result = apply_migrations(conn)
    if result.applied:
        for label in result.applied:
            click.echo(f"applied {label}")
        click.echo(f"database is at schema version {result.version}")
    else:
        click.echo(f"nothing to do: database is already at schema version {result.version}")


@cli.command()
@_dispatch_options
def run(**options: Any) -> None:
    """Run the reactor until SIGTERM/SIGINT (a second signal exits at once)."""
    stopper = Stopper()
    stopper.install()
    reactor = Reactor(_settings(options), stopper=stopper)
    reactor.start()
    reactor.run()


@cli.command()
@_dispatch_options
def sweep(**options: Any) -> None:
    """Run one sweep round and print its result as JSON."""
    settings = replace(_settings(options), doorbell=DoorbellMode.POLL_ONLY, metrics_port=None)
    reactor = Reactor(settings)
    reactor.start()
    try:
        result = reactor.sweep_once()
    finally:
        reactor.close()
    click.echo(json.dumps(asdict(result)))


@cli.command()
@_database_option
@_routes_option
@_stale_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(database_url: str, routes: tuple[str, ...], stale_after: float, as_json: bool) -> None:
    """Show counts by type and state, backlog age, retries, stale rows, unrouted types."""
    routed = resolve_routes(routes)
    conn = db.connect(database_url, purpose="status")
    with conn:
        db.check_schema(conn)
        result = read_status(conn, routed, stale_after)
    click.echo(json.dumps(result.as_dict()) if as_json else format_status(result))


@cli.command()
@_database_option
@click.argument("photo_ids", nargs=-1)
@click.option("--failed", "all_failed", is_flag=True, help="Requeue every failed row.")
@click.option("--type", "job_type", default=None, help="Only rows of this type.")
def requeue(
    database_url: str, photo_ids: tuple[str, ...], all_failed: bool, job_type: str | None
) -> None:
    """Move done/failed rows back to pending (attempts 0): PHOTO_ID... or --failed."""
    if bool(photo_ids) == all_failed:
        raise click.UsageError("give PHOTO_IDs or --failed (one of them)")
    conn = db.connect(database_url, purpose="requeue")
    with conn:
        db.check_schema(conn)
        if all_failed:
            moved = admin.requeue_failed(conn, job_type)
        else:
            moved = admin.requeue_photos(conn, photo_ids, job_type)
    click.echo(json.dumps({"requeued": moved}))


@cli.command()
@_database_option
@click.option("--done-older-than", required=True, metavar="DURATION", help="e.g. 7d, 12h.")
@click.option("--failed-older-than", default=None, metavar="DURATION", help="e.g. 30d.")
def prune(database_url: str, done_older_than: str, failed_older_than: str | None) -> None:
    """Delete done (and failed) rows older than a duration, in batches."""
    done_age = admin.parse_duration(done_older_than)
    failed_age = None if failed_older_than is None else admin.parse_duration(failed_older_than)
    conn = db.connect(database_url, purpose="prune")
    with conn:
        db.check_schema(conn)
        result = admin.prune(conn, done_older_than=done_age, failed_older_than=failed_age)
    click.echo(json.dumps({"deleted_done": result.done, "deleted_failed": result.failed}))


@cli.command("submit")
@_database_option
@click.argument("photo_ids", nargs=-1, required=True)
@click.option("--type", "job_type", default=DEFAULT_JOB_TYPE, show_default=True)
@click.option("--max-attempts", type=click.IntRange(min=1), default=None)
def submit_command(
    database_url: str, photo_ids: tuple[str, ...], job_type: str, max_attempts: int | None
) -> None:
    """Submit photos (one transaction): new rows, or done/failed rows re-armed."""
    conn = db.connect(database_url, purpose="submit")
    with conn:
        db.check_schema(conn)
        with conn.transaction():
            submitted = sum(
                submit(conn, photo_id, job_type, max_attempts=max_attempts)
                for photo_id in photo_ids
            )
    click.echo(json.dumps({"submitted": submitted, "unchanged": len(photo_ids) - submitted}))


# -- reactor worker --------------------------------------------------------------------------


@cli.command("worker")
@_database_option
@_routes_option
@click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=DEFAULT_REDIS_URL,
    show_default=True,
    show_envvar=True,
    help="Redis URL of the RQ queues.",
)
@click.option("--simple", is_flag=True, help="Run jobs in this process (no fork per job).")
@click.option("--burst", is_flag=True, help="Quit when the queues are empty.")
@click.option("--name", default=None, help="Worker name in RQ (default: random).")
@click.option(
    "--max-jobs", type=click.IntRange(min=1), default=None, help="Quit after this many jobs."
)
@click.argument("queues", nargs=-1)
def worker_command(**options: Any) -> None:
    """Run an RQ worker on QUEUES (default: the routed ones) with the lifecycle in this process.

    Retry and heartbeat settings come from REACTOR_RETRY_BASE_SECONDS,
    REACTOR_RETRY_MAX_SECONDS and REACTOR_HEARTBEAT_SECONDS.
    """
    import redis  # noqa: PLC0415 - the other commands do not need RQ's worker machinery

    from reactor.enqueue import connect_redis  # noqa: PLC0415
    from reactor.settings import WorkerSettings  # noqa: PLC0415
    from reactor.workers import SimpleWorker, Worker  # noqa: PLC0415

    routed = resolve_routes(options["routes"])
    names = list(options["queues"]) or sorted({route.queue for route in routed.values()})
    settings = replace(WorkerSettings.from_env(), database_url=options["database_url"])
    worker_class = SimpleWorker if options["simple"] else Worker
    instance = worker_class(
        names,
        name=options["name"],
        connection=connect_redis(options["redis_url"]),
        routes=routed,
        settings=settings,
    )
    instance.check_startup()
    try:
        instance.work(burst=options["burst"], max_jobs=options["max_jobs"])
    except redis.RedisError as exc:
        raise click.ClickException(f"Redis: {redact(str(exc))}") from None


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="reactor")
    sys.exit(0)
