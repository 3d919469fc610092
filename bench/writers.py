"""Writer cost of the NOTIFY triggers: insert throughput with and without them.

pgbench runs single-row inserting transactions at 1, 4 and 16 clients, and 100-row inserts
at 16 clients, against `photo_jobs` with its triggers enabled and disabled, side by side in
each repetition, with a `reactor run` (sweep interval 1 s) draining the table meanwhile.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from bench.common import Reactor, Stat, flush_redis, fresh_database, table
from tests.servers import find_binary

SINGLE = "INSERT INTO photo_jobs (photo_id, type) VALUES (md5(random()::text), 'photo.process');\n"
HUNDRED = (
    "INSERT INTO photo_jobs (photo_id, type)"
    " SELECT md5(random()::text), 'photo.process' FROM generate_series(1, 100);\n"
)
TRIGGERS = ("photo_jobs_notify_inserted", "photo_jobs_notify_pending")


def _set_triggers(url: str, enabled: bool) -> None:
    verb = "ENABLE" if enabled else "DISABLE"
    with psycopg.connect(url, autocommit=True) as conn:
        for trigger in TRIGGERS:
            conn.execute(f"ALTER TABLE photo_jobs {verb} TRIGGER {trigger}")  # type: ignore[arg-type]
        conn.execute("TRUNCATE photo_jobs")
    flush_redis()


def _pgbench(url: str, script: Path, clients: int, seconds: float) -> float:
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


def run(quick: bool) -> dict[str, Any]:
    seconds = 2 if quick else 10
    reps = 3 if quick else 5
    cases = [
        ("single-row", SINGLE, 1),
        ("single-row", SINGLE, 4),
        ("single-row", SINGLE, 16),
        ("100-row", HUNDRED, 16),
    ]
    results: dict[str, Any] = {}
    rows = []
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for name, text, _ in cases:
            scripts[name] = Path(tmp) / f"{name}.sql"
            scripts[name].write_text(text)
        reactor = Reactor(url, "--sweep-interval", "1").started()
        try:
            for name, _, clients in cases:
                with_t, without_t, ratios = [], [], []
                for rep in range(reps):
                    order = [True, False] if rep % 2 == 0 else [False, True]
                    tps = {}
                    for enabled in order:
                        _set_triggers(url, enabled)
                        tps[enabled] = _pgbench(url, scripts[name], clients, seconds)
                    with_t.append(tps[True])
                    without_t.append(tps[False])
                    ratios.append(tps[True] / tps[False])
                _set_triggers(url, True)
                unit = 1 if name == "single-row" else 100
                w, wo, r = (
                    Stat.of([x * unit for x in with_t]),
                    Stat.of([x * unit for x in without_t]),
                    Stat.of(ratios),
                )
                key = f"{name}@{clients}"
                results[key] = {
                    "rows_per_s_with": w.as_dict(),
                    "rows_per_s_without": wo.as_dict(),
                    "ratio": r.as_dict(),
                }
                rows.append([name, str(clients), wo.fmt(digits=0), w.fmt(digits=0), r.fmt("×", 2)])
        finally:
            reactor.stop()
    results["table"] = table(
        ["transactions", "writers", "rows/s, no trigger", "rows/s, NOTIFY triggers", "ratio"], rows
    )
    return results
