"""Telling exactly which notifications a piece of writing sent: a LISTEN session, and a
sentinel NOTIFY after the writing that marks where its notifications end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from reactor.pg.queries import DOORBELL_ARM
from tests.support.env import Env

SENTINEL = "photo_jobs_test_sentinel"


class Notifications:
    """A LISTEN session that can tell exactly what a piece of writing sent.

    `armed`: the session holds the doorbell lock as an idle reactor does (sql/0004), so the
    triggers notify; unarmed, they must stay silent.
    """

    def __init__(self, env: Env, *, armed: bool = True) -> None:
        self.listener = env.connect()
        self.listener.execute("LISTEN photo_jobs")
        self.listener.execute(f"LISTEN {SENTINEL}")
        if armed:
            self.listener.execute(DOORBELL_ARM)
        self.writer = env.connect()

    def sent_by(self, write: Callable[[psycopg.Connection[Any]], None]) -> list[str]:
        """Run `write`, then a sentinel NOTIFY in a later transaction; notifications arrive in
        commit order, so everything `write` caused has arrived once the sentinel has."""
        write(self.writer)
        self.writer.execute(f"NOTIFY {SENTINEL}")
        payloads: list[str] = []
        deadline = time.monotonic() + 10
        for note in self.listener.notifies(timeout=10):
            if note.channel == SENTINEL:
                return payloads
            payloads.append(note.payload)
            assert time.monotonic() < deadline
        raise AssertionError("sentinel notification never arrived")


def in_tx(*statements: str, rollback: bool = False) -> Callable[[psycopg.Connection[Any]], None]:
    """A write for `Notifications.sent_by`: `statements` in one transaction (rolled back if
    `rollback`)."""

    def write(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction(force_rollback=rollback):
            for statement in statements:
                conn.execute(statement)

    return write
