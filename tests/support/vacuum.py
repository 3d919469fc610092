"""What the test server's own settings say about autovacuum, for tests that check what the
reactor reports (CI's server runs with autovacuum off; the throwaway servers with it on)."""

from __future__ import annotations

from typing import Any

import psycopg


def server_autovacuum_off(conn: psycopg.Connection[Any]) -> list[str]:
    """The server settings that keep autovacuum off every table, in the order the reactor
    names them (`reactor.pg.vacuum`): `autovacuum`, `track_counts`."""
    off = []
    for setting in ("autovacuum", "track_counts"):
        row = conn.execute(f"SHOW {setting}").fetchone()
        if row is None or row[0] != "on":
            off.append(setting)
    return off
