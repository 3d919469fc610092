"""Sessions waiting on a lock, as Postgres sees them: how a test knows that a process reached
the statement the test holds up (with a lock of its own), without a sleep."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import psycopg


def lock_waiter(
    conn: psycopg.Connection[Any], application_name: str, *, not_in: Collection[int] = ()
) -> int:
    """The pid of a session of this database whose `application_name` is LIKE the given
    pattern and that waits on a lock, other than those of `not_in`; 0 when there is none (a
    falsy value for `wait_for`)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND application_name LIKE %s",
        [application_name],
    ).fetchall()
    return next((int(pid) for (pid,) in rows if int(pid) not in not_in), 0)
