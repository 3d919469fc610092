"""`python -m bench [all|latency|drain|sweep|writers|memory|scaleout|operator|workers|dashboard|
tracing|fork|counts|hot|pressure|history ...] [--quick] [--minutes M] [--before]`.

Runs the chosen benchmarks against real servers (see bench.common), prints each table, and
writes bench/results/latest.json and bench/results/latest.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench import (
    big_counts,
    dashboard,
    drain,
    forkcost,
    heap_only,
    history,
    latency,
    memory,
    operator_features,
    pressure,
    scaleout,
    sweep_cost,
    tracing,
    workers,
    writers,
)
from bench.common import ROOT

SUITES: dict[str, tuple[str, Callable[[bool], dict[str, Any]]]] = {
    "latency": ("Dispatch latency", latency.run),
    "drain": ("Backlog drain", drain.run),
    "sweep": ("Sweep cost vs history", sweep_cost.run),
    "writers": ("Writer cost of the NOTIFY triggers", writers.run),
    "memory": ("Reactor memory", memory.run),
    "scaleout": ("Scale-out", scaleout.run),
    "operator": ("Operator features: pause check and retention", operator_features.run),
    "workers": ("Workers end to end", workers.run),
    "dashboard": ("Dashboard on a big table", dashboard.run),
    "tracing": ("Tracing's cost end to end", tracing.run),
    "fork": ("A work horse's fork with the OpenTelemetry SDK loaded", forkcost.run),
    "counts": ("Operator counts on a big table", big_counts.run),
    "hot": ("Heap-only updates of the lifecycle", heap_only.run),
    "pressure": ("Claims under a held snapshot", pressure.run),
    "history": ("Retention: deleting rows against dropping a month of history", history.run),
}


def _commit() -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes outside bench/results
    (which this command writes itself; figures are quoted with the commit they ran on)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "-uno", "--", ".", ":!bench/results")
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    # The default is one choice, not a list: argparse checks it against `choices` as one value.
    parser.add_argument("suites", nargs="*", default="all", choices=["all", *SUITES])
    parser.add_argument("--quick", action="store_true", help="small sizes, ~1-2 minutes")
    parser.add_argument("--minutes", type=float, help="pressure: minutes per side (10)")
    parser.add_argument(
        "--before", action="store_true", help="pressure: also the claim over the whole range"
    )
    options = parser.parse_args()
    if isinstance(options.suites, str):
        options.suites = [options.suites]
    pressure.MINUTES, pressure.BEFORE = options.minutes, options.before
    chosen = list(SUITES) if "all" in options.suites else options.suites
    flags = [
        *(["--quick"] if options.quick else []),
        *([f"--minutes {options.minutes:g}"] if options.minutes is not None else []),
        *(["--before"] if options.before else []),
    ]
    command = " ".join(["python -m bench", *options.suites, *flags])
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    latest = out / "latest.json"
    # Each suite's entry is replaced when it runs again; the others are kept, each with the
    # command and time that produced it. Written after every suite, so a crash loses nothing.
    previous: dict[str, Any] = json.loads(latest.read_text()) if latest.exists() else {}
    results = {k: v for k, v in previous.items() if isinstance(v, dict) and "command" in v}
    for name in chosen:
        title, run = SUITES[name]
        started = time.monotonic()
        result = run(options.quick)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["command"] = command
        result["when"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        result["machine"] = f"{platform.machine()}, Python {platform.python_version()}"
        result["commit"] = _commit()
        results[name] = result
        print(f"### {title}\n\n{result['table']}\n", flush=True)
        latest.write_text(json.dumps(results, indent=2, default=str) + "\n")
        markdown = [
            f"### {SUITES[key][0]}\n\n`{results[key]['command']}` ({results[key]['when']}, "
            f"commit {results[key].get('commit', 'unknown')})\n\n"
            f"{results[key]['table']}\n"
            for key in SUITES
            if key in results
        ]
        (out / "latest.md").write_text("\n".join(markdown))


main()
