"""Reading a reactor's Prometheus metrics and health over HTTP."""

from __future__ import annotations

import re
import urllib.error
import urllib.request


def metric(text: str, name: str, default: float | None = None) -> float:
    """One sample of a Prometheus text exposition: `name` with its labels as exposed
    (`reactor_pruned_total{state="done"}`).

    A series that is not in the text fails the test (a renamed metric or a misspelt name must
    not read as 0), unless `default` is given: a labelled series appears only with its first
    sample, so a test that reads one which may not exist yet says what absence means.
    """
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+|[+-]Inf|NaN)$", text, re.M)
    if match:
        return float(match.group(1))
    if default is not None:
        return default
    raise AssertionError(f"no series {name} in the metrics:\n{text[-3000:]}")


def scrape(port: int) -> str:
    """The /metrics text of a reactor serving on 127.0.0.1:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def health(port: int) -> tuple[int, str]:
    """The status code and body of /healthz on 127.0.0.1:`port` (503 included)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
