"""The probe before a poll's claims: which types have a row a claim could take, asked in one
statement outside any transaction.

A claim is a transaction: BEGIN, the claiming UPDATE and COMMIT, a round trip each, so a
claim that finds nothing still costs three round trips for each type. A reactor
whose doorbell is silent polls, up to a thousand times a second; once a poll has found
nothing, the next asks first which types have a due pending row in their claims' windows
(`queries.DUE_TYPES`, in autocommit) and claims only those. An empty poll is then one round
trip and no transaction at all.

Guarantees: the probe never hides a row its claim would take. A type that owes a full claim
(`reactor.dispatcher.bounds`) is claimed without asking; every other type is asked over the
window its bounded claim would read, counting rows locked by other transactions and rows the
claims refuse. A type found empty counts as a short claim at the probe's start for its
low-water mark: it saw no due row in that window at all. A probe that fails on a healthy
connection leaves every type to its claim (a type whose claim fails is then left out alone).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from reactor.dispatcher.bounds import ClaimBounds
from reactor.errors import StatementError
from reactor.pg import db, queries
from reactor.pg.db import Connection

__all__ = ["due_types"]


def due_types(conn: Connection, types: Sequence[str], bounds: ClaimBounds) -> list[str]:
    """`types` less those with no due pending row in their claim's window, in their order.

    Raises:
        DatabaseError: the connection failed, or was inside a transaction.
    """
    started = time.monotonic()
    windows = {t: bounds.window(t, started) for t in types}
    asked = [t for t, window in windows.items() if window is not None]
    if not asked:
        return list(types)
    params = {"types": asked, "windows": [windows[t] for t in asked]}
    try:
        with db.outside_transaction(conn), db.translating("probe failed", conn):
            found = {row[0] for row in conn.execute(queries.DUE_TYPES, params)}
    except StatementError:
        return list(types)
    for job_type in asked:
        if job_type not in found:
            bounds.claimed(job_type, started, windows[job_type], short=True)
    return [t for t in types if windows[t] is None or t in found]
