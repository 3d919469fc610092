"""Workers end to end: photos committed → handler → `done`, beside plain RQ on the same class.

Each measure runs ours and plain RQ side by side in one run (alternating order; the three
latency sides of the list below in rotating order), with the same no-op function
(`bench.noop`) on the same RQ worker class:

- throughput: 5,000 photos (`--quick`: 500) inserted in 100-row transactions, 2 worker
  processes of `reactor.Worker` / `reactor.SimpleWorker` behind a `reactor run` (default
  settings, which prepare statements on a direct session; once more per run with
  `REACTOR_PREPARED_STATEMENTS=1`, which forces them, as a check), clock from the
  first insert to the last row `done`; plain RQ: the same number of jobs with
  `enqueue_many` (100 a call) to 2 `rq.worker.Worker` / `SimpleWorker`, clock to the last job
  finished. Once more per run, plain RQ's SimpleWorker renewing its worker key as ours do
  (`bench.reference`), so the lifecycle's cost shows apart from what that renewal saves.
  Also Postgres sessions opened per job during our run (`pg_stat_database.sessions`),
  and the CPU time per job of each party over the same window (from /proc: the workers with
  the work horses they reaped, the reactor, every Postgres and Redis server process): on a
  machine whose cores all of them share, the total bounds the throughput.
- latency (SimpleWorker, 2 workers): one insert every 20 ms after 20 warm-up jobs, COMMIT
  (the insert's autocommit `execute` returned) → handler start; plain RQ: `enqueue` returned
  → handler start. The handler stamps its start (wall clock) into Redis. Beside them, the
  bare hop (`bench.reference`): each insert notifies with its photo id, and one process
  enqueues it to plain RQ at once (no claim, no lifecycle), COMMIT → handler start: what a
  minimal relay between Postgres and RQ adds, and so how much of the target's margin is left.
- first job: a freshly started worker, idle for a second, gets one photo (one job): COMMIT
  (enqueue) → handler start, for both classes.
The machine's load average is recorded before and after, since other work skews figures.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from rq import Queue

from bench.common import (
    REDIS_URL,
    ROOT,
    Reactor,
    Stat,
    fresh_database,
    percentile,
    redis_client,
    reset,
    rq_workers,
    table,
    wait_until,
)
from bench.noop import STARTED_KEY
from bench.reference import HOP_CHANNEL, HOP_STOP

CLASSES = {
    ("fork", "ours"): "reactor.Worker",
    ("fork", "plain"): "rq.worker.Worker",
    ("simple", "ours"): "reactor.SimpleWorker",
    ("simple", "plain"): "rq.worker.SimpleWorker",
    # RQ's SimpleWorker renewing its key as ours do: what the lifecycle costs, without that.
    ("simple", "renewing"): "bench.reference.RenewingSimpleWorker",
}
QUEUE = "photo-process"
PLAIN_QUEUE = "plain"
PARTIES = ("workers", "reactor", "postgres", "redis")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The bare hop's insert: the row and its notification (the photo id) in one transaction.
HOP_INSERT = """
WITH row AS (INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')
             RETURNING photo_id)
SELECT pg_notify(%s, photo_id) FROM row
"""


def _route(function: str) -> str:
    return f"photo.process=bench.noop.{function}"


@contextmanager
def _workers(
    kind: str, side: str, count: int, url: str, function: str, *, prepared: bool = False
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` `rq worker -w CLASS` processes, quiet, registered before this yields."""
    queue = QUEUE if side == "ours" else PLAIN_QUEUE
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": REDIS_URL,
        "REACTOR_ROUTES": _route(function),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("REACTOR_PREPARED_STATEMENTS", None)  # the default, unless asked for
    if prepared:
        env["REACTOR_PREPARED_STATEMENTS"] = "1"
    command = [sys.executable, "-m", "rq.cli", "worker", "-w", CLASSES[kind, side]]
    with rq_workers([*command, queue, "--url", REDIS_URL, "-q"], queue, count, env) as procs:
        yield procs


def _cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """CPU time a process used so far (with `reaped`: plus its children it waited for)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _CLOCK_TICKS


def _cpu(workers: list[int], reactor: int | None) -> dict[str, float]:
    """CPU seconds so far of each party: the worker processes (with their reaped work
    horses), the reactor, and every Postgres and Redis server process of the machine."""
    used = dict.fromkeys(PARTIES, 0.0)
    used["workers"] = sum(_cpu_seconds(pid, reaped=True) for pid in workers)
    used["reactor"] = 0.0 if reactor is None else _cpu_seconds(reactor)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        party = {"postgres": "postgres", "redis-server": "redis"}.get(name)
        if party is not None:
            used[party] += _cpu_seconds(int(entry.name))
    return used


def _per_job(before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, float]:
    return {party: (after[party] - before[party]) * 1000 / jobs for party in PARTIES}


def _sessions(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def _done(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'done'").fetchone()
    return int(row[0]) if row else 0


def _unfinished(conn: psycopg.Connection[Any]) -> bool:
    """Whether a row is still pending or active: two probes of the partial indexes, so the
    poll costs Postgres next to nothing (a count of `done` rows every 20 ms scanned the
    table, and that CPU was charged to our side)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM photo_jobs WHERE state = 'pending')"
        " OR EXISTS (SELECT FROM photo_jobs WHERE state = 'active')"
    ).fetchone()
    return bool(row and row[0])


# -- throughput ------------------------------------------------------------------------------


def _ours_throughput(
    url: str, kind: str, photos: int, *, prepared: bool = False
) -> tuple[float, float, dict[str, float]]:
    """(jobs/s, Postgres sessions opened per job, CPU ms per job by party)."""
    reset(url)
    reactor = Reactor(url, "--route", _route("noop"), "--sweep-interval", "600").started()
    try:
        with (
            _workers(kind, "ours", 2, url, "noop", prepared=prepared) as procs,
            psycopg.connect(url, autocommit=True) as poll,
            psycopg.connect(url) as writer,
        ):
            pids = [proc.pid for proc in procs]
            before = _sessions(poll)
            cpu_before = _cpu(pids, reactor.proc.pid)
            started = time.perf_counter()
            for first in range(0, photos, 100):
                writer.execute(
                    "INSERT INTO photo_jobs (photo_id, type)"
                    " SELECT 't' || i, 'photo.process' FROM generate_series(%s::int, %s::int) AS i",
                    [first, min(first + 100, photos) - 1],
                )
                writer.commit()
            wait_until(lambda: not _unfinished(poll), timeout=1800, interval=0.02)
            elapsed = time.perf_counter() - started
            cpu = _per_job(cpu_before, _cpu(pids, reactor.proc.pid), photos)
            opened = _sessions(poll) - before
            if (done := _done(poll)) != photos:
                raise RuntimeError(f"{photos - done} of {photos} photos did not end done")
    finally:
        reactor.stop()
    return photos / elapsed, opened / photos, cpu


def _plain_throughput(
    url: str, kind: str, photos: int, side: str = "plain"
) -> tuple[float, dict[str, float]]:
    """(jobs/s, CPU ms per job by party)."""
    reset(url)
    client = redis_client()
    queue = Queue(PLAIN_QUEUE, connection=client)
    with _workers(kind, side, 2, url, "noop") as procs:
        pids = [proc.pid for proc in procs]
        cpu_before = _cpu(pids, None)
        started = time.perf_counter()
        for first in range(0, photos, 100):
            queue.enqueue_many(
                [
                    Queue.prepare_data("bench.noop.noop", args=(f"t{i}",))
                    for i in range(first, min(first + 100, photos))
                ]
            )
        registry = queue.finished_job_registry
        wait_until(lambda: registry.count >= photos, timeout=1800, interval=0.02)
        elapsed = time.perf_counter() - started
        cpu = _per_job(cpu_before, _cpu(pids, None), photos)
    client.close()
    return photos / elapsed, cpu


# -- latency ---------------------------------------------------------------------------------


def _stamps(expected: int) -> dict[str, float]:
    client = redis_client()
    try:
        wait_until(lambda: client.llen(STARTED_KEY) >= expected, timeout=120, interval=0.01)
        entries = [
            (raw.decode() if isinstance(raw, bytes) else raw).split()
            for raw in client.lrange(STARTED_KEY, 0, -1)
        ]
    finally:
        client.close()
    return {photo_id: float(at) for photo_id, at in entries}


def _paced(count: int, pause: float, send: Any) -> dict[str, float]:
    sent: dict[str, float] = {}
    for i in range(count):
        begun = time.perf_counter()
        name = f"l{i}"
        send(name)
        sent[name] = time.time()
        time.sleep(max(0.0, pause - (time.perf_counter() - begun)))
    return sent


def _delays(sent: dict[str, float], warmup: int) -> list[float]:
    started = _stamps(len(sent))
    return [(started[name] - at) * 1000 for i, (name, at) in enumerate(sent.items()) if i >= warmup]


def _ours_latency(url: str, count: int, warmup: int) -> list[float]:
    reset(url)
    reactor = Reactor(url, "--route", _route("stamp"), "--sweep-interval", "600").started()
    try:
        with (
            _workers("simple", "ours", 2, url, "stamp"),
            psycopg.connect(url, autocommit=True) as conn,
        ):

            def send(name: str) -> None:
                conn.execute(
                    "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')", [name]
                )

            sent = _paced(count + warmup, 0.020, send)
            return _delays(sent, warmup)
    finally:
        reactor.stop()


def _plain_latency(url: str, count: int, warmup: int) -> list[float]:
    reset(url)
    client = redis_client()
    queue = Queue(PLAIN_QUEUE, connection=client)
    with _workers("simple", "plain", 2, url, "stamp"):
        sent = _paced(count + warmup, 0.020, lambda name: queue.enqueue("bench.noop.stamp", name))
        delays = _delays(sent, warmup)
    client.close()
    return delays


def _hop_latency(url: str, count: int, warmup: int) -> list[float]:
    """The bare hop (`bench.reference.hop`): each insert notifies in its own transaction, and
    one process enqueues the notified photo to plain RQ at once; 2 plain SimpleWorkers."""
    reset(url)
    env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": REDIS_URL, "PYTHONPATH": str(ROOT)}
    relay = subprocess.Popen(
        [sys.executable, "-m", "bench.reference", PLAIN_QUEUE],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert relay.stdout is not None
        ready, _, _ = select.select([relay.stdout], [], [], 60)
        if not ready or relay.stdout.readline().strip() != "ready":
            raise RuntimeError("the bare hop did not start within 60 s")
        with (
            _workers("simple", "plain", 2, url, "stamp"),
            psycopg.connect(url, autocommit=True) as conn,
        ):

            def send(name: str) -> None:
                conn.execute(HOP_INSERT, [name, HOP_CHANNEL])

            sent = _paced(count + warmup, 0.020, send)
            delays = _delays(sent, warmup)
            conn.execute("SELECT pg_notify(%s, %s)", [HOP_CHANNEL, HOP_STOP])
        with contextlib.suppress(subprocess.TimeoutExpired):
            relay.wait(timeout=30)  # a slow exit loses no measurement: killed below
        return delays
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()


LATENCY_SIDES: dict[str, Callable[[str, int, int], list[float]]] = {
    "ours": _ours_latency,
    "plain": _plain_latency,
    "hop": _hop_latency,
}


def _first_job(url: str, kind: str, side: str) -> float:
    """ms from COMMIT (enqueue) to the handler's start, on a fresh worker idle for a second."""
    reset(url)
    reactor = (
        Reactor(url, "--route", _route("stamp"), "--sweep-interval", "600").started()
        if side == "ours"
        else None
    )
    try:
        with _workers(kind, side, 1, url, "stamp"):
            time.sleep(1.0)  # idle: what a freshly started worker looks like when work arrives
            if side == "ours":
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(
                        "INSERT INTO photo_jobs (photo_id, type) VALUES ('f', 'photo.process')"
                    )
                    sent = time.time()
            else:
                client = redis_client()
                Queue(PLAIN_QUEUE, connection=client).enqueue("bench.noop.stamp", "f")
                sent = time.time()
                client.close()
            return (_stamps(1)["f"] - sent) * 1000
    finally:
        if reactor is not None:
            reactor.stop()


# -- the suite -------------------------------------------------------------------------------


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def run(quick: bool) -> dict[str, Any]:
    photos = 500 if quick else 5000
    reps = 3 if quick else 5
    lat_count, warmup = (100, 20) if quick else (500, 20)
    load_before = _load()
    rates: dict[tuple[str, str], list[float]] = {}
    sessions: dict[str, list[float]] = {"fork": [], "simple": []}
    latency: dict[str, list[list[float]]] = {side: [] for side in LATENCY_SIDES}
    first: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[dict[str, float]]] = {}
    with fresh_database() as url:
        for rep in range(reps):
            sides = ("ours", "plain") if rep % 2 == 0 else ("plain", "ours")
            for kind in ("fork", "simple"):
                for side in sides:
                    if side == "ours":
                        rate, per_job, used = _ours_throughput(url, kind, photos)
                        sessions[kind].append(per_job)
                    else:
                        rate, used = _plain_throughput(url, kind, photos)
                    rates.setdefault((kind, side), []).append(rate)
                    cpu.setdefault((kind, side), []).append(used)
            rate, used = _plain_throughput(url, "simple", photos, "renewing")
            rates.setdefault(("simple", "renewing"), []).append(rate)
            cpu.setdefault(("simple", "renewing"), []).append(used)
            # What prepared statements are worth: the same run with them.
            rate, _, used = _ours_throughput(url, "simple", photos, prepared=True)
            rates.setdefault(("simple", "prepared"), []).append(rate)
            cpu.setdefault(("simple", "prepared"), []).append(used)
            # The three latency sides in a rotating order, so none is always first or last.
            order = list(LATENCY_SIDES)
            for side in order[rep % 3 :] + order[: rep % 3]:
                latency[side].append(LATENCY_SIDES[side](url, lat_count, warmup))
            for kind in ("fork", "simple"):
                for side in sides:
                    first.setdefault((kind, side), []).append(_first_job(url, kind, side))
    load_after = _load()

    def ratio(kind: str, side: str = "ours", base: str = "plain") -> Stat:
        pairs = zip(rates[kind, side], rates[kind, base], strict=True)
        return Stat.of([o / p for o, p in pairs])

    p50 = {s: Stat.of([percentile(r, 0.50) for r in latency[s]]) for s in latency}
    p99 = {s: Stat.of([percentile(r, 0.99) for r in latency[s]]) for s in latency}
    rows = []
    for kind, target in (("fork", "≥ 0.90×"), ("simple", "≥ 0.95×")):
        rows.append(
            [
                f"{kind}: jobs/s, {photos:,} photos, 2 workers",
                Stat.of(rates[kind, "ours"]).fmt(digits=0),
                Stat.of(rates[kind, "plain"]).fmt(digits=0),
                ratio(kind).fmt("×", digits=2),
                target,
            ]
        )
    rows.append(
        [
            "simple: ours vs RQ's SimpleWorker renewing its key as ours do: jobs/s",
            Stat.of(rates["simple", "ours"]).fmt(digits=0),
            Stat.of(rates["simple", "renewing"]).fmt(digits=0),
            ratio("simple", base="renewing").fmt("×", digits=2),
            "",
        ]
    )
    rows.append(
        [
            "simple, with prepared statements: jobs/s",
            Stat.of(rates["simple", "prepared"]).fmt(digits=0),
            Stat.of(rates["simple", "plain"]).fmt(digits=0),
            ratio("simple", "prepared").fmt("×", digits=2),
            "",
        ]
    )
    for name, stats, margin in (("p50", p50, 1.0), ("p99", p99, 2.0)):
        rows.append(
            [
                f"simple, warm: COMMIT (enqueue) → handler start, {name} ms",
                stats["ours"].fmt(digits=2),
                stats["plain"].fmt(digits=2),
                f"{stats['ours'].median - stats['plain'].median:+.2f} ms",
                f"≤ +{margin} ms",
            ]
        )
    for kind in ("fork", "simple"):
        ours, plain = Stat.of(first[kind, "ours"]), Stat.of(first[kind, "plain"])
        rows.append(
            [
                f"{kind}: first job of a fresh idle worker, ms",
                ours.fmt(digits=1),
                plain.fmt(digits=1),
                f"{ours.median - plain.median:+.1f} ms",
                "≤ +10 ms",
            ]
        )
    for kind in ("fork", "simple"):
        rows.append(
            [
                f"{kind}: Postgres sessions opened per job",
                Stat.of(sessions[kind]).fmt(digits=4),
                "",
                "",
                "≤ 0.01",
            ]
        )
    text = table(["measure", "photo-reactor", "plain RQ", "ours vs plain", "target"], rows)
    hop_rows = [
        [
            name,
            stats["ours"].fmt(digits=2),
            stats["hop"].fmt(digits=2),
            stats["plain"].fmt(digits=2),
            f"{stats['ours'].median - stats['hop'].median:+.2f} ms",
            f"{stats['hop'].median - stats['plain'].median:+.2f} ms",
        ]
        for name, stats in (("p50", p50), ("p99", p99))
    ]
    text += (
        "\n\nLatency beside the bare hop (simple, warm, ms; the hop: one process enqueues each "
        "notified photo to plain RQ at once, no claim, no lifecycle):\n\n"
        + table(
            ["", "photo-reactor", "bare hop", "plain RQ", "ours − hop", "hop − plain"], hop_rows
        )
    )
    cpu_rows = []
    names = {
        "ours": "photo-reactor",
        "plain": "plain RQ",
        "prepared": "photo-reactor, with prepared statements",
        "renewing": "RQ renewing its key as ours do",
    }
    shown = ("fork", "ours"), ("fork", "plain"), ("simple", "ours"), ("simple", "plain")
    for kind, side in (*shown, ("simple", "renewing"), ("simple", "prepared")):
        runs = cpu[kind, side]
        medians = {p: Stat.of([r[p] for r in runs]).median for p in PARTIES}
        totals = Stat.of([sum(r.values()) for r in runs])
        cpu_rows.append(
            [f"{kind}, {names[side]}"]
            + [f"{medians[p]:.2f}" for p in PARTIES]
            + [totals.fmt(digits=2)]
        )
    text += "\n\nCPU ms per job over the throughput runs (medians):\n\n" + table(
        ["run", *PARTIES, "total"], cpu_rows
    )
    text += (
        f"\n\nMedians of {reps} runs (min–max). Load average (1/5/15 min) before: "
        f"{load_before}; after: {load_after}."
    )
    return {
        "photos": photos,
        "runs": reps,
        "jobs_per_second": {f"{k}/{s}": Stat.of(v).as_dict() for (k, s), v in rates.items()},
        "ratio": {k: ratio(k).as_dict() for k in ("fork", "simple")},
        "ratio_simple_vs_renewing": ratio("simple", base="renewing").as_dict(),
        "latency_ms": {s: {"p50": p50[s].as_dict(), "p99": p99[s].as_dict()} for s in latency},
        "first_job_ms": {f"{k}/{s}": Stat.of(v).as_dict() for (k, s), v in first.items()},
        "sessions_per_job": {k: Stat.of(v).as_dict() for k, v in sessions.items()},
        "cpu_ms_per_job": {
            f"{k}/{s}": {p: Stat.of([r[p] for r in v]).as_dict() for p in PARTIES}
            for (k, s), v in cpu.items()
        },
        "load_before": load_before,
        "load_after": load_after,
        "table": text,
    }
