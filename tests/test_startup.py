"""Start-up: `import smiquery`, the fake nvidia-smi and `smiquery query` import only what they use.

What a process imported is read from the interpreter itself (``PYTHONPROFILEIMPORTTIME``: one stderr line per
module), in a fresh process each time: this test process has long since imported everything. The times themselves
are measured by scripts/bench_start.py, never here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import smiquery
from smiquery.testing import InProcessRunner
from tests.conftest import MakeFake

ROOT = Path(__file__).resolve().parent.parent
# what `import smiquery` and a fake nvidia-smi call must leave alone: the heavy or the process-running modules
HEAVY = ("pandas", "numpy", "typer", "click", "rich", "tenacity", "subprocess", "logging", "json", "asyncio")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=120, check=False)


def _imported(argv: list[str], **env: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``argv`` (a Python program) and return its result and every module it imported."""
    done = _run(argv, PYTHONPROFILEIMPORTTIME="1", **env)
    modules = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                modules.add(name)
    assert "site" in modules, f"no import report: {done.stderr[-400:]}"
    return done, modules


def test_import_smiquery_loads_only_the_errors() -> None:
    done, modules = _imported([sys.executable, "-c", "import smiquery"])
    assert done.returncode == 0, done.stderr[-400:]
    assert {m for m in modules if m.startswith("smiquery")} == {"smiquery", "smiquery.errors"}
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_errors_are_catchable_after_a_plain_import() -> None:
    code = (
        "import smiquery\n"
        "try:\n    raise smiquery.errors.NvidiaSmiNotFoundError()\n"
        "except smiquery.SmiqueryError as exc:\n    print(type(exc).__name__)\n"
    )
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.split() == ["NvidiaSmiNotFoundError"]


def test_fake_query_imports_neither_pandas_nor_the_runner(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    argv = [sys.executable, str(exe), "--query-gpu=index,name,power.draw", "--format=csv,noheader"]
    done, modules = _imported(argv)
    assert done.returncode == 0, done.stderr[-400:]
    assert len(done.stdout.splitlines()) == 8  # the bundled demo: 8 GPUs
    assert "smiquery.testing" in modules
    assert not {"smiquery.runner", "smiquery.sources.query_gpu", "smiquery.streams.sync"} & modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_fake_logs_its_calls_all_the_same(fake_smi: MakeFake, tmp_path: Path) -> None:
    # json is imported only when a log is asked for; the log still gets its line
    log = tmp_path / "calls.jsonl"
    exe = fake_smi(log=log)
    done = _run([str(exe), "--query-gpu=index", "--format=csv,noheader"])
    assert done.returncode == 0, done.stderr[-400:]
    assert '"argv": ["--query-gpu=index", "--format=csv,noheader"]' in log.read_text(encoding="utf-8")


def test_smiquery_query_imports_no_typer_and_no_pandas(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    argv = [sys.executable, "-m", "smiquery", "--nvidia-smi", str(exe), "query", "--format", "csv"]
    done, modules = _imported(argv)
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.count("\n") == 9  # header and 8 GPUs
    assert not {"typer", "click", "rich", "pandas"} & modules


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("GpuSample", "sample"),
        ("RetryPolicy", "retry"),
        ("Stream", "streams.sync"),
        ("stream", "streams.sync"),
        ("query", "sources.query_gpu"),
        ("query_df", "sources.query_gpu"),
        ("get_gpu_status", "sources.query_gpu"),
        ("processes", "sources.apps"),
        ("read_csv", "recordings"),
        ("replay", "recordings"),
    ],
)
def test_lazy_names_resolve_to_their_modules_objects(name: str, module: str) -> None:
    code = f"import importlib, smiquery; print(smiquery.{name} is importlib.import_module('smiquery.{module}').{name})"
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.split() == ["True"]


def test_submodules_resolve_after_a_plain_import() -> None:
    names = ["fields", "sources", "sample", "runner", "source", "streams", "aio", "compat"]
    code = f"import smiquery; print(*(getattr(smiquery, n).__name__ for n in {names!r}))"
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.split() == [f"smiquery.{n}" for n in names]


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        getattr(smiquery, "no_such_thing")  # noqa: B009


def test_star_import_and_dir_cover_all() -> None:
    code = (
        "from smiquery import *\n"
        "import smiquery\n"
        "missing = [n for n in smiquery.__all__ if n not in globals()]\n"
        "print('missing', *missing)\n"
        "print('dir', *sorted(set(smiquery.__all__) - set(dir(smiquery))))\n"
    )
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.splitlines() == ["missing", "dir"]


def test_dir_lists_the_lazy_names_before_they_are_used() -> None:
    code = "import smiquery; print(*sorted({'Stream', 'read_csv', 'aio', 'fields'} - set(dir(smiquery))))"
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stdout.strip() == ""


@pytest.mark.parametrize(
    "module", ["smiquery.streams.sync", "smiquery.source", "smiquery.alerts.notify", "smiquery.exporter"]
)
def test_library_logging_stays_quiet_without_logging_configured(module: str) -> None:
    # without the package's NullHandler, Python's last-resort handler would print these on stderr
    code = (
        f"import logging, {module}\n"
        "logging.getLogger('smiquery').warning('should not be printed')\n"
        "logging.getLogger('smiquery.exporter').error('nor this')\n"
    )
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-400:]
    assert done.stderr == ""


def _recording(tmp_path: Path, sweeps: int) -> Path:
    lines = ["timestamp, index, power.draw [W]"]
    for s in range(sweeps):
        lines += [f"2024/05/21 10:00:0{s}.000, {i}, {10 * s + i}.00 W" for i in range(2)]
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_fake_loop_wraps_around_a_short_recording(tmp_path: Path) -> None:
    # the recording is read only as far as it is replayed: the end of it still brings the first sweep back
    with InProcessRunner(recording=_recording(tmp_path, 3)) as runner:
        src = runner.lines(["nvidia-smi", "--query-gpu=index,power.draw", "--format=csv,noheader,nounits", "-lms", "1"])
        try:
            got = [src.readline(30.0) for _ in range(14)]
        finally:
            src.close()
    assert got == [f"{i}, {10 * (s % 3) + i}.00" for s in range(7) for i in range(2)]


def test_fake_one_shot_sweep_choice_wraps_modulo_the_count(tmp_path: Path) -> None:
    with InProcessRunner(recording=_recording(tmp_path, 3), env={"SMIQUERY_FAKE_SWEEP": "4"}) as runner:
        done = runner.run(["nvidia-smi", "--query-gpu=index,power.draw", "--format=csv,noheader,nounits"], 30.0)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == ["0, 10.00", "1, 11.00"]
