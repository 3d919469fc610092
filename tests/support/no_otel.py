"""`python tests/support/no_otel.py ARGS...`: the reactor CLI with OpenTelemetry unimportable,
as if the `otel` extra were not installed. At exit it prints, on stderr, one line
`otel_modules=[...]`: the OpenTelemetry modules the process loaded (none expected)."""

from __future__ import annotations

import atexit
import importlib.abc
import json
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _report() -> None:
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] == "opentelemetry")
    print("otel_modules=" + json.dumps(loaded), file=sys.stderr)


if __name__ == "__main__":
    sys.meta_path.insert(0, _Absent())
    atexit.register(_report)
    from reactor.cli import main

    sys.argv[0] = "reactor"
    main()
