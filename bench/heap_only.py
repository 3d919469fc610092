"""Heap-only updates: full lifecycles with heartbeats on the schema before sql/0019 and after.

Each run starts from an empty, freshly migrated database: migrations up to 0018 with the
statements of the revision before 0019 (its `reactor/pg/queries.sql`, read with `git show`),
or every migration with the current statements. It then runs `jobs` lifecycles through the
statements the producer, the reactor and the workers run, in batches of 100 as a reactor
claims them: SUBMIT_MANY, CLAIM_DUE, the fenced start (ATTEMPT_START, a row claimed a moment
ago: only read), a rescue of one row in ten (REDISPATCH: its job lost, a new attempt),
three heartbeats each (ATTEMPT_HEARTBEAT), ATTEMPT_DONE. Each statement is its own transaction
(`synchronous_commit` off for the bench's session: neither HOT nor sizes depend on it).
Autovacuum runs as the server's defaults and the table's settings say.

A third row runs the current schema with 0019's storage settings reset to the defaults
(fillfactor 100, autovacuum by scale factor): what the new column does alone.

Printed per schema (medians over the runs, min to max): the share of the table's updates that
were heap-only (`n_tup_hot_upd / n_tup_upd` of pg_stat_user_tables), the growth of the heap
and of all its indexes per 1,000 jobs, and the claim's time: CLAIM_DUE's server-side mean
from pg_stat_statements (a server of its own is started with it loaded, unless
BENCH_DATABASE_URL names one: then only if that server has it) and the client-timed median.
The configurations run in alternating order. BENCH_HOT_BEFORE=REV names the revision of the
"before" statements (default: the parent of the commit that added sql/0019).
"""

from __future__ import annotations

import atexit
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.common import ROOT, SERVER_URL, Stat, fresh_database, table, wait_until
from reactor.pg import queries
from reactor.pg.migrate import SEARCH_PATH, load_migrations
from tests.support.servers import PostgresServer

TYPE = "photo.process"
BATCH = 100
BEATS = 3
RESCUE_EVERY = 10
MIGRATION = "sql/0019_keep_heartbeats_heap_only.sql"
_NAME_LINE = re.compile(r"^-- name: ([A-Z][A-Z0-9_]*)$", re.MULTILINE)
_NEEDED = (
    "SUBMIT_MANY",
    "CLAIM_DUE",
    "ATTEMPT_START",
    "REDISPATCH",
    "ATTEMPT_HEARTBEAT",
    "ATTEMPT_DONE",
)
#: The last migration of the schema before heap-only heartbeats.
BEFORE_VERSION = 18


def _statements(text: str) -> dict[str, str]:
    """The named statements of a queries.sql text, as `reactor.pg.queries` cuts them."""
    parts = _NAME_LINE.split(text)[1:]
    found: dict[str, str] = {}
    for name, block in zip(parts[::2], parts[1::2], strict=True):
        lines = block.strip("\n").split("\n")
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        while lines and (not lines[-1].strip() or lines[-1].startswith("--")):
            lines.pop()
        found[name] = "\n".join(lines).strip() + "\n"
    return found


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], check=False, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _before_revision() -> str:
    named = os.environ.get("BENCH_HOT_BEFORE")
    if named:
        return named
    added = _git("log", "--diff-filter=A", "--format=%H", "-1", "--", MIGRATION)
    return f"{added}^" if added else "HEAD"


def _server() -> tuple[str, bool]:
    """A server URL, and whether pg_stat_statements is loaded there."""
    if os.environ.get("BENCH_DATABASE_URL"):
        with psycopg.connect(SERVER_URL, autocommit=True) as conn:
            row = conn.execute("SHOW shared_preload_libraries").fetchone()
        return SERVER_URL, bool(row and "pg_stat_statements" in str(row[0]))
    server = PostgresServer(
        settings={"fsync": "on", "shared_preload_libraries": "pg_stat_statements"}
    )
    atexit.register(server.stop)
    return server.url, True


#: Undoes 0019's storage settings: the third row isolates what the column alone does.
_RESET_STORAGE = (
    "ALTER TABLE photo_jobs RESET (fillfactor, autovacuum_vacuum_scale_factor,"
    " autovacuum_vacuum_threshold, autovacuum_vacuum_insert_scale_factor,"
    " autovacuum_vacuum_insert_threshold, autovacuum_analyze_scale_factor,"
    " autovacuum_analyze_threshold)"
)


def _prepare(
    up_to: int, statements_ext: bool, reset_storage: bool
) -> Callable[[psycopg.Connection[Any]], None]:
    """What makes a fresh database this configuration's: migrations up to `up_to`, the storage
    settings reset or not, pg_stat_statements reset or not."""

    def prepare(conn: psycopg.Connection[Any]) -> None:
        conn.execute(queries.SET_SEARCH_PATH, {"search_path": SEARCH_PATH})
        for migration in load_migrations():
            if migration.version <= up_to:
                with conn.transaction():
                    conn.execute(migration.sql.encode("utf-8"))
        if reset_storage:
            conn.execute(_RESET_STORAGE)
        if statements_ext:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")

    return prepare


def _sizes(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute(
        "SELECT pg_relation_size('photo_jobs'), pg_indexes_size('photo_jobs')"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _lifecycles(url: str, statements: dict[str, str], jobs: int) -> tuple[int, list[float]]:
    """Run `jobs` lifecycles; (updates made, client-timed CLAIM_DUE milliseconds)."""
    made = 0
    claims: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for first in range(0, jobs, BATCH):
            ids = [f"p{i}" for i in range(first, min(jobs, first + BATCH))]
            conn.execute(
                statements["SUBMIT_MANY"],
                {
                    "type": TYPE,
                    "photo_ids": ids,
                    "run_at": None,
                    "max_attempts": None,
                    "traceparent": None,
                    "tracestate": None,
                },
            )
            started = time.perf_counter()
            claimed = conn.execute(
                statements["CLAIM_DUE"], {"type": TYPE, "limit": BATCH, "skip": [], "window": None}
            ).fetchall()
            claims.append((time.perf_counter() - started) * 1000)
            made += len(claimed)
            tokens = {str(r[1]): int(r[2]) for r in claimed}
            for n, (photo_id, token) in enumerate(sorted(tokens.items())):
                fence = {"photo_id": photo_id, "type": TYPE, "token": token}
                conn.execute(statements["ATTEMPT_START"], {**fence, "fresh": 10.0})
                if n % RESCUE_EVERY == 0:
                    rescue = {
                        "types": [TYPE],
                        "photo_ids": [photo_id],
                        "tokens": [token],
                        "why": "job lost",
                        "error": None,
                        "stale_after": None,
                    }
                    made += conn.execute(statements["REDISPATCH"], rescue).rowcount
                    tokens[photo_id] = token + 1
            for _ in range(BEATS):
                for photo_id, token in tokens.items():
                    fence = {"photo_id": photo_id, "type": TYPE, "token": token}
                    made += conn.execute(statements["ATTEMPT_HEARTBEAT"], fence).rowcount
            for photo_id, token in tokens.items():
                fence = {"photo_id": photo_id, "type": TYPE, "token": token}
                made += conn.execute(statements["ATTEMPT_DONE"], fence).rowcount
    return made, claims


def _one(
    server_url: str,
    config: tuple[int, dict[str, str], bool],
    jobs: int,
    pgss: bool,
) -> dict[str, float]:
    up_to, statements, reset_storage = config
    with fresh_database(server_url, _prepare(up_to, pgss, reset_storage)) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            heap0, index0 = _sizes(conn)
        made, claims = _lifecycles(url, statements, jobs)
        with psycopg.connect(url, autocommit=True) as conn:

            def counted() -> tuple[int, int, int]:
                conn.execute("SELECT pg_stat_clear_snapshot()")
                row = conn.execute(
                    "SELECT n_tup_upd, n_tup_hot_upd, autovacuum_count + autoanalyze_count"
                    " FROM pg_stat_user_tables WHERE relid = 'photo_jobs'::regclass"
                ).fetchone()
                assert row is not None
                return int(row[0]), int(row[1]), int(row[2])

            # The lifecycles' session reports its counts as it ends: wait for all of them.
            wait_until(lambda: counted()[0] >= made, timeout=30, interval=0.1)
            updated, hot, autovacuums = counted()
            heap, index = _sizes(conn)
            claim_mean = float("nan")
            if pgss:
                row = conn.execute(
                    "SELECT sum(total_exec_time) / sum(calls) FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database"
                    "                WHERE datname = current_database())"
                    "   AND query LIKE 'UPDATE photo_jobs AS j%ORDER BY coalesce(p.next_retry_at%'"
                ).fetchone()
                if row is not None and row[0] is not None:
                    claim_mean = float(row[0])
    per_thousand = 1000 / jobs / 1024
    return {
        "hot_share": hot / updated if updated else 0.0,
        "updates": float(updated),
        "heap_kib_per_1000": (heap - heap0) * per_thousand,
        "index_kib_per_1000": (index - index0) * per_thousand,
        "claim_server_ms": claim_mean,
        "claim_client_ms": statistics.median(claims),
        "autovacuum_runs": float(autovacuums),
    }


def run(quick: bool) -> dict[str, Any]:
    jobs = 2_000 if quick else 20_000
    reps = 2 if quick else 3
    revision = _before_revision()
    before = _statements(_git("show", f"{revision}:reactor/pg/queries.sql"))
    after = _statements((ROOT / "reactor" / "pg" / "queries.sql").read_text())
    for name in _NEEDED:
        assert name in before and name in after, name
    before_version = BEFORE_VERSION
    after_version = max(m.version for m in load_migrations())
    server_url, pgss = _server()
    configs = {
        f"before (migrations to {before_version:04d})": (before_version, before, False),
        f"after ({after_version:04d})": (after_version, after, False),
        f"after ({after_version:04d}), its storage settings reset": (after_version, after, True),
    }
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for rep in range(reps):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            measured[name].append(_one(server_url, configs[name], jobs, pgss))

    def stat(name: str, key: str) -> Stat:
        return Stat.of([m[key] for m in measured[name]])

    rows = []
    results: dict[str, Any] = {}
    for name in configs:
        hot = Stat.of([100 * m["hot_share"] for m in measured[name]])
        server = stat(name, "claim_server_ms")
        rows.append(
            [
                name,
                hot.fmt(" %"),
                stat(name, "heap_kib_per_1000").fmt(" KiB"),
                stat(name, "index_kib_per_1000").fmt(" KiB"),
                server.fmt(" ms", 3) if pgss else "n/a",
                stat(name, "claim_client_ms").fmt(" ms", 3),
                stat(name, "autovacuum_runs").fmt("", 0),
            ]
        )
        results[name] = {key: stat(name, key).as_dict() for key in measured[name][0]}
    return {
        "jobs_per_run": jobs,
        "runs": reps,
        "before_revision": revision,
        "pg_stat_statements": pgss,
        "results": results,
        "table": table(
            [
                f"schema ({jobs:,} lifecycles a run, {BEATS} heartbeats each)",
                "HOT share of updates",
                "heap growth / 1,000 jobs",
                "index growth / 1,000 jobs",
                f"CLAIM_DUE server mean ({BATCH} rows)",
                "CLAIM_DUE client median",
                "autovacuum + autoanalyze runs",
            ],
            rows,
        ),
    }
