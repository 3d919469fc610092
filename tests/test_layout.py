"""The house rules of the package layout, checked on the source: which package may import
which (the worker and the dispatcher never reach the operator tools or the CLI), where psycopg
errors may be caught, and how big a module or a class may grow."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "reactor"
#: Packages whose modules, and everything they import from the project, must stay clear of
#: `FORBIDDEN`.
GUARDED = ("reactor.worker", "reactor.dispatcher")
FORBIDDEN = ("reactor.ops", "reactor.cli")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
#: The only modules that catch psycopg's exceptions (everything else sees the project's).
PSYCOPG_CATCHERS = {"reactor.pg.db", "reactor.pg.migrate", "reactor.worker.inflight"}
#: The only modules that catch redis-py's exceptions: the reactor's Redis gateway (its writes,
#: its reads) and `reactor worker`, which keeps RQ's own loop alive through Redis outages.
REDIS_CATCHERS = {"reactor.rq.enqueue", "reactor.rq.state", "reactor.cli.worker"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The project modules `name` imports, at any depth of its code (lazy imports too)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in MODULES)
    return found


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_imports(name))
    return seen


def test_the_rule_sees_imports() -> None:
    # A rule that finds no import would pass for any layout.
    assert "reactor.dispatcher.loop" in _closure("reactor.cli.main")
    assert "reactor.ops.status" in _closure("reactor.cli.ops")


@pytest.mark.parametrize(
    "name", [m for m in MODULES if m.startswith(GUARDED)], ids=lambda m: m.removeprefix("reactor.")
)
def test_the_worker_and_the_dispatcher_never_import_ops_or_the_cli(name: str) -> None:
    reached = sorted(m for m in _closure(name) if m.startswith(FORBIDDEN))
    assert not reached, f"{name} reaches {reached}"


def test_importing_the_worker_side_loads_neither_metrics_nor_the_loop() -> None:
    """What an RQ worker imports to run jobs (the package, its classes, the entry point)
    loads neither Prometheus nor any part of the reactor process (but the doorbell's pure
    core, whose modes the settings name), nor the operator tools; a fresh interpreter checks."""
    probe = (
        "import sys, reactor, reactor.worker, reactor.worker.entry, reactor.worker.classes;"
        "print(sorted(m for m in sys.modules if m == 'prometheus_client'"
        " or m.startswith(('reactor.dispatcher.', 'reactor.ops', 'reactor.cli'))"
        " and m != 'reactor.dispatcher.doorbell'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _catches(tree: ast.AST, package: str) -> bool:
    """Whether the module catches (or suppresses) an exception of `package`: named through
    the package (`psycopg.Error`, `redis.RedisError`) or imported from it by name."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = ast.unparse(node.type)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("suppress"):
            caught = " ".join(ast.unparse(arg) for arg in node.args)
        else:
            continue
        names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9.]*", caught))
        if any(n.split(".")[0] == package for n in names) or names & imported:
            return True
    return False


@pytest.mark.parametrize(
    ("package", "expected"),
    [("psycopg", PSYCOPG_CATCHERS), ("redis", REDIS_CATCHERS)],
    ids=["psycopg", "redis"],
)
def test_library_errors_are_caught_only_in_their_gateway(package: str, expected: set[str]) -> None:
    catchers = {
        name
        for name, path in MODULES.items()
        if _catches(ast.parse(path.read_text(encoding="utf-8")), package)
    }
    assert catchers == expected


def test_modules_and_classes_stay_small() -> None:
    too_big = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"{name}.{node.name}: {size} lines")
    assert not too_big, too_big
