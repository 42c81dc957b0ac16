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

ROOT = Path(__file__).resolve().parents[2]
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


def training_names() -> set[str]:
    """The metrics a training job serves through smiquery.training (metrics_port= or a Pushgateway), as its
    ``collect()`` writes them for a run with process shares on."""
    from types import SimpleNamespace

    from smiquery.training.monitor import Totals
    from smiquery.training.outputs import JobMetrics

    run = SimpleNamespace(totals=Totals(), uuids=dict, process_share=True, process_shares=dict)
    metrics = JobMetrics(run_id="scan")
    metrics.monitor = run  # type: ignore[assignment]
    names = set()
    for family in metrics.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    assert "smiquery_training_steps_total" in names, "scan of smiquery/training/outputs.py is broken"
    return names


def kubernetes_names() -> set[str]:
    """The series of ``--kubernetes`` and ``--kubernetes-processes`` (smiquery/attribution/), as they come out."""
    from smiquery.attribution import Attribution, Grant, Workload
    from smiquery.attribution.kubernetes import KubernetesBackend, PodDirectory
    from smiquery.exporter.families import attribution_families, workload_families
    from smiquery.exporter.pmonwatch import ProcessInstant
    from smiquery.sources.apps import GpuProcess
    from smiquery.sources.pmon import PmonRow

    gpu = "GPU-c1b0d0c2-7b24-505e-e600-706601380be7"
    answers: list[Any] = [
        OSError("kubelet away"),  # a failed List: the errors counter
        [
            Grant(Workload(("ns", "p", "c")), "nvidia.com/gpu", gpu),
            Grant(Workload(("ns", "q", "c")), "nvidia.com/gpu", "x"),
        ],
    ]

    def lister(socket: str, timeout: float) -> Any:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    backend = KubernetesBackend("/nonexistent", lister=lister, pods=PodDirectory(node="n"))
    att = Attribution(backend, mig_listing=str)
    att.refresh()
    att.refresh()
    instant = ProcessInstant(((PmonRow(0, 7, "C", 40, 20), None),), {0: 1}, 0.0)
    procs = [GpuProcess(pid=7, process_name="python", gpu_uuid=gpu, gpu_index=0, used_memory=1024)]
    fams = attribution_families(att, {gpu: 0}, "uuid", {})
    fams += workload_families(att, {gpu: 0}, instant, procs, "uuid", {})
    names = {s.name for f in fams for s in f.samples}
    assert {"smiquery_gpu_allocation_info", "smiquery_pod_gpu_utilization_ratio"} <= names, "not every series"
    return names


def exported_names() -> set[str]:
    names = {s.sample for s in metric_specs("all")} | kubernetes_names()
    # the training monitor's metrics, joined to the exporter's series by UUID
    return names | set(HEALTH_METRICS) | training_names()


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
    assert 'alert="temperature.gpu > 85 for 3"' in crit["expr"] and crit["labels"]["severity"] == "critical"
    assert "smiquery_alert_fired_total" in crit["expr"]  # an episode between two scrapes still fires
    stalled = rules["GpuStalledPipeline"]
    # every scrape under 20 % for 30 minutes: no 30-minute average before a 30-minute `for` (that fired ~55 late)
    assert stalled["expr"].startswith("smiquery_utilization_gpu_ratio < 0.2") and stalled["for"] == "30m"
    assert (
        "smiquery_training_gpu_info" in stalled["expr"] and "rate(smiquery_training_steps_total[5m])" in stalled["expr"]
    )
    hung = rules["TrainingJobHung"]
    assert "increase(smiquery_training_steps_total[10m]) == 0" in hung["expr"] and hung["for"] == "5m"
    assert "hung collective" not in stalled["annotations"]["description"]
    # memory held at 0 % busy is also an idle inference server: no evidence of training, so no part of the rule
    assert "smiquery_process_used_memory_bytes" not in stalled["expr"]
    assert "smiquery_gpu_lost" in crit["expr"] and "smiquery_up" in crit["expr"]
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
    training = training_names()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            # the exporter's series are filtered by $instance; a training job's own series (its own instance)
            # join them by UUID instead
            exporter_metrics = set(re.findall(r"\bsmiquery_[a-z0-9_]+", t["expr"])) - training
            if exporter_metrics:
                assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_has_a_by_pod_row_and_an_allocated_but_idle_table():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name in ("namespace", "pod"):
        assert variables[name]["includeAll"] and "smiquery_gpu_allocation_info" in variables[name]["query"]["query"]
    assert 'namespace=~"$namespace"' in variables["pod"]["query"]["query"]
    panels = {p["title"]: p for p in dash["panels"]}
    assert any(p["type"] == "row" and "pod" in p["title"] for p in dash["panels"])
    for title in ("GPU utilisation by pod", "GPU memory by pod", "Allocated but idle"):
        (target,) = panels[title]["targets"]
        # one series per holding pod: the allocation on the left, so a time-sliced GPU is never a many-to-many error
        assert target["expr"].startswith('smiquery_gpu_allocation_info{instance=~"$instance", namespace=~"$namespace"')
        assert 'pod=~"$pod"' in target["expr"] and "* on(instance, uuid) group_left()" in target["expr"]
    idle = panels["Allocated but idle"]
    assert (
        "max_over_time(smiquery_utilization_gpu_ratio" in idle["targets"][0]["expr"]
        and "[30m]" in idle["targets"][0]["expr"]
    )
    (flt,) = [t for t in idle["transformations"] if t["id"] == "filterByValue"]
    assert flt["options"]["filters"][0]["config"] == {"id": "lower", "options": {"value": 0.05}}
    rule = next(r for r in load_rules() if r["alert"] == "GpuAllocatedButIdle")
    assert "< 0.05" in rule["expr"] and rule["for"] == "30m", "the table and the alert ask the same question"


# ------------------------------------------------- the same rules at any scrape interval, in both namings

DCGM_RULES = PROM_DIR / "smiquery-dcgm-rules.yml"
RULE_FILES = {"smiquery": RULES, "dcgm": DCGM_RULES}
U = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]
CRIT = "temperature.gpu > 85 for 3"


def _gpu_labels(naming: str, gpu: int) -> dict[str, str]:
    base = {"instance": "gpu-node-1:9849", "job": "smiquery-exporter", "gpu": str(gpu)}
    bus = f"00000000:1{gpu}:00.0"
    if naming == "dcgm":
        return {
            **base,
            "UUID": U[gpu],
            "device": f"nvidia{gpu}",
            "modelName": "NVIDIA H100",
            "Hostname": "gpu-node-1",
            "pci_bus_id": bus,
        }
    return {**base, "uuid": U[gpu], "name": "NVIDIA H100", "pci_bus_id": bus}


def _native_labels(gpu: int) -> dict[str, str]:
    return _gpu_labels("smiquery", gpu)


def _sel(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _n(minutes: float, step: int) -> int:
    """Samples after the first one covering ``minutes`` at one sample per ``step`` seconds."""
    return round(minutes * 60 / step)


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": _sel(name, labels), "values": values}


def _alert(alertname: str, labels: dict[str, str], severity: str) -> dict[str, Any]:
    return {"exp_labels": {**labels, "severity": severity}}


def _cases(naming: str, step: int) -> list[dict[str, Any]]:
    """promtool test groups that must fire and must stay quiet, for one naming at one scrape interval."""
    g = [_gpu_labels(naming, i) for i in range(4)]
    temp = "DCGM_FI_DEV_GPU_TEMP" if naming == "dcgm" else "smiquery_temperature_gpu_celsius"
    util = "DCGM_FI_DEV_GPU_UTIL" if naming == "dcgm" else "smiquery_utilization_gpu_ratio"
    low = "5" if naming == "dcgm" else "0.05"
    n = functools.partial(_n, step=step)
    interval = f"{step}s"
    out: list[dict[str, Any]] = []
    # above 80 C for 5 minutes: GPU 0 hot for 7 minutes; GPU 1 hot but dipped once at 4 minutes
    out.append(
        {
            "name": f"GpuTemperatureHigh at {interval}",
            "interval": interval,
            "input_series": [
                _series(temp, g[0], f"81x{n(8)}"),
                _series(temp, g[1], f"81x{n(4) - 1} 79 81x{n(4)}"),
                _series(temp, g[2], f"80x{n(8)}"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "GpuTemperatureHigh", "exp_alerts": []},
                {
                    "eval_time": "6m",
                    "alertname": "GpuTemperatureHigh",
                    "exp_alerts": [_alert("GpuTemperatureHigh", g[0], "warning")],
                },
            ],
        }
    )
    # 3 consecutive samples above 85 C, counted by the exporter: GPU 0 fires and stays hot; GPU 1 had a short
    # episode between two scrapes (only the counter shows it); GPU 2 never
    crit = {**{}, "alert": CRIT}
    out.append(
        {
            "name": f"GpuTemperatureCritical at {interval}",
            "interval": interval,
            "input_series": [
                _series("smiquery_alert_firing", {**g[0], **crit}, f"0x{n(2)} 1x{n(10)}"),
                _series("smiquery_alert_fired_total", {**g[0], **crit}, f"0x{n(2)} 1x{n(10)}"),
                _series("smiquery_alert_firing", {**g[1], **crit}, f"0x{n(12)}"),
                _series("smiquery_alert_fired_total", {**g[1], **crit}, f"0x{n(3)} 1x{n(9)}"),
                _series("smiquery_alert_firing", {**g[2], **crit}, f"0x{n(12)}"),
                _series("smiquery_alert_fired_total", {**g[2], **crit}, f"0x{n(12)}"),
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "GpuTemperatureCritical", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "GpuTemperatureCritical",
                    "exp_alerts": [
                        _alert("GpuTemperatureCritical", {**g[0], **crit}, "critical"),
                        _alert("GpuTemperatureCritical", {**g[1], **crit}, "critical"),
                    ],
                },
                {
                    "eval_time": "11m",
                    "alertname": "GpuTemperatureCritical",
                    "exp_alerts": [_alert("GpuTemperatureCritical", {**g[0], **crit}, "critical")],
                },
            ],
        }
    )
    out += _training_cases(naming, step)
    # a pure inference fleet: processes hold memory at 0 % busy (--processes on), no training metric anywhere;
    # nothing says a job is starved, so nothing fires
    out.append(
        {
            "name": f"GpuStalledPipeline at {interval}: a pure inference fleet stays quiet",
            "interval": interval,
            "input_series": [
                _series(util, g[0], f"0x{n(90)}"),
                _series("smiquery_process_used_memory_bytes", {**_native_labels(0), "pid": "9"}, f"2e10x{n(90)}"),
                _series(util, g[1], f"{low}x{n(90)}"),
                _series("smiquery_process_used_memory_bytes", {**_native_labels(1), "pid": "12"}, f"6e9x{n(90)}"),
            ],
            "alert_rule_test": [
                {"eval_time": t, "alertname": "GpuStalledPipeline", "exp_alerts": []} for t in ("35m", "61m", "90m")
            ],
        }
    )
    # a GPU that fell off the bus while its alert fired, and an exporter whose data went stale: the critical alert
    # ends (GpuLost and smiquery_up carry the news); the exporter leaves smiquery_alert_firing out meanwhile
    up = {"instance": "gpu-node-1:9849", "job": "smiquery-exporter"}
    out.append(
        {
            "name": f"GpuTemperatureCritical at {interval}: lost or stale ends it",
            "interval": interval,
            "input_series": [
                _series("smiquery_alert_firing", {**g[0], **crit}, f"1x{n(3)} _x{n(20)}"),
                _series("smiquery_alert_fired_total", {**g[0], **crit}, f"1x{n(23)}"),
                _series("smiquery_gpu_lost", g[0], f"0x{n(3)} 1x{n(20)}"),
                _series("smiquery_alert_firing", {**g[1], **crit}, f"1x{n(3)} _x{n(20)}"),
                _series("smiquery_alert_fired_total", {**g[1], **crit}, f"1x{n(23)}"),
                _series("smiquery_gpu_lost", g[1], f"0x{n(23)}"),
                _series("smiquery_up", up, f"1x{n(10)} 0x{n(13)}"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "2m",
                    "alertname": "GpuTemperatureCritical",
                    "exp_alerts": [
                        _alert("GpuTemperatureCritical", {**g[0], **crit}, "critical"),
                        _alert("GpuTemperatureCritical", {**g[1], **crit}, "critical"),
                    ],
                },
                {
                    "eval_time": "5m",
                    "alertname": "GpuTemperatureCritical",
                    "exp_alerts": [_alert("GpuTemperatureCritical", {**g[1], **crit}, "critical")],
                },
                {"eval_time": "12m", "alertname": "GpuTemperatureCritical", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "GpuTemperatureCritical", "exp_alerts": []},
            ],
        }
    )
    out.append(
        {
            "name": f"GpuLost and SmiqueryExporterDown at {interval}",
            "interval": interval,
            "input_series": [
                _series("smiquery_gpu_lost", g[0], f"0 1x{n(5)}"),
                _series("smiquery_gpu_lost", g[1], f"0x{n(5)}"),
                _series("up", {"instance": "gpu-node-1:9849", "job": "smiquery-exporter"}, f"1 0x{n(5)}"),
                _series("up", {"instance": "gpu-node-2:9849", "job": "smiquery-exporter"}, f"1x{n(5)}"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "1m",
                    "alertname": "GpuLost",
                    "exp_alerts": [_alert("GpuLost", g[0], "critical")],
                },
                {"eval_time": "1m", "alertname": "SmiqueryExporterDown", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "SmiqueryExporterDown",
                    "exp_alerts": [
                        _alert(
                            "SmiqueryExporterDown",
                            {"instance": "gpu-node-1:9849", "job": "smiquery-exporter"},
                            "warning",
                        )
                    ],
                },
            ],
        }
    )
    out.extend(_allocated_idle_cases(naming, step))
    return out


def _allocated_idle_cases(naming: str, step: int) -> list[dict[str, Any]]:
    """GpuAllocatedButIdle: fires 30 minutes (within one scrape) after a held GPU went under 5 %, once per holding
    container; an idle GPU that nobody holds, and a held busy one, stay quiet."""
    g = [_gpu_labels(naming, i) for i in range(4)]
    uu = "UUID" if naming == "dcgm" else "uuid"
    util = "DCGM_FI_DEV_GPU_UTIL" if naming == "dcgm" else "smiquery_utilization_gpu_ratio"
    low, high = ("2", "90") if naming == "dcgm" else ("0.02", "0.9")
    n = functools.partial(_n, step=step)
    interval = f"{step}s"

    def held(gpu: int, pod: str) -> dict[str, str]:
        base = {k: g[gpu][k] for k in ("instance", "job", "gpu", uu)}
        return {**base, "pod": pod, "namespace": "ml", "container": "main", "resource": "nvidia.com/gpu"}

    # 5 busy minutes first: the 30 minutes count from the first idle sample, not from the series' start
    idle = f"{high}x{n(5) - 1} {low}x{n(45)}"
    return [
        {
            "name": f"GpuAllocatedButIdle at {interval}",
            "interval": interval,
            "input_series": [
                _series(util, g[0], idle),
                _series("smiquery_gpu_allocation_info", held(0, "train-a"), f"1x{n(50)}"),
                _series(util, g[1], f"0x{n(50)}"),  # idle, held by nobody
                _series(util, g[2], f"{high}x{n(50)}"),  # held and busy
                _series("smiquery_gpu_allocation_info", held(2, "train-b"), f"1x{n(50)}"),
                _series(util, g[3], idle),  # time-sliced to two pods: one alert each
                _series("smiquery_gpu_allocation_info", held(3, "share-1"), f"1x{n(50)}"),
                _series("smiquery_gpu_allocation_info", held(3, "share-2"), f"1x{n(50)}"),
            ],
            "alert_rule_test": [
                {"eval_time": f"{35 * 60 - step}s", "alertname": "GpuAllocatedButIdle", "exp_alerts": []},
                {
                    "eval_time": f"{35 * 60 + step}s",
                    "alertname": "GpuAllocatedButIdle",
                    "exp_alerts": [
                        _alert("GpuAllocatedButIdle", held(0, "train-a"), "warning"),
                        _alert("GpuAllocatedButIdle", held(3, "share-1"), "warning"),
                        _alert("GpuAllocatedButIdle", held(3, "share-2"), "warning"),
                    ],
                },
            ],
        }
    ]


def _training_cases(naming: str, step: int) -> list[dict[str, Any]]:
    """The training rules after an hour of healthy load: a starved job, a hung job, and what must stay quiet."""
    g = [_gpu_labels(naming, i) for i in range(4)]
    util = "DCGM_FI_DEV_GPU_UTIL" if naming == "dcgm" else "smiquery_utilization_gpu_ratio"
    mem = "DCGM_FI_DEV_FB_USED" if naming == "dcgm" else "smiquery_memory_used_bytes"
    low, high = ("5", "90") if naming == "dcgm" else ("0.05", "0.9")
    held = "40000" if naming == "dcgm" else "4e10"
    n = functools.partial(_n, step=step)
    interval = f"{step}s"
    trainer = {"job": "training", "instance": "trainer-1:8000", "host": "gpu-node-1"}
    pushed = {"job": "training", "instance": "pushgateway:9091", "host": "gpu-node-1"}

    def info(run: str, gpu: int, where: dict[str, str] = trainer) -> dict[str, str]:
        return _series(
            "smiquery_training_gpu_info", {**where, "run": run, "uuid": U[gpu], "gpu": str(gpu)}, f"1x{n(100)}"
        )

    def steps(run: str, values: str, where: dict[str, str] = trainer) -> dict[str, str]:
        return _series("smiquery_training_steps_total", {**where, "run": run}, values)

    # the load is healthy for an hour; from 60 min (the first low sample) it is not
    drop = f"{high}x{n(60) - 1} {low}x{n(40)}"
    at = lambda minutes, d=0: f"{round(minutes * 60) + d * step}s"  # noqa: E731
    # GPU 0 (run a) is starved: steps still rise. GPU 1 (run b) takes steps on a busy GPU. GPU 2: an idle
    # inference server (low, memory held, no training). GPU 3 (run c) hangs:
    # steps stop at 60 min, so it is TrainingJobHung's, not this rule's.
    stalled = {
        "name": f"GpuStalledPipeline at {interval}: 30 min after the drop that follows an hour of load",
        "interval": interval,
        "input_series": [
            _series(util, g[0], drop),
            info("a", 0),
            steps("a", f"0+10x{n(100)}"),
            _series(util, g[1], f"{high}x{n(100)}"),
            info("b", 1),
            steps("b", f"0+10x{n(100)}"),
            _series(util, g[2], drop),
            _series(mem, g[2], f"{held}x{n(100)}"),
            _series(util, g[3], drop),
            info("c", 3),
            steps("c", f"0+10x{n(60)} {10 * n(60)}x{n(40)}"),
        ],
        "alert_rule_test": [
            {"eval_time": at(60), "alertname": "GpuStalledPipeline", "exp_alerts": []},
            {"eval_time": at(90, -1), "alertname": "GpuStalledPipeline", "exp_alerts": []},
            {
                "eval_time": at(90, +1),
                "alertname": "GpuStalledPipeline",
                "exp_alerts": [_alert("GpuStalledPipeline", g[0], "warning")],
            },
            {
                "eval_time": at(99),
                "alertname": "GpuStalledPipeline",
                "exp_alerts": [_alert("GpuStalledPipeline", g[0], "warning")],
            },
        ],
    }
    # hung: run a (scraped) stops stepping at 60 min with its memory held and fires 15 min later (10 min with no
    # increase, then for 5 min). Run b was killed at 60 min: its Pushgateway group stays, but its push time ages,
    # so its GPU (memory held by something else) stays quiet. Run c, also pushed, hangs with its pusher alive.
    # Run d is starved, not hung (steps rise).
    flat = f"0+10x{n(60)} {10 * n(60)}x{n(40)}"
    hung = {
        "name": f"TrainingJobHung at {interval}: no step for 15 min with memory held",
        "interval": interval,
        "input_series": [
            _series(util, g[0], drop),
            _series(mem, g[0], f"{held}x{n(100)}"),
            info("a", 0),
            steps("a", flat),
            _series(util, g[1], drop),
            _series(mem, g[1], f"{held}x{n(100)}"),
            info("b", 1, pushed),
            steps("b", flat, pushed),
            _series("push_time_seconds", {**pushed, "run": "b"}, f"0+{step}x{n(60)} 3600x{n(40)}"),
            _series(util, g[2], drop),
            _series(mem, g[2], f"{held}x{n(100)}"),
            info("c", 2, pushed),
            steps("c", flat, pushed),
            _series("push_time_seconds", {**pushed, "run": "c"}, f"0+{step}x{n(100)}"),
            _series(util, g[3], drop),
            _series(mem, g[3], f"{held}x{n(100)}"),
            info("d", 3),
            steps("d", f"0+10x{n(100)}"),
        ],
        "alert_rule_test": [
            {"eval_time": at(60), "alertname": "TrainingJobHung", "exp_alerts": []},
            {"eval_time": at(74), "alertname": "TrainingJobHung", "exp_alerts": []},
            {
                "eval_time": at(77),
                "alertname": "TrainingJobHung",
                "exp_alerts": [
                    _alert("TrainingJobHung", g[0], "critical"),
                    _alert("TrainingJobHung", g[2], "critical"),
                ],
            },
            {
                "eval_time": at(95),
                "alertname": "GpuStalledPipeline",
                "exp_alerts": [_alert("GpuStalledPipeline", g[3], "warning")],
            },
        ],
    }
    return [stalled, hung]


def _without_annotations(rules: Path, dest: Path) -> Path:
    # promtool compares annotations too; the templates are checked by `promtool check rules` and the shipped test
    # file, so these interval tests compare labels only
    doc = yaml.safe_load(rules.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return dest


@pytest.mark.parametrize("naming", ["smiquery", "dcgm"])
@pytest.mark.parametrize("step", [15, 30, 60])
def test_rules_fire_and_stay_quiet_at_any_scrape_interval(tmp_path, naming, step):
    rules = _without_annotations(RULE_FILES[naming], tmp_path / "rules.yml")
    spec = {"rule_files": [rules.name], "evaluation_interval": f"{step}s", "tests": _cases(naming, step)}
    test_file = tmp_path / "rules.test.yml"
    test_file.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    done = promtool("test", "rules", str(test_file))
    assert done.returncode == 0, done.stdout + done.stderr


def test_dcgm_rules_are_the_same_alerts_and_promtool_clean():
    done = promtool("check", "rules", "--lint=all", "--lint-fatal", str(DCGM_RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    dcgm = yaml.safe_load(DCGM_RULES.read_text(encoding="utf-8"))
    names = [r["alert"] for g in dcgm["groups"] for r in g["rules"]]
    assert names == [r["alert"] for r in load_rules()]
    assert all("smiquery_temperature_gpu_celsius" not in r["expr"] for g in dcgm["groups"] for r in g["rules"])


def test_scrape_configs_service_monitor_and_rules_agree_on_the_job():
    prom = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    k8s = ROOT / "docker" / "k8s"
    cm = yaml.safe_load(
        (k8s / "components" / "plain-prometheus" / "prometheus-scrape-config.yaml").read_text(encoding="utf-8")
    )
    k8s_jobs = {j["job_name"] for j in yaml.safe_load(cm["data"]["smiquery-scrape.yml"])["scrape_configs"]}
    # the Prometheus Operator names the job after the Service unless the ServiceMonitor sets jobLabel
    monitor = yaml.safe_load((k8s / "monitoring" / "servicemonitor.yaml").read_text(encoding="utf-8"))
    services = [d for d in yaml.safe_load_all((k8s / "base" / "exporter.yaml").read_text(encoding="utf-8")) if d]
    selected = monitor["spec"]["selector"]["matchLabels"]
    svc = [
        s for s in services if s["kind"] == "Service" and selected.items() <= s["metadata"].get("labels", {}).items()
    ]
    assert len(svc) == 1 and "jobLabel" not in monitor["spec"]
    operator_job = svc[0]["metadata"]["name"]
    rule_jobs = set()
    for path in RULE_FILES.values():
        for expr in re.findall(r'up\{job="([^"]+)"\}', path.read_text(encoding="utf-8")):
            rule_jobs.add(expr)
    # the training pods' own job (smiquery-training) is no exporter: the rules join its series by uuid, not by job
    assert jobs == k8s_jobs - {"smiquery-training"} == {operator_job} == rule_jobs == {"smiquery-exporter"}
    ports = {p["port"] for p in svc[0]["spec"]["ports"]}
    assert ports == {9849}


# ------------------------------------------------------------------------------------------------ Xid rules

XID_RULES = PROM_DIR / "smiquery-xid-rules.yml"
XID_RULES_TEST = PROM_DIR / "smiquery-xid-rules.test.yml"


def load_xid_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(XID_RULES.read_text(encoding="utf-8"))
    assert [g["name"] for g in doc["groups"]] == ["smiquery-xid"]
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_promtool_checks_and_unit_tests_pass_for_the_xid_rules():
    done = promtool("check", "rules", "--lint=all", "--lint-fatal", str(XID_RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(load_xid_rules())} rules found" in done.stdout
    done = promtool("test", "rules", str(XID_RULES_TEST))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_xid_unit_tests_make_every_alert_fire_and_not_fire():
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(XID_RULES_TEST.read_text(encoding="utf-8"))["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {r["alert"] for r in load_xid_rules()}
    assert alerts - fires == set() and alerts - silent == set()


def test_every_critical_xid_has_a_rule_whose_description_is_the_catalogue_entry():
    from smiquery.sources.xid import XID_CATALOGUE

    by_code: dict[int, dict[str, Any]] = {}
    for rule in load_xid_rules():
        for codes in re.findall(r'xid=~?"([0-9|]+)"', rule["expr"]):
            for code in codes.split("|"):
                by_code[int(code)] = rule
    # the codes the issue names: off the bus, ECC (double-bit, contained, uncontained), row remapping, NVLink,
    # application faults
    assert {79, 48, 94, 95, 63, 64, 74, 13, 31, 43} <= set(by_code)
    for code, rule in by_code.items():
        info = XID_CATALOGUE[code]
        desc = rule["annotations"]["description"]
        if info.action == "application":
            assert "application" in desc and str(code) in desc, code
            assert rule["labels"]["severity"] == "warning"
            continue
        assert info.meaning in desc and info.advice in desc, code
        assert rule["labels"]["severity"] == ("critical" if info.action in ("drain", "rma") else "warning"), code
    for rule in load_xid_rules():
        assert len(rule["annotations"]["summary"]) < 120 and re.search(r"\bCheck\b", rule["annotations"]["description"])


def test_xid_rules_use_only_metrics_the_exporter_serves_and_prometheus_loads_them():
    used = set()
    for rule in load_xid_rules():
        used |= set(re.findall(r"\bsmiquery_[a-z0-9_]+", rule["expr"]))
    assert used == {"smiquery_xid_errors_total", "smiquery_xid_source_up"} and used <= exported_names()
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    assert XID_RULES.name in config["rule_files"]


def test_dashboard_shows_mig_memory_and_says_mig_utilisation_is_not_available():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    mig = [p for p in dash["panels"] if "smiquery_mig_memory" in json.dumps(p.get("targets", []))]
    assert len(mig) == 1 and "not available" in mig[0]["description"]
    exprs = dashboard_exprs()
    assert not [e for e in exprs if "mig" in e.lower() and "util" in e.lower()]  # never a made-up 0
    assert any("smiquery_xid_errors_total" in e for e in exprs)


# ------------------------------------------------------------------------------- the by-Slurm-job row


def test_dashboard_has_a_by_slurm_job_row_beside_the_by_pod_row():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    job = variables["slurm_job"]
    assert job["type"] == "query" and job["includeAll"] and job["multi"]
    assert job["query"]["query"] == (
        'label_values(smiquery_gpu_allocation_info{instance=~"$instance", slurm_job_id!=""}, slurm_job_id)'
    )
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    pod_row = next(i for i, t in enumerate(rows) if t.startswith("By pod"))
    assert rows[pod_row + 1] == "By Slurm job (smiquery export --slurm)"
    panels = {p["title"]: p for p in dash["panels"]}
    pairs = {
        "GPU utilisation by pod": "GPU utilisation by Slurm job",
        "GPU memory by pod": "GPU memory by Slurm job",
        "Allocated but idle": "Allocated but idle (Slurm)",
    }
    for pod_title, job_title in pairs.items():
        pod, mine = panels[pod_title], panels[job_title]
        # the same panel shapes: type, size, units, legend and table settings, the idle filter
        for key in ("type", "fieldConfig", "options", "transformations"):
            assert mine.get(key) == pod.get(key), (job_title, key)
        assert (mine["gridPos"]["w"], mine["gridPos"]["h"]) == (pod["gridPos"]["w"], pod["gridPos"]["h"])
        (target,) = mine["targets"]
        assert target["expr"].startswith(SLURM_SELECTOR) and "* on(instance, uuid) group_left()" in target["expr"]
        assert {k: v for k, v in target.items() if k not in ("expr", "legendFormat")} == {
            k: v for k, v in pod["targets"][0].items() if k not in ("expr", "legendFormat")
        }
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in dash["panels"]]
    for i, (x, y, w, h) in enumerate(boxes):  # no panel drawn over another
        for x2, y2, w2, h2 in boxes[i + 1 :]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, (x, y, x2, y2)


SLURM_SELECTOR = 'smiquery_gpu_allocation_info{instance=~"$instance", slurm_job_id!="", slurm_job_id=~"$slurm_job"}'
JOB_TITLES = ("GPU utilisation by Slurm job", "GPU memory by Slurm job", "Allocated but idle (Slurm)")


def _slurm_case(exprs: dict[str, str], slurm_job: str) -> dict[str, Any]:
    """Evaluated at 30 min, one sample a minute, as an exporter with --slurm writes them: job 4242 got GPU 0 at
    minute 10 (the device series carry its labels from then on, and had none before), job 4243 holds GPU 1 throughout
    and leaves it idle, a pod holds GPU 2 (--kubernetes, no Slurm labels), GPU 3 is nobody's."""
    node = {"instance": "gpu07:9849", "job": "smiquery-exporter"}

    def job(gpu: int, jid: str, user: str) -> dict[str, str]:
        return {
            **node,
            "uuid": U[gpu],
            "gpu": str(gpu),
            "slurm_job_id": jid,
            "slurm_user": user,
            "slurm_account": "physics",
            "slurm_partition": "gpu",
            "slurm_job_name": f"train {jid}",
            "resource": "gpu",
        }

    def dev(gpu: int, **extra: str) -> dict[str, str]:
        return {**node, "uuid": U[gpu], "gpu": str(gpu), "name": "NVIDIA H100", **extra}

    j42, j43 = job(0, "4242", "alice"), job(1, "4243", "bob")
    labels42 = {k: v for k, v in j42.items() if k.startswith("slurm_")}
    labels43 = {k: v for k, v in j43.items() if k.startswith("slurm_")}
    pod = {"namespace": "ml", "pod": "train-0"}
    series = [
        _series("smiquery_gpu_allocation_info", j42, "_x9 1x20"),
        _series("smiquery_gpu_allocation_info", j43, "1x30"),
        _series("smiquery_gpu_allocation_info", {**node, "uuid": U[2], "gpu": "2", **pod, "resource": "x"}, "1x30"),
        _series("smiquery_utilization_gpu_ratio", dev(0), "0x9"),
        _series("smiquery_utilization_gpu_ratio", dev(0, **labels42), "_x9 0.9x20"),
        _series("smiquery_utilization_gpu_ratio", dev(1, **labels43), "0.01x30"),
        _series("smiquery_utilization_gpu_ratio", dev(2, **pod), "0.5x30"),
        _series("smiquery_utilization_gpu_ratio", dev(3), "0.3x30"),
        _series("smiquery_memory_used_bytes", dev(0), "1e9x9"),
        _series("smiquery_memory_used_bytes", dev(0, **labels42), "_x9 2e9x20"),
        _series("smiquery_memory_used_bytes", dev(1, **labels43), "5e8x30"),
        _series("smiquery_memory_used_bytes", dev(2, **pod), "7e9x30"),
    ]
    want = {
        "GPU utilisation by Slurm job": {"4242": 0.9, "4243": 0.01},
        "GPU memory by Slurm job": {"4242": 2e9, "4243": 5e8},
        "Allocated but idle (Slurm)": {"4242": 0.9, "4243": 0.01},
    }
    tests = []
    for title, expr in exprs.items():
        got = {j: v for j, v in want[title].items() if slurm_job in (".*", j)}
        samples = [{"labels": _sel("", {"4242": j42, "4243": j43}[j]), "value": v} for j, v in got.items()]
        expr = expr.replace("$instance", ".*").replace("$slurm_job", slurm_job)
        tests.append({"expr": expr, "eval_time": "30m", "exp_samples": samples})
    return {"interval": "1m", "input_series": series, "promql_expr_test": tests}


@pytest.mark.parametrize("slurm_job", [".*", "4243"])
def test_by_slurm_job_queries_return_one_series_per_job_and_gpu(tmp_path, slurm_job):
    """promtool evaluates the row's queries on series as the exporter writes them: one series per job on each GPU it
    holds, the job's own figures, no pod and no unallocated GPU; a job that got its GPU inside the idle table's 30
    minutes is no duplicate-series error."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = {p["title"]: p["targets"][0]["expr"] for p in dash["panels"] if p["title"] in JOB_TITLES}
    assert set(exprs) == set(JOB_TITLES)
    (tmp_path / "none.yml").write_text("groups: []\n", encoding="utf-8")
    spec = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [_slurm_case(exprs, slurm_job)]}
    test_file = tmp_path / "slurm.test.yml"
    test_file.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    done = promtool("test", "rules", str(test_file))
    assert done.returncode == 0, done.stdout + done.stderr
