"""The table, its triggers and indexes, and `submit()`, against a real Postgres.

The notification tests here run with an armed listener (one holding the doorbell lock); what
the triggers do when no reactor is armed is in test_doorbell.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from reactor import submit
from reactor.pg import queries
from tests.support.env import Env
from tests.support.notifications import Notifications, in_tx


@pytest.fixture
def notes(env: Env) -> Notifications:
    return Notifications(env)


def test_an_insert_notifies_its_type_and_names_no_row(notes: Notifications) -> None:
    single = "INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 'photo.process')"
    assert notes.sent_by(in_tx(single)) == ["photo.process"]
    # Whatever the rows hold (due or not, any attempt, spaces in the id): the types alone.
    mixed = (
        "INSERT INTO photo_jobs (photo_id, type, next_retry_at, attempts) VALUES"
        " ('b c', 't', NULL, 0), ('d', 't', now() + '1 h', 0), ('e', 'u', NULL, 1)"
    )
    assert sorted(notes.sent_by(in_tx(mixed))) == ["t", "u"]


def test_bulk_insert_select_notifies_once(notes: Notifications) -> None:
    sent = notes.sent_by(
        in_tx(
            "INSERT INTO photo_jobs (photo_id, type)"
            " SELECT 'p' || i, 'photo.process' FROM generate_series(1, 1000) AS i"
        )
    )
    assert sent == ["photo.process"]


def test_copy_notifies_once(notes: Notifications) -> None:
    def copy_rows(conn: psycopg.Connection[Any]) -> None:
        with (
            conn.transaction(),
            conn.cursor() as cur,
            cur.copy("COPY photo_jobs (photo_id, type) FROM STDIN") as copy,
        ):
            for i in range(500):
                copy.write_row((f"c{i}", "photo.process"))
        assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (500,)

    assert notes.sent_by(copy_rows) == ["photo.process"]


def test_two_inserts_in_one_transaction_notify_each_type_once(notes: Notifications) -> None:
    sent = notes.sent_by(
        in_tx(
            "INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 'photo.process')",
            "INSERT INTO photo_jobs (photo_id, type) VALUES ('b', 'photo.process')",
            "INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 'photo.thumb')",
        )
    )
    # Identical notifications of one transaction are delivered once.
    assert sorted(sent) == ["photo.process", "photo.thumb"]


def test_no_notification_for_rollback_for_done_rows_or_empty_inserts(notes: Notifications) -> None:
    assert (
        notes.sent_by(
            in_tx("INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 't')", rollback=True)
        )
        == []
    )
    assert (
        notes.sent_by(
            in_tx("INSERT INTO photo_jobs (photo_id, type, state) VALUES ('d', 't', 'done')")
        )
        == []
    )
    assert (
        notes.sent_by(in_tx("INSERT INTO photo_jobs (photo_id, type) SELECT 'x', 't' WHERE false"))
        == []
    )


def test_updates_notify_only_when_moving_into_pending(notes: Notifications) -> None:
    notes.sent_by(in_tx("INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 'photo.process')"))
    not_into_pending = [
        "UPDATE photo_jobs SET state = 'active', attempts = 1",
        "UPDATE photo_jobs SET updated_at = now()",
        "UPDATE photo_jobs SET last_error = 'x'",
        "UPDATE photo_jobs SET state = 'failed'",
    ]
    for statement in not_into_pending:
        assert notes.sent_by(in_tx(statement)) == [], statement
    assert notes.sent_by(in_tx("UPDATE photo_jobs SET state = 'pending', attempts = 0")) == [
        "photo.process"
    ]
    # pending -> pending is not a move into pending
    assert (
        notes.sent_by(in_tx("UPDATE photo_jobs SET state = 'pending', next_retry_at = now()")) == []
    )


def test_updated_at_moves_on_every_update(env: Env) -> None:
    conn = env.connect()
    conn.execute("INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 't')")
    seen = [conn.execute("SELECT updated_at FROM photo_jobs").fetchone()]
    for statement in [
        "UPDATE photo_jobs SET last_error = 'x'",
        "UPDATE photo_jobs SET attempts = 1",
    ]:
        conn.execute(statement)
        seen.append(conn.execute("SELECT updated_at FROM photo_jobs").fetchone())
    assert seen[0] < seen[1] < seen[2]  # type: ignore[operator]


@pytest.mark.parametrize(
    ("statement", "constraint"),
    [
        (
            "INSERT INTO photo_jobs (photo_id, type, state) VALUES ('a', 't', 'running')",
            "photo_jobs_state_check",
        ),
        (
            "INSERT INTO photo_jobs (photo_id, type, attempts) VALUES ('a', 't', -1)",
            "photo_jobs_attempts_check",
        ),
        (
            "INSERT INTO photo_jobs (photo_id, type) VALUES ('a', 'bad type')",
            "photo_jobs_type_check",
        ),
        ("INSERT INTO photo_jobs (photo_id, type) VALUES ('', 't')", "photo_jobs_photo_id_check"),
    ],
)
def test_checks_reject_bad_rows_clearly(env: Env, statement: str, constraint: str) -> None:
    conn = env.connect()
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute(statement)
    assert info.value.diag.constraint_name == constraint
    assert constraint in str(info.value)


def test_submit_follows_the_callers_transaction(notes: Notifications, env: Env) -> None:
    def rolled_back(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction(force_rollback=True):
            assert submit(conn, "p1") is True

    assert notes.sent_by(rolled_back) == []
    conn = env.connect()
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (0,)

    def twice(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            assert submit(conn, "p1") is True
            assert submit(conn, "p1") is False

    assert notes.sent_by(twice) == ["photo.process"]
    assert conn.execute("SELECT count(*) FROM photo_jobs").fetchone() == (1,)


def test_submit_rearms_done_and_failed_rows_only(env: Env) -> None:
    conn = env.connect()
    submit(conn, "p1", max_attempts=3)
    conn.execute("UPDATE photo_jobs SET state = 'active', attempts = 2")
    assert submit(conn, "p1") is False  # active: left alone
    assert conn.execute("SELECT state, attempts FROM photo_jobs").fetchone() == ("active", 2)
    conn.execute("UPDATE photo_jobs SET state = 'done', attempts = 2, last_error = 'old'")
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert submit(conn, "p1", run_at=later) is True
    row = conn.execute(
        "SELECT state, attempts, last_error, max_attempts, next_retry_at FROM photo_jobs"
    ).fetchone()
    assert row == ("pending", 0, None, 3, later)
    conn.execute("UPDATE photo_jobs SET state = 'failed'")
    assert submit(conn, "p1", max_attempts=9) is True
    assert conn.execute("SELECT state, max_attempts FROM photo_jobs").fetchone() == ("pending", 9)


def plan(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> str:
    rows = conn.execute("EXPLAIN " + query, params).fetchall()
    return "\n".join(r[0] for r in rows)


def test_a_page_of_the_rescue_pass_reads_its_own_rows_not_all_after_its_key(env: Env) -> None:
    """The pass pages through every active row: a page that read (and sorted) all the rows
    after its key made a pass cost rows² / page (18 s for 150,000 rows stuck in a queue)."""
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
        " SELECT 'a' || i, 'photo.process', 'active', 1, now() - (i || ' s')::interval"
        " FROM generate_series(1, 20000) AS i"
    )
    conn.execute("INSERT INTO reactor_paused_types (type) VALUES ('photo.other')")
    conn.execute("ANALYZE photo_jobs")
    params = {
        "types": ["photo.process"],
        "until": datetime.now(timezone.utc),
        "after_at": (datetime.now(timezone.utc) - timedelta(seconds=10000)).isoformat(),
        "after_type": "",
        "after_id": "",
        "limit": 500,
        "stale_after": 300.0,
        "gone_after": 30.0,
    }
    [(found,)] = conn.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.LIST_ACTIVE, params
    ).fetchall()

    def scanned(node: dict[str, Any]) -> int:
        own = node["Actual Rows"] if node.get("Relation Name") == "photo_jobs" else 0
        return own + sum(scanned(child) for child in node.get("Plans", []))

    assert scanned(found[0]["Plan"]) <= 2 * 500, json.dumps(found, indent=1)[:3000]


@pytest.mark.slow
def test_dispatch_queries_use_the_partial_indexes_beside_a_million_done_rows(env: Env) -> None:
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
        " SELECT 'd' || i, 'photo.process', 'done', 1, now() - interval '1 day'"
        " FROM generate_series(1, 1000000) AS i"
    )
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type) SELECT 'p' || i, 'photo.process'"
        " FROM generate_series(1, 1000) AS i"
    )
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts)"
        " SELECT 'a' || i, 'photo.process', 'active', 1 FROM generate_series(1, 1000) AS i"
    )
    conn.execute("ANALYZE photo_jobs")
    types = ["photo.process"]
    checks: dict[str, tuple[str, dict[str, Any], str]] = {
        "claim": (
            queries.CLAIM_DUE,
            {"type": "photo.process", "limit": 500, "skip": [], "window": None},
            "photo_jobs_pending_due_idx",
        ),
        "next due": (queries.NEXT_DUE_IN, {"types": types}, "photo_jobs_pending_due_idx"),
        "active page": (
            queries.LIST_ACTIVE,
            {
                "types": types,
                "until": datetime.now(timezone.utc),
                "after_at": "-infinity",
                "after_type": "",
                "after_id": "",
                "limit": 500,
                "stale_after": 300.0,
                "gone_after": 30.0,
            },
            "photo_jobs_active_updated_idx",
        ),
        "pending types": (queries.PENDING_TYPES, {}, "photo_jobs_pending_due_idx"),
        "stale rows": (
            queries.STATUS_PER_TYPE,
            {"types": types, "stale_after": 300.0},
            "photo_jobs_active_updated_idx",
        ),
    }
    for name, (query, params, index) in checks.items():
        text = plan(conn, query, params)
        assert index in text, f"{name} does not use {index}:\n{text}"
        assert "Seq Scan on photo_jobs" not in text, f"{name} scans the table:\n{text}"
