"""The fleet report reads back the slowdown reasons and the memory health the exporter writes, in all three
namings, and finds in them what a recording of the same samples finds: throttling, ECC errors, retired pages and
row-remapping failures, each on the right GPU of the right node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from smiquery.analysis import load_recording, report
from smiquery.fleet import PrometheusClient, fleet_frame
from tests.exporter.test_rules import require_tool
from tests.fleet.fleetdata import backfill, started

pytestmark = pytest.mark.xdist_group("prometheus")

STEP = 15
SAMPLES = 40  # ten minutes
# per node: its naming, and per extra field the stretch (in samples) where the flag is set or the count grows
NODES = {
    "node-a:9849": ("smiquery", {"clocks_event_reasons.hw_thermal_slowdown": (8, 24), "ecc": (10, 30)}),
    "node-b:9400": (
        "dcgm",
        {"clocks_event_reasons.hw_power_brake_slowdown": (12, 28), "retired_pages.pending": (0, 40)},
    ),
    "node-c:9835": (
        "nvidia_smi",
        {"clocks_event_reasons.sw_thermal_slowdown": (4, 20), "remapped_rows.failure": (20, 40)},
    ),
}
FLAGS = (
    "clocks_event_reasons.hw_thermal_slowdown",
    "clocks_event_reasons.sw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown",
    "retired_pages.pending",
    "remapped_rows.failure",
)
# (metric, labels style) per naming of each extra field; the DCGM naming writes the reasons under smiquery's names
DCGM = {
    "ecc": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "retired_pages.pending": "DCGM_FI_DEV_RETIRED_PENDING",
    "remapped_rows.failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
}


def _metric(naming: str, fld: str) -> tuple[str, str]:
    if naming == "nvidia_smi":
        name = "ecc.errors.corrected.volatile.total" if fld == "ecc" else fld
        return "nvidia_smi_" + name.replace(".", "_"), "nvidia_smi"
    if naming == "dcgm" and fld in DCGM:
        return DCGM[fld], "dcgm"
    if fld == "ecc":
        return "smiquery_ecc_errors_corrected_volatile_total", "smiquery"
    suffix = "_active" if fld.startswith("clocks_event_reasons.") else ""
    return "smiquery_" + fld.replace(".", "_") + suffix, "smiquery"


def _uuid(instance: str) -> str:
    return f"GPU-{instance[5]}0000000-1111-2222-3333-444444444444"


def _labels(instance: str, style: str) -> str:
    uuid = _uuid(instance)
    pairs = {
        "smiquery": [("gpu", "0"), ("uuid", uuid), ("name", "NVIDIA H100")],
        "dcgm": [("gpu", "0"), ("UUID", uuid), ("modelName", "NVIDIA H100"), ("Hostname", instance[:6])],
        "nvidia_smi": [("uuid", uuid)],
    }[style]
    return ",".join(f'{k}="{v}"' for k, v in [("instance", instance), ("job", style), *pairs])


def _value(fld: str, span: tuple[int, int] | None, i: int) -> int:
    if span is None:
        return 0
    a, b = span
    if fld == "ecc":  # a count that grows by one each sample of its stretch
        return max(0, min(i, b) - a + 1) if i >= a else 0
    return 1 if a <= i < b else 0


def _write(om: Path, csv: Path, start: int) -> None:
    """The samples as OpenMetrics (each node in its exporter's naming) and as one nvidia-smi CSV recording."""
    util = {"smiquery": "smiquery_utilization_gpu_ratio", "dcgm": "DCGM_FI_DEV_GPU_UTIL"}
    util["nvidia_smi"] = "nvidia_smi_utilization_gpu_ratio"
    families: dict[str, list[str]] = {}
    for fld in ("util", "ecc", *FLAGS):
        for instance, (naming, events) in NODES.items():
            if fld == "util":
                name, style = util[naming], naming
                values = [90 if naming == "dcgm" else 0.9] * SAMPLES
            else:
                name, style = _metric(naming, fld)
                values = [_value(fld, events.get(fld), i) for i in range(SAMPLES)]
            series = families.setdefault(name, [f"# TYPE {name} gauge"])
            series += [f"{name}{{{_labels(instance, style)}}} {v} {start + i * STEP}" for i, v in enumerate(values)]
    lines = [line for series in families.values() for line in series]
    info = "nvidia_smi_gpu_info{" + _labels("node-c:9835", "nvidia_smi") + ',index="0",name="NVIDIA H100"}'
    lines += ["# TYPE nvidia_smi_gpu_info gauge", *(f"{info} 1 {start + i * STEP}" for i in range(SAMPLES)), "# EOF"]
    om.write_text("\n".join(lines) + "\n", encoding="utf-8")
    head = "timestamp, index, uuid, name, utilization.gpu [%], " + ", ".join(
        ("ecc.errors.corrected.volatile.total", *FLAGS)
    )
    rows = [head]
    words = {"retired_pages.pending": ("No", "Yes"), "remapped_rows.failure": ("No", "Yes")}
    for i in range(SAMPLES):
        stamp = datetime.fromtimestamp(start + i * STEP, timezone.utc).strftime("%Y/%m/%d %H:%M:%S.000")
        for k, (instance, (_, events)) in enumerate(NODES.items()):
            cells = [str(_value("ecc", events.get("ecc"), i))]
            for fld in FLAGS:
                cells.append(words.get(fld, ("Not Active", "Active"))[_value(fld, events.get(fld), i)])
            rows.append(f"{stamp}, {k}, {_uuid(instance)}, NVIDIA H100, 90 %, " + ", ".join(cells))
    csv.write_text("\n".join(rows) + "\n", encoding="utf-8")


@dataclass
class Health:
    url: str
    start: int
    end: int
    recording: Path


@pytest.fixture(scope="module")
def health(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Health]:
    promtool, prometheus = require_tool("promtool"), require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("health")
    end = int(time.time()) // STEP * STEP - 5 * 60
    start = end - (SAMPLES - 1) * STEP
    _write(tmp / "health.om", tmp / "health.csv", start)
    backfill(promtool, tmp / "health.om", tmp / "data")
    with started(prometheus, tmp / "data", tmp / "prom.log") as server:
        yield Health(server.url, start, end, tmp / "health.csv")


def test_the_fleet_report_finds_throttling_and_memory_health_as_the_recording_does(health):
    df = fleet_frame(PrometheusClient(health.url), health.start, health.end)
    for fld in ("clocks_event_reasons_hw_thermal_slowdown", "retired_pages_pending", "remapped_rows_failure"):
        assert str(df[fld].dtype) == "boolean", fld
    from_prom = report(df, name="fleet")
    from_rec = report(load_recording(health.recording, tz="UTC"), name="fleet")
    got = sorted((f.kind, f.severity, f.gpus) for f in from_prom.findings)
    assert got == sorted((f.kind, f.severity, f.gpus) for f in from_rec.findings)
    kinds = {(kind, gpus) for kind, _, gpus in got}
    # node-a (smiquery naming): thermal slowdown and growing ECC; node-b (dcgm): power brake and pending
    # retirement; node-c (nvidia_smi): software thermal slowdown and a remapping failure
    assert {("throttle", (0,)), ("ecc", (0,)), ("throttle", (1,)), ("retired_pages", (1,))} <= kinds, kinds
    assert {("throttle", (2,)), ("remapped_rows", (2,))} <= kinds, kinds
    verdicts = " ".join(f.verdict for f in from_prom.findings)
    for node in ("node-a", "node-b", "node-c"):
        assert f"{node}" in verdicts, verdicts
    assert [s.gpu for s in from_prom.alerts] == [s.gpu for s in from_rec.alerts]
