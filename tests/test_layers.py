"""The import contract: the package's layers, lowest first. A module imports only from its own layer or lower ones.

Read from the source, with imports inside functions AND under ``TYPE_CHECKING`` counted: a type-only arrow that runs
upward ties a lower layer to a higher one as surely as a run-time import does. The package root (``smiquery``) is the
facade and may import anything; ``from smiquery import __version__`` is no arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "smiquery"

#: Lowest first. Each entry is a module or a package (prefix); modules of one entry may import each other.
#: Consumers (from ``recordings`` on) are ordered too: one may import an earlier consumer, never a later one.
LAYERS: list[tuple[str, ...]] = [
    ("smiquery._log", "smiquery.errors", "smiquery.printable"),
    ("smiquery.sample", "smiquery.clock"),
    ("smiquery.kinds",),
    ("smiquery.fields",),
    ("smiquery.frames",),
    ("smiquery.retry", "smiquery.source"),
    ("smiquery.runner",),
    ("smiquery.streams.argv", "smiquery.streams.engine"),
    ("smiquery.sources.latest",),
    ("smiquery.sources.query_gpu",),
    ("smiquery.streams.sweeps",),
    ("smiquery.sources.apps",),
    ("smiquery.sources.pmon", "smiquery.sources.details"),
    ("smiquery.sources.xid",),
    ("smiquery.sources",),
    ("smiquery.streams",),
    ("smiquery.aio",),
    ("smiquery.recordings",),
    ("smiquery.alerts",),
    ("smiquery.analysis",),
    ("smiquery.fleet",),
    ("smiquery.httpd",),
    ("smiquery.attribution",),
    ("smiquery.exporter",),
    ("smiquery.training",),
    ("smiquery.compat",),
    ("smiquery.doctor",),
    ("smiquery.testing",),
    ("smiquery.cli",),
    ("smiquery.__main__",),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int | None:
    """The index of the most specific entry of :data:`LAYERS` that holds ``module``."""
    best: tuple[int, int] | None = None  # (length of the matched name, layer)
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


def _imports(module: str, tree: ast.AST) -> set[str]:
    """Every smiquery module ``module`` imports, anywhere in its source (functions and TYPE_CHECKING included)."""
    is_package = MODULES[module].name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name not in ("smiquery", module):
                found.add(name)
    return found


def upward_imports() -> list[str]:
    """``importer -> imported`` for every import that runs up the layers (or into a module no layer holds)."""
    wrong = []
    for module, path in sorted(MODULES.items()):
        if module == "smiquery":
            continue
        mine = layer_of(module)
        for target in sorted(_imports(module, ast.parse(path.read_text(encoding="utf-8")))):
            theirs = layer_of(target)
            if mine is None or theirs is None or theirs > mine:
                wrong.append(f"{module} (layer {mine}) -> {target} (layer {theirs})")
    return wrong


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "smiquery" and layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    assert upward_imports() == []


def test_the_contract_sees_type_only_and_function_level_imports(tmp_path: Path):
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from smiquery.cli import app\n"
    source += "def f():\n    from smiquery.exporter import server\n"
    found = _imports("smiquery.errors", ast.parse(source))
    assert {"smiquery.cli", "smiquery.exporter.server"} <= found


@pytest.mark.parametrize(
    ("module", "lower", "higher"),
    [
        ("smiquery.sources.xid", "smiquery.sample", "smiquery.exporter"),
        ("smiquery.exporter", "smiquery.httpd", "smiquery.cli"),
    ],
)
def test_layers_are_ordered(module: str, lower: str, higher: str):
    assert layer_of(lower) < layer_of(module) < layer_of(higher)  # type: ignore[operator]
