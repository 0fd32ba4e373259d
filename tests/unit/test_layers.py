"""The package's import graph, read from the source (function-level imports included, ``TYPE_CHECKING``
blocks not): no import circles in the core packages, and imports only point down the layers of
docs/architecture.md."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "horovod"
CORE = ("horovod.base", "horovod.transport", "horovod.runtime", "horovod.common")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                node.body = []
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_scan_sees_imports():
    graph = _graph()
    assert "horovod.runtime.engine" in graph["horovod.common.basics"]


def test_no_import_circles_in_the_core():
    graph = _graph()
    core = {m for m in graph if _in(m, CORE)}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph[m] & core):
            if seen.get(d) == 1:
                circles.append(path[path.index(d):] + [d])
            elif d not in seen:
                visit(d, [*path, d])
        seen[m] = 2

    for m in sorted(core):
        if m not in seen:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize("package,allowed", [
    ("horovod.base", ("horovod.base",)),
    ("horovod.transport", ("horovod.base", "horovod.transport")),
    ("horovod.runtime", ("horovod.base", "horovod.transport", "horovod.runtime")),
])
def test_lower_layers_import_only_what_is_below(package, allowed):
    """The floor, the transport and the engine never reach into the facade (horovod.common) or above."""
    graph = _graph()
    outside = {(m, d) for m, deps in graph.items() if _in(m, (package,)) for d in deps if not _in(d, allowed)}
    assert outside == set()


@pytest.mark.parametrize("package,forbidden", [
    ("horovod.transport", ("horovod.runtime", "horovod.torch", "horovod.tensorflow", "horovod.runner")),
    ("horovod.runtime", ("horovod.torch", "horovod.tensorflow", "horovod.keras", "horovod.runner")),
])
def test_imports_point_down(package, forbidden):
    graph = _graph()
    upward = {(m, d) for m, deps in graph.items() if _in(m, (package,)) for d in deps if _in(d, forbidden)}
    assert upward == set()
