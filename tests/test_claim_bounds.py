"""The claim's low-water marks (`reactor.dispatcher.bounds`) against real servers: a row
committed late with a due time below its type's mark is still claimed within the full-claim
interval, and while a snapshot is held the bounded claim's index work does not grow with the
rows dispatched since.

The reactor runs in this process (its turns driven by the test, as in tests/test_loop_turn.py);
a watchdog requests a stop after a minute, so a turn that waits for nothing ends the test.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import reactor
from reactor.dispatcher import bounds
from reactor.dispatcher.bounds import MARGIN_SECONDS
from reactor.dispatcher.drain import Dispatcher
from reactor.dispatcher.loop import Reactor
from reactor.pg import queries
from reactor.routes import parse_routes
from reactor.rq.enqueue import Enqueuer
from reactor.settings import ReactorSettings
from tests.support.env import Env
from tests.support.waiting import wait_for

ROUTES = parse_routes(["photo.process=reactor.demo.process_photo"])
TYPE = "photo.process"
INSERT = "INSERT INTO photo_jobs (photo_id, type) VALUES (%s, 'photo.process')"
WATCHDOG_SECONDS = 60.0
#: What a loaded test machine may add to the stated bound.
SLACK_SECONDS = 1.0
#: The interval of full claims here (1 s in production): a full claim reads every row, and on
#: a loaded machine one could come due between a test's set-up and the claim it watches.
FULL_EVERY_SECONDS = 3.0


@pytest.fixture(autouse=True)
def _full_claims_every(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full claims every FULL_EVERY_SECONDS, however long one takes: on a loaded machine a full
    claim of 50 ms would otherwise space them 5 s apart (`FULL_SHARE`, tested on its own)."""
    monkeypatch.setattr(bounds, "FULL_EVERY_SECONDS", FULL_EVERY_SECONDS)
    monkeypatch.setattr(bounds, "FULL_SHARE", 0.0)


def test_full_claims_space_out_while_they_are_slow_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bounds, "FULL_SHARE", 100.0)
    marks = bounds.ClaimBounds()
    started = time.monotonic() - 0.05  # a full claim that took 50 ms (or a little more)
    marks.claimed(TYPE, started, None, short=True)
    assert marks.window(TYPE, started + 4.9) is not None  # 100 times 50 ms: bounded until 5 s
    due = marks.full_claim_due()
    assert due is not None and due >= started + 5.0
    assert marks.window(TYPE, started + bounds.FULL_EVERY_MAX_SECONDS + 0.01) is None


@pytest.fixture
def make_reactor(env: Env) -> Iterator[Callable[..., Reactor]]:
    made: list[tuple[Reactor, threading.Timer]] = []

    def make(**extra: Any) -> Reactor:
        settings = ReactorSettings(
            env.database_url, env.redis_url, ROUTES, sweep_interval_seconds=3600.0, **extra
        )
        started = Reactor(settings)
        started.start()
        watchdog = threading.Timer(WATCHDOG_SECONDS, started.stopper.request)
        watchdog.daemon = True
        watchdog.start()
        made.append((started, watchdog))
        return started

    yield make
    for started, watchdog in made:
        watchdog.cancel()
        started.close()


def state_of(conn: psycopg.Connection[Any], photo_id: str) -> str | None:
    row = conn.execute("SELECT state FROM photo_jobs WHERE photo_id = %s", [photo_id]).fetchone()
    return None if row is None else str(row[0])


def wait_past_margin(conn: psycopg.Connection[Any], since: datetime) -> None:
    """Until the database clock is more than the margin past `since`: the row's due time is
    then older than the margin before any claim that starts afterwards."""
    wait_for(
        lambda: _db_now(conn) > since + timedelta(seconds=MARGIN_SECONDS + 0.1),
        timeout=10,
        what="the margin to pass",
    )


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def claim_after_commit(target: Reactor, conn: psycopg.Connection[Any], photo_id: str) -> float:
    """Drive turns until `photo_id` is claimed; the seconds from now until then. At least one
    turn must have drained without claiming it (the row was below the mark)."""
    committed = time.monotonic()
    missed = 0
    while state_of(conn, photo_id) == "pending":
        turn = target.turn()
        assert not target.stopper.requested, "the watchdog stopped the reactor"
        if turn.work is not None and state_of(conn, photo_id) == "pending":
            missed += 1
    assert missed, "every claim read the row: it was not below the mark"
    return time.monotonic() - committed


def test_a_row_inserted_by_a_transaction_begun_before_the_previous_claim_is_claimed_in_time(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    writer = env.connect(autocommit=False)
    target = make_reactor()
    target.turn()  # the drain at start
    writer.execute(INSERT, ["late"])  # created_at: the writer's transaction start
    began = writer.execute("SELECT now()").fetchone()
    assert began is not None
    wait_past_margin(conn, began[0])
    target.turn()  # a short claim after the margin: the mark is past the row's due time
    writer.commit()
    assert claim_after_commit(target, conn, "late") < FULL_EVERY_SECONDS + SLACK_SECONDS
    assert state_of(conn, "late") == "active"


def test_a_bulk_insert_begun_before_the_previous_claim_is_claimed_whole_in_time(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    """Rows below the mark are claimed by full claims, one batch after another while they come
    back full: not one batch per full-claim interval."""
    conn = env.connect()
    writer = env.connect(autocommit=False)
    target = make_reactor(batch_size=5)
    target.turn()  # the drain at start
    writer.execute(
        "INSERT INTO photo_jobs (photo_id, type)"
        " SELECT 'bulk' || i, %s FROM generate_series(1, 23) AS i",
        [TYPE],
    )
    began = writer.execute("SELECT now()").fetchone()
    assert began is not None
    wait_past_margin(conn, began[0])
    target.turn()  # a short claim after the margin: the mark is past the rows' due time
    writer.commit()
    took = claim_after_commit(target, conn, "bulk23")
    assert took < FULL_EVERY_SECONDS + SLACK_SECONDS, f"{took:.1f} s for 5 batches"
    pending = conn.execute("SELECT count(*) FROM photo_jobs WHERE state = 'pending'").fetchone()
    assert pending == (0,)


def test_a_row_rearmed_with_an_old_due_time_is_claimed_in_time(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts) VALUES ('again', %s, 'done', 1)",
        [TYPE],
    )
    target = make_reactor()
    target.turn()  # the drain at start: nothing due, the mark is set
    hour_ago = datetime.now(timezone.utc) - timedelta(hours=1)
    assert reactor.submit(conn, "again", TYPE, run_at=hour_ago)  # re-armed, committed
    assert claim_after_commit(target, conn, "again") < FULL_EVERY_SECONDS + SLACK_SECONDS


def test_a_row_of_a_type_paused_past_the_margin_is_claimed_in_time_after_the_resume(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    conn.execute("INSERT INTO reactor_paused_types (type, paused_by) VALUES (%s, 'test')", [TYPE])
    target = make_reactor()
    conn.execute(INSERT, ["paused"])
    inserted = conn.execute("SELECT created_at FROM photo_jobs").fetchone()
    assert inserted is not None
    target.turn()  # the drain at start claims nothing: paused
    wait_past_margin(conn, inserted[0])
    target.turn()  # paused still: a short claim past the row's due time
    conn.execute("DELETE FROM reactor_paused_types")
    assert claim_after_commit(target, conn, "paused") < FULL_EVERY_SECONDS + SLACK_SECONDS


def test_a_row_a_claim_skipped_while_another_transaction_held_its_lock_is_claimed_in_time(
    env: Env, make_reactor: Callable[..., Reactor]
) -> None:
    conn = env.connect()
    conn.execute(INSERT, ["locked"])
    inserted = conn.execute("SELECT created_at FROM photo_jobs").fetchone()
    assert inserted is not None
    locker = env.connect(autocommit=False)
    locker.execute("SELECT FROM photo_jobs WHERE photo_id = 'locked' FOR UPDATE")
    target = make_reactor()
    target.turn()  # the drain at start skips the locked row
    wait_past_margin(conn, inserted[0])
    target.turn()  # another short claim past the row's due time, the row still locked
    locker.rollback()
    assert claim_after_commit(target, conn, "locked") < FULL_EVERY_SECONDS + SLACK_SECONDS


def _claim_buffers(conn: psycopg.Connection[Any], window: float | None) -> int:
    """Shared buffers the claim touches (hit or read), from EXPLAIN (ANALYZE, BUFFERS); its
    transaction is rolled back."""
    params = {"type": TYPE, "limit": 500, "skip": [], "window": window}
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries.CLAIM_DUE, params
        ).fetchone()
    assert row is not None
    plan = (json.loads(row[0]) if isinstance(row[0], str) else row[0])[0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_the_bounded_claim_does_not_walk_the_rows_dispatched_under_a_held_snapshot(
    env: Env,
) -> None:
    conn, work = env.connect(), env.connect(autocommit=False)
    holder = env.connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM photo_jobs").fetchone()  # the snapshot, held
    dispatcher = Dispatcher(Enqueuer(env.redis(), ROUTES), ROUTES, batch_size=500)
    measured: list[tuple[int, int]] = []
    try:
        for round_, count in enumerate((500, 5000)):
            conn.execute(
                "INSERT INTO photo_jobs (photo_id, type)"
                " SELECT %s || i, %s FROM generate_series(1, %s) AS i",
                [f"r{round_}-", TYPE, count],
            )
            inserted = _db_now(conn)
            assert dispatcher.drain(work, [TYPE]).claimed == count
            wait_past_margin(conn, inserted)
            assert dispatcher.drain(work, [TYPE]).claimed == 0  # short: the mark moves on
            window = dispatcher.bounds.window(TYPE, time.monotonic())
            assert window is not None, "a full claim just ran: the next one is bounded"
            measured.append((_claim_buffers(conn, window), _claim_buffers(conn, None)))
    finally:
        holder.rollback()
    (bounded_before, full_before), (bounded_after, full_after) = measured
    # The full range walks every entry the snapshot keeps, pages of the index and of the
    # heap behind it (the test's premise: 11 times the rows); the bounded claim none of them.
    assert full_after > 2 * full_before and full_after > full_before + 30, measured
    assert bounded_after <= bounded_before + 3, measured


def test_a_quarantined_type_owes_no_full_claim(env: Env) -> None:
    conn, work = env.connect(), env.connect(autocommit=False)
    dispatcher = Dispatcher(Enqueuer(env.redis(), ROUTES), ROUTES, batch_size=500)
    dispatcher.drain(work, [TYPE])  # full: the mark
    dispatcher.drain(work, [TYPE])  # bounded: a full claim is owed
    assert dispatcher.bounds.full_claim_due() is not None
    conn.execute(
        "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'poisoned row' USING ERRCODE = '22003'; END $$;"
        " CREATE TRIGGER poison BEFORE UPDATE ON photo_jobs FOR EACH ROW"
        " WHEN (NEW.state = 'active') EXECUTE FUNCTION poison()"
    )
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type)"
        " SELECT 'p' || i, %s FROM generate_series(1, 10) AS i",
        [TYPE],
    )
    assert dispatcher.drain(work, [TYPE]).claimed == 0
    assert TYPE in dispatcher.quarantined
    # Else the loop would wake for that claim at once, turn after turn, while the
    # quarantine leaves the type out of every drain.
    assert dispatcher.bounds.full_claim_due() is None
