"""Settings of the reactor and of the worker side, with their named defaults.

Every reactor setting is a CLI flag and an environment variable (the CLI wires both, the flag
wins); the worker-side settings are read from the environment of the `rq worker` process,
because RQ starts our entry point, not our CLI. Values are validated here, once, so the rest of
the code can trust them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from reactor.dispatcher.doorbell import DoorbellMode
from reactor.errors import ConfigError
from reactor.routes import Route, parse_handler_prefixes

__all__ = [
    "BUSY_KEY_TTL_HEARTBEATS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_DASHBOARD_PORT",
    "DEFAULT_GONE_AFTER_SECONDS",
    "DEFAULT_HEARTBEAT_SECONDS",
    "DEFAULT_POLL_INTERVAL_SECONDS",
    "DEFAULT_PRUNE_BATCH_SIZE",
    "DEFAULT_REDIS_TIMEOUT_SECONDS",
    "DEFAULT_REDIS_URL",
    "DEFAULT_RETRY_BASE_SECONDS",
    "DEFAULT_RETRY_MAX_SECONDS",
    "DEFAULT_STALE_AFTER_SECONDS",
    "DEFAULT_SWEEP_INTERVAL_SECONDS",
    "FAILED_JOB_TTL_SECONDS",
    "MIN_RETENTION_AGE_SECONDS",
    "RESULT_TTL_SECONDS",
    "TRACE_RELATIONSHIPS",
    "ReactorSettings",
    "WorkerSettings",
]

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: `reactor dashboard` listens on 127.0.0.1 at this port unless told otherwise.
DEFAULT_DASHBOARD_PORT = 9180
#: Seconds the reactor waits for Redis to connect or to answer one command. The claim's
#: transaction (and its row locks) stays open while the enqueue waits: a hung Redis must not
#: hold it longer than this.
DEFAULT_REDIS_TIMEOUT_SECONDS = 5.0
DEFAULT_BATCH_SIZE = 500
DEFAULT_SWEEP_INTERVAL_SECONDS = 30.0
#: Poll-only mode: how often the reactor looks for due rows without a notification.
DEFAULT_POLL_INTERVAL_SECONDS = 1.0
DEFAULT_STALE_AFTER_SECONDS = 300.0
DEFAULT_RETRY_BASE_SECONDS = 5.0
DEFAULT_RETRY_MAX_SECONDS = 3600.0
#: Seconds between a running attempt's heartbeats: one Postgres write each, and a renewal of
#: the worker's RQ key, which expires `BUSY_KEY_TTL_HEARTBEATS` beats after the last one.
DEFAULT_HEARTBEAT_SECONDS = 15.0
#: While a worker class runs an attempt, its RQ worker key (and the job's execution in RQ's
#: started registry) lives this many heartbeat intervals past each beat: a dead worker's key
#: is gone within that long, a live one's never lapses (a beat every interval).
BUSY_KEY_TTL_HEARTBEATS = 4
#: A started (or ended) job whose RQ worker is gone (its key expired) is rescued once its row
#: has had no write for this many seconds (two default heartbeats: a worker cut off from Redis
#: but still beating in Postgres keeps its attempt).
DEFAULT_GONE_AFTER_SECONDS = 30.0
#: Rows the retention pruner deletes per transaction.
DEFAULT_PRUNE_BATCH_SIZE = 500
#: The youngest finished rows archived or pruned: a photo submitted again once its row is gone
#: gets a new row, whose tokens start again at 1, so no attempt of the old life may still be
#: running (well beyond RQ's job timeout): its job id would be the new row's.
MIN_RETENTION_AGE_SECONDS = 3600.0
#: How long RQ keeps a failed job in its failed registry (the database row is the truth).
FAILED_JOB_TTL_SECONDS = 7 * 24 * 3600
#: How long RQ keeps a finished job (RQ's default), set on every job so that a worker's
#: `--results-ttl 0` cannot delete it before the worker classes write its outcome: the sweep
#: re-dispatches the row of a job missing from Redis at once.
RESULT_TTL_SECONDS = 500


@dataclass(frozen=True)
class ReactorSettings:
    """What `reactor run` and `reactor sweep` need."""

    database_url: str
    redis_url: str
    routes: Mapping[str, Route]
    batch_size: int = DEFAULT_BATCH_SIZE
    sweep_interval_seconds: float = DEFAULT_SWEEP_INTERVAL_SECONDS
    stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS
    gone_after_seconds: float = DEFAULT_GONE_AFTER_SECONDS
    doorbell: DoorbellMode = DoorbellMode.ADAPTIVE
    poll_interval_seconds: float = DEFAULT_POLL_INTERVAL_SECONDS
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    job_timeout_seconds: int | None = None
    redis_timeout_seconds: float = DEFAULT_REDIS_TIMEOUT_SECONDS
    #: Retention (`run` only): delete done/failed rows older than this many seconds.
    prune_done_after_seconds: float | None = None
    prune_failed_after_seconds: float | None = None
    prune_batch_size: int = DEFAULT_PRUNE_BATCH_SIZE
    #: Retention into the history (`run` only): move done/failed/cancelled rows older than
    #: this to photo_jobs_history; drop its months older than `drop_history_after_seconds`.
    archive_after_seconds: float | None = None
    drop_history_after_seconds: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigError(f"batch size must be 1..10000, not {self.batch_size}")
        if self.sweep_interval_seconds <= 0:
            raise ConfigError("sweep interval must be positive")
        if self.stale_after_seconds <= 0:
            raise ConfigError("stale-after must be positive")
        if self.gone_after_seconds <= 0:
            raise ConfigError("gone-after must be positive")
        if self.poll_interval_seconds <= 0:
            raise ConfigError("poll interval must be positive")
        if self.redis_timeout_seconds <= 0:
            raise ConfigError("Redis timeout must be positive")
        if self.prune_failed_after_seconds is not None and self.prune_done_after_seconds is None:
            raise ConfigError("--prune-failed-after needs --prune-done-after")
        for age in (self.prune_done_after_seconds, self.prune_failed_after_seconds):
            if age is not None and age < MIN_RETENTION_AGE_SECONDS:
                raise ConfigError("prune ages must be at least 1h")
        if self.archive_after_seconds is not None:
            if self.prune_done_after_seconds is not None:
                raise ConfigError("give --prune-done-after or --archive-after, not both")
            if self.archive_after_seconds < MIN_RETENTION_AGE_SECONDS:
                raise ConfigError("--archive-after must be at least 1h")
        if self.drop_history_after_seconds is not None and self.drop_history_after_seconds <= 0:
            raise ConfigError("--drop-history-after must be positive")

    @property
    def listen(self) -> bool:
        """Whether the reactor keeps a LISTEN connection (every doorbell mode but poll-only)."""
        return self.doorbell is not DoorbellMode.POLL_ONLY


#: The largest number of seconds a worker setting takes (ten years).
MAX_SETTING_SECONDS = 10 * 365 * 86400


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, not {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, not {raw!r}")
    if not math.isfinite(value) or value > MAX_SETTING_SECONDS:
        # Past this, Redis TTLs and Postgres intervals made from it overflow at every job.
        raise ConfigError(
            f"{name} must be a number of seconds up to {MAX_SETTING_SECONDS:,}, not {raw!r}"
        )
    return value


#: How a worker's `process` span relates to the row's stored trace context (`reactor.tracing`).
TRACE_RELATIONSHIPS = ("link", "child", "none")


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker entry point needs, read from the `rq worker` process environment."""

    database_url: str
    retry_base_seconds: float = DEFAULT_RETRY_BASE_SECONDS
    retry_max_seconds: float = DEFAULT_RETRY_MAX_SECONDS
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    #: The modules handlers may be imported from (`reactor.worker.own_routes`); empty: any.
    handler_prefixes: tuple[str, ...] = ()
    #: How a `process` span relates to the stored trace context: `link`, `child` or `none`.
    trace_relationship: str = "link"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """Read `DATABASE_URL`, the `REACTOR_RETRY_*`/`REACTOR_HEARTBEAT_SECONDS` variables and
        `REACTOR_HANDLER_PREFIXES`, `REACTOR_TRACE_RELATIONSHIP`.

        Raises:
            ConfigError: a value is not a positive number, a prefix not a module path, or the
                trace relationship not one of `TRACE_RELATIONSHIPS`.
        """
        env = os.environ if env is None else env
        relationship = env.get("REACTOR_TRACE_RELATIONSHIP", "") or "link"
        if relationship not in TRACE_RELATIONSHIPS:
            raise ConfigError(
                f"REACTOR_TRACE_RELATIONSHIP must be one of {', '.join(TRACE_RELATIONSHIPS)},"
                f" got {relationship[:40]!r}"
            )
        return cls(
            database_url=env.get("DATABASE_URL", ""),
            retry_base_seconds=_positive_float(
                env, "REACTOR_RETRY_BASE_SECONDS", DEFAULT_RETRY_BASE_SECONDS
            ),
            retry_max_seconds=_positive_float(
                env, "REACTOR_RETRY_MAX_SECONDS", DEFAULT_RETRY_MAX_SECONDS
            ),
            heartbeat_seconds=_positive_float(
                env, "REACTOR_HEARTBEAT_SECONDS", DEFAULT_HEARTBEAT_SECONDS
            ),
            handler_prefixes=parse_handler_prefixes([env.get("REACTOR_HANDLER_PREFIXES", "")]),
            trace_relationship=relationship,
        )
