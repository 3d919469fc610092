"""The operator commands of `reactor`: status, failures, pause, resume, requeue, cancel, submit
and dashboard (prune and archive: `reactor.cli.retention`). They read and write the table only
through `reactor.ops` and never dispatch."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from reactor.cli.ids import report_missing, with_stdin
from reactor.cli.options import (
    connect_migrated,
    database_option,
    gone_option,
    redis_option,
    routes_option,
    stale_option,
)
from reactor.errors import ConfigError, ReactorError
from reactor.ops import admin
from reactor.ops.cancel import StopNotSentError, cancel_pending, cancel_photos
from reactor.ops.failures import format_failures, read_failures
from reactor.ops.hosts import parse_allowed_host
from reactor.ops.pause import check_types, pause_types, resume_types, who
from reactor.ops.status import format_status, read_status
from reactor.pg import db
from reactor.pg.registry import read_recorded_routes, routes_in_use
from reactor.producer import DEFAULT_JOB_TYPE, submit_many
from reactor.routes import Route, given_routes
from reactor.settings import DEFAULT_DASHBOARD_PORT
from reactor.signals import Stopper
from reactor.validate import (
    MAX_ATTEMPTS,
    check_job_type,
    check_row_photo_id,
    validate_job,
)

__all__ = ["OPS_COMMANDS"]

logger = logging.getLogger(__name__)

#: `reactor status` gives up on a Redis that does not answer within this long (seconds), and
#: prints the rest.
STATUS_REDIS_TIMEOUT_SECONDS = 5.0
#: The shortest password `reactor dashboard --hash-password` hashes.
MIN_PASSWORD_CHARS = 8


@click.command()
@database_option
@redis_option
@stale_option
@gone_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--exact",
    is_flag=True,
    help="Count every finished row (a scan), not the planner's estimate (≈) of many rows.",
)
def status(
    *,
    database_url: str,
    redis_url: str,
    stale_after: float,
    gone_after: float,
    as_json: bool,
    exact: bool,
) -> None:
    """Show counts by type and state, backlog age, retries, stale rows and rows whose RQ worker
    is gone, the routes the reactors use, unrouted types, what holds back vacuum."""
    from reactor.rq.redis_url import connect_redis  # noqa: PLC0415 - only this command's Redis

    client = connect_redis(
        redis_url,
        socket_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
        socket_connect_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
    )
    try:
        with connect_migrated(database_url, "status", read_write=False) as conn:
            result = read_status(
                conn, stale_after, client=client, gone_after_seconds=gone_after, exact=exact
            )
    finally:
        client.close()
    click.echo(json.dumps(result.as_dict()) if as_json else format_status(result))


@click.command()
@database_option
@click.option("--type", "job_type", default=None, help="Only rows of this type.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Rows shown."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (errors in full).")
def failures(database_url: str, job_type: str | None, limit: int, as_json: bool) -> None:
    """Show the latest failed, cancelled and retried rows: attempt, last_error, when."""
    with connect_migrated(database_url, "failures", read_write=False) as conn:
        found = read_failures(conn, job_type, limit)
    click.echo(json.dumps(found.as_dict()) if as_json else format_failures(found))


@click.command()
@database_option
@routes_option
@click.argument("types", nargs=-1, required=True)
def pause(database_url: str, routes: tuple[str, ...], types: tuple[str, ...]) -> None:
    """Stop dispatching TYPE... on every reactor (rows stay pending; running jobs finish)."""
    with connect_migrated(database_url, "pause") as conn:
        result = pause_types(conn, types, _known_routes(conn, routes), who())
    click.echo(json.dumps({"paused": result.changed, "already_paused": result.unchanged}))


@click.command()
@database_option
@routes_option
@click.argument("types", nargs=-1, required=True)
def resume(database_url: str, routes: tuple[str, ...], types: tuple[str, ...]) -> None:
    """Dispatch TYPE... again (listening reactors start at once)."""
    with connect_migrated(database_url, "resume") as conn:
        result = resume_types(conn, types, _known_routes(conn, routes))
    click.echo(json.dumps({"resumed": result.changed, "not_paused": result.unchanged}))


def _known_routes(conn: db.Connection, flags: tuple[str, ...]) -> dict[str, Route]:
    """The routes named on the command line, else those the reactors recorded."""
    return given_routes(flags) or dict(routes_in_use(conn))


@click.command()
@database_option
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
    """Move done/failed/cancelled rows back to pending (attempts 0): PHOTO_ID... or --failed.
    `-` reads photo ids from standard input, one a line (lines end at a line feed, a CR before
    it is dropped; empty lines are skipped). Photo ids with no row are reported (exit 1); the
    others are requeued. A --type that is neither routed, paused nor in the table is refused."""
    if bool(photo_ids) == all_failed:
        raise click.UsageError("give PHOTO_IDs or --failed (one of them)")
    if job_type is not None:
        check_job_type(job_type)
    photo_ids = tuple(dict.fromkeys(with_stdin(photo_ids)))
    for photo_id in photo_ids:
        check_row_photo_id(photo_id)
    missing: list[str] = []
    with connect_migrated(database_url, "requeue") as conn:
        if all_failed:
            moved = admin.requeue_failed(conn, job_type)
            if moved == 0 and job_type is not None:
                _check_type_known(conn, job_type, "requeued")
        else:
            missing = admin.missing_photo_ids(conn, photo_ids, job_type)
            moved = admin.requeue_photos(conn, photo_ids, job_type)
    click.echo(json.dumps({"requeued": moved, "not_found": missing}))
    if missing:
        report_missing(missing, job_type)
        ctx.exit(1)


@click.command()
@database_option
@redis_option
@click.argument("photo_ids", nargs=-1)
@click.option("--pending", "all_pending", is_flag=True, help="Cancel every pending row of --type.")
@click.option("--type", "job_type", default=None, help="Only rows of this type.")
@click.pass_context
def cancel(
    ctx: click.Context,
    *,
    database_url: str,
    redis_url: str,
    photo_ids: tuple[str, ...],
    all_pending: bool,
    job_type: str | None,
) -> None:
    """Cancel pending/active rows (state `cancelled`): PHOTO_ID... or --pending --type T. Every
    row is cancelled first; then the started jobs of active rows are asked to stop (their
    outcomes never count either way; exit 1 when Redis failed, with the counts printed). Photo
    ids with no row are reported (exit 1). A --type that is neither routed, paused nor in the
    table is refused."""
    from reactor.rq.redis_url import connect_redis  # noqa: PLC0415 - only this command's Redis

    if bool(photo_ids) == all_pending:
        raise click.UsageError("give PHOTO_IDs or --pending --type T (one of them)")
    if all_pending and job_type is None:
        raise click.UsageError("--pending needs --type")
    if job_type is not None:
        check_job_type(job_type)
    for photo_id in photo_ids:
        check_row_photo_id(photo_id)
    missing: list[str] = []
    not_stopped: StopNotSentError | None = None
    with connect_migrated(database_url, "cancel") as conn:
        if all_pending and job_type is not None:
            result = cancel_pending(conn, job_type, who())
            if result.cancelled == 0:
                _check_type_known(conn, job_type, "cancelled")
        else:
            missing = admin.missing_photo_ids(conn, photo_ids, job_type)
            client = connect_redis(
                redis_url,
                socket_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
                socket_connect_timeout=STATUS_REDIS_TIMEOUT_SECONDS,
            )
            try:
                result = cancel_photos(conn, client, photo_ids, job_type, who())
            except StopNotSentError as exc:
                result, not_stopped = exc.result, exc
            finally:
                client.close()
    # Rows found, none pending or active: already done, failed or cancelled, left as they are.
    unchanged = sorted(set(photo_ids) - result.photo_ids - set(missing))
    shown = {"cancelled": result.cancelled, "stopped": result.stopped, "not_found": missing}
    click.echo(json.dumps(shown | {"unchanged": unchanged}))
    if missing:
        report_missing(missing, job_type)
    if not_stopped is not None:
        click.echo(f"reactor: error: {not_stopped}", err=True)
    if missing or not_stopped is not None:
        ctx.exit(1)


def _check_type_known(conn: db.Connection, job_type: str, done: str) -> None:
    """After a bulk action that changed no row (the lookup may read the whole table), refuse
    a type that is neither routed, paused nor in the table, as `reactor pause` does: a typo
    is no quiet success. Raises ConfigError."""
    routed = _known_routes(conn, ())
    try:
        check_types(conn, [job_type], routed)
    except ConfigError:
        raise ConfigError(
            f"unknown type {job_type!r}: no route, no rows and not paused (nothing {done})"
        ) from None


@click.command("submit")
@database_option
@click.argument("photo_ids", nargs=-1, required=True)
@click.option("--type", "job_type", default=DEFAULT_JOB_TYPE, show_default=True)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1, max=MAX_ATTEMPTS),
    default=None,
    help="Attempts before a row fails (new rows: 5; re-armed rows keep theirs).",
)
def submit_command(
    database_url: str, photo_ids: tuple[str, ...], job_type: str, max_attempts: int | None
) -> None:
    """Submit photos (one transaction): new rows, or done/failed/cancelled rows re-armed. `-`
    reads photo ids from standard input, one a line (lines end at a line feed, a CR before it
    is dropped; empty lines are skipped)."""
    photo_ids = tuple(dict.fromkeys(with_stdin(photo_ids)))
    for photo_id in photo_ids:
        validate_job(photo_id, job_type)
    with connect_migrated(database_url, "submit") as conn:
        with conn.transaction():
            submitted = submit_many(conn, photo_ids, job_type, max_attempts=max_attempts)
        click.echo(json.dumps({"submitted": submitted, "unchanged": len(photo_ids) - submitted}))
        _warn_if_never_routed(conn, job_type)


def _warn_if_never_routed(conn: db.Connection, job_type: str) -> None:
    """A type no reactor ever recorded a route for is most often a typo: say so (the rows stay,
    pending until a reactor routes the type). Nothing is said to a role that may not read
    the routes."""
    try:
        recorded = {r.route.type for r in read_recorded_routes(conn)}
    except ReactorError:
        return
    if recorded and job_type not in recorded:
        click.echo(
            f"reactor: warning: no reactor has recorded a route for type {job_type!r} (routed: "
            f"{', '.join(sorted(recorded))}): its rows stay pending until one does",
            err=True,
        )


@click.command()
@database_option
@routes_option
@stale_option
@redis_option
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
    default=DEFAULT_DASHBOARD_PORT,
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
    help="Seconds a client may take to send its request, from connecting, and may stay silent; "
    "the body of a POST that may act gets a second more per 64 KiB (then 408).",
)
@click.option(
    "--actions",
    is_flag=True,
    help="Offer requeue, cancel, pause and resume (page and POST /api/...), behind the "
    "credentials of REACTOR_DASHBOARD_TOKEN / REACTOR_DASHBOARD_READ_TOKEN (bearer) or "
    "REACTOR_DASHBOARD_USERS (basic auth); every request then needs one.",
)
@click.option(
    "--hash-password",
    is_flag=True,
    help="Read a password (prompted, or one line of standard input) and print its hash for "
    "REACTOR_DASHBOARD_USERS; serve nothing.",
)
def dashboard(**options: Any) -> None:
    """Serve a web page of the table, the reactors and RQ (and /api/overview); read-only
    unless --actions."""
    from reactor.ops.auth import hash_password, load_credentials  # noqa: PLC0415

    if options["hash_password"]:
        if sys.stdin.isatty():
            password = click.prompt("password", hide_input=True, confirmation_prompt=True)
        else:
            password = sys.stdin.readline().rstrip("\n")
        if len(password) < MIN_PASSWORD_CHARS:
            raise ConfigError(f"give a password of at least {MIN_PASSWORD_CHARS} characters")
        click.echo(hash_password(password))
        return
    try:
        from reactor.ops.actions import Actions  # noqa: PLC0415
        from reactor.ops.dashboard import Dashboard, serve_dashboard  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"reactor dashboard needs {exc.name}: pip install '/path/to/photo-reactor[dashboard]'"
        ) from None
    actions = None
    if options["actions"]:
        actions = Actions(
            options["database_url"],
            options["redis_url"],
            given_routes(options["routes"]),
            load_credentials(os.environ),
        )
    allowed = [
        parse_allowed_host(name)
        for given in options["allowed_hosts"]
        for name in given.split(",")
        if name.strip()
    ]
    board = Dashboard(
        options["database_url"],
        options["redis_url"],
        given_routes(options["routes"]),
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
        actions=actions,
    )
    bound_host, bound_port = server.server_address[:2]
    logger.info(
        "dashboard_serving url=http://%s:%d/ actions=%s",
        bound_host,
        bound_port,
        "on" if actions is not None else "off",
    )
    while not stopper.sleep(3600):
        pass
    server.shutdown()
    server.server_close()
    board.close()


#: The commands this module adds to `reactor`.
OPS_COMMANDS = (
    status,
    failures,
    pause,
    resume,
    requeue,
    cancel,
    submit_command,
    dashboard,
)
