"""Writer cost of the NOTIFY triggers: insert throughput with and without them.

pgbench runs single-row inserting transactions at 1, 4 and 16 clients, and 100-row inserts
at 16 clients, against `photo_jobs` while a `reactor run` drains the table, in three set-ups
measured side by side in each repetition (in a rotating order):

- no trigger: the NOTIFY triggers disabled, an adaptive reactor (it finds rows by its 1 s
  sweep) — the baseline;
- adaptive: the triggers of sql/0004 and a reactor in the default `--doorbell adaptive`;
- plain: the same triggers and a reactor in `--doorbell plain`, which holds the doorbell
  lock, so every writing transaction notifies (what sql/0003 did).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from bench.common import Reactor, Stat, armed_by, flush_redis, fresh_database, table, wait_until
from tests.support.servers import find_binary

SINGLE = "INSERT INTO photo_jobs (photo_id, type) VALUES (md5(random()::text), 'photo.process');\n"
HUNDRED = (
    "INSERT INTO photo_jobs (photo_id, type)"
    " SELECT md5(random()::text), 'photo.process' FROM generate_series(1, 100);\n"
)
TRIGGERS = ("photo_jobs_notify_inserted", "photo_jobs_notify_pending")
MODES = ("none", "adaptive", "plain")


def _set_triggers(url: str, enabled: bool) -> None:
    verb = "ENABLE" if enabled else "DISABLE"
    with psycopg.connect(url, autocommit=True) as conn:
        for trigger in TRIGGERS:
            conn.execute(f"ALTER TABLE photo_jobs {verb} TRIGGER {trigger}")
        conn.execute("TRUNCATE photo_jobs")
    flush_redis()


def _armed(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        return armed_by(conn) is not None


def pgbench(url: str, script: Path, clients: int, seconds: float, rate: int | None = None) -> float:
    """Run `script` from `clients` clients for `seconds` (at most `rate` tx/s in all); tps."""
    pgbench = find_binary("pgbench")
    if pgbench is None:
        raise RuntimeError("pgbench not found")
    out = subprocess.run(
        [
            pgbench,
            "-n",
            "-c",
            str(clients),
            "-j",
            str(min(clients, 4)),
            "-T",
            str(int(seconds)),
            "-f",
            str(script),
            *(["-R", str(rate)] if rate else []),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"tps = ([0-9.]+)", out)
    if not match:
        raise RuntimeError(f"no tps in pgbench output:\n{out}")
    return float(match.group(1))


def _measure(url: str, mode: str, script: Path, clients: int, seconds: float) -> float:
    """Transactions per second of `script` with the reactor and triggers of `mode`."""
    _set_triggers(url, mode != "none")
    doorbell = "plain" if mode == "plain" else "adaptive"
    reactor = Reactor(url, "--sweep-interval", "1", "--doorbell", doorbell).started()
    try:
        # Start measuring from the reactor's idle state: armed (it arms once quiet).
        wait_until(lambda: _armed(url), timeout=30)
        return pgbench(url, script, clients, seconds)
    finally:
        reactor.stop()


def run(quick: bool) -> dict[str, Any]:
    seconds = 2 if quick else 8
    reps = 3 if quick else 5
    cases = [
        ("single-row", SINGLE, 1),
        ("single-row", SINGLE, 4),
        ("single-row", SINGLE, 16),
        ("100-row", HUNDRED, 16),
    ]
    results: dict[str, Any] = {"seconds_per_run": seconds, "runs": reps}
    rows = []
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for name, text, _ in cases:
            scripts[name] = Path(tmp) / f"{name}.sql"
            scripts[name].write_text(text)
        for name, _, clients in cases:
            tps: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(reps):
                order = MODES[rep % 3 :] + MODES[: rep % 3]
                for mode in order:
                    tps[mode].append(_measure(url, mode, scripts[name], clients, seconds))
            unit = 1 if name == "single-row" else 100
            stats = {m: Stat.of([x * unit for x in tps[m]]) for m in MODES}
            ratios = {
                m: Stat.of([a / b for a, b in zip(tps[m], tps["none"], strict=True)])
                for m in ("adaptive", "plain")
            }
            results[f"{name}@{clients}"] = {
                **{f"rows_per_s_{m}": stats[m].as_dict() for m in MODES},
                **{f"ratio_{m}": ratios[m].as_dict() for m in ratios},
            }
            rows.append(
                [
                    name,
                    str(clients),
                    stats["none"].fmt(digits=0),
                    stats["adaptive"].fmt(digits=0),
                    ratios["adaptive"].fmt("×", 2),
                    stats["plain"].fmt(digits=0),
                    ratios["plain"].fmt("×", 2),
                ]
            )
        _set_triggers(url, True)
    results["table"] = table(
        [
            "transactions",
            "writers",
            "rows/s, no trigger",
            "rows/s, adaptive",
            "adaptive ÷ none",
            "rows/s, plain",
            "plain ÷ none",
        ],
        rows,
    )
    return results
