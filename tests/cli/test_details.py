"""`smiquery inspect`, as users run it: the summary, JSON, a saved file, and one-line errors with exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from smiquery.testing import InProcessRunner, fake_nvidia_smi
from tests.cli.test_cli import run

FIXTURE = Path(__file__).parents[1] / "fixtures" / "details-2gpu-mig.xml"


def test_summary_shows_mig_instances_and_health():
    done = run("inspect", runner=InProcessRunner(env={"SMIQUERY_FAKE_XML": str(FIXTURE)}))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "GPU 0  NVIDIA A100-SXM4-80GB  GPU-11111111-2222-3333-4444-555555555555  00000000:07:00.0" in out
    assert "event reasons: sw_power_cap, hw_thermal_slowdown" in out
    assert "remapped   2 correctable, 1 uncorrectable, pending yes, failed no" in out
    assert "MIG        Enabled, 2 instance(s)" in out
    assert "    MIG 1  1g.10gb  MIG-" in out and "14 SMs  13 MiB used of 9,728 MiB" in out
    assert "pid 4242  C  1,150 MiB  python train.py" in out
    assert "memory     ? used of 81,920 MiB" in out  # N/A shown as unknown, never 0


def test_json_has_every_value_and_null_with_a_reason():
    done = run(
        "inspect", "--format", "json", "--gpus", "1", runner=InProcessRunner(env={"SMIQUERY_FAKE_XML": str(FIXTURE)})
    )
    assert done.returncode == 0, done.stderr
    (gpu,) = json.loads(done.stdout)
    assert gpu["uuid"] == "GPU-66666666-7777-8888-9999-000000000000"
    assert gpu["memory_used"] is None and gpu["missing"]["memory_used"] == "not_available"
    assert gpu["retired_pages"] == {"single_bit": 0, "double_bit": 1, "pending": True, "missing": {}}


def test_a_saved_file_needs_no_nvidia_smi(tmp_path):
    done = run("inspect", "--xml", FIXTURE, runner=InProcessRunner(fault="driver-not-loaded"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\nGPU ") + done.stdout.startswith("GPU ") == 2


def test_errors_are_one_line_with_their_exit_code(tmp_path):
    done = run("inspect", runner=InProcessRunner(fault="driver-not-loaded"))
    assert done.returncode == 4
    assert done.stderr.count("\n") == 1 and "driver" in done.stderr
    bad = tmp_path / "bad.xml"
    bad.write_text("<nvidia_smi_log><gpu>")
    done = run("inspect", "--xml", bad)
    assert done.returncode == 1 and "not well-formed" in done.stderr and done.stderr.count("\n") == 1
    done = run("inspect", "--xml", tmp_path / "nope.xml")
    assert done.returncode == 1 and "cannot read" in done.stderr
    done = run("inspect", "--gpus", "zero")
    assert done.returncode == 2


def test_the_real_process_against_the_fake_executable(tmp_path):
    smi = fake_nvidia_smi(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "SMIQUERY_FAKE_XML": str(FIXTURE), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "smiquery", "--nvidia-smi", str(smi), "inspect", "--format", "json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gpus = json.loads(done.stdout)
    assert [d["profile"] for d in gpus[0]["mig_devices"]] == ["3g.40gb", "1g.10gb"]
