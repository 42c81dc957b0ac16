"""The public surface: `__all__` is the task API, documented; no name shadows a module; one exception tree."""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import smiquery
from smiquery import errors

PACKAGE = Path(smiquery.__file__).parent
README = PACKAGE.parent / "README.md"
#: the docs page whose table says where each task's names live (the README's Architecture section moved there)
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
#: The README's tasks, each by its own name: one snapshot, a stream, recordings, processes, details, a status dict.
TASK_API = {
    "GpuSample",
    "RetryPolicy",
    "SmiqueryError",
    "Stream",
    "__version__",
    "details",
    "get_gpu_status",
    "processes",
    "query",
    "query_df",
    "read_csv",
    "replay",
    "stream",
}


def _isort_key(name: str) -> tuple[int, str]:
    # isort-style, as ruff sorts __all__: CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _public_names(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)  # submodules appear as attributes once imported
        and value is not __future__.annotations
    }


def test_all_is_the_task_api():
    assert set(smiquery.__all__) == TASK_API


def test_all_names_resolve_and_are_sorted():
    for name in smiquery.__all__:
        assert getattr(smiquery, name) is not None, name
    assert list(smiquery.__all__) == sorted(smiquery.__all__, key=_isort_key)
    assert len(set(smiquery.__all__)) == len(smiquery.__all__)


def test_all_is_exactly_the_public_names():
    for name in smiquery.__all__:
        getattr(smiquery, name)  # resolves the lazy names too, so they join the module's namespace
    assert _public_names(smiquery) | {"__version__"} == set(smiquery.__all__)


def test_adoption_modules_need_no_import_of_their_own():
    # `import smiquery` then `smiquery.aio.query(...)`: the submodule loads on first use, in a fresh interpreter
    code = "import sys, smiquery; assert 'smiquery.aio' not in sys.modules; print(smiquery.aio.query.__module__,"
    code += " smiquery.compat.GPUtil.getGPUs.__module__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["smiquery.aio", "smiquery.compat.GPUtil"]


def _submodule_names(package: ModuleType) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(package.__path__)}


def _packages() -> list[ModuleType]:
    found = [smiquery]
    for info in pkgutil.walk_packages(smiquery.__path__, prefix="smiquery."):
        if info.ispkg:
            found.append(importlib.import_module(info.name))
    return found


def test_no_public_name_is_also_a_submodule():
    # `import smiquery.x` sets the attribute `x` on the package: a public `x` would then depend on import order
    for package in _packages():
        children = _submodule_names(package)
        public = set(getattr(package, "__all__", ())) | _public_names(package)
        # a name that IS the submodule (`from smiquery.compat import GPUtil`) cannot change with import order
        clashes = {
            n
            for n in public & children
            if getattr(package, n, None) is not importlib.import_module(f"{package.__name__}.{n}")
        }
        assert not clashes, f"{package.__name__} exports names of its own submodules: {clashes}"
    assert {"errors", "fields", "sample", "sources", "recordings"} <= _submodule_names(smiquery)


def _exception_classes_by_module() -> dict[str, set[str]]:
    """Module path -> its public exception classes, found in the source (no import, so no optional deps)."""
    bases: dict[str, set[str]] = {}
    where: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
                where.setdefault(module, set()).add(node.name)

    def builtin_exception(name: str) -> bool:
        obj = getattr(builtins, name, None)
        return isinstance(obj, type) and issubclass(obj, BaseException)

    exceptions = {n for n, b in bases.items() if any(builtin_exception(x) for x in b)}
    grew = True
    while grew:
        more = {n for n, b in bases.items() if b & exceptions} - exceptions
        exceptions |= more
        grew = bool(more)
    # a private package (smiquery.testing._emulator) is no public surface: its exceptions never reach a caller
    public = {m: names for m, names in where.items() if not any(p.startswith("_") for p in m.split(".")[1:-1])}
    return {m: {n for n in names if n in exceptions and not n.startswith("_")} for m, names in public.items()}


def test_every_exception_class_is_defined_in_errors():
    found = _exception_classes_by_module()
    assert {"SmiqueryError", "NvidiaSmiFailedError", "GpuLostError"} <= found["smiquery.errors"], "scan is broken"
    elsewhere = {m: sorted(n) for m, n in found.items() if n and m != "smiquery.errors"}
    assert not elsewhere, f"exception classes outside smiquery/errors.py: {elsewhere}"


def test_each_error_carries_the_documented_exit_code():
    """The exit codes of `smiquery --help`: 2 usage, 3 nvidia-smi missing, 4 driver, 5 timeout, 1 anything else."""
    from smiquery.cli._boundary import exit_code_for

    documented = {
        2: {"InvalidFieldError", "InvalidGpuIdError", "InvalidRuleError", "InvalidTimeZoneError", "UsageError"},
        3: {"NvidiaSmiNotFoundError"},
        4: {
            "DriverNotLoadedError",
            "NvmlNotFoundError",
            "DriverVersionMismatchError",
            "NoDevicesFoundError",
            "GpuLostError",
            "InsufficientPermissionsError",
        },
        5: {"NvidiaSmiTimeoutError"},
    }
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.SmiqueryError)]
    assert len(classes) > 30, "scan is broken"
    for cls in classes:
        want = next((code for code, names in documented.items() if cls.__name__ in names), 1)
        assert cls.exit_status == want, cls.__name__
        assert exit_code_for(cls.__new__(cls)) == want, cls.__name__
    assert exit_code_for(KeyboardInterrupt()) == 130 and exit_code_for(RuntimeError()) == 1


def test_the_error_tree_is_reachable_through_smiquery_errors():
    tree = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == "smiquery.errors"
    }
    public_tree = {n for n in tree if not n.startswith("_")}
    assert public_tree == _exception_classes_by_module()["smiquery.errors"]
    assert public_tree <= set(errors.__all__)
    assert public_tree & set(smiquery.__all__) == {"SmiqueryError"}  # the root of the tree; the rest by its home
    assert smiquery.SmiqueryError is errors.SmiqueryError
    assert all(issubclass(getattr(errors, n), (errors.SmiqueryError, Warning)) for n in public_tree)
    assert issubclass(errors.PortInUseError, errors.ListenError)
    assert issubclass(errors.ReportError, ValueError) and issubclass(errors.ReportError, errors.SmiqueryError)
    # `import smiquery` alone makes every error reachable (smiquery.errors is its one eager import)
    code = "import smiquery; print(*sorted(n for n in smiquery.errors.__all__ if hasattr(smiquery.errors, n)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(done.stdout.split()) == set(errors.__all__) >= public_tree


def test_exceptions_have_one_home():
    tree = {n for n, o in vars(errors).items() if isinstance(o, type) and issubclass(o, BaseException)}
    listed = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        if module in ("smiquery.errors", "smiquery.__init__"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names = {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
                if names & tree:
                    listed[module] = sorted(names & tree)
    assert listed == {}  # import them from smiquery or smiquery.errors


def test_import_does_not_pull_optional_or_heavy_modules():
    code = (
        "import sys, smiquery\n"
        "heavy = [m for m in ('pandas', 'pyarrow', 'prometheus_client', 'keras', 'tensorflow', 'matplotlib')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_recordings_names_have_one_home():
    # the recordings package owns reading and writing; frames only converts, playback only paces
    from smiquery import frames, recordings
    from smiquery.recordings import playback

    assert smiquery.read_csv.__module__ == "smiquery.recordings.csvfile"
    assert smiquery.read_csv is recordings.read_csv
    assert recordings.to_dataframe is frames.to_dataframe
    assert smiquery.replay is playback.replay
    assert not hasattr(frames, "read_csv")
    assert playback.__all__ == ["MAX_GAP_SECONDS", "Replay", "replay"]


def test_every_name_is_documented():
    architecture = ARCHITECTURE.read_text(encoding="utf-8")
    for name in smiquery.__all__:
        if name != "__version__":
            assert (getattr(smiquery, name).__doc__ or "").strip(), f"{name} has no docstring"
        assert f"`{name}`" in architecture, f"docs/architecture.md never names `{name}`"
    # the Architecture page's table says where each task's names live
    table = architecture[architecture.index("| task |") :]
    assert all(f"`{name}`" in table for name in smiquery.__all__ if name != "__version__")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_every_readme_task_needs_at_most_four_import_paths():
    pages = [README, *sorted((PACKAGE.parent / "docs").glob("*.md"))]
    for block in (b for page in pages for b in _python_blocks(page.read_text(encoding="utf-8"))):
        paths = set()
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Import):
                paths |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                paths.add(node.module)
        assert len(paths) <= 4, sorted(paths)
