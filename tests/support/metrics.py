"""Reading a reactor's Prometheus metrics over HTTP."""

from __future__ import annotations

import re
import urllib.request


def metric(text: str, name: str) -> float:
    """One sample of a Prometheus text exposition (0 if absent)."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def scrape(port: int) -> str:
    """The /metrics text of a reactor serving on 127.0.0.1:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())
