"""README's metrics table names every series the reactor's `/metrics` exposes, and nothing it
does not (the `_created` series prometheus-client adds to counters and histograms aside)."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from reactor.dispatcher.metrics import Metrics
from tests.support.paths import ROOT


def _readme_metrics() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("| about | metrics |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(reactor_[a-z_]+)", table))


def _exposed() -> set[str]:
    text = generate_latest(Metrics().registry).decode()
    names = re.findall(r"^# TYPE (\S+) \S+$", text, flags=re.MULTILINE)
    return {name for name in names if not name.endswith("_created")}


def test_the_readme_table_names_every_metric_and_only_those() -> None:
    listed, exposed = _readme_metrics(), _exposed()
    assert len(exposed) > 20  # the parse found the registry's series
    assert exposed - listed == set(), "exposed but not in README's table"
    assert listed - exposed == set(), "in README's table but not exposed"
