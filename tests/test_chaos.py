"""Chaos: break real servers and processes while jobs flow; prove nothing is lost or doubled.

Three `reactor run` and six workers serve a Redis of the test's own and the test's database
while four writers insert photos. The workers are `reactor worker` (forking and `--simple`),
the project's classes under RQ's CLI (`rq worker -w reactor.Worker|reactor.SimpleWorker`) and
plain `rq worker`s (in-process and forking) that run the lifecycle inside each job, all on one
queue. Meanwhile, on a seeded random schedule, the test
restarts Redis (losing its data), terminates the reactors' and workers' Postgres backends,
SIGKILLs and restarts a reactor and a worker (mid-job), freezes a worker (SIGSTOP) for longer
than stale_after so its attempt is superseded, makes Redis refuse writes (checking meanwhile
that no row is active without its job), and sends bursts of garbage notifications. Then the faults stop, the test waits for quiescence (with a deadline) and checks
the guarantees, and that no reactor and no `reactor worker` exited by itself: only the
processes the chaos killed were gone (a process that exits is restarted meanwhile, as a
supervisor would, so the run goes on; a worker under RQ's CLI, which quits on Redis errors it
does not expect, as README says, may exit only during a Redis fault). The seed and schedule are printed, so a failure can be replayed:

    REACTOR_CHAOS_SEED=1234 scripts/test -m chaos -s

Size: REACTOR_CHAOS_PHOTOS (default 5000) and REACTOR_CHAOS_SECONDS of faults (default 45);
the long form is REACTOR_CHAOS_PHOTOS=20000 REACTOR_CHAOS_SECONDS=600.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import redis

from tests.handlers import SCHEMA, chaos_told_to_fail
from tests.support.env import Env
from tests.support.processes import Process, start_worker
from tests.support.rq_state import jobs_missing, queue_ids
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

PHOTOS = int(os.environ.get("REACTOR_CHAOS_PHOTOS", "5000"))
FAULT_SECONDS = float(os.environ.get("REACTOR_CHAOS_SECONDS", "45"))
SEED = int(os.environ.get("REACTOR_CHAOS_SEED", str(random.SystemRandom().randrange(10**6))))
FAULTS = (
    "redis_restart",
    "redis_oom",
    "pg_terminate",
    "kill_reactor",
    "kill_worker",
    "pause_worker",
    "garbage",
)
STALE_AFTER_SECONDS = 6
#: One worker process of each kind, on one queue: `reactor worker [--simple]`, and
#: `rq worker -w CLASS`.
WORKER_KINDS = (
    "reactor worker",
    "reactor worker --simple",
    "reactor.Worker",
    "reactor.SimpleWorker",
    "rq.worker.SimpleWorker",
    "rq.worker.Worker",
)
#: Kinds that must never exit by themselves: `reactor worker` rides out Redis restarts and
#: refusals and Postgres terminations. Under RQ's own CLI (`rq worker`, our classes too) RQ
#: quits on a Redis error it does not expect, as README says: those may exit, in a Redis fault.
STEADFAST_WORKERS = frozenset(k for k in WORKER_KINDS if k.startswith("reactor worker"))
#: Environment of every worker process.
WORKER_ENV = {
    "REACTOR_HEARTBEAT_SECONDS": "1",
    "REACTOR_RETRY_BASE_SECONDS": "0.2",
    "REACTOR_RETRY_MAX_SECONDS": "2",
}
#: How long the backlog the faults left may take to clear: the forking workers (a plain one
#: forks and connects to Postgres for every job) clear it at a few dozen jobs a second.
SETTLE_SECONDS = 480
#: After a Redis restart, rows whose jobs it lost are legitimately active without a job until
#: a sweep re-dispatches them (sweep interval 2 s); the invariant is checked only after this.
SETTLE_AFTER_RESTART_SECONDS = 8.0


def schedule(rng: random.Random, seconds: float) -> list[tuple[float, str]]:
    """Faults every 0.5-2.5 s; at least two of each kind, the rest drawn at random. The first
    two make Redis refuse writes before any restart, so the active-row invariant is always
    checked at least twice."""
    times: list[float] = []
    t = rng.uniform(3, 4)
    while t < seconds:
        times.append(round(t, 2))
        t += rng.uniform(0.5, 2.5)
    kinds = [k for k in FAULTS for _ in range(2)]
    kinds += [rng.choice(FAULTS) for _ in range(max(0, len(times) - len(kinds)))]
    rng.shuffle(kinds)
    kinds.remove("redis_oom")
    kinds.remove("redis_oom")
    kinds = ["redis_oom", "redis_oom", *kinds]
    return list(zip(times, kinds[: len(times)], strict=True))


@dataclass
class Cluster:
    """The processes under test, restartable by role."""

    spawn: Callable[..., Process]
    env: Env
    redis: RedisServer
    reactors: list[Process] = field(default_factory=list)
    workers: list[Process] = field(default_factory=list)
    crashes: Counter[str] = field(default_factory=Counter)
    #: (role or worker kind, exit code, seconds since the last Redis fault, the output's end)
    #: of each process that exited by itself.
    exits: list[tuple[str, int, float, str]] = field(default_factory=list)
    last_redis_fault: float = float("-inf")
    last_restart: float = 0.0
    invariant_checks: int = 0
    violations: list[str] = field(default_factory=list)

    def check_active_rows_have_jobs(self, admin: psycopg.Connection[Any]) -> None:
        """A row is never active without its job in Redis (Redis kept its data)."""
        if time.monotonic() - self.last_restart < SETTLE_AFTER_RESTART_SECONDS:
            return
        client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        try:
            missing = jobs_missing(admin, client)
        finally:
            client.close()
        self.invariant_checks += 1
        self.violations += missing

    def start_reactor(self) -> Process:
        return self.spawn(
            "-m",
            "reactor",
            "run",
            "--route",
            "photo.process=tests.handlers.chaos",
            "--sweep-interval",
            "2",
            "--stale-after",
            str(STALE_AFTER_SECONDS),
            "--batch-size",
            "100",
            name="reactor",
            extra_env={"REDIS_URL": self.redis.url},
        )

    def start_worker(self, slot: int) -> Process:
        kind = WORKER_KINDS[slot % len(WORKER_KINDS)]
        if kind.startswith("reactor worker"):
            # The recorded routes, as the `rq worker`s follow them.
            simple = ("--simple",) if kind.endswith("--simple") else ()
            return self.spawn(
                "-m",
                "reactor",
                "worker",
                *simple,
                "photo-process",
                name=kind,
                extra_env={**WORKER_ENV, "REACTOR_ROUTES": "", "REDIS_URL": self.redis.url},
            )
        proc = start_worker(
            self.spawn,
            self.env,
            extra_args=("--worker-class", kind),
            redis_url=self.redis.url,
            REDIS_URL=self.redis.url,
            REACTOR_HEARTBEAT_SECONDS=WORKER_ENV["REACTOR_HEARTBEAT_SECONDS"],
            REACTOR_RETRY_BASE_SECONDS=WORKER_ENV["REACTOR_RETRY_BASE_SECONDS"],
            REACTOR_RETRY_MAX_SECONDS=WORKER_ENV["REACTOR_RETRY_MAX_SECONDS"],
        )
        proc.name = kind
        return proc

    def supervise(self) -> None:
        """Restart any process that exited on its own (a process manager would), noting it."""
        for group, role in ((self.reactors, "reactor"), (self.workers, "worker")):
            for i, proc in enumerate(group):
                code = proc.proc.poll()
                if code is not None:
                    name = role if role == "reactor" else proc.name
                    self.crashes[name] += 1
                    since = time.monotonic() - self.last_redis_fault
                    tail = proc.output()[-2000:]
                    self.exits.append((name, code, since, tail))
                    print(f"chaos: a {name} exited by itself (exit {code}):\n{tail}")
                    group[i] = self.start_reactor() if role == "reactor" else self.start_worker(i)


def _resume(proc: Any) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)


def inject(kind: str, cluster: Cluster, rng: random.Random, admin: psycopg.Connection[Any]) -> None:
    if kind in ("redis_restart", "redis_oom"):
        cluster.last_redis_fault = time.monotonic()
    if kind == "redis_restart":
        cluster.redis.stop()
        time.sleep(rng.uniform(0.2, 1.5))  # the outage itself: a duration, not a synchronisation
        cluster.redis.start()
        cluster.last_restart = cluster.last_redis_fault = time.monotonic()
    elif kind == "redis_oom":
        # Redis refuses every write but keeps its data: claims must roll back, and no row may
        # be active without its job meanwhile.
        client = redis.Redis.from_url(cluster.redis.url, socket_timeout=5)
        try:
            client.config_set("maxmemory", 1)
            for _ in range(3):
                time.sleep(rng.uniform(0.2, 0.6))  # the outage: a duration, not a synchronisation
                cluster.check_active_rows_have_jobs(admin)
        finally:
            client.config_set("maxmemory", 0)
            client.close()
            cluster.last_redis_fault = time.monotonic()
    elif kind == "pg_terminate":
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'photo-reactor %'"
        )
    elif kind == "kill_reactor":
        i = rng.randrange(len(cluster.reactors))
        cluster.reactors[i].kill()
        cluster.reactors[i] = cluster.start_reactor()
    elif kind == "kill_worker":
        i = rng.randrange(len(cluster.workers))
        cluster.workers[i].kill()
        cluster.workers[i] = cluster.start_worker(i)
    elif kind == "pause_worker":
        # A worker frozen mid-job (a VM pause, a stop-the-world GC) for longer than
        # stale_after: its attempt is rescued and re-run elsewhere, then it wakes up and
        # tries to complete a superseded attempt.
        # Prefer a worker that is inside a handler right now (its 'started' is the latest).
        busy = {
            row[0]
            for row in admin.execute(
                "SELECT DISTINCT ON (photo_id) pid FROM handler_runs"
                " WHERE at > clock_timestamp() - interval '2 s'"
                " ORDER BY photo_id, at DESC"
            )
        }
        candidates = [w for w in cluster.workers if w.proc.pid in busy] or cluster.workers
        proc = rng.choice(candidates).proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)
            resume = threading.Timer(STALE_AFTER_SECONDS + 3, _resume, [proc])
            resume.daemon = True
            resume.start()
    elif kind == "garbage":
        for _ in range(200):
            payload = "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 60)))
            admin.execute("SELECT pg_notify('photo_jobs', %s)", [payload])


@pytest.mark.timeout(FAULT_SECONDS + SETTLE_SECONDS + 300)  # faults, settling, checks
def test_nothing_lost_or_doubled_under_faults(env: Env, spawn: Callable[..., Process]) -> None:
    rng = random.Random(SEED)
    plan = schedule(rng, FAULT_SECONDS)
    print(f"\nchaos: seed={SEED} photos={PHOTOS} fault_seconds={FAULT_SECONDS}")
    print(f"chaos: schedule={plan}")
    admin = env.connect()
    admin.execute(SCHEMA)
    redis_server = RedisServer()
    env.cleanups.append(redis_server.close)
    cluster = Cluster(spawn, env, redis_server)
    cluster.reactors = [cluster.start_reactor() for _ in range(3)]
    cluster.workers = [cluster.start_worker(i) for i in range(len(WORKER_KINDS))]
    for proc in cluster.reactors:
        proc.wait_for_line("reactor_started")

    queue_client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    env.cleanups.append(queue_client.close)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            wrng = random.Random(SEED * 10 + w)
            per_writer = PHOTOS // 4
            pace = FAULT_SECONDS * 0.8 / max(1, per_writer)
            with psycopg.connect(env.database_url, autocommit=True) as conn:
                done = 0
                while done < per_writer:
                    size = min(per_writer - done, wrng.randint(1, 20))
                    with conn.transaction():
                        for i in range(done, done + size):
                            # max_attempts counts dispatches, rescues included: every Redis
                            # restart re-dispatches the rows whose jobs it lost, so give the
                            # infrastructure churn of this test room before a row fails.
                            conn.execute(
                                "INSERT INTO photo_jobs (photo_id, type, max_attempts)"
                                " VALUES (%s, 'photo.process', 50)",
                                [f"w{w}-{i}"],
                            )
                    done += size
                    time.sleep(pace * size)  # pacing the load over the fault period
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    started = time.monotonic()
    injected: Counter[str] = Counter()
    for at, kind in plan:
        while time.monotonic() - started < at:
            cluster.supervise()
            time.sleep(0.05)
        inject(kind, cluster, rng, admin)
        injected[kind] += 1
    for t in writers:
        t.join()
    assert not errors, errors
    total = (PHOTOS // 4) * 4

    def quiet() -> bool:
        cluster.supervise()
        row = admin.execute(
            "SELECT count(*) FILTER (WHERE state IN ('pending', 'active')), count(*) FROM photo_jobs"
        ).fetchone()
        assert row is not None
        return row[0] == 0 and row[1] == total and not queue_ids(queue_client)

    try:
        wait_for(quiet, timeout=SETTLE_SECONDS, interval=0.5, what="quiescence")
    except AssertionError:
        print(admin.execute("SELECT state, count(*) FROM photo_jobs GROUP BY 1").fetchall())
        print(f"chaos: queued jobs {len(queue_ids(queue_client))}")
        for proc in cluster.reactors + cluster.workers:
            print(f"--- {proc.name}\n" + "\n".join(proc.lines[-15:]))
        print(f"chaos: seed={SEED} (replay with REACTOR_CHAOS_SEED={SEED})")
        raise
    settle_seconds = time.monotonic() - started

    # 0. No row was ever seen active without its job while Redis kept its data.
    assert cluster.invariant_checks > 0, f"seed={SEED}: the invariant was never checked"
    assert not cluster.violations, (
        f"seed={SEED}: active rows without a job: {cluster.violations[:20]}"
    )
    # 1. Every row done, or failed exactly where the handler was told to fail.
    rows = admin.execute("SELECT photo_id, state, attempts FROM photo_jobs").fetchall()
    wrong = [(p, s) for p, s, _ in rows if s != ("failed" if chaos_told_to_fail(p) else "done")]
    assert not wrong, f"seed={SEED}: rows in the wrong final state: {wrong[:20]}"
    final = {p: a for p, _, a in rows}
    # 2. Exactly one successful execution recorded for each done photo's final attempt.
    oks = admin.execute(
        "SELECT photo_id, attempt FROM handler_runs WHERE outcome = 'ok'"
    ).fetchall()
    ok_final = Counter(p for p, a in oks if final[p] == a)
    done_photos = [p for p, s, _ in rows if s == "done"]
    missing = [p for p in done_photos if ok_final[p] != 1]
    assert not missing, f"seed={SEED}: photos without exactly one final success: {missing[:20]}"
    # 3. No completion from a superseded attempt changed a row.
    finals = admin.execute(
        "SELECT t.photo_id, t.attempts, j.attempts FROM transitions t JOIN photo_jobs j USING (photo_id)"
        " WHERE t.new_state IN ('done', 'failed')"
    ).fetchall()
    superseded = [f for f in finals if f[1] != f[2]]
    assert not superseded, f"seed={SEED}: superseded completions: {superseded[:20]}"
    assert len(finals) == total, f"seed={SEED}: {len(finals)} final transitions for {total} rows"
    # ... and every transition a worker made was made by the attempt it names: a row turns
    # done only after its final attempt's handler succeeded, and a retry or a handler failure
    # at attempt A follows a failure that attempt A's handler recorded.
    early = admin.execute(
        "SELECT t.photo_id FROM transitions t JOIN photo_jobs j USING (photo_id)"
        " WHERE t.new_state = 'done' AND NOT EXISTS (SELECT 1 FROM handler_runs r"
        "   WHERE r.photo_id = t.photo_id AND r.attempt = j.attempts AND r.outcome = 'ok'"
        "     AND r.at <= t.at)"
    ).fetchall()
    assert not early, f"seed={SEED}: done before the final attempt succeeded: {early[:20]}"
    foreign = admin.execute(
        "SELECT t.photo_id, t.attempts, t.new_state, t.last_error FROM transitions t"
        " WHERE t.old_state = 'active' AND t.new_state IN ('pending', 'failed')"
        "   AND t.last_error NOT LIKE '%% lost: %%'"
        # a work horse that ended without an outcome (killed, or RQ failed the job on a Redis
        # error before the handler ran): a failed attempt the worker process recorded
        "   AND t.last_error NOT LIKE 'WorkHorseLost:%%'"
        "   AND NOT EXISTS (SELECT 1 FROM handler_runs r WHERE r.photo_id = t.photo_id"
        "     AND r.attempt = t.attempts AND r.outcome IN ('error', 'permanent'))"
    ).fetchall()
    assert not foreign, f"seed={SEED}: failures recorded for another attempt: {foreign[:20]}"

    executions = admin.execute(
        "SELECT count(*) FROM handler_runs WHERE outcome = 'started'"
    ).fetchone()
    doubled = sum(1 for p, a in oks if final[p] != a)
    delay = admin.execute(
        "SELECT max(d) FROM (SELECT min(t.at) - j.created_at AS d FROM transitions t"
        " JOIN photo_jobs j USING (photo_id) WHERE t.new_state = 'active'"
        " GROUP BY t.photo_id, j.created_at) s"
    ).fetchone()
    assert executions is not None and delay is not None
    print(
        f"chaos: summary seed={SEED} jobs={total} faults={dict(injected)} "
        f"executions={executions[0]} side_effects_doubled_by_kills={doubled} "
        f"crashes={dict(cluster.crashes)} invariant_checks={cluster.invariant_checks} "
        f"max_dispatch_delay={delay[0]} "
        f"quiescent_after={settle_seconds:.0f}s"
    )
    # 5. Only the processes the chaos killed were gone: no reactor and no `reactor worker`
    # exited by itself; a worker under RQ's CLI only within a Redis fault.
    steadfast = [
        (name, code, tail)
        for name, code, _, tail in cluster.exits
        if name == "reactor" or name in STEADFAST_WORKERS
    ]
    assert not steadfast, f"seed={SEED}: processes that exited by themselves: {steadfast}"
    unexplained = [
        (name, code, f"{since:.1f}s after a Redis fault", tail)
        for name, code, since, tail in cluster.exits
        if since > SETTLE_AFTER_RESTART_SECONDS
    ]
    assert not unexplained, f"seed={SEED}: workers exited away from any Redis fault: {unexplained}"

    for proc in cluster.reactors + cluster.workers:
        proc.proc.send_signal(signal.SIGTERM)
