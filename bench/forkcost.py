"""The price of one fork with the OpenTelemetry SDK loaded: what a forking worker's work horse
pays per job before the job starts.

Each configuration runs in a fresh interpreter that imports what a worker has loaded (rq,
redis, psycopg, the reactor's worker), sets up the SDK as the configuration says, then forks a
child that exits at once, `FORKS` times, and reports the median fork → reaped time. The
configurations alternate over the rounds; the table shows the median of the rounds' medians
and their spread. Needs the `[otel]` extra and opentelemetry-sdk (`pip install -e '.[test]'`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from bench.common import Stat, table

FORKS = 300

_PROVIDER = "from opentelemetry.sdk.trace import TracerProvider\nprovider = TracerProvider()"
_BATCH = (
    "import os\nfrom opentelemetry.sdk.trace import TracerProvider\n"
    "from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter\n"
    "provider = TracerProvider()\nprovider.add_span_processor("
    "BatchSpanProcessor(ConsoleSpanExporter(out=open(os.devnull, 'w'))))"
)
# The set-up `opentelemetry-instrument` makes with the tracing benchmark's settings: spans to
# the console (here /dev/null), no metrics or logs exported; the SDK still makes all three
# providers.
_INSTRUMENT = (
    "import os\nos.environ.update(OTEL_TRACES_EXPORTER='console', OTEL_METRICS_EXPORTER='none',"
    " OTEL_LOGS_EXPORTER='none')\nimport sys\nsys.stdout = open(os.devnull, 'w')\n"
    "from opentelemetry.instrumentation.auto_instrumentation import initialize\ninitialize()\n"
    "sys.stdout = sys.__stdout__"
)

#: Name → (the set-up each interpreter runs before it forks, what each child does before it
#: exits).
CONFIGURATIONS: dict[str, tuple[str, str]] = {
    "no SDK (the API's no-ops)": ("", ""),
    "SDK imported, no provider": ("import opentelemetry.sdk.trace", ""),
    "a TracerProvider": (_PROVIDER, ""),
    "a TracerProvider, its at-fork hooks not registered": (
        "import os\nregister, os.register_at_fork = os.register_at_fork, lambda **_: None\n"
        + _PROVIDER
        + "\nos.register_at_fork = register",
        "",
    ),
    "a TracerProvider with a BatchSpanProcessor": (_BATCH, ""),
    "the same, and the child exports one span": (
        _BATCH,
        "with provider.get_tracer('bench').start_as_current_span('process photo.process'):\n"
        "    pass\nprovider.force_flush()",
    ),
    "as `opentelemetry-instrument` sets it up (tracer, meter and logger providers)": (
        _INSTRUMENT,
        "",
    ),
    "the same, their at-fork hooks not registered": (
        "import os\nregister, os.register_at_fork = os.register_at_fork, lambda **_: None\n"
        + _INSTRUMENT
        + "\nos.register_at_fork = register",
        "",
    ),
}

_CHILD = """
import json, os, statistics, time
import psycopg, redis, rq
import reactor.worker
{setup}
times = []
for _ in range({forks}):
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
{child}
        os._exit(0)
    os.waitpid(pid, 0)
    times.append(time.perf_counter() - started)
print(json.dumps(statistics.median(times)))
"""


def _median_fork_seconds(setup: str, child: str) -> float:
    code = _CHILD.format(setup=setup, forks=FORKS, child=textwrap.indent(child or "pass", " " * 8))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def run(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 7
    values: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for round_ in range(rounds):
        names = list(CONFIGURATIONS)
        for name in names if round_ % 2 == 0 else reversed(names):
            values[name].append(_median_fork_seconds(*CONFIGURATIONS[name]) * 1000)
    stats = {name: Stat.of(v) for name, v in values.items()}
    base = stats["no SDK (the API's no-ops)"].median
    return {
        "forks_per_round": FORKS,
        "rounds": rounds,
        "fork_ms": {name: stat.as_dict() for name, stat in stats.items()},
        "table": table(
            ["in the worker before the fork", "fork → child reaped, ms", "over no SDK"],
            [
                [name, stat.fmt(" ms", 2), f"{stat.median - base:+.2f} ms"]
                for name, stat in stats.items()
            ],
        ),
    }
