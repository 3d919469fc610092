"""`reactor worker`: an RQ worker of the project's classes, which waits for its Redis, rides out
a Redis restart or a Sentinel failover, and starts RQ's work loop again when it quits on an
unexpected error."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import click

from reactor.cli.options import (
    connect_migrated,
    database_option,
    redis_option,
    routes_option,
)
from reactor.errors import ConfigError
from reactor.pg.registry import routes_in_use
from reactor.redact import redact
from reactor.routes import given_routes, parse_handler_prefixes
from reactor.sdnotify import Notifier
from reactor.signals import Stopper

__all__ = ["worker_command"]

logger = logging.getLogger(__name__)

# -- reactor worker --------------------------------------------------------------------------

#: Retries of one Redis command by `reactor worker` before it gives up (with backoff to 2 s).
WORKER_REDIS_RETRIES = 20
#: Pause before `reactor worker` starts RQ's work loop again after it quit on an error,
#: doubled at each quit in a row up to the maximum (a loop that ran that long starts it over):
#: an error that every start meets (a Redis key of the wrong type) is not retried every second.
WORKER_RESTART_SECONDS = 1.0
WORKER_RESTART_MAX_SECONDS = 30.0
#: Before its work loop, `reactor worker` checks that Redis answers within this many seconds,
#: and while it does not, says so (at once, then at most every `WORKER_REDIS_WAIT_LOG_SECONDS`)
#: and asks again with backoff up to `WORKER_REDIS_WAIT_MAX_SECONDS` apart: a worker started
#: before its Redis waits for it, where RQ's own retries ran silent for half a minute.
WORKER_REDIS_CHECK_SECONDS = 5.0
WORKER_REDIS_WAIT_MAX_SECONDS = 5.0
WORKER_REDIS_WAIT_LOG_SECONDS = 30.0


@click.command("worker")
@database_option
@routes_option
@redis_option
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
    from reactor.worker.classes import SimpleWorker, Worker  # noqa: PLC0415
    from reactor.worker.startup import RQ_DEFAULT_QUEUE  # noqa: PLC0415

    if options["quiet"]:
        logging.getLogger().setLevel(logging.WARNING)
    given = given_routes(options["routes"])
    routed = given
    if not routed:
        with connect_migrated(options["database_url"], "worker") as conn:
            routed = dict(routes_in_use(conn))
    # With no queue and no route yet, the worker waits for a reactor to record its routes.
    names = list(options["queues"]) or sorted({route.queue for route in routed.values()})
    names = names or [RQ_DEFAULT_QUEUE]
    settings = replace(WorkerSettings.from_env(), database_url=options["database_url"])
    if options["handler_prefixes"]:
        prefixes = parse_handler_prefixes(options["handler_prefixes"])
        settings = replace(settings, handler_prefixes=prefixes)
    _check_watchdog(Notifier.from_env(), settings.heartbeat_seconds)
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
    # `default` named by us, not by the user: once routes are recorded, their queues alone.
    instance.default_queue_serves = "default" if options["queues"] else "routed"
    if options["name"]:
        _check_name_free(instance)
    instance.check_startup()
    # RQ sets its loggers to INFO unless told a level: its lines follow --log-level too.
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    failed = False
    pause = WORKER_RESTART_SECONDS
    while True:
        started = time.monotonic()
        try:
            if failed:
                # The failed loop's teardown may not have recorded the worker's death: RQ's
                # start would then take this worker for a live one of the same name.
                instance.register_death()  # type: ignore[no-untyped-call]
                failed = False
            instance.work(burst=options["burst"], max_jobs=options["max_jobs"], logging_level=level)
        except redis.RedisError as exc:
            refused = isinstance(
                exc, (redis.AuthenticationError, redis.exceptions.NoPermissionError)
            )
            if refused or options["burst"] or options["max_jobs"] or instance.stop_requested:
                raise click.ClickException(f"Redis: {redact(str(exc))}") from None
            # Redis failed RQ's start or teardown too (down past the retries, refusing writes
            # when full): like a quit of its loop, ridden out by a long-running worker.
            failed = True
            why = f"Redis failed RQ's work loop: {redact(str(exc))}"
        else:
            if options["burst"] or options["max_jobs"] or instance.stop_requested:
                return
            # RQ's work loop quits on any error it does not expect (a Redis error that outlived
            # the retries, a blocked read cut by a failover): a long-running worker starts it
            # again.
            why = "RQ's work loop quit"
        if time.monotonic() - started >= WORKER_RESTART_MAX_SECONDS:
            pause = WORKER_RESTART_SECONDS
        if _stopped_during(pause, why):
            logger.info("worker_stopped (asked to while RQ's work loop was down)")
            return
        pause = min(pause * 2, WORKER_RESTART_MAX_SECONDS)


def _stopped_during(seconds: float, why: str) -> bool:
    """Say why and wait before RQ's loop starts again; whether SIGTERM or SIGINT asked for a
    stop meanwhile (from the line on: RQ's own handlers are set again by its next start)."""
    stopper = Stopper()
    stopper.install()
    try:
        logger.warning("worker_restarting in=%.0fs (%s)", seconds, why)
        return stopper.sleep(seconds)
    finally:
        stopper.close()


def _check_name_free(instance: Any) -> None:
    """RQ refuses a name whose worker key is in Redis with no death recorded: say why, and
    what to do, instead of its ValueError (a killed idle worker's key lives for minutes)."""
    key = instance.key
    if instance.connection.exists(key) and not instance.connection.hexists(key, "death"):
        ttl = instance.connection.ttl(key)
        raise ConfigError(
            f"a worker named {instance.name!r} is registered in Redis already (a live one, or "
            f"one that was killed: its key expires in {ttl} s): give another --name, or none"
        )


def _check_watchdog(notifier: Notifier, heartbeat_seconds: float) -> None:
    """During a job only the heartbeat renews the worker's key, and so tells the watchdog."""
    if notifier.max_wait() < heartbeat_seconds:
        raise ConfigError(
            f"the systemd watchdog ({notifier.watchdog_seconds:g} s) must be at least two "
            f"heartbeats (REACTOR_HEARTBEAT_SECONDS={heartbeat_seconds:g}): raise WatchdogSec"
        )


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
