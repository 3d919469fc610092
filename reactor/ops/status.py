"""`reactor status`: what the table holds, for people and (as JSON) for scripts.

Counts by type and state, the age of the oldest due pending row, the next scheduled retry,
stale `active` rows, `active` rows whose RQ worker is gone (read from Redis when a client is
given, None when not or when Redis failed: the rows the sweep's next pass re-dispatches for
that reason, found by the sweep's own query and decision, `reactor.rq.state.worker_gone_rows`),
pending rows whose claim a reactor found failing (named, with the error), paused types, the
routes recorded by the reactors (and how many running reactors use each), and pending types
that no route covers, and what holds back vacuum of the table (`reactor.pg.vacuum`: the xmin
horizon's oldest holder, the dead-tuple share, whether autovacuum runs on it). Pending and
active rows are counted exactly through their partial indexes; finished rows (done, failed,
cancelled) exactly up to `reactor.pg.estimates.EXACT_UP_TO` of each state, beyond that as the
planner's estimate, named in each type's `estimated` and shown as `≈ 5.0M` (`exact=True`
counts every row: a scan). So a table of millions of done rows costs about what one of a
hundred thousand does. The table for people shows texts from the database (who paused a type,
a recorded route) with control characters escaped (`reactor.ops.terminal`).

Types are named up to a bound, as the backlog metrics label them: every routed or paused type,
and the `MAX_OTHER_TYPES_NAMED` others with the most rows waiting (then finished); the rest are
summed in one last entry, `OTHER_TYPES`, with how many they are (`other_types`; of them with
pending rows: `other_unrouted_types`, the unrouted types `unrouted_types` does not name). So
thousands of types (an INSERT-only role can make them) cost a few statements and a few lines,
never a statement or a line each.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from reactor.dispatcher.refused import CLAIM_REFUSED_PREFIX
from reactor.errors import RedisUnavailableError
from reactor.jobs import JobRef
from reactor.ops.pause import PausedType, paused_types
from reactor.ops.terminal import visible
from reactor.pg import queries
from reactor.pg.db import Connection, translating
from reactor.pg.estimates import Count, StateRows, counts_by_type, read_state_rows
from reactor.pg.history import count_history
from reactor.pg.registry import RecordedRoute, read_recorded_routes
from reactor.pg.vacuum import VacuumHealth, read_vacuum_health
from reactor.redact import redact
from reactor.routes import format_route
from reactor.rq.state import RqState, reading
from reactor.settings import DEFAULT_GONE_AFTER_SECONDS

__all__ = [
    "FINISHED_STATES",
    "MAX_OTHER_TYPES_NAMED",
    "OTHER_TYPES",
    "STATES",
    "FinishedCounts",
    "Status",
    "TypeStatus",
    "format_status",
    "read_finished_counts",
    "read_status",
    "shown_count",
]

#: The states of a row, in the order a row moves through them.
STATES = ("pending", "active", "done", "failed", "cancelled")
#: The states whose rows pile up (estimated when they are many).
FINISHED_STATES = ("done", "failed", "cancelled")
#: Quiet active rows whose RQ worker `reactor status` looks up (the oldest first).
MAX_WORKER_CHECKS = 10_000
#: Pending rows whose claim fails, named by `reactor status`.
MAX_REFUSED_SHOWN = 10
#: Types named besides the routed and paused ones (those with the most rows waiting, then
#: finished); the others are summed in the entry `OTHER_TYPES`.
MAX_OTHER_TYPES_NAMED = 20
#: The `type` of that entry (no type can be called so: `reactor.validate.is_valid_type`).
OTHER_TYPES = "(other types)"


@dataclass(frozen=True)
class TypeStatus:
    """The figures of one job type, or of the types not named together (`OTHER_TYPES`: its
    oldest due row is that of any of them, its next retry the first of theirs)."""

    type: str
    counts: dict[str, int]
    oldest_due_age_seconds: float | None
    next_retry_at: str | None
    stale_active: int
    routed: bool
    paused: bool = False
    #: Active rows whose RQ worker is gone (None: not known, Redis not read).
    worker_gone: int | None = None
    #: The states whose count is the planner's estimate (many finished rows).
    estimated: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Status:
    """The whole table."""

    types: list[TypeStatus] = field(default_factory=list)
    unrouted_types: list[str] = field(default_factory=list)
    routes: list[RecordedRoute] = field(default_factory=list)
    paused_types: list[PausedType] = field(default_factory=list)
    #: Why the workers' liveness could not be read from Redis (None: it was, or not asked).
    redis_error: str | None = None
    #: Pending rows whose claim fails (type, photo id, last_error), the latest first.
    claim_refused: list[tuple[str, str, str]] = field(default_factory=list)
    #: What holds back vacuum of the table (None: not read).
    vacuum: VacuumHealth | None = None
    #: Rows archived into photo_jobs_history, and its monthly partitions.
    history: Count = field(default_factory=lambda: Count(0))
    history_months: int = 0
    #: Types summed in the entry `OTHER_TYPES` of `types` (0: every type is named, no entry),
    #: and how many of them have pending rows (unrouted types not in `unrouted_types`).
    other_types: int = 0
    other_unrouted_types: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "types": [vars(t) for t in self.types],
            "unrouted_types": self.unrouted_types,
            "other_types": self.other_types,
            "other_unrouted_types": self.other_unrouted_types,
            "routes": [
                {
                    "type": r.route.type,
                    "handler": r.route.handler,
                    "queue": r.route.queue,
                    "running_reactors": r.live_reactors,
                    "used_by": r.live_by,
                    "registered_at": r.registered_at.isoformat(),
                }
                for r in self.routes
            ],
            "paused_types": [
                {"type": p.type, "paused_at": p.paused_at.isoformat(), "paused_by": p.paused_by}
                for p in self.paused_types
            ],
            "redis_error": self.redis_error,
            "claim_refused": [
                {"type": t, "photo_id": p, "error": e} for t, p, e in self.claim_refused
            ],
            "postgres": None if self.vacuum is None else self.vacuum.as_dict(),
            "history": {
                "rows": self.history.rows,
                "estimated": self.history.estimated,
                "months": self.history_months,
            },
        }


@dataclass(frozen=True)
class FinishedCounts:
    """Rows of finished states by type, as far as read (`reactor.pg.estimates.StateRows`)."""

    states: dict[str, StateRows] = field(default_factory=dict)


def read_finished_counts(
    conn: Connection,
    states: tuple[str, ...] = FINISHED_STATES,
    types: tuple[str, ...] = (),
    *,
    exact: bool = False,
) -> FinishedCounts:
    """Rows of `states` by type: exact up to `EXACT_UP_TO` of a state, beyond that the
    planner's estimates (of `types`, such as the routed ones, which `read_status` always
    names, and of the table's common types; other types as `read_status` asks), unless `exact`.

    Raises:
        DatabaseError: the query failed.
    """
    with translating("status query failed"), conn.transaction():
        return FinishedCounts({s: read_state_rows(conn, s, types, exact=exact) for s in states})


def read_status(
    conn: Connection,
    stale_after_seconds: float,
    *,
    client: redis.Redis | None = None,
    gone_after_seconds: float = DEFAULT_GONE_AFTER_SECONDS,
    done_counts: FinishedCounts | None = None,
    exact: bool = False,
) -> Status:
    """Read the figures (one short read-only transaction), the recorded routes and what holds
    back vacuum; with `client`, also which quiet active rows' jobs were started by an RQ worker
    that is gone. `done_counts`, when given, stands for the count of `done` rows
    (`read_finished_counts(conn, ("done",))`; the dashboard reads it less often). `exact`:
    count every finished row instead of estimating many.

    Raises:
        DatabaseError: a query failed (a Redis failure is reported in `redis_error`).
    """
    routes = read_recorded_routes(conn)
    routed = {r.route.type for r in routes}
    stale_after = {"stale_after": stale_after_seconds}
    with translating("status query failed"), conn.transaction():
        waiting: dict[str, dict[str, int]] = {}
        for job_type, state, count in conn.execute(queries.BACKLOG):  # exact: few, indexed
            waiting.setdefault(job_type, {})[state] = int(count)
        paused = paused_types(conn)
        paused_names = {p.type for p in paused}
        pinned = routed | paused_names
        states = FINISHED_STATES if done_counts is None else ("failed", "cancelled")
        finished = {s: read_state_rows(conn, s, sorted(pinned), exact=exact) for s in states}
        if done_counts is not None:
            finished.update(done_counts.states)
        named, folded = _named_types(pinned, waiting, finished.values())
        counts = {t: dict.fromkeys(STATES, 0) for t in (*named, OTHER_TYPES)}
        for job_type, by_state in waiting.items():
            for state, rows_of in by_state.items():
                counts[_entry(job_type, counts)][state] += rows_of
        estimated = set()
        for state, read in finished.items():
            found = counts_by_type(conn, read, named)
            for job_type, rows_of in found.by_type.items():
                counts[job_type][state] = rows_of
            counts[OTHER_TYPES][state] += found.other if folded else 0
            if found.estimated:
                estimated.add(state)
        rows = conn.execute(queries.STATUS_PER_TYPE, {"types": named, **stale_after}).fetchall()
        if folded:
            [other] = conn.execute(queries.STATUS_OTHER_TYPES, {"types": named, **stale_after})
            rows.append((OTHER_TYPES, *other))
        # The sweep's page of active rows, its oldest first: the quiet ones not yet stale are
        # those it re-dispatches when their worker is gone (stale ones are counted as such).
        quiet = [
            JobRef(t, p, int(token))
            for t, p, token, _, paused, stale_row, quiet in conn.execute(
                queries.LIST_ACTIVE,
                {
                    "types": sorted(t for t, by in waiting.items() if by.get("active")),
                    "until": "infinity",
                    "after_at": "-infinity",
                    "after_type": "",
                    "after_id": "",
                    "limit": MAX_WORKER_CHECKS,
                    "gone_after": min(gone_after_seconds, stale_after_seconds),
                    **stale_after,
                },
            )
            if quiet and not stale_row and not paused
        ]
        refused = [
            (str(t), str(p), str(e).removeprefix(CLAIM_REFUSED_PREFIX))
            for t, p, e in conn.execute(
                queries.CLAIM_REFUSED_ROWS,
                {"prefix": CLAIM_REFUSED_PREFIX, "limit": MAX_REFUSED_SHOWN},
            )
        ]
        history, history_months = count_history(conn, exact=exact)
    vacuum = read_vacuum_health(conn)
    gone: dict[str, int] | None = None
    redis_error = None
    if client is not None:
        try:
            with reading():
                gone = {}
                for job_type, lost in _workers_gone(client, quiet).items():
                    entry = _entry(job_type, counts)
                    gone[entry] = gone.get(entry, 0) + lost
        except RedisUnavailableError as exc:
            gone = None
            text = str(exc).strip()
            redis_error = redact(text.splitlines()[0] if text else repr(exc))
    types = [
        TypeStatus(
            type=job_type,
            counts=counts[job_type],
            oldest_due_age_seconds=None if age is None else round(float(age), 3),
            next_retry_at=next_at,
            stale_active=int(stale_active),
            routed=job_type in routed,
            paused=job_type in paused_names,
            worker_gone=None if gone is None else gone.get(job_type, 0),
            estimated=[s for s in STATES if s in estimated],
        )
        for job_type, age, next_at, stale_active in rows
    ]
    unrouted = [t for t in named if t not in routed and waiting.get(t, {}).get("pending")]
    other_unrouted = sum(1 for t in folded if waiting.get(t, {}).get("pending"))
    return Status(
        types,
        unrouted,
        routes,
        paused,
        redis_error,
        refused,
        vacuum,
        history,
        history_months,
        len(folded),
        other_unrouted,
    )


def _named_types(
    pinned: set[str], waiting: dict[str, dict[str, int]], finished: Iterable[StateRows]
) -> tuple[list[str], set[str]]:
    """The types named (sorted): `pinned` and the `MAX_OTHER_TYPES_NAMED` others with the most
    rows waiting, then finished (as read: a few rows of each, or the planner's estimate of the
    common ones), then by name; and the other types found with rows, summed as `OTHER_TYPES`."""
    finished_rows: dict[str, int] = {}
    for read in finished:
        for job_type, rows in read.by_type.items():
            finished_rows[job_type] = finished_rows.get(job_type, 0) + rows
    others = (set(waiting) | set(finished_rows)) - pinned
    first = heapq.nsmallest(
        MAX_OTHER_TYPES_NAMED,
        others,
        key=lambda t: (-sum(waiting.get(t, {}).values()), -finished_rows.get(t, 0), t),
    )
    return sorted(pinned.union(first)), others.difference(first)


def _entry(job_type: str, counts: dict[str, dict[str, int]]) -> str:
    """The entry of `types` that counts `job_type`: its own, or `OTHER_TYPES`."""
    return job_type if job_type in counts else OTHER_TYPES


def _workers_gone(client: redis.Redis, refs: list[JobRef]) -> dict[str, int]:
    """Per type, how many of `refs` (quiet active rows) have a job whose RQ worker is gone.

    Raises:
        redis.RedisError, RedisUnavailableError: Redis failed.
    """
    state = RqState(client, {})
    statuses = state.job_statuses(refs)
    counts: dict[str, int] = {}
    for ref, lost in zip(refs, state.worker_gone_rows(refs, statuses), strict=True):
        if lost:
            counts[ref.type] = counts.get(ref.type, 0) + 1
    return counts


def shown_count(rows: int, estimated: bool) -> str:
    """A count for people: as it is, or an estimate rounded and marked (`≈ 5.0M`)."""
    if not estimated:
        return str(rows)
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if rows >= size:
            return f"\N{ALMOST EQUAL TO} {rows / size:.1f}{unit}"
    return f"\N{ALMOST EQUAL TO} {rows}"


def format_status(status: Status) -> str:
    """A table for people."""
    header = f"{'type':<24} " + " ".join(f"{s:>9}" for s in STATES) + "  details"
    lines = [header]
    for t in status.types:
        details = [f"{status.other_types} types not named"] if t.type == OTHER_TYPES else []
        if t.oldest_due_age_seconds is not None:
            details.append(f"oldest due {t.oldest_due_age_seconds:.1f}s ago")
        if t.next_retry_at is not None:
            details.append(f"next retry {t.next_retry_at}")
        if t.stale_active:
            details.append(f"{t.stale_active} stale active")
        if t.worker_gone:
            details.append(f"{t.worker_gone} worker gone")
        if t.paused:
            details.append("PAUSED")
        if not t.routed:
            details.append("NO ROUTE")
        c = t.counts
        lines.append(
            f"{t.type:<24} "
            + " ".join(f"{shown_count(c[s], s in t.estimated):>9}" for s in STATES)
            + f"  {', '.join(details)}".rstrip()
        )
    if not status.types:
        lines.append("(no rows yet: `reactor submit PHOTO_ID`, or your producers' submit())")
    if status.routes:
        lines.append("routes (recorded by the reactors; `reactor run --route` records them):")
    for r in status.routes:
        used = (
            f"used by {r.live_reactors} running reactor{'s' if r.live_reactors > 1 else ''}"
            f" ({r.live_by})"
            if r.live_reactors
            else f"no running reactor (last recorded {r.registered_at:%Y-%m-%d %H:%M:%S %Z})"
        )
        lines.append(f"  {format_route(r.route)}  {used}")
    unrouted = list(status.unrouted_types)
    if status.other_unrouted_types:
        unrouted.append(f"{status.other_unrouted_types} more in {OTHER_TYPES}")
    if unrouted:
        lines.append("unrouted types with pending rows (left alone): " + ", ".join(unrouted))
    for p in status.paused_types:
        lines.append(f"paused: {p.type} since {p.paused_at.isoformat()} by {p.paused_by}")
    if status.redis_error is not None:
        lines.append(f"workers' liveness unknown (Redis: {status.redis_error})")
    for job_type, photo_id, error in status.claim_refused:
        lines.append(f"claim refused: {job_type} {photo_id!r}: {error}")
    if status.history.rows or status.history_months:
        lines.append(
            f"history: {shown_count(status.history.rows, status.history.estimated)} rows"
            f" archived, in {status.history_months} monthly partitions (photo_jobs_history)"
        )
    if any(t.estimated for t in status.types) or status.history.estimated:
        lines.append(
            "\N{ALMOST EQUAL TO}: the planner's estimate of many rows (--exact counts them all)"
        )
    if status.vacuum is not None:
        lines += status.vacuum.lines()
    # Every line is one line on the screen, whatever a value from the database holds.
    return "\n".join(visible(line) for line in lines)
