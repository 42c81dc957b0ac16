"""The fleet's recording rules (GPU-hours allocated and idle while allocated, energy; per pod and per Slurm job)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.exporter.test_rules import require_tool

PROM_DIR = Path(__file__).resolve().parents[2] / "docker" / "prometheus"
RULES = PROM_DIR / "smiquery-fleet-rules.yml"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=PROM_DIR)


def test_fleet_recording_rules_are_clean():
    done = _promtool("check", "rules", "--lint=all", "--lint-fatal", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 12 rules found" in done.stdout


def test_fleet_recording_rules_pass_their_promtool_tests():
    done = _promtool("test", "rules", "smiquery-fleet-rules.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
