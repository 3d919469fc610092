"""The adaptive doorbell (sql/0004, reactor/dispatcher/doorbell.py): who notifies, when a reactor arms,
and that no row waits for the fallback sweep while writers skip NOTIFY.

Every test runs the reactor with a sweep interval far beyond the test, so a row that the
doorbell design missed would stay `pending` and fail the test.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from reactor.dispatcher.bounds import FULL_EVERY_SECONDS, MARGIN_SECONDS
from reactor.dispatcher.doorbell import BUSY_RINGS, RECHECK_SECONDS, ArmOutcome
from reactor.dispatcher.listener import Listener
from reactor.pg.queries import DOORBELL_ARM as LOCK_DOORBELL
from tests.support.doorbell import armed_by, doorbell_locks, listener_pids
from tests.support.env import Env
from tests.support.metrics import metric, scrape
from tests.support.notifications import Notifications, in_tx
from tests.support.processes import Process, start_reactor
from tests.support.rows import states
from tests.support.rq_state import jobs_missing
from tests.support.servers import free_port
from tests.support.waiting import wait_for

NO_SWEEP = ("--sweep-interval", "3600")
INSERT = "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, %s)"


def insert_one(
    conn: psycopg.Connection[Any], photo_id: str, job_type: str = "photo.process"
) -> None:
    conn.execute(INSERT, [photo_id, job_type])


def is_active(conn: psycopg.Connection[Any], photo_id: str) -> bool:
    row = conn.execute("SELECT state FROM photo_jobs WHERE photo_id = %s", [photo_id]).fetchone()
    return row is not None and row[0] == "active"


def drain_notifications(conn: psycopg.Connection[Any], quiet: float = 0.5) -> int:
    """Count the notifications that arrive until none has come for `quiet` seconds."""
    count = 0
    while True:
        got = sum(1 for _ in conn.notifies(timeout=quiet))
        if not got:
            return count
        count += got


# -- the triggers --------------------------------------------------------------------------


def test_the_triggers_ask_for_the_keys_the_reactor_takes(env: Env) -> None:
    # The WHEN clauses spell the key with literals (cheaper to plan); they must agree with the
    # functions the reactor and the operators' queries use.
    conn = env.connect()
    row = conn.execute("SELECT photo_jobs_doorbell_key(), photo_jobs_doorbell_stripes()").fetchone()
    assert row is not None
    key, stripes = row
    check = f"pg_try_advisory_xact_lock_shared(('{key}'::bigint + (pg_backend_pid() % {stripes})))"
    definitions = [
        d
        for (d,) in conn.execute(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE tgrelid = 'photo_jobs'::regclass AND tgname LIKE 'photo_jobs_notify_%'"
        )
    ]
    assert len(definitions) == 2
    assert all(f"(NOT {check})" in d for d in definitions), definitions


def test_with_no_reactor_armed_writers_send_nothing_and_hold_the_shared_lock(env: Env) -> None:
    notes = Notifications(env, armed=False)
    assert notes.sent_by(in_tx("INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 't')")) == []
    assert (
        notes.sent_by(
            in_tx(
                "INSERT INTO photo_jobs (photo_id, type)"
                " SELECT 'b' || i, 't' FROM generate_series(1, 100) AS i"
            )
        )
        == []
    )
    assert notes.sent_by(in_tx("UPDATE photo_jobs SET state = 'done'")) == []
    assert notes.sent_by(in_tx("UPDATE photo_jobs SET state = 'pending'")) == []

    admin, writer = env.connect(), env.connect(autocommit=False)
    insert_one(writer, "c")
    # Held to the end of the transaction: an arming reactor must wait for this commit.
    assert doorbell_locks(admin) == [(writer.info.backend_pid, "ShareLock", True)]
    writer.commit()
    assert doorbell_locks(admin) == []


def connect_on_key(env: Env, stripe: int, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection whose writes ask for doorbell key number `stripe` (chosen by backend pid)."""
    for _ in range(200):
        conn = env.connect(**kwargs)
        stripes = conn.execute("SELECT photo_jobs_doorbell_stripes()").fetchone()
        assert stripes is not None
        if conn.info.backend_pid % stripes[0] == stripe:
            return conn
        conn.close()
    raise AssertionError(f"no backend pid maps to key {stripe}")


def test_writers_notify_while_a_reactor_is_queued_for_their_key(env: Env) -> None:
    notes = Notifications(env, armed=False)
    admin = env.connect()
    early = connect_on_key(env, 15, autocommit=False)
    insert_one(early, "early")  # skipped NOTIFY, holds the shared lock, not committed
    arming = env.connect()
    locker = threading.Thread(target=arming.execute, args=(LOCK_DOORBELL,))
    locker.start()
    wait_for(
        lambda: (arming.info.backend_pid, "ExclusiveLock", False) in doorbell_locks(admin),
        what="the exclusive request queued behind the early writer",
    )
    # A conditional shared request conflicts with a queued exclusive one: a writer on the
    # same key rings although nobody holds that key yet.
    late = connect_on_key(env, 15)
    assert notes.sent_by(lambda _: insert_one(late, "late")) == ["photo.process"]
    assert locker.is_alive(), "the exclusive lock must wait for the early writer"
    early.commit()
    locker.join(timeout=10)
    assert not locker.is_alive()
    assert armed_by(admin) == arming.info.backend_pid


def test_lock_outcomes_of_the_listener_session(env: Env) -> None:
    admin = env.connect()
    first, second = Listener(env.database_url), Listener(env.database_url)
    first.connect()
    second.connect()
    assert first.lock_doorbell() is ArmOutcome.ARMED
    assert armed_by(admin) == first.backend_pid
    assert second.lock_doorbell() is ArmOutcome.HELD_ELSEWHERE
    first.unlock_doorbell()
    assert doorbell_locks(admin) == []

    writer = env.connect(autocommit=False)
    insert_one(writer, "in-flight")
    started = time.monotonic()
    assert first.lock_doorbell() is ArmOutcome.BUSY
    # Without its lock timeout the arm would wait for the writer, who commits only below.
    assert time.monotonic() - started < 5.0, "an arm attempt must give up quickly"
    assert doorbell_locks(admin) == [(writer.info.backend_pid, "ShareLock", True)]
    writer.commit()
    assert first.lock_doorbell() is ArmOutcome.ARMED
    first.close()  # the lock goes with the session
    wait_for(lambda: doorbell_locks(admin) == [], what="lock released with the session")
    assert second.lock_doorbell() is ArmOutcome.ARMED
    second.close()


def test_a_session_squatting_on_one_key_is_not_taken_for_an_armed_reactor(env: Env) -> None:
    # Any role that can connect may take an advisory lock; one holding a single key must not
    # make the reactor stop polling while the writers of the other keys skip NOTIFY.
    squatter = env.connect()
    squatter.execute("SELECT pg_advisory_lock(photo_jobs_doorbell_key() + 3)")
    listener = Listener(env.database_url)
    listener.connect()
    assert listener.lock_doorbell() is ArmOutcome.BUSY
    squatter.execute(LOCK_DOORBELL)  # now it holds every key: as an armed reactor would
    assert listener.lock_doorbell() is ArmOutcome.HELD_ELSEWHERE
    listener.close()


def test_a_reactor_keeps_polling_while_a_session_squats_on_one_key(
    env: Env, spawn: Callable[..., Process]
) -> None:
    admin, squatter = env.connect(), env.connect()
    writers = [env.connect() for _ in range(8)]
    # The key of none of the writers: their triggers take the shared lock and skip NOTIFY.
    taken = {w.info.backend_pid % 16 for w in writers}
    free = min(set(range(16)) - taken)
    squatter.execute("SELECT pg_advisory_lock(photo_jobs_doorbell_key() + %s)", [free])
    port = free_port()
    start_reactor(spawn, *NO_SWEEP, "--metrics-port", str(port), "--metrics-host", "127.0.0.1")

    def arm_attempts() -> float:
        text = scrape(port)
        return sum(
            metric(text, f'reactor_doorbell_arm_attempts_total{{outcome="{outcome}"}}', 0)
            for outcome in ("armed", "busy", "held_elsewhere")
        )

    wait_for(lambda: arm_attempts() >= 2, what="the reactor's attempts to arm")
    # It polls on (taking the squatter for an armed reactor, it would wait for notifications
    # that the writers of the other keys never send, and for the claims over the whole range).
    polls = metric(scrape(port), "reactor_polls_total", 0)
    wait_for(lambda: metric(scrape(port), "reactor_polls_total", 0) >= polls + 20, what="polls")
    for i, writer in enumerate(writers):
        insert_one(writer, f"sq{i}")
        # Far below the 1 h sweep, the only other path.
        wait_for(lambda i=i: is_active(admin, f"sq{i}"), timeout=5, what=f"sq{i}")  # type: ignore[misc]


def test_a_session_holding_every_key_only_makes_writers_notify(
    env: Env, spawn: Callable[..., Process]
) -> None:
    # A role that can merely connect takes every key, as an armed reactor would: writers then
    # notify (as under --doorbell plain) and the listening reactor dispatches their rows.
    admin, squatter = env.connect(), env.connect()
    squatter.execute(LOCK_DOORBELL)
    start_reactor(spawn, *NO_SWEEP)
    writers = [env.connect() for _ in range(4)]
    for i, writer in enumerate(writers):
        insert_one(writer, f"all{i}")
        # Far below the 1 h sweep, the only other path.
        wait_for(lambda i=i: is_active(admin, f"all{i}"), timeout=5, what=f"all{i}")  # type: ignore[misc]
    assert armed_by(admin) == squatter.info.backend_pid


# -- the reactor ---------------------------------------------------------------------------


def test_an_idle_reactor_arms_and_each_isolated_insert_rings_it(
    env: Env, spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, *NO_SWEEP)
    admin, writer = env.connect(), env.connect()
    delays = []
    for i in range(10):
        wait_for(lambda: armed_by(admin) in listener_pids(admin), what="armed reactor")
        insert_one(writer, f"iso{i}")
        committed = time.monotonic()
        wait_for(lambda i=i: is_active(admin, f"iso{i}"), interval=0.0005, what=f"iso{i}")  # type: ignore[misc]
        delays.append(time.monotonic() - committed)
    # A margin no loaded 2-core machine reaches, still far below the 1 h sweep (the only
    # other path); the latency itself is measured in bench/.
    assert max(delays) < 5.0, f"dispatch delays (s): {sorted(delays)}"


def test_a_writer_that_skipped_notify_is_dispatched_when_its_commit_lets_the_reactor_arm(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """The case the drain after arming exists for: a writer holds the shared lock (it skipped
    NOTIFY) while the reactor tries to arm; its COMMIT is what grants the reactor the lock, and
    nothing else will ever ring for its row."""
    start_reactor(spawn, *NO_SWEEP)
    admin, bell_ringer = env.connect(), env.connect()
    caught = 0
    for i in range(40):
        writer = env.connect(autocommit=False)
        wait_for(lambda: armed_by(admin) in listener_pids(admin), what="armed reactor")
        # Notifications back to back: the reactor drains, releases the keys and polls (one
        # alone would leave it armed).
        for k in range(BUSY_RINGS):
            insert_one(bell_ringer, f"ring{i}-{k}")
        # The keys go right after the drain, and the reactor re-arms a few milliseconds later:
        # the writer must start in that window (or try again).
        last = f"ring{i}-{BUSY_RINGS - 1}"
        wait_for(lambda last=last: is_active(admin, last), interval=0.0005, what=last)  # type: ignore[misc]
        until = time.monotonic() + 0.05
        while armed_by(admin) is not None and time.monotonic() < until:
            pass  # a window of milliseconds: if it is missed, the writer rings (tried again)
        insert_one(writer, f"slow{i}")
        if (writer.info.backend_pid, "ShareLock", True) not in doorbell_locks(admin):
            writer.rollback()  # it rang (the reactor had re-armed): not the case under test
            continue
        queued = (listener_pids(admin)[0], "ExclusiveLock", False)
        wait_for(
            lambda queued=queued: queued in doorbell_locks(admin),  # type: ignore[misc]
            interval=0.0005,
            what="the reactor queued for the lock behind the writer",
        )
        writer.commit()
        committed = time.monotonic()
        wait_for(lambda i=i: is_active(admin, f"slow{i}"), timeout=30, what=f"slow{i}")  # type: ignore[misc]
        assert time.monotonic() - committed < 5.0  # the drain after arming, not the 1 h sweep
        caught += 1
        if caught == 5:
            break
    assert caught == 5, "the writer kept ringing: the reactor never polled long enough"


def stream(conn: psycopg.Connection[Any], seconds: float, prefix: str) -> int:
    """Single-row inserting transactions back to back for `seconds`; how many committed."""
    count = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        insert_one(conn, f"{prefix}{count}")
        count += 1
    return count


@pytest.mark.parametrize("mode", ["adaptive", "plain"])
def test_under_a_stream_adaptive_writers_skip_notify_plain_writers_always_ring(
    env: Env, spawn: Callable[..., Process], mode: str
) -> None:
    start_reactor(spawn, *NO_SWEEP, "--doorbell", mode)
    admin, writer, listener = env.connect(), env.connect(), env.connect()
    listener.execute("LISTEN photo_jobs")
    wait_for(lambda: armed_by(admin) in listener_pids(admin), what="armed reactor")
    sent = stream(writer, 2.0, "s")
    wait_for(lambda: states(admin) == {"active": sent}, timeout=10, what="all dispatched")
    rang = drain_notifications(listener)
    print(f"{mode}: {sent} transactions, {rang} notifications")
    if mode == "plain":
        assert rang == sent  # one per transaction (same payload only folds within one)
        assert armed_by(admin) in listener_pids(admin)  # never released
    else:
        assert rang * 10 < sent, f"{rang} of {sent} transactions notified"


def test_a_second_reactor_takes_over_when_the_armed_one_dies(
    env: Env, spawn: Callable[..., Process]
) -> None:
    first = start_reactor(spawn, *NO_SWEEP, name="first")
    admin, writer = env.connect(), env.connect()
    wait_for(lambda: armed_by(admin) in listener_pids(admin), what="first reactor armed")
    holder = armed_by(admin)
    start_reactor(spawn, *NO_SWEEP, name="second")
    wait_for(lambda: len(listener_pids(admin)) == 2, what="second listener")
    # The second reactor finds the lock held and only listens: a ring reaches both.
    insert_one(writer, "both")
    wait_for(lambda: is_active(admin, "both"), what="dispatch with two reactors")
    wait_for(lambda: armed_by(admin) is not None, what="re-armed")
    first.kill()
    wait_for(lambda: holder not in listener_pids(admin), what="first listener gone")
    insert_one(writer, "orphan")
    committed = time.monotonic()
    wait_for(lambda: is_active(admin, "orphan"), timeout=10, interval=0.005, what="takeover")
    delay = time.monotonic() - committed
    # The survivor's recheck, not the 1 h sweep (margin for a loaded machine).
    assert delay < RECHECK_SECONDS + 5.0, f"took {delay:.3f}s"
    wait_for(lambda: armed_by(admin) in listener_pids(admin), what="second reactor armed")


def test_poll_only_dispatches_every_poll_interval_without_listener_or_lock(
    env: Env, spawn: Callable[..., Process]
) -> None:
    start_reactor(spawn, *NO_SWEEP, "--doorbell", "poll-only", "--poll-interval", "0.2")
    admin, writer = env.connect(), env.connect()
    assert listener_pids(admin) == []
    for i in range(3):
        insert_one(writer, f"p{i}")
        committed = time.monotonic()
        wait_for(lambda i=i: is_active(admin, f"p{i}"), timeout=30, what=f"p{i}")  # type: ignore[misc]
        # A poll, not the 1 h sweep (the poll's own timing is measured in bench/).
        assert time.monotonic() - committed < 0.2 + 5.0
    assert doorbell_locks(admin) == []


# -- correctness under mixed writers, with the sweep disabled ---------------------------------

#: Seconds of mixed writing; the long form is REACTOR_DOORBELL_SECONDS=60.
SOAK_SECONDS = float(os.environ.get("REACTOR_DOORBELL_SECONDS", "16"))
TYPES = ("photo.process", "photo.thumb")
ROUTES = [f"--route={t}=reactor.demo.process_photo" for t in TYPES]


@dataclass
class Ledger:
    """What the writers committed, and what they rolled back."""

    committed: set[tuple[str, str]] = field(default_factory=set)
    aborted: set[tuple[str, str]] = field(default_factory=set)
    transactions: int = 0
    isolated_delays: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rows: Sequence[tuple[str, str]], aborted: Sequence[tuple[str, str]] = ()) -> None:
        with self.lock:
            self.committed.update(rows)
            self.aborted.update(aborted)
            self.transactions += 1


class Phases:
    """Busy phases (every writer) and idle gaps (only the isolated writer and lock holders)."""

    def __init__(self, seconds: float, rng: random.Random) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds
        self.bounds: list[tuple[float, float]] = []  # idle gaps
        t = self.start
        while t < self.end:
            t += rng.uniform(1.0, 2.5)  # busy
            gap = rng.uniform(0.6, 1.2)
            self.bounds.append((t, t + gap))
            t += gap

    def running(self) -> bool:
        return time.monotonic() < self.end

    def busy(self) -> bool:
        now = time.monotonic()
        return not any(a <= now < b for a, b in self.bounds)


def mixed_writers(env: Env, seconds: float, seed: int) -> Ledger:
    rng = random.Random(seed)
    phases = Phases(seconds, rng)
    ledger = Ledger()

    def writer(
        name: str, body: Callable[[psycopg.Connection[Any], random.Random, int], None]
    ) -> None:
        conn = psycopg.connect(env.database_url, autocommit=True)
        local = random.Random(f"{seed}-{name}")
        n = 0
        try:
            while phases.running():
                if name not in ("holder", "isolated") and not phases.busy():
                    time.sleep(0.005)
                    continue
                body(conn, local, n)
                n += 1
        except Exception as exc:  # reported by the test, never swallowed
            ledger.errors.append(f"{name}: {exc!r}")
        finally:
            conn.close()

    def kind(rng: random.Random) -> str:
        return rng.choice(TYPES)

    def single(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        row = (f"single-{n}", kind(r))
        conn.execute(INSERT, [row[0], row[1]])
        ledger.add([row])
        time.sleep(r.uniform(0, 0.004))

    def hundred(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        t = kind(r)
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type)"
            " SELECT %s || i, %s FROM generate_series(1, 100) AS i",
            [f"hundred-{n}-", t],
        )
        ledger.add([(f"hundred-{n}-{i}", t) for i in range(1, 101)])
        time.sleep(r.uniform(0.05, 0.15))

    def repeatable(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        rows = [(f"rr-{n}-{i}", kind(r)) for i in range(r.randint(1, 5))]
        with conn.transaction():
            conn.execute("SELECT count(*) FROM photo_jobs")  # the snapshot is taken here
            for row in rows:
                conn.execute(INSERT, list(row))
        ledger.add(rows)
        time.sleep(r.uniform(0, 0.005))

    def sleepy(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        row = (f"sleepy-{n}", kind(r))
        with conn.transaction():
            conn.execute(INSERT, list(row))
            time.sleep(r.uniform(0, 0.05))
        ledger.add([row])

    def holder(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        time.sleep(r.uniform(1.0, 4.0))
        row = (f"holder-{n}", kind(r))
        with conn.transaction():
            conn.execute(INSERT, list(row))
            time.sleep(r.uniform(0.5, 2.5))  # holds the shared doorbell lock all along
        ledger.add([row])

    def savepoints(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        kept = [(f"sp-{n}-a", kind(r)), (f"sp-{n}-c", kind(r))]
        dropped = (f"sp-{n}-b", kind(r))
        with conn.transaction():
            conn.execute(INSERT, list(kept[0]))
            with conn.transaction(force_rollback=True):
                conn.execute(INSERT, list(dropped))
            with conn.transaction():
                conn.execute(INSERT, list(kept[1]))
        ledger.add(kept, [dropped])
        time.sleep(r.uniform(0, 0.005))

    def aborts(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        row = (f"abort-{n}", kind(r))
        with conn.transaction(force_rollback=True):
            conn.execute(INSERT, list(row))
        ledger.add([], [row])
        time.sleep(r.uniform(0, 0.005))

    def requeue(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        row = (f"requeue-{n}", kind(r))
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES (%s, %s, 'done')", list(row)
        )
        time.sleep(r.uniform(0, 0.01))
        conn.execute(
            "UPDATE photo_jobs SET state = 'pending' WHERE photo_id = %s AND type = %s", list(row)
        )
        ledger.add([row])

    def isolated(conn: psycopg.Connection[Any], r: random.Random, n: int) -> None:
        # Once per idle gap, after the reactor had time to go quiet and arm.
        now = time.monotonic()
        gap = next(((a, b) for a, b in phases.bounds if now < b), None)
        if gap is None:
            time.sleep(0.01)
            return
        a, b = gap
        wake = a + (b - a) * r.uniform(0.5, 0.8)
        while time.monotonic() < wake:
            time.sleep(0.002)
        row = (f"isolated-{n}", kind(r))
        conn.execute(INSERT, list(row))
        committed = time.monotonic()
        ledger.add([row])
        deadline = committed + 5
        while not is_active(conn, row[0]):
            if time.monotonic() > deadline:
                ledger.errors.append(f"isolated row {row} not dispatched within 5 s")
                break
            time.sleep(0.001)
        ledger.isolated_delays.append(time.monotonic() - committed)
        while time.monotonic() < b:  # one per gap
            time.sleep(0.01)

    bodies = {
        "single": single,
        "hundred": hundred,
        "repeatable": repeatable,
        "sleepy": sleepy,
        "holder": holder,
        "savepoints": savepoints,
        "aborts": aborts,
        "requeue": requeue,
        "isolated": isolated,
    }
    threads = [threading.Thread(target=writer, args=(n, b)) for n, b in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 60)
    return ledger


@pytest.fixture
def seed() -> Iterator[int]:
    value = int(os.environ.get("REACTOR_DOORBELL_SEED", random.randrange(1_000_000)))
    print(f"doorbell soak seed {value} (REACTOR_DOORBELL_SEED={value} to repeat)")
    yield value


@pytest.mark.slow
@pytest.mark.parametrize("reactors", [1, 2])
@pytest.mark.timeout(SOAK_SECONDS * 3 + 120)
def test_mixed_writers_lose_nothing_without_the_sweep(
    env: Env, spawn: Callable[..., Process], reactors: int, seed: int
) -> None:
    ports = [free_port() for _ in range(reactors)]
    for i, port in enumerate(ports):
        start_reactor(
            spawn,
            *NO_SWEEP,
            *ROUTES,
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            name=f"reactor{i}",
        )
    admin = env.connect()
    ledger = mixed_writers(env, SOAK_SECONDS, seed)
    assert not ledger.errors, ledger.errors
    finished = time.monotonic()

    # No sweep runs: every committed row must be dispatched by the doorbell or by polling.
    wait_for(lambda: "pending" not in states(admin), timeout=10, what="nothing left pending")
    settle = time.monotonic() - finished
    stored = set(admin.execute("SELECT photo_id, type FROM photo_jobs").fetchall())
    assert stored == ledger.committed
    assert not stored & ledger.aborted
    assert states(admin) == {"active": len(stored)}
    assert jobs_missing(admin, env.redis()) == []

    texts = [scrape(port) for port in ports]
    total = {
        # An outcome a reactor never had has no series there.
        name: sum(metric(t, name, 0) for t in texts)
        for name in (
            "reactor_sweeps_total",
            "reactor_polls_total",
            "reactor_notifications_total",
            'reactor_doorbell_arm_attempts_total{outcome="armed"}',
            'reactor_doorbell_arm_attempts_total{outcome="busy"}',
            'reactor_doorbell_arm_attempts_total{outcome="held_elsewhere"}',
        )
    }
    delays = sorted(ledger.isolated_delays)
    print(
        f"{reactors} reactor(s), {SOAK_SECONDS:.0f}s: {len(stored)} rows in "
        f"{ledger.transactions} transactions, {len(ledger.aborted)} rolled back; "
        f"settled {settle:.3f}s after the writers; isolated delays max "
        f"{max(delays) * 1000:.1f} ms, median {delays[len(delays) // 2] * 1000:.1f} ms; {total}"
    )
    assert total["reactor_sweeps_total"] == 0
    # Every path was taken: polling under load, arming when idle, ringing.
    assert total["reactor_polls_total"] > 0
    assert total['reactor_doorbell_arm_attempts_total{outcome="armed"}'] > 0
    assert total["reactor_notifications_total"] > 0
    # An isolated row waits for a notification or a poll; one whose commit took longer than
    # the claims' margin after its statement began (a loaded machine) waits for the next claim
    # over the whole range (`reactor.dispatcher.bounds`).
    assert len(delays) >= 3 and max(delays) < FULL_EVERY_SECONDS + MARGIN_SECONDS, delays
