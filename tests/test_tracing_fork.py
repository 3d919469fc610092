"""A fork while the batch span processor exports: the forking worker holds exports across its
fork, and a work horse's flush of its spans is bounded, so a lock the parent's exporting
thread held at the fork never hangs the horse (a real SDK, a real fork, in a child program:
`tests.support.fork_exports`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.paths import ROOT


def _fork_while_exporting(mode: str, tmp_path: Path) -> tuple[dict[str, Any], list[str], str]:
    spans = tmp_path / "spans"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.fork_exports", mode, str(spans)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    names = spans.read_text(encoding="utf-8").splitlines() if spans.exists() else []
    return json.loads(done.stdout), names, done.stderr


def test_a_fork_waits_for_the_export_in_progress_and_the_child_exports(tmp_path: Path) -> None:
    child, names, stderr = _fork_while_exporting("held", tmp_path)
    assert child["exited"] and child["status"] == 0, (child, stderr)
    # The fork waited for the 0.3 s export, then the child exported in about as long.
    assert child["seconds"] < 1.0, child
    assert sorted(names) == ["in the child", "in the parent"], names
    assert "spans_not_flushed" not in stderr


def test_a_child_that_finds_the_exporter_locked_gives_its_spans_up_in_time(
    tmp_path: Path,
) -> None:
    child, names, stderr = _fork_while_exporting("bare", tmp_path)
    # Without the bound the child waits forever on the lock its parent's thread held.
    assert child["exited"] and child["status"] == 0, (child, stderr)
    assert 1.0 <= child["seconds"] < 5.0, child
    assert names == ["in the parent"], names
    assert "spans_not_flushed within=1s" in stderr, stderr
