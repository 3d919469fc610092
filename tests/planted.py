"""A handler the tests plant in a tampered route, standing for `os.system`: importing this
module, or calling its handler, leaves a file in the directory named by PLANTED_TRACE_DIR, so a
test can tell that a worker imported or ran what it must not."""

from __future__ import annotations

import os
from pathlib import Path

_TRACE_DIR = os.environ.get("PLANTED_TRACE_DIR")
if _TRACE_DIR:
    (Path(_TRACE_DIR) / f"imported-{os.getpid()}").touch()


def run(photo_id: str) -> None:
    if _TRACE_DIR:
        (Path(_TRACE_DIR) / f"ran-{photo_id}").touch()
