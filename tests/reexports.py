"""A module inside a test's handler allow-list that imports a function defined outside it
(`tests.planted.run`, standing for `os.system`), as an application module may `from os import
system`: the path `tests.reexports.run` lies inside the allow-list, the function does not."""

from __future__ import annotations

from tests.planted import run

__all__ = ["run"]
