"""The exporter: collector values and absences, naming, health, HTTP(S) server, CLI, and no nvidia-smi per scrape.

nvidia-smi is the in-process fake (`InProcessRunner`, installed by the `inproc` fixture or passed as `runner=`):
same output and faults as the executable, no process per start. Real processes stay where they are the subject:
the exporter reaping its child on stop, the CLI stopped by SIGTERM/SIGINT, its JSON logs, and imports.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime
import functools
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from typer.testing import CliRunner

from smiquery.cli import app as smiquery_app
from smiquery.errors import InvalidFieldError, NvidiaSmiTimeoutError, PortInUseError
from smiquery.exporter import (
    DCGM_MAP,
    Exporter,
    SmiCollector,
    metric_specs,
    parse_labels,
    render,
    serve,
)
from smiquery.exporter.server import process_poller
from smiquery.fields import CATALOGUE, Kind, resolve_fields
from smiquery.retry import RetryPolicy
from smiquery.runner import SubprocessRunner
from smiquery.sample import GpuSample, Schema
from smiquery.source import StreamStats, Sweep
from smiquery.streams.sync import stream
from smiquery.testing import InProcessRunner, use_runner
from tests.conftest import assert_stopped
from tests.helpers import wait_for
from tests.leakcheck import no_leaks, wait_no_children

ROOT = Path(__file__).resolve().parents[2]
# shared/ sits beside the checkout (a clone) or beside the folder of worktrees.
SHARED = next(
    (p / "shared" for p in (ROOT.parent, ROOT.parent.parent) if (p / "shared").is_dir()), ROOT.parent / "shared"
)
DCGM_DIR = SHARED / "dcgm"
MiB = 1048576.0
#: The nvidia-smi path given where one is shown (build_info); the in-process fake looks nothing up.
FAKE_PATH = "/opt/fake-driver/bin/nvidia-smi"

# Edits to the bundled demo's first sweep (GPU index -> {field: cell}), so that the values vary per GPU and
# some cells hold status tokens. The fake replays this one sweep over and over: every sweep is the same.
EDITS: dict[int, dict[str, str]] = {
    0: {
        "temperature.gpu": "71",
        "utilization.gpu": "87 %",
        "utilization.memory": "45 %",
        "memory.used": "70312 MiB",
        "power.draw": "612.40 W",
        "clocks.current.sm": "1980 MHz",
    },
    1: {"temperature.gpu": "[Unknown Error]", "power.draw": "[N/A]"},
    2: {
        "pstate": "P2",
        "clocks_event_reasons.hw_thermal_slowdown": "Active",
        "clocks_event_reasons.active": "0x0000000000000040",
    },
    3: {"ecc.errors.corrected.volatile.total": "5", "retired_pages.pending": "Yes"},
}


def write_recording(path: Path) -> Path:
    """The demo's first sweep with :data:`EDITS` applied, as a ``--format=csv`` recording."""
    text = resources.files("smiquery").joinpath("data/demo-8gpu.csv").read_text(encoding="utf-8")
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    names = [h.split(" [")[0] for h in header]
    rows = []
    for line in lines[1:9]:
        cells = line.split(", ")
        idx = int(cells[names.index("index")])
        for name, cell in EDITS.get(idx, {}).items():
            cells[names.index(name)] = cell
        rows.append(", ".join(cells))
    path.write_text(lines[0] + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def recorded(path: Path) -> dict[int, dict[str, str]]:
    """GPU index -> field -> cell (without its unit) of a recording."""
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.reader(fh, skipinitialspace=True))
    names = [h.split(" [")[0] for h in rows[0]]
    out: dict[int, dict[str, str]] = {}
    for row in rows[1:]:
        cells = {n: c.strip().split(" ")[0] if not c.strip().startswith("[") else c.strip() for n, c in zip(names, row)}
        cells["name"] = row[names.index("name")].strip()
        cells["pstate"] = row[names.index("pstate")].strip()
        out[int(cells["index"])] = cells
    return out


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    return write_recording(tmp_path / "sweep.csv")


@pytest.fixture
def started(recording: Path) -> Iterator[Any]:
    """A factory: a started background stream over the in-process fake, closed at the end."""
    made: list[Any] = []
    runners: list[InProcessRunner] = []

    def make(fields: str = "health", fault: str | None = None, extra: tuple[str, ...] = (), **kw: Any) -> Any:
        names = ["index", "uuid", "name", "pci.bus_id", *(f.name for f in resolve_fields(fields)), *extra]
        runners.append(InProcessRunner(fault=fault, recording=recording))
        s = stream(list(dict.fromkeys(names)), interval=0.05, runner=runners[-1], **kw)
        made.append(s)
        s.start()
        wait_for(lambda: s.latest()[0] is not None, what="the first sweep")
        return s

    yield make
    for s in made:
        s.close()
    for runner in runners:
        assert_stopped(runner)


def collected(collector: SmiCollector) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(collector)
    return reg


def labels_of(rec: dict[int, dict[str, str]], gpu: int, **extra: str) -> dict[str, str]:
    r = rec[gpu]
    return {"gpu": str(gpu), "uuid": r["uuid"], "name": r["name"], "pci_bus_id": r["pci.bus_id"], **extra}


# ------------------------------------------------------------------------------------------- the core alone


def test_core_import_does_not_need_prometheus_client():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"  # as if it were not installed
        "import smiquery, smiquery.cli.export, smiquery.sources.query_gpu\n"
        "assert 'smiquery.exporter' not in sys.modules\n"
        "try:\n"
        "    import smiquery.exporter\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "pip install 'smiquery[export]'" in done.stdout


def test_cli_without_prometheus_client_says_what_to_install(tmp_path):
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = cli("--port", "0", "--nvidia-smi", "/bin/true", env=env)
    assert done.returncode == 1
    assert "smiquery: error: smiquery.exporter needs prometheus_client: pip install 'smiquery[export]'" in done.stderr


# ------------------------------------------------------------------------------------------------ values


def test_values_equal_the_recording_in_base_units(started, recording):
    s = started("health")
    reg = collected(SmiCollector(s))
    rec = recorded(recording)
    checks = {
        "smiquery_temperature_gpu_celsius": ("temperature.gpu", 1.0),
        "smiquery_utilization_gpu_ratio": ("utilization.gpu", 0.01),
        "smiquery_utilization_memory_ratio": ("utilization.memory", 0.01),
        "smiquery_memory_used_bytes": ("memory.used", MiB),
        "smiquery_memory_total_bytes": ("memory.total", MiB),
        "smiquery_power_draw_watts": ("power.draw", 1.0),
        "smiquery_power_limit_watts": ("power.limit", 1.0),
        "smiquery_clocks_current_sm_hertz": ("clocks.current.sm", 1e6),
        "smiquery_ecc_errors_corrected_volatile_total": ("ecc.errors.corrected.volatile.total", 1.0),
        "smiquery_ecc_errors_uncorrected_volatile_total": ("ecc.errors.uncorrected.volatile.total", 1.0),
    }
    seen = 0
    for gpu in range(8):
        for metric, (field, scale) in checks.items():
            cell = rec[gpu][field]
            got = reg.get_sample_value(metric, labels_of(rec, gpu))
            if cell.startswith("["):
                assert got is None, (metric, gpu)  # a status token: absent, never 0
            else:
                assert got == pytest.approx(float(cell) * scale, rel=1e-12), (metric, gpu)
                seen += 1
    assert seen >= 75
    assert reg.get_sample_value("smiquery_memory_used_bytes", labels_of(rec, 0)) == 70312 * MiB
    assert reg.get_sample_value("smiquery_clocks_current_sm_hertz", labels_of(rec, 0)) == 1.98e9
    assert reg.get_sample_value("smiquery_utilization_gpu_ratio", labels_of(rec, 0)) == pytest.approx(0.87)


def test_missing_values_leave_the_series_out(started, recording):
    s = started("health")
    reg = collected(SmiCollector(s))
    rec = recorded(recording)
    assert reg.get_sample_value("smiquery_temperature_gpu_celsius", labels_of(rec, 1)) is None  # [Unknown Error]
    assert reg.get_sample_value("smiquery_power_draw_watts", labels_of(rec, 1)) is None  # [N/A]
    assert reg.get_sample_value("smiquery_power_limit_watts", labels_of(rec, 1)) == 700.0  # the rest is there
    text = generate_latest(reg).decode()
    assert "smiquery_fan_speed_ratio" not in text  # [N/A] on every GPU: not even a HELP line


def test_bools_enums_and_bitmasks(started, recording):
    s = started("health")
    reg = collected(SmiCollector(s))
    rec = recorded(recording)
    g2, g0, g3 = labels_of(rec, 2), labels_of(rec, 0), labels_of(rec, 3)
    assert reg.get_sample_value("smiquery_clocks_event_reasons_hw_thermal_slowdown_active", g2) == 1.0
    assert reg.get_sample_value("smiquery_clocks_event_reasons_hw_thermal_slowdown_active", g0) == 0.0
    assert reg.get_sample_value("smiquery_clocks_event_reasons_active_bitmask", g2) == 0x40
    assert reg.get_sample_value("smiquery_pstate", g2) == 2.0
    assert reg.get_sample_value("smiquery_pstate_info", {**g2, "value": "P2"}) == 1.0
    assert reg.get_sample_value("smiquery_retired_pages_pending", g3) == 1.0
    assert reg.get_sample_value("smiquery_retired_pages_pending", g0) == 0.0


def test_constant_labels_on_every_series(started, inproc):
    s = started("health")
    poller = process_poller(60)
    poller.poll()
    col = SmiCollector(s, labels=["site=lab", "rack=r7"], processes=poller)
    families = list(col.collect())
    assert len(families) > 20
    for fam in families:
        for sample in fam.samples:
            assert sample.labels.get("site") == "lab" and sample.labels.get("rack") == "r7", sample


def test_gpu_lost_mid_stream_shows_in_health_and_series_vanish(started, recording):
    s = started("health", fault="gpu-lost-after:16:3")
    wait_for(lambda: 3 in s.stats.lost_gpus and s.latest()[0][3].gpu_lost, what="GPU 3 to be lost")
    reg = collected(SmiCollector(s))
    rec = recorded(recording)
    assert reg.get_sample_value("smiquery_gpu_lost", labels_of(rec, 3)) == 1.0
    assert reg.get_sample_value("smiquery_gpu_lost", labels_of(rec, 2)) == 0.0
    assert reg.get_sample_value("smiquery_temperature_gpu_celsius", labels_of(rec, 3)) is None
    assert reg.get_sample_value("smiquery_memory_used_bytes", labels_of(rec, 3)) is None
    assert reg.get_sample_value("smiquery_temperature_gpu_celsius", labels_of(rec, 2)) is not None
    assert reg.get_sample_value("smiquery_up", {}) == 1.0  # the exporter itself is fine


def test_processes_memory_per_pid(started, inproc, recording):
    s = started("health")
    inproc.recording = recording
    poller = process_poller(60)
    poller.poll()
    reg = collected(SmiCollector(s, processes=poller))
    rec = recorded(recording)
    labels = {"pid": "48213", "process_name": "/opt/conda/bin/python3.11", "gpu": "0", "uuid": rec[0]["uuid"]}
    assert reg.get_sample_value("smiquery_process_used_memory_bytes", labels) == 69126 * MiB
    assert reg.get_sample_value("smiquery_processes_last_success_timestamp_seconds", {}) == pytest.approx(
        time.time(), abs=30
    )


def test_processes_poll_failure_is_counted_not_raised(inproc):
    inproc.fault = "driver-not-loaded"
    poller = process_poller(60)
    poller.poll()
    snap = poller.get()
    assert snap.failures == {"DriverNotLoadedError": 1}
    assert (snap.value, snap.age, snap.at) == (None, None, None)


# ----------------------------------------------------------------------------------------------- naming


def test_dcgm_naming_names_units_and_labels(started, recording):
    s = started("health", extra=("driver_version", "memory.free", "temperature.memory", "clocks.current.memory"))
    reg = collected(SmiCollector(s, naming="dcgm", hostname="node-7"))
    rec = recorded(recording)

    def lab(gpu: int) -> dict[str, str]:
        r = rec[gpu]
        return {
            "gpu": str(gpu),
            "UUID": r["uuid"],
            "device": f"nvidia{gpu}",
            "modelName": r["name"],
            "Hostname": "node-7",
            "pci_bus_id": r["pci.bus_id"],
            "DCGM_FI_DRIVER_VERSION": "590.48.01",
        }

    assert reg.get_sample_value("DCGM_FI_DEV_GPU_TEMP", lab(0)) == 71.0
    assert reg.get_sample_value("DCGM_FI_DEV_GPU_TEMP", lab(1)) is None
    assert reg.get_sample_value("DCGM_FI_DEV_GPU_UTIL", lab(0)) == 87.0  # percent, as DCGM
    assert reg.get_sample_value("DCGM_FI_DEV_FB_USED", lab(0)) == 70312.0  # MiB, as DCGM
    assert reg.get_sample_value("DCGM_FI_DEV_FB_FREE", lab(0)) == float(rec[0]["memory.free"])
    assert reg.get_sample_value("DCGM_FI_DEV_POWER_USAGE", lab(0)) == 612.4
    assert reg.get_sample_value("DCGM_FI_DEV_SM_CLOCK", lab(0)) == 1980.0  # MHz
    assert reg.get_sample_value("DCGM_FI_DEV_MEM_CLOCK", lab(0)) == float(rec[0]["clocks.current.memory"])
    assert reg.get_sample_value("DCGM_FI_DEV_MEMORY_TEMP", lab(0)) == float(rec[0]["temperature.memory"])
    assert reg.get_sample_value("DCGM_FI_DEV_PSTATE", lab(2)) == 2.0
    assert reg.get_sample_value("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", lab(2)) == 0x40
    assert reg.get_sample_value("DCGM_FI_DEV_RETIRED_PENDING", lab(3)) == 1.0
    # counters keep DCGM's own names: no _total appended to the samples
    text = render(SmiCollector(s, naming="dcgm", hostname="node-7").collect())
    assert "\nDCGM_FI_DEV_ECC_SBE_VOL_TOTAL{" in text and "# TYPE DCGM_FI_DEV_ECC_SBE_VOL_TOTAL counter\n" in text
    # a field without a DCGM name is kept under its native name and labels
    native = {**labels_of(rec, 2)}
    assert reg.get_sample_value("smiquery_clocks_event_reasons_hw_thermal_slowdown_active", native) == 1.0
    # health metrics keep smiquery's names
    assert reg.get_sample_value("smiquery_up", {}) == 1.0


def _dcgm_counters_csv() -> Path:
    path = DCGM_DIR / "default-counters.csv"
    if not path.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing; CI must check the DCGM mapping against it")
        pytest.skip(f"{path} is not available")
    return path


def test_dcgm_names_and_types_agree_with_dcgm_exporter_default_counters():
    listed: dict[str, str] = {}
    for line in _dcgm_counters_csv().read_text(encoding="utf-8").splitlines():
        line = line.strip().lstrip("#").strip()
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].startswith("DCGM_F"):
            listed[parts[0]] = parts[1]
    ours = {name: typ for entries in DCGM_MAP.values() for name, typ, _ in entries}
    for name, typ in ours.items():
        if name in listed:
            assert typ == listed[name], name
    # the default counters nvidia-smi can supply (the list) are all mapped
    for name in (
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    ):
        assert name in listed and name in ours, name
    # every mapped name is documented
    doc = (ROOT / "docs" / "exporter.md").read_text(encoding="utf-8")
    for name in ours:
        assert f"`{name}`" in doc, f"{name} is not in docs/exporter.md"


def test_native_names_for_every_catalogue_field_are_unique_and_well_formed():
    for naming in ("smiquery", "dcgm"):
        specs = metric_specs("all", naming)  # type: ignore[arg-type]
        samples = [s.sample for s in specs]
        assert len(samples) == len(set(samples)), naming
    for spec in metric_specs("all"):
        assert spec.sample.startswith("smiquery_") and spec.sample == spec.sample.lower(), spec
        if spec.type == "counter":
            assert spec.sample.endswith("_total"), spec
        else:
            assert not spec.sample.endswith(("_total", "_count", "_sum", "_bucket")), spec
        assert spec.help.rstrip().endswith("."), spec


def test_units_convert_to_base_units():
    by_field = {s.field: s for s in metric_specs("all")}
    assert by_field["memory.used"].sample == "smiquery_memory_used_bytes" and by_field["memory.used"].scale == MiB
    assert by_field["clocks.current.sm"].sample == "smiquery_clocks_current_sm_hertz"
    assert by_field["clocks.current.sm"].scale == 1e6
    assert by_field["utilization.gpu"].sample == "smiquery_utilization_gpu_ratio"
    assert by_field["temperature.gpu"].sample == "smiquery_temperature_gpu_celsius"
    assert by_field["power.draw"].sample == "smiquery_power_draw_watts"
    counters = by_field["clocks_event_reasons_counters.sw_power_cap"]
    assert counters.sample == "smiquery_clocks_event_reasons_counters_sw_power_cap_seconds_total"
    assert counters.scale == 1e-6
    assert by_field["retired_pages.single_bit_ecc.count"].sample == "smiquery_retired_pages_single_bit_ecc_total"
    assert by_field["driver_version"].sample == "smiquery_driver_version_info"
    assert by_field["ecc.mode.current"].sample == "smiquery_ecc_mode_current_enabled"


# ------------------------------------------------------------------------------------- exposition format


class FrozenSource:
    """A stand-in stream: one fixed sweep of every catalogue field on two GPUs."""

    interval = 1.0
    running = True
    error = None

    def __init__(self) -> None:
        self.stats = StreamStats(starts=1, sweeps=3, restarts=2, dropped_rows=1)
        self.stats.errors["NvidiaSmiTimeoutError"] = 2
        self.calls = 0
        schema = Schema(tuple(f.name for f in CATALOGUE))
        self.sweep = Sweep([GpuSample(schema, self._values(i), self._raw(i)) for i in range(2)])

    @staticmethod
    def _value(f: Any, i: int) -> Any:
        if f.kind is Kind.TIMESTAMP:
            return datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
        if f.name == "index":
            return i
        if f.name == "pstate":
            return "P8"
        if f.kind.is_bool:
            return i == 0
        if f.kind in (Kind.INT, Kind.HEX, Kind.BITMASK):
            return 7 + i
        if f.kind is Kind.FLOAT:
            return 12.5
        return f'he said "x\\y"\n{i}' if f.name == "serial" else f"v{i}"

    def _values(self, i: int) -> tuple[Any, ...]:
        return tuple(self._value(f, i) for f in CATALOGUE)

    def _raw(self, i: int) -> tuple[str, ...]:
        return tuple(str(self._value(f, i)) for f in CATALOGUE)

    def latest(self) -> tuple[Sweep, float]:
        self.calls += 1
        return self.sweep, 0.25


def _strip_volatile(text: str) -> str:
    return "\n".join(
        ln for ln in text.splitlines() if not ln.startswith(("smiquery_collection_duration", "smiquery_last_sample"))
    )


@pytest.mark.parametrize("naming", ["smiquery", "dcgm"])
def test_fast_path_matches_prometheus_client(naming):
    src = FrozenSource()
    col = SmiCollector(src, fields=list(CATALOGUE), naming=naming, labels={"site": "a\\b"}, hostname="h")
    ours = col.exposition().decode()
    theirs = generate_latest(collected(col)).decode()
    if naming == "smiquery":
        assert _strip_volatile(ours) == _strip_volatile(theirs)
    else:  # generate_latest appends _total to a counter's TYPE line; DCGM's counters keep their own name
        fixed = theirs
        for entries in DCGM_MAP.values():
            for name, typ, _ in entries:
                if typ == "counter":
                    fixed = fixed.replace(f"# HELP {name}_total ", f"# HELP {name} ")
                    fixed = fixed.replace(f"# TYPE {name}_total ", f"# TYPE {name} ")
        assert _strip_volatile(ours) == _strip_volatile(fixed)
    assert r"serial_info{" in ours and r'value="he said \"x\\y\"\n0"' in ours  # escaping
    assert 'site="a\\\\b"' in ours


def test_registering_does_not_collect():
    src = FrozenSource()
    reg = CollectorRegistry()
    reg.register(SmiCollector(src, fields=list(CATALOGUE)))
    assert src.calls == 0


GOLDEN_HEALTH_PRESET = """\
# HELP smiquery_temperature_gpu_celsius GPU core temperature in degrees Celsius (nvidia-smi temperature.gpu, in celsius).
# TYPE smiquery_temperature_gpu_celsius gauge
# HELP smiquery_utilization_gpu_ratio Percent of the sample period during which a kernel was running (nvidia-smi utilization.gpu, converted from % to ratio).
# TYPE smiquery_utilization_gpu_ratio gauge
# HELP smiquery_utilization_memory_ratio Percent of the sample period during which memory was read or written (nvidia-smi utilization.memory, converted from % to ratio).
# TYPE smiquery_utilization_memory_ratio gauge
# HELP smiquery_memory_used_bytes GPU memory allocated by active contexts (nvidia-smi memory.used, converted from MiB to bytes).
# TYPE smiquery_memory_used_bytes gauge
# HELP smiquery_memory_total_bytes Total GPU memory (nvidia-smi memory.total, converted from MiB to bytes).
# TYPE smiquery_memory_total_bytes gauge
# HELP smiquery_power_draw_watts Power drawn by the GPU (1 s average on Ampere and later) (nvidia-smi power.draw, in watts).
# TYPE smiquery_power_draw_watts gauge
# HELP smiquery_power_limit_watts Software power limit (nvidia-smi power.limit, in watts).
# TYPE smiquery_power_limit_watts gauge
# HELP smiquery_pstate_info Performance state, P0 (maximum) to P12/P15 (minimum); the value is the label 'value' (nvidia-smi pstate).
# TYPE smiquery_pstate_info gauge
# HELP smiquery_pstate Performance state, P0 (maximum) to P12/P15 (minimum), as a number (P0 -> 0) (nvidia-smi pstate).
# TYPE smiquery_pstate gauge
# HELP smiquery_clocks_current_sm_hertz Current SM clock (nvidia-smi clocks.current.sm, converted from MHz to hertz).
# TYPE smiquery_clocks_current_sm_hertz gauge
# HELP smiquery_clocks_event_reasons_active_bitmask Bitmask of the clock event reasons active now, as the numeric bitmask (nvidia-smi clocks_event_reasons.active).
# TYPE smiquery_clocks_event_reasons_active_bitmask gauge
# HELP smiquery_clocks_event_reasons_hw_thermal_slowdown_active Whether clocks are held down now by: hw thermal slowdown: 1 = Active, 0 = Not Active (nvidia-smi clocks_event_reasons.hw_thermal_slowdown).
# TYPE smiquery_clocks_event_reasons_hw_thermal_slowdown_active gauge
# HELP smiquery_clocks_event_reasons_sw_thermal_slowdown_active Whether clocks are held down now by: sw thermal slowdown: 1 = Active, 0 = Not Active (nvidia-smi clocks_event_reasons.sw_thermal_slowdown).
# TYPE smiquery_clocks_event_reasons_sw_thermal_slowdown_active gauge
# HELP smiquery_clocks_event_reasons_hw_power_brake_slowdown_active Whether clocks are held down now by: hw power brake slowdown: 1 = Active, 0 = Not Active (nvidia-smi clocks_event_reasons.hw_power_brake_slowdown).
# TYPE smiquery_clocks_event_reasons_hw_power_brake_slowdown_active gauge
# HELP smiquery_ecc_errors_corrected_volatile_total Corrected ECC errors in all locations since the driver loaded (nvidia-smi ecc.errors.corrected.volatile.total).
# TYPE smiquery_ecc_errors_corrected_volatile_total counter
# HELP smiquery_ecc_errors_uncorrected_volatile_total Uncorrected ECC errors in all locations since the driver loaded (nvidia-smi ecc.errors.uncorrected.volatile.total).
# TYPE smiquery_ecc_errors_uncorrected_volatile_total counter
# HELP smiquery_retired_pages_pending Whether retired pages wait for a reboot to take effect: 1 = Yes, 0 = No (nvidia-smi retired_pages.pending).
# TYPE smiquery_retired_pages_pending gauge
# HELP smiquery_up 1 when nvidia-smi delivers fresh samples (newest younger than 15 s), else 0.
# TYPE smiquery_up gauge
# HELP smiquery_stream_info The nvidia-smi stream's state (starting, running, retrying, failed...), its last error type and whether that error needs a person (permanent); always 1.
# TYPE smiquery_stream_info gauge
# HELP smiquery_build_info smiquery's version, its source revision (a commit, or unknown), the driver and its nvidia-smi; always 1.
# TYPE smiquery_build_info gauge
# HELP smiquery_last_sample_timestamp_seconds Unix time at which the newest sweep of nvidia-smi rows was received.
# TYPE smiquery_last_sample_timestamp_seconds gauge
# HELP smiquery_last_sample_age_seconds Age of the newest sweep of nvidia-smi rows.
# TYPE smiquery_last_sample_age_seconds gauge
# HELP smiquery_nvidia_smi_starts_total nvidia-smi loop processes started.
# TYPE smiquery_nvidia_smi_starts_total counter
# HELP smiquery_nvidia_smi_restarts_total nvidia-smi loop processes restarted after a failure.
# TYPE smiquery_nvidia_smi_restarts_total counter
# HELP smiquery_sweeps_total Complete sweeps (one row per GPU) received.
# TYPE smiquery_sweeps_total counter
# HELP smiquery_dropped_rows_total Rows of nvidia-smi output rejected by the parser.
# TYPE smiquery_dropped_rows_total counter
# HELP smiquery_gpu_lost 1 while a GPU seen since the exporter started is lost (nvidia-smi says so, or its rows stopped), else 0.
# TYPE smiquery_gpu_lost gauge
# HELP smiquery_collection_duration_seconds Time spent building this scrape's metrics.
# TYPE smiquery_collection_duration_seconds gauge
"""  # noqa: E501


def test_golden_names_types_and_help_of_the_health_preset(started):
    s = started("health")
    text = SmiCollector(s).exposition().decode()
    meta = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith("#"))
    assert meta == GOLDEN_HEALTH_PRESET


# ---------------------------------------------------------------------------------------- labels & args


def test_parse_labels():
    assert parse_labels(["site=lab", "note=a=b", "empty="]) == {"site": "lab", "note": "a=b", "empty": ""}
    for bad, why in [
        (["novalue"], "key=value"),
        (["9x=1"], "invalid"),
        (["__x=1"], "invalid"),
        (["gpu=1"], "set by the exporter"),
        (["modelName=x"], "set by the exporter"),
        (["a=1", "a=2"], "twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_labels(bad)


def test_serve_validates_before_anything_runs(inproc):
    for kw, why in [
        ({"naming": "prom"}, "naming"),
        ({"interval": 0}, "interval"),
        ({"port": 70000}, "out of range"),
        ({"tls_cert": "x"}, "both"),
        ({"client_ca": "x"}, "need TLS"),
        ({"labels": ["bad"]}, "key=value"),
        ({"fields": "temperature.gpux"}, "unknown field"),
        ({"gpus": "GPU-nope"}, "invalid GPU id"),
    ]:
        with pytest.raises(ValueError, match=why):
            serve(**{"port": 0, **kw})
    assert inproc.calls == []


# ------------------------------------------------------------------------------------------------ server


def get(url: str, timeout: float = 5.0, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def exporter(inproc: InProcessRunner) -> Iterator[Any]:
    """A factory for serve() over the in-process fake ``inproc`` (set its fault or recording first).

    Every exporter is stopped at the end; no child may be left, and no in-process run (``inproc`` checks).
    """
    made: list[Exporter] = []

    def make(**kw: Any) -> Exporter:
        kw.setdefault("port", 0)
        exp = serve(**kw)
        made.append(exp)
        return exp

    yield make
    for exp in made:
        exp.stop()
    assert not wait_no_children(5.0)


def test_serves_metrics_healthz_and_index(exporter, inproc, recording):
    inproc.recording = recording
    exp = exporter(interval=0.1)
    assert exp.bind == "127.0.0.1" and exp.url.startswith("http://127.0.0.1:")
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, what="healthy")
    code, body = get(exp.url + "/metrics")
    assert code == 200 and "smiquery_temperature_gpu_celsius{" in body and "smiquery_up 1.0" in body
    assert get(exp.url + "/")[0] == 200 and "/metrics" in get(exp.url + "/")[1]
    assert get(exp.url + "/nope")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", exp.port)
    conn.request("HEAD", "/metrics")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/plain; version=0.0.4; charset=utf-8"
    assert int(r.getheader("Content-Length") or 0) > 1000 and r.read() == b""
    conn.close()


def test_no_nvidia_smi_start_per_scrape(exporter, inproc):
    exp = exporter(interval=0.1)
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, what="healthy")
    assert len(inproc.calls) == 1
    conn = http.client.HTTPConnection("127.0.0.1", exp.port)
    for _ in range(200):
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and b"smiquery_power_draw_watts{" in r.read()
    conn.close()
    assert len(inproc.calls) == 1 and "-lms" in inproc.calls[0]


def test_healthz_turns_503_when_nvidia_smi_hangs(exporter, inproc):
    inproc.fault = "hang-after:16"
    exp = exporter(interval=0.1, stale_after=0.8, stall_timeout=30)
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, what="healthy")
    wait_for(lambda: get(exp.url + "/healthz")[0] == 503, timeout=10, what="stale")
    code, body = get(exp.url + "/healthz")
    assert code == 503 and body.startswith("stale: newest sample is") and body.count("\n") == 1
    code, metrics = get(exp.url + "/metrics")
    assert code == 200 and "smiquery_up 0.0" in metrics
    assert "smiquery_temperature_gpu_celsius{" not in metrics  # stale values are not served as current
    assert "smiquery_last_sample_age_seconds" in metrics


def test_metrics_answer_while_nvidia_smi_fails(exporter, inproc):
    inproc.fault = "driver-not-loaded"
    exp = exporter(interval=0.1)
    wait_for(lambda: exp.stream.stats.errors["DriverNotLoadedError"] >= 2, what="failures")
    code, body = get(exp.url + "/metrics")
    assert code == 200 and "smiquery_up 0.0" in body
    assert 'smiquery_nvidia_smi_errors_total{source="stream",type="DriverNotLoadedError"}' in body
    assert "smiquery_nvidia_smi_restarts_total" in body
    code, why = get(exp.url + "/healthz")
    assert code == 503 and "retrying" in why and "NVIDIA driver" in why


def test_permanent_failure_keeps_serving_and_retrying(exporter, inproc):
    inproc.fault = "permission"
    exp = exporter(interval=0.1)
    wait_for(lambda: exp.stream.stats.state == "retrying", what="the stream to wait for its next attempt")
    assert exp.stream.running and exp.stream.stats.permanent
    code, why = get(exp.url + "/healthz")
    assert code == 503 and "Insufficient Permissions" in why
    assert "smiquery_up 0.0" in get(exp.url + "/metrics")[1]


def test_processes_are_polled_on_their_own_interval(exporter, inproc):
    exp = exporter(interval=0.1, processes=True, processes_interval=0.3)
    wait_for(lambda: "smiquery_process_used_memory_bytes{" in get(exp.url + "/metrics")[1], what="processes")

    def argvs() -> list[tuple[str, ...]]:
        return list(inproc.calls)

    def polls() -> int:
        return sum(1 for a in argvs() if any(x.startswith("--query-compute-apps") for x in a))

    wait_for(lambda: polls() >= 3, timeout=15, what="three process polls")
    assert sum(1 for a in argvs() if "-lms" in a) == 1  # the loop itself was never restarted


def test_extra_registry_is_appended(exporter):
    from prometheus_client import Counter

    reg = CollectorRegistry()
    Counter("my_app_jobs", "Jobs done.", registry=reg).inc(3)
    exp = exporter(interval=0.1, registry=reg)
    assert "my_app_jobs_total 3.0" in get(exp.url + "/metrics")[1]


def test_port_in_use_says_so(inproc):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"^port {port} on 127.0.0.1 is in use; pick another with --port$"):
            serve(port=port)
    assert inproc.calls == []  # nvidia-smi never started


def test_ipv6_loopback(exporter):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    exp = exporter(bind="::1", interval=0.1)
    assert exp.url.startswith("http://[::1]:")
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, what="healthy")


def test_stop_closes_keepalive_connections_and_reaps(fake_smi):
    # a real child: stopping the exporter reaps it (the process boundary is the subject)
    with no_leaks(reap_timeout=5.0):
        exp = serve(port=0, interval=0.1, nvidia_smi=fake_smi())
        wait_for(lambda: get(exp.url + "/healthz")[0] == 200, what="healthy")
        conn = http.client.HTTPConnection("127.0.0.1", exp.port)
        conn.request("GET", "/metrics")
        conn.getresponse().read()  # the connection stays open (HTTP/1.1 keep-alive)
        exp.stop()
        exp.stop()  # idempotent
        conn.close()


# ------------------------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return path

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, *, ca: bool, usage: Any = None, san: Any = None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write_cert(c: Any, path: Path) -> Path:
        path.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("smiquery test CA", ca_key, "smiquery test CA", ca_key, ca=True)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = cert(
        "127.0.0.1",
        srv_key,
        "smiquery test CA",
        ca_key,
        ca=False,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = cert("prometheus", cli_key, "smiquery test CA", ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key = ec.generate_private_key(ec.SECP256R1())
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = cert(
        "stranger", stranger_key, "someone else", other_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    return {
        "ca": write_cert(ca, d / "ca.pem"),
        "cert": write_cert(srv, d / "server.pem"),
        "key": write_key(srv_key, d / "server.key"),
        "client_cert": write_cert(cli, d / "client.pem"),
        "client_key": write_key(cli_key, d / "client.key"),
        "stranger_cert": write_cert(stranger, d / "stranger.pem"),
        "stranger_key": write_key(stranger_key, d / "stranger.key"),
    }


def client_context(pki: dict[str, Path], who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if who is not None:
        ctx.load_cert_chain(str(pki[f"{who}_cert"]), str(pki[f"{who}_key"]))
    return ctx


def test_tls(exporter, pki):
    exp = exporter(interval=0.1, tls_cert=pki["cert"], tls_key=pki["key"])
    assert exp.url.startswith("https://127.0.0.1:")
    wait_for(lambda: get(exp.url + "/healthz", context=client_context(pki, None))[0] == 200, what="healthy")
    code, body = get(exp.url + "/metrics", context=client_context(pki, None))
    assert code == 200 and "smiquery_up 1.0" in body
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        get(f"http://127.0.0.1:{exp.port}/metrics", timeout=3)  # plain HTTP to the TLS port


def test_tls_client_certificates_are_required(exporter, pki):
    exp = exporter(interval=0.1, tls_cert=pki["cert"], tls_key=pki["key"], client_ca=pki["ca"])
    wait_for(lambda: get(exp.url + "/healthz", context=client_context(pki, "client"))[0] == 200, what="healthy")
    assert get(exp.url + "/metrics", context=client_context(pki, "client"))[0] == 200
    for who in (None, "stranger"):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            get(exp.url + "/metrics", context=client_context(pki, who), timeout=3)
    # the server is still fine after refusing them
    assert get(exp.url + "/metrics", context=client_context(pki, "client"))[0] == 200


# -------------------------------------------------------------------------------------------------- CLI


def flat(text: str) -> str:
    """Text without rich's box drawing and line wrapping."""
    return " ".join(text.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def in_process_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m smiquery export ARGS` run in this process (typer's test runner), from the checkout."""

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(smiquery_app, ["export", *args])
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["export", *args], result.exit_code, result.stdout, result.stderr)


def cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`python -m smiquery export ARGS` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "smiquery", "export", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        **kw,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "Invalid value for '--interval'"),
        (["--port", "70000"], "--port"),
        (["--fields", "temperature.gpux"], "unknown field 'temperature.gpux'"),
        (["--gpus", "GPU-zz"], "invalid GPU id"),
        (["--label", "novalue"], "not key=value"),
        (["--label", "gpu=1"], "set by the exporter"),
        (["--naming", "prom"], "--naming"),
        (["--tls-cert", "pyproject.toml"], "both --tls-cert and --tls-key"),
        (["--client-ca", "pyproject.toml"], "client certificates need HTTPS"),
        (["--tls-cert", "/no/such.pem", "--tls-key", "/no/such.key"], "does not exist"),
        (["--bind", "192.0.2.1", "--port", "0"], "the address is not on this machine"),
        (["--bind", "no-such-host.invalid", "--port", "0"], "cannot listen on 'no-such-host.invalid'"),
        (["--alert", "temperature.gpu >> 5"], "invalid alert"),
        (["--log-format", "xml"], "--log-format"),
        (["--web-config-file", "pyproject.toml"], "not valid YAML"),
    ],
)
def test_cli_usage_errors(inproc, args, message):
    done = in_process_cli(*args, "--nvidia-smi", "/bin/true")
    assert done.returncode == 2, done.stderr
    assert message in flat(done.stderr), done.stderr
    assert inproc.calls == []  # refused before nvidia-smi ran


def test_cli_port_in_use(inproc):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = in_process_cli("--port", str(port), "--nvidia-smi", FAKE_PATH)
    assert done.returncode == 1
    assert done.stderr.strip() == f"smiquery: error: port {port} on 127.0.0.1 is in use; pick another with --port"


def test_cli_missing_nvidia_smi_exits_3(tmp_path):
    with use_runner(SubprocessRunner()):  # the real lookup
        done = in_process_cli("--port", "0", "--nvidia-smi", str(tmp_path / "nope"))
    assert done.returncode == 3 and done.stderr.startswith("smiquery: error: ")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_cli_serves_and_stops_cleanly_on_signals(fake_smi, tmp_path, sig, code):
    log = tmp_path / "calls.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smiquery",
            "export",
            "--port",
            "0",
            "--interval",
            "0.1",
            "--nvidia-smi",
            str(fake_smi(log=log)),
            "--label",
            "site=lab",
            "--naming",
            "dcgm",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving http://127.0.0.1:" in line, line
        url = line.split("serving ", 1)[1].split("/metrics", 1)[0]
        wait_for(lambda: get(url + "/healthz")[0] == 200, what="healthy")
        body = get(url + "/metrics")[1]
        assert "DCGM_FI_DEV_GPU_TEMP{" in body and 'site="lab"' in body
        child = json.loads(log.read_text().splitlines()[0])["pid"]
        proc.send_signal(sig)
        assert proc.wait(15) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # nvidia-smi was reaped with the exporter


def test_export_help_lists_its_options():
    result = CliRunner().invoke(smiquery_app, ["export", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for opt in ("--port", "--bind", "--interval", "--fields", "--gpus", "--label", "--naming", "--processes"):
        assert opt in text
    assert "--tls-cert" in text and "--client-ca" in text and "--nvidia-smi" in text


def test_docs_list_every_native_metric_and_health_metric():
    from smiquery.exporter import HEALTH_METRICS

    doc = (ROOT / "docs" / "exporter.md").read_text(encoding="utf-8")
    for spec in metric_specs("all"):
        assert f"`{spec.sample}`" in doc, spec.sample
    for name in HEALTH_METRICS:
        assert f"`{name}" in doc, name


def test_a_process_listed_twice_on_one_gpu_is_one_series():
    from smiquery.exporter.families import process_families
    from smiquery.sources.apps import GpuProcess

    rows = [
        GpuProcess(7, "train.py", "GPU-a", 0, 100),
        GpuProcess(7, "train.py", "GPU-a", 0, 28),
        GpuProcess(7, "train.py", "GPU-b", 1, 5),
        GpuProcess(8, "idle.py", "GPU-b", 1, None),
    ]
    (fam,) = process_families(rows, {})
    got = {(s.labels["pid"], s.labels["gpu"]): s.value for s in fam.samples}
    assert got == {("7", "0"): 128 * MiB, ("7", "1"): 5 * MiB}


def test_hostname_label_overrides_the_dcgm_hostname():
    col = SmiCollector(FrozenSource(), fields=list(CATALOGUE), naming="dcgm", labels=["Hostname=node-9"])
    text = col.exposition().decode()
    assert 'Hostname="node-9"' in text and text.count("Hostname=") >= text.count("DCGM_FI_DEV_GPU_TEMP{")


# ------------------------------------------------------------------------------ v2: state, lost GPUs, alerts


def _sample(index: int, uuid: str, temp: float | None = 60.0, lost: bool = False) -> GpuSample:
    schema = Schema(("index", "uuid", "name", "pci.bus_id", "temperature.gpu"))
    return GpuSample(
        schema,
        (index, uuid, "NVIDIA H100", f"00000000:{index:02X}:00.0", None if lost else temp),
        (str(index), uuid, "NVIDIA H100", f"00000000:{index:02X}:00.0", "[GPU is lost]" if lost else str(temp)),
        gpu_lost=lost,
    )


class ScriptedSource:
    """A stand-in SampleSource: the test sets each sweep and the stats (core v2's fields included)."""

    interval = 1.0

    def __init__(self) -> None:
        self.fields = resolve_fields(["index", "uuid", "name", "pci.bus_id", "temperature.gpu"])
        self.stats = StreamStats()
        self.running = True
        self.error: BaseException | None = None
        self._latest: tuple[Sweep, float] | None = None

    def publish(self, *samples: GpuSample, age: float = 0.1) -> None:
        self.stats.sweeps += 1
        self.stats.rows += len(samples)
        self.stats.state = "running"
        self._latest = (Sweep(samples), age)

    def latest(self) -> tuple[Sweep | None, float | None]:
        return self._latest if self._latest is not None else (None, None)


UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


def _scripted(**kw: Any) -> tuple[ScriptedSource, SmiCollector, CollectorRegistry]:
    src = ScriptedSource()
    col = SmiCollector(src, fields=src.fields, hostname="node-1", **kw)
    return src, col, collected(col)


def test_retrying_after_a_permanent_error_shows_up_0_the_error_type_and_next_attempt():
    src, col, reg = _scripted()
    src.publish(*(_sample(i, UUIDS[i]) for i in range(2)))
    assert reg.get_sample_value("smiquery_up", {}) == 1.0
    # the stream (core v2) keeps retrying a permanent error; the newest sweep is still young
    src.stats.state, src.stats.permanent = "retrying", True
    src.stats.last_error_type, src.stats.last_error = "DriverVersionMismatchError", "Driver/library version mismatch"
    src.stats.next_retry_at = time.time() + 30
    assert reg.get_sample_value("smiquery_up", {}) == 0.0
    info = {"state": "retrying", "last_error_type": "DriverVersionMismatchError", "permanent": "true"}
    assert reg.get_sample_value("smiquery_stream_info", info) == 1.0
    assert reg.get_sample_value("smiquery_next_attempt_timestamp_seconds", {}) == src.stats.next_retry_at
    ok, why = col.health()
    assert not ok and "permanent" in why and "DriverVersionMismatchError" in why and "next attempt in" in why
    # the fault clears: the next sweep brings it back at once
    src.stats.state, src.stats.permanent, src.stats.next_retry_at = "running", False, None
    src.publish(*(_sample(i, UUIDS[i]) for i in range(2)))
    assert reg.get_sample_value("smiquery_up", {}) == 1.0
    assert reg.get_sample_value("smiquery_next_attempt_timestamp_seconds", {}) is None
    assert col.health() == (True, "ok")


def test_a_source_that_ended_with_an_error_reads_as_failed():
    src, _col, reg = _scripted()
    src.running, src.error = False, InvalidFieldError("bogus.field")
    labels = {"state": "failed", "last_error_type": "InvalidFieldError", "permanent": "false"}
    assert reg.get_sample_value("smiquery_stream_info", labels) == 1.0
    assert reg.get_sample_value("smiquery_up", {}) == 0.0


def test_a_gpu_whose_rows_stop_is_lost_by_uuid_until_it_comes_back():
    changes: list[tuple[bool, int, str | None]] = []
    src, col, reg = _scripted(on_gpu_change=lambda *a: changes.append(a))
    src.publish(*(_sample(i, UUIDS[i]) for i in range(4)))
    lab = {"gpu": "2", "uuid": UUIDS[2], "name": "NVIDIA H100", "pci_bus_id": "00000000:02:00.0"}
    assert reg.get_sample_value("smiquery_gpu_lost", lab) == 0.0
    # GPU 2 drops out; after a restart NVML renumbers the GPUs behind it (3 becomes 2)
    survivors = [_sample(0, UUIDS[0]), _sample(1, UUIDS[1]), _sample(2, UUIDS[3])]
    src.publish(*survivors)
    col.refresh()
    assert not col.lost_gpus()  # one short sweep is not a lost GPU
    src.publish(*survivors)
    assert reg.get_sample_value("smiquery_gpu_lost", lab) == 1.0
    moved = {"gpu": "2", "uuid": UUIDS[3], "name": "NVIDIA H100", "pci_bus_id": "00000000:02:00.0"}
    assert reg.get_sample_value("smiquery_gpu_lost", moved) == 0.0
    assert reg.get_sample_value("smiquery_up", {}) == 1.0  # data flows; the loss is its own signal
    ok, why = col.health()
    assert not ok and UUIDS[2] in why
    assert changes == [(True, 2, UUIDS[2])]
    # stale data does not forget it either
    src.publish(*survivors, age=1e6)
    assert col.lost_gpus() == [(2, UUIDS[2])]
    src.publish(*(_sample(i, UUIDS[i]) for i in range(4)))
    assert reg.get_sample_value("smiquery_gpu_lost", {**lab}) == 0.0
    assert changes[-1] == (False, 2, UUIDS[2]) and col.health() == (True, "ok")


def test_gpu_reported_lost_by_the_source_before_the_collector_saw_it():
    src, _col, reg = _scripted()
    src.stats.known_gpus = {0: UUIDS[0], 5: UUIDS[3]}
    src.stats.lost_gpus = {5}
    src.publish(_sample(0, UUIDS[0]))
    assert reg.get_sample_value("smiquery_gpu_lost", {"gpu": "5", "uuid": UUIDS[3]}) == 1.0


def test_lost_gpu_carries_the_dcgm_labels_in_dcgm_naming():
    src, _col, reg = _scripted(naming="dcgm")
    src.publish(_sample(0, UUIDS[0]), _sample(1, UUIDS[1], lost=True))
    src.publish(_sample(0, UUIDS[0]), _sample(1, UUIDS[1], lost=True))
    lab = {
        "gpu": "1",
        "UUID": UUIDS[1],
        "device": "nvidia1",
        "modelName": "NVIDIA H100",
        "Hostname": "node-1",
        "pci_bus_id": "00000000:01:00.0",
    }
    assert reg.get_sample_value("smiquery_gpu_lost", lab) == 1.0
    assert (
        reg.get_sample_value(
            "smiquery_gpu_lost",
            {**lab, "gpu": "0", "UUID": UUIDS[0], "device": "nvidia0", "pci_bus_id": "00000000:00:00.0"},
        )
        == 0.0
    )


def test_consecutive_samples_rule_counts_nvidia_smi_samples_not_scrapes():
    from smiquery.alerts import AlertEvaluator

    src, col, reg = _scripted(alerts=AlertEvaluator(["temperature.gpu > 85 for 3"]))
    lab = {
        "gpu": "0",
        "uuid": UUIDS[0],
        "name": "NVIDIA H100",
        "pci_bus_id": "00000000:00:00.0",
        "alert": "temperature.gpu > 85 for 3",
    }
    for temp in (90, 91, 60, 92, 93):  # never three hot samples in a row
        src.publish(_sample(0, UUIDS[0], temp))
        col.refresh()
    assert reg.get_sample_value("smiquery_alert_firing", lab) == 0.0
    assert reg.get_sample_value("smiquery_alert_fired_total", lab) == 0.0
    # three hot samples between two scrapes, then cool: the scrape after still sees that it fired
    for temp in (94, 95, 96, 60):
        src.publish(_sample(0, UUIDS[0], temp))
        col.refresh()
    assert reg.get_sample_value("smiquery_alert_firing", lab) == 0.0
    assert reg.get_sample_value("smiquery_alert_fired_total", lab) == 1.0
    for temp in (90, 90, 90):
        src.publish(_sample(0, UUIDS[0], temp))
        col.refresh()
    assert reg.get_sample_value("smiquery_alert_firing", lab) == 1.0
    assert reg.get_sample_value("smiquery_alert_fired_total", lab) == 2.0


def test_event_log_is_rate_limited_and_says_how_much_it_held_back(caplog):
    from smiquery.exporter import EventLog

    now = [0.0]
    ev = EventLog(burst=2, period=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="smiquery.exporter"):
        sent = [ev.emit("restart", logging.WARNING, f"restart {i}") for i in range(10)]
        assert sent == [True, True] + [False] * 8
        now[0] += 60.0
        assert ev.emit("restart", logging.WARNING, "restart again")
        assert ev.emit("gpu_lost", logging.WARNING, "other kinds have their own budget")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[2] == "restart again (8 similar messages suppressed)"
    assert len(msgs) == 4


def test_json_log_lines(capsys):
    from smiquery.exporter import EventLog, configure_logging

    handler = configure_logging("json")
    try:
        EventLog().on_gpu_change(True, 3, UUIDS[3])
    finally:
        logging.getLogger("smiquery").removeHandler(handler)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    got = json.loads(line)
    assert got["level"] == "warning" and got["event"] == "gpu_lost"
    assert got["gpu"] == 3 and got["uuid"] == UUIDS[3] and UUIDS[3] in got["msg"]


def test_stream_events_are_logged_at_warning_without_debug(caplog):
    from smiquery.exporter import EventLog
    from smiquery.source import StreamEvent

    ev = EventLog()
    with caplog.at_level(logging.INFO, logger="smiquery.exporter"):
        ev.on_stream_event(
            StreamEvent("restart", NvidiaSmiTimeoutError("nvidia-smi did not answer within 10 s"), "in 2.00 s")
        )
        ev.on_stream_event(StreamEvent("recovered", None, "rows flow again"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "restart" in caplog.records[0].getMessage()


# ------------------------------------------------------------------------------ v2: real processes


def test_build_info_and_livez_while_nvidia_smi_cannot_start(exporter, inproc):
    inproc.fault = "version-mismatch"
    exp = exporter(interval=0.1, nvidia_smi=FAKE_PATH)
    wait_for(
        lambda: (
            'last_error_type="' in get(exp.url + "/metrics")[1]
            and 'last_error_type=""' not in get(exp.url + "/metrics")[1]
        ),
        20,
        "the error type",
    )
    code, body = get(exp.url + "/metrics")
    assert code == 200 and "smiquery_up 0.0" in body
    assert re.search(r'smiquery_stream_info\{last_error_type="\w+Error"', body)
    build = r'smiquery_build_info\{driver_version="[^"]*",nvidia_smi="[^"]+nvidia-smi",revision="\w+",version="'
    assert re.search(build, body)
    assert get(exp.url + "/livez") == (200, "ok\n")
    assert get(exp.url + "/readyz")[0] == 503


def test_a_gpu_that_drops_out_after_a_restart_is_lost_by_uuid(exporter, inproc, tmp_path, recording, caplog):
    rec = recorded(recording)
    # the fake crashes after two sweeps; it then replays a recording without GPU 7, as a GPU that fell off the bus
    inproc.recording, inproc.fault = recording, "crash-after:16"
    with caplog.at_level(logging.INFO, logger="smiquery.exporter"):
        exp = exporter(interval=0.1)
        wait_for(lambda: get(exp.url + "/readyz")[0] == 200, 20, "ready")
        lines = recording.read_text(encoding="utf-8").splitlines()
        short = tmp_path / "seven.csv"
        short.write_text("\n".join(lines[:8]) + "\n", encoding="utf-8")
        inproc.recording, inproc.fault = short, None
        lab = labels_of(rec, 7)
        reg_text = lambda: get(exp.url + "/metrics")[1]  # noqa: E731
        wait_for(
            lambda: (
                f'smiquery_gpu_lost{{gpu="7",name="{lab["name"]}",pci_bus_id="{lab["pci_bus_id"]}",'
                f'uuid="{lab["uuid"]}"}} 1.0' in reg_text()
            ),
            30,
            "GPU 7 lost",
        )
        code, why = get(exp.url + "/readyz")
        assert code == 503 and lab["uuid"] in why
        assert get(exp.url + "/livez")[0] == 200
        assert "smiquery_up 1.0" in reg_text()
    assert any(r.levelno == logging.WARNING and lab["uuid"] in r.getMessage() for r in caplog.records)


def test_recovers_by_itself_when_a_permanent_error_clears(exporter, inproc, recording, monkeypatch):
    inproc.recording, inproc.fault = recording, "version-mismatch"
    # revive_after stands in for the retry period: a core that stops on permanent errors gets a new stream after
    # it; the core v2 supervisor retries by itself (state "retrying"). Either way the exporter says so and recovers.
    # The supervisor's period for faults that need a person (30 s) is shortened to 2 s for the exporter's stream:
    # the same path, without half a minute of waiting.
    import smiquery.exporter.server as server

    monkeypatch.setattr(server, "RetryPolicy", functools.partial(RetryPolicy, permanent_retry=2.0))
    exp = exporter(interval=0.1, revive_after=1.0)

    def waiting() -> bool:
        body = get(exp.url + "/metrics")[1]
        return (
            "smiquery_next_attempt_timestamp_seconds " in body
            and 'last_error_type="DriverVersionMismatchError"' in body
        )

    wait_for(waiting, 30, "the error and the next attempt")
    body = get(exp.url + "/metrics")[1]
    assert "smiquery_up 0.0" in body and re.search(r'state="(retrying|failed)"', body)
    code, why = get(exp.url + "/readyz")
    assert code == 503 and ("next attempt in" in why or "a new one starts in" in why), why
    assert get(exp.url + "/livez")[0] == 200
    inproc.fault = None  # the driver is fixed (the reboot happened)
    wait_for(lambda: get(exp.url + "/readyz")[0] == 200, 90, "recovery within one retry period")
    assert "smiquery_up 1.0" in get(exp.url + "/metrics")[1]


# ------------------------------------------------------------------------------ v2: HTTP hardening


def _raw_get(port: int, path: str = "/metrics", timeout: float = 10.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_slow_clients_cost_no_thread_and_good_clients_are_served(exporter):
    exp = exporter(interval=0.1, max_connections=64, request_timeout=2.0)
    wait_for(lambda: _raw_get(exp.port, "/readyz") == 200, 20, "ready")
    before = threading.active_count()
    slow = []
    try:
        for _ in range(200):  # more than max_connections: the oldest incomplete ones make room
            s = socket.create_connection(("127.0.0.1", exp.port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
            slow.append(s)
        for _ in range(20):
            assert _raw_get(exp.port) == 200
        assert threading.active_count() == before
        assert exp.http.open_connections <= 64
    finally:
        for s in slow:
            s.close()


def test_an_unfinished_request_head_is_cut_off_at_the_deadline(exporter):
    exp = exporter(interval=0.1, request_timeout=1.0)
    with socket.create_connection(("127.0.0.1", exp.port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        for _ in range(3):
            with contextlib.suppress(OSError):
                s.sendall(b"X-a: b\r\n")  # trickling bytes does not extend the deadline
            time.sleep(0.3)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                data += chunk
    assert data.startswith(b"HTTP/1.1 408")


def test_bad_requests_get_4xx_and_the_server_goes_on(exporter):
    exp = exporter(interval=0.1)
    for raw, code in (
        (b"garbage\r\n\r\n", b"400"),
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", b"413"),
        (b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"400"),  # HTTP/1.1 without Host
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", b"431"),
    ):
        with socket.create_connection(("127.0.0.1", exp.port), timeout=10) as s:
            s.sendall(raw)
            assert s.recv(100).split(b" ")[1] == code, raw[:20]
    assert _raw_get(exp.port, "/livez") == 200


def test_keep_alive_serves_many_requests_on_one_connection(exporter):
    exp = exporter(interval=0.1)
    conn = http.client.HTTPConnection("127.0.0.1", exp.port, timeout=10)
    try:
        for _ in range(50):
            conn.request("GET", "/livez")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"ok\n")
    finally:
        conn.close()


# ------------------------------------------------------------------------------ v2: web config


def _hash(password: str) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


def test_web_config_basic_auth(exporter, tmp_path):
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"basic_auth_users:\n  prometheus: '{_hash('s3cret')}'\n", encoding="utf-8")
    exp = exporter(interval=0.1, web_config=cfg)
    assert get(exp.url + "/metrics")[0] == 401
    good = base64.b64encode(b"prometheus:s3cret").decode()
    bad = base64.b64encode(b"prometheus:nope").decode()
    for auth, code in ((good, 200), (bad, 401), (good, 200)):
        req = urllib.request.Request(exp.url + "/metrics", headers={"Authorization": f"Basic {auth}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                got = r.status
        except urllib.error.HTTPError as exc:
            got = exc.code
        assert got == code


def test_web_config_tls_with_client_certificates(exporter, tmp_path, pki):
    cfg = tmp_path / "web.yml"
    cfg.write_text(
        "tls_server_config:\n"
        f"  cert_file: {pki['cert']}\n  key_file: {pki['key']}\n  client_ca_file: {pki['ca']}\n"
        "  client_auth_type: RequireAndVerifyClientCert\n",
        encoding="utf-8",
    )
    exp = exporter(interval=0.1, web_config=cfg)
    assert exp.url.startswith("https://")
    wait_for(lambda: get(exp.url + "/readyz", context=client_context(pki, "client"))[0] == 200, 20, "ready")
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        get(exp.url + "/metrics", context=client_context(pki, None), timeout=3)


# ------------------------------------------------------------------------------ v2: nvidia_gpu_exporter naming

NVSMI_DIR = SHARED / "nvidia_gpu_exporter"
# Families nvidia_gpu_exporter serves that --naming nvidia_smi does not, and why (docs/exporter.md says the same):
NVSMI_NOT_SERVED = {
    "nvidia_smi_command_exit_code": "its own scrape bookkeeping; smiquery_up and smiquery_stream_info say more",
    "nvidia_smi_failed_scrapes_total": "as above",
    "nvidia_smi_last_collect_success": "as above",
    "nvidia_smi_name": "the name text read as a number (RTX 4080 -> 4080): not a measurement",
    "nvidia_smi_driver_version": "the version text read as a number: not a measurement",
    # served with --processes (tested below), not from --query-gpu:
    "nvidia_smi_compute_app_info": "",
    "nvidia_smi_compute_app_used_memory_bytes": "",
    "nvidia_smi_compute_apps": "",
    "nvidia_smi_compute_apps_last_collect_success": "",
}


def _nvsmi_pairs() -> list[Path]:
    got = sorted((NVSMI_DIR / "expected-metrics").glob("*.metrics"))
    if not got and os.environ.get("CI") == "true":
        pytest.fail(f"{NVSMI_DIR} is missing; CI must compare the nvidia_smi naming with it")
    return got


def _samples_of(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"(\w+)(\{[^}]*\})? (\S+)$", line)
        assert m, line
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


@pytest.mark.parametrize("expected", _nvsmi_pairs(), ids=lambda p: p.stem)
def test_nvidia_smi_naming_matches_nvidia_gpu_exporter_on_corpus_captures(expected):
    from smiquery.sources.query_gpu import CsvParser

    capture = SHARED / "nvsmi-corpus" / "csv" / f"utkuozdemir__{expected.stem}.csv"
    rows = list(csv.reader(capture.read_text(encoding="utf-8").splitlines(), skipinitialspace=True))
    names = [h.split(" [")[0].strip() for h in rows[0]]
    known = [n for n in names if n in {f.name for f in CATALOGUE}]
    flds = resolve_fields(known)
    cols = [names.index(n) for n in known]
    parser = CsvParser(flds, strict=False)
    samples = [s for s in (parser.feed(", ".join(r[i] for i in cols)) for r in rows) if s is not None]
    src = ScriptedSource()
    col = SmiCollector(src, fields=flds, naming="nvidia_smi")
    ours = _samples_of(render(col.sweep_families(Sweep(samples))))
    theirs = _samples_of(expected.read_text(encoding="utf-8"))
    info_ours = {k: v for k, v in ours.items() if k[0] == "nvidia_smi_gpu_info"}
    compared = 0
    for (name, labels), value in theirs.items():
        if name in NVSMI_NOT_SERVED:
            continue
        if name == "nvidia_smi_gpu_info":
            # the same identity labels, except cuda_version (nvidia-smi's banner, not a query field)
            want = re.sub(r'cuda_version="[^"]*",?', "", labels)
            assert (name, want) in info_ours, (want, list(info_ours))
            continue
        assert (name, labels) in ours, f"{name}{labels} is not served"
        assert ours[(name, labels)] == pytest.approx(value, rel=1e-9), name
        compared += 1
    assert compared > 20
    # and nothing is served that they would not (a missing value stays absent, never 0)
    extra = {k[0] for k in ours} - {k[0] for k in theirs}
    assert not extra, extra


def test_nvidia_smi_naming_serves_processes_and_the_dashboard_variables(exporter):
    exp = exporter(interval=0.1, naming="nvidia_smi", processes=True, processes_interval=0.2)
    # the process poll and the loop's first sweep arrive in either order: wait for both
    both = ("nvidia_smi_compute_app_used_memory_bytes{", "\nnvidia_smi_index{")
    wait_for(lambda: all(x in get(exp.url + "/metrics")[1] for x in both), 30, "processes and the first sweep")
    body = get(exp.url + "/metrics")[1]
    for name in (
        "nvidia_smi_index",
        "nvidia_smi_gpu_info",
        "nvidia_smi_temperature_gpu",
        "nvidia_smi_power_draw_watts",
    ):
        assert re.search(rf'^{name}\{{.*uuid="[0-9a-f-]+"', body, re.M), name
    assert 'uuid="GPU-' not in body.split("# HELP smiquery_up")[0]  # the peer's labels carry the bare UUID
    assert "nvidia_smi_compute_apps_last_collect_success 1.0" in body
    assert "smiquery_up 1.0" in body  # smiquery's own health metrics stay


def test_fields_supported_asks_the_driver_once_and_skips_what_no_gpu_supports(exporter, inproc, tmp_path, recording):
    lines = recording.read_text(encoding="utf-8").splitlines()
    lines = [lines[0] + ", encoder.stats.sessionCount"] + [ln + ", [Not Supported]" for ln in lines[1:]]
    rec = tmp_path / "with-unsupported.csv"
    rec.write_text("\n".join(lines) + "\n", encoding="utf-8")
    inproc.recording = rec
    exp = exporter(interval=0.1, fields="supported")
    wait_for(lambda: get(exp.url + "/readyz")[0] == 200, 20, "ready")
    body = get(exp.url + "/metrics")[1]
    # fields outside the health preset that this recording (driver) supplies are exported
    assert "smiquery_power_draw_instant_watts{" in body and "smiquery_pcie_link_gen_gpucurrent{" in body
    calls = list(inproc.calls)
    assert sum("--help-query-gpu" in argv for argv in calls) == 1
    loop = [argv for argv in calls if any(a.startswith("-l") for a in argv)]
    assert loop and not any("encoder.stats.sessionCount" in " ".join(argv) for argv in loop)


def test_cli_json_logs_say_what_fails_without_debug(fake_smi, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smiquery",
            "export",
            "--port",
            "0",
            "--interval",
            "0.1",
            "--log-format",
            "json",
            "--nvidia-smi",
            str(fake_smi(fault="crash-after:8")),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines: list[dict[str, Any]] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(x.get("event") == "restart" for x in lines):
            text = proc.stderr.readline()
            if text.startswith("{"):
                lines.append(json.loads(text))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    restart = next(x for x in lines if x.get("event") == "restart")
    assert restart["level"] == "warning" and "nvidia-smi" in restart["msg"] and restart["logger"] == "smiquery.exporter"


def test_rate_limit_filter_holds_back_repeats_of_any_smiquery_line():
    from smiquery.exporter.events import RateLimitFilter

    now = [0.0]
    flt = RateLimitFilter(burst=1, period=60.0, clock=lambda: now[0])

    def rec(level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("smiquery", level, __file__, 1, "restarting nvidia-smi in %.2f s", (2.0,), None)

    assert [flt.filter(rec()) for _ in range(4)] == [True, False, False, False]
    assert flt.filter(rec(logging.ERROR))  # errors always go out
    now[0] += 60.0
    r = rec()
    assert flt.filter(r)
    assert r.getMessage() == "restarting nvidia-smi in 2.00 s (3 similar messages suppressed)"


def test_tls_clients_that_never_finish_the_handshake_do_not_block_others(exporter, pki):
    exp = exporter(interval=0.1, tls_cert=pki["cert"], tls_key=pki["key"], request_timeout=1.0)
    ctx = client_context(pki, None)
    wait_for(lambda: get(exp.url + "/readyz", context=ctx)[0] == 200, 20, "ready")
    stalled = [socket.create_connection(("127.0.0.1", exp.port), timeout=10) for _ in range(50)]
    try:
        for s in stalled[:10]:
            s.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and nothing more
        for _ in range(10):
            assert get(exp.url + "/metrics", context=ctx)[0] == 200
        # the handshake deadline closes them
        stalled[0].settimeout(30)
        assert stalled[0].recv(100) == b""
    finally:
        for s in stalled:
            s.close()


def test_listen_backlog_is_not_five(exporter):
    # 5 (socketserver's default) made new-connection clients time out under load; the kernel reports a listening
    # socket's backlog as its Send-Q
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("ss (iproute2) is not installed")
    exp = exporter(interval=0.1)
    out = subprocess.run([ss, "-ltnH", f"sport = :{exp.port}"], capture_output=True, text=True, check=True).stdout
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(out.split()[2]) == min(1024, somaxconn), out


def test_two_hundred_clients_at_once_all_get_answers(exporter):
    exp = exporter(interval=0.1)
    wait_for(lambda: _raw_get(exp.port, "/readyz") == 200, 20, "ready")
    codes: list[int] = []
    go = threading.Event()

    def one() -> None:
        go.wait()
        try:
            codes.append(_raw_get(exp.port, timeout=30))
        except OSError as exc:
            codes.append(-1)
            print(exc)

    threads = [threading.Thread(target=one) for _ in range(200)]
    for th in threads:
        th.start()
    go.set()
    for th in threads:
        th.join(60)
    assert codes.count(200) == 200, sorted(set(codes))


def test_dcgm_defaults_cover_every_default_counter_nvidia_smi_can_supply():
    from smiquery.exporter.naming import exporter_fields

    listed = set()
    for line in _dcgm_counters_csv().read_text(encoding="utf-8").splitlines():
        parts = [p.strip() for p in line.strip().split(",")]  # commented-out lines are not defaults
        if len(parts) >= 3 and parts[0].startswith("DCGM_F") and parts[1] != "label":
            listed.add(parts[0])
    suppliable = {name for entries in DCGM_MAP.values() for name, _, _ in entries} & listed
    defaults = {s.name for s in metric_specs(exporter_fields("health", "dcgm"), "dcgm")}
    assert suppliable - defaults == set()
    for name in ("DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_FB_RESERVED"):
        assert name in defaults
    assert {"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"} <= defaults
