"""The alert rules and the Grafana dashboard: promtool checks and unit tests, and static checks of both.

promtool comes from Debian's ``prometheus`` package; ``scripts/install-prometheus`` installs it when missing (as
root). Without it these tests skip on a laptop, and fail under ``CI=true``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from smiquery.exporter import HEALTH_METRICS, metric_specs

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "docker" / "prometheus"
RULES = PROM_DIR / "smiquery-rules.yml"
RULES_TEST = PROM_DIR / "smiquery-rules.test.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "smiquery-dashboard.json"


@functools.cache
def _install_attempt() -> str:
    script = ROOT / "scripts" / "install-prometheus"
    if os.geteuid() != 0:
        return "not root, so scripts/install-prometheus could not install it"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=600)
    return (done.stdout + done.stderr).strip()


def require_tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``; installs Debian's package once when missing.

    Skips when it is still missing, except under ``CI=true``, where that fails the test.
    """
    path = shutil.which(name)
    if path is None:
        note = _install_attempt()
        path = shutil.which(name)
        if path is None:
            why = f"{name} is not installed ({note})"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{why}; CI must run the Prometheus checks")
            pytest.skip(why)
    return path


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def exported_names() -> set[str]:
    names = {s.sample for s in metric_specs("all")}
    return names | set(HEALTH_METRICS)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


# ------------------------------------------------------------------------------------------------ promtool


def test_promtool_check_rules_is_clean():
    done = promtool("check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in done.stdout
    assert "WARNING" not in done.stdout + done.stderr


def test_promtool_unit_tests_pass():
    done = promtool("test", "rules", str(RULES_TEST))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_example_prometheus_config_is_valid():
    done = promtool("check", "config", str(PROM_DIR / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------------------------- rules, statically


def test_unit_tests_make_every_alert_fire_and_not_fire():
    tests = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))["tests"]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {r["alert"] for r in load_rules()}
    assert alerts - fires == set(), "alerts never made to fire"
    assert alerts - silent == set(), "alerts never checked to stay quiet"


def test_the_issue_alerts_exist_with_their_thresholds():
    rules = {r["alert"]: r for r in load_rules()}
    high, crit = rules["GpuTemperatureHigh"], rules["GpuTemperatureCritical"]
    assert "> 80" in high["expr"] and high["for"] == "5m" and high["labels"]["severity"] == "warning"
    assert "> 85" in crit["expr"] and ">= 3" in crit["expr"] and crit["labels"]["severity"] == "critical"
    stalled = rules["GpuStalledPipeline"]
    assert "< 0.2" in stalled["expr"] and "smiquery_memory_used_bytes" in stalled["expr"]
    assert "hw_thermal_slowdown" in rules["GpuThermalThrottling"]["expr"]
    assert "power_brake" in rules["GpuPowerBrakeThrottling"]["expr"]
    assert "smiquery_gpu_lost" in rules["GpuLost"]["expr"]
    assert "smiquery_up == 0" in rules["SmiqueryDataStale"]["expr"]
    assert rules["SmiqueryExporterDown"]["expr"].startswith("up{")
    assert "increase(smiquery_ecc_errors_uncorrected" in rules["GpuEccUncorrectedErrors"]["expr"]
    assert "increase(smiquery_ecc_errors_corrected" in rules["GpuEccCorrectedErrorsGrowing"]["expr"]
    assert "/ smiquery_memory_total_bytes" in rules["GpuMemoryNearlyFull"]["expr"]


def test_every_rule_tells_an_operator_what_to_check():
    for rule in load_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        ann = rule["annotations"]
        assert ann["summary"].strip() and len(ann["summary"]) < 120, rule["alert"]
        assert len(ann["description"]) > 150, rule["alert"]
        assert re.search(r"\b(Check|check)\b", ann["description"]), f"{rule['alert']}: say what to check"


def test_rules_and_dashboard_use_only_metrics_the_exporter_serves():
    names = exported_names()
    used = set()
    for expr in [r["expr"] for r in load_rules()] + dashboard_exprs():
        used |= set(re.findall(r"\bsmiquery_[a-z0-9_]+", expr))
    assert used and used <= names, used - names


# ----------------------------------------------------------------------------------------- dashboard, statically


def test_dashboard_has_instance_and_gpu_variables_and_the_panels_asked_for():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"instance", "gpu"} <= set(variables)
    for name in ("instance", "gpu"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
    panels = {p["title"]: p for p in dash["panels"]}
    temp = panels["Temperature"]
    steps = [s["value"] for s in temp["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 80, 85] and temp["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    exprs = " ".join(dashboard_exprs())
    for metric in (
        "smiquery_utilization_gpu_ratio",
        "smiquery_memory_used_bytes",
        "smiquery_memory_total_bytes",
        "smiquery_power_draw_watts",
        "smiquery_power_limit_watts",
        "smiquery_clocks_current_sm_hertz",
        "smiquery_clocks_event_reasons_hw_thermal_slowdown_active",
        "smiquery_up",
        "smiquery_last_sample_age_seconds",
        "smiquery_nvidia_smi_errors_total",
        "smiquery_nvidia_smi_restarts_total",
    ):
        assert metric in exprs, metric
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
