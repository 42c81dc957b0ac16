"""The package's shape: no import cycle (imports inside functions count), no oversized module, few private imports.

Read from the source (no import), so that a cycle hidden in a function is found before it bites at run time.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "smiquery"
MAX_LINES = 900
MAX_PRIVATE_IMPORTS = 5


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(n.lineno for n in ast.walk(node) if hasattr(n, "lineno"))
    return lines


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix, *(f"{prefix}.{a.name}" for a in node.names)]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[str] = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
                continue
            for target in _targets(name, node):
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "smiquery"):
                    edges[name].add(target)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smiquery"):
                private += [f"{name} <- {node.module}.{a.name}" for a in node.names if _private(a.name)]
    return edges, private


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_package():
    edges, _ = _graph()
    assert "smiquery.errors" in MODULES and "smiquery.streams.engine" in MODULES
    assert "smiquery.errors" in edges["smiquery.runner"]


def test_no_import_cycle_between_modules():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_a_cycle_hidden_in_a_function_is_found():
    edges = {"a": {"b"}, "b": {"a"}}
    assert _cycles(edges) == [["a", "b"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_oversized(module: str):
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines"


def test_few_private_names_cross_modules():
    _, private = _graph()
    assert len(private) <= MAX_PRIVATE_IMPORTS, "\n".join(private)


def test_no_module_is_named_after_a_standard_library_module():
    """``smiquery.inspect`` once shadowed ``inspect`` for star-importers and confused tracebacks: never again."""
    clashes = [m for m in MODULES if m != "smiquery" and m.rpartition(".")[2] in sys.stdlib_module_names]
    assert clashes == []
