"""Where the checkout is: the working directory and import root of every child process."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (holds `reactor/`, `sql/`, `tests/`).
ROOT = Path(__file__).resolve().parent.parent.parent
