"""`make demo` ends with a plot: it installs the plot extra into the venv it runs the demo with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_make_demo_installs_the_plot_extra_before_running_the_demo(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    plan = subprocess.run(
        [make, "-n", "demo", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    plot = next(i for i, line in enumerate(plan) if "pip install" in line and "plot" in line)
    demo = next(i for i, line in enumerate(plan) if line.endswith("scripts/demo.py"))
    assert plot < demo and plan[plot].startswith(f"{venv}/bin/python")  # into the demo's own venv, first
    assert plan[demo] == f"{venv}/bin/python scripts/demo.py"


def test_the_demo_runs_twice_in_a_row_where_nvidia_smi_works(tmp_path: Path, fake_smi) -> None:
    fake = fake_smi()
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    env.pop("SMIQUERY_NVIDIA_SMI", None)
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "demo.py")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, f"run {run}: {done.stdout[-800:]}{done.stderr[-800:]}"
        assert "nvidia-smi works" in done.stdout
    assert (tmp_path / "smiquery-demo" / "live.csv").read_text().count("\n") > 1
