"""`smiquery export` serves from a lean process: typer parses, then the process image is replaced (same pid) by one
that holds no command-line framework; the same series as before, plus the standard process_* self-metrics; the
build's revision on smiquery_build_info; `smiquery export --version`. Real processes, the fake nvidia-smi, HTTP."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smiquery.cli._export_run import MODULES_ENV
from smiquery.exporter.collector import revision
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]

#: The metric families `smiquery export --interval 1 --kernel-log ''` served (health preset, default options),
#: taken from the exporter before it was made lean (commit 1f3cc1f).
BEFORE = {
    "smiquery_alert_fired",
    "smiquery_alert_firing",
    "smiquery_build_info",
    "smiquery_clocks_current_sm_hertz",
    "smiquery_clocks_event_reasons_active_bitmask",
    "smiquery_clocks_event_reasons_hw_power_brake_slowdown_active",
    "smiquery_clocks_event_reasons_hw_thermal_slowdown_active",
    "smiquery_clocks_event_reasons_sw_thermal_slowdown_active",
    "smiquery_collection_duration_seconds",
    "smiquery_details_last_success_timestamp_seconds",
    "smiquery_details_up",
    "smiquery_dropped_rows",
    "smiquery_ecc_errors_corrected_volatile",
    "smiquery_ecc_errors_uncorrected_volatile",
    "smiquery_gpu_lost",
    "smiquery_last_sample_age_seconds",
    "smiquery_last_sample_timestamp_seconds",
    "smiquery_memory_total_bytes",
    "smiquery_memory_used_bytes",
    "smiquery_nvidia_smi_restarts",
    "smiquery_nvidia_smi_starts",
    "smiquery_power_draw_watts",
    "smiquery_power_limit_watts",
    "smiquery_pstate",
    "smiquery_pstate_info",
    "smiquery_retired_pages_pending",
    "smiquery_stream_info",
    "smiquery_sweeps",
    "smiquery_temperature_gpu_celsius",
    "smiquery_up",
    "smiquery_utilization_gpu_ratio",
    "smiquery_utilization_memory_ratio",
}
#: prometheus_client's ProcessCollector, on Linux.
PROCESS = {
    "process_cpu_seconds",
    "process_max_fds",
    "process_open_fds",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_virtual_memory_bytes",
}
#: What only a command line needs: none of it may stay in the serving process.
CLI_ONLY = ("typer", "click", "rich", "pydantic", "pydantic_core", "shellingham")


def _families(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _once_served(url: str, names: set[str]) -> dict[str, Any] | None:
    """The scrape's families once it has every one of ``names``, else None (to wait on)."""
    fams = _families(url)
    return fams if names <= set(fams) else None


def test_export_serves_the_same_series_from_a_process_without_typer(fake_smi: Any, tmp_path: Path) -> None:
    modules = tmp_path / "modules.txt"
    argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--interval", "0.2", "--kernel-log", ""]
    env = {**os.environ, MODULES_ENV: str(modules)}
    proc = subprocess.Popen(
        [*argv, "--nvidia-smi", str(fake_smi()), "--label", "site=lab"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving http://127.0.0.1:" in line, line
        url = line.split("serving ", 1)[1].split("/metrics", 1)[0]
        # the pid the caller started is the one serving, now running the lean module
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"smiquery.cli._export_run" in cmdline, cmdline
        got = wait_for(lambda: _once_served(url, BEFORE), what="every series served before")
        assert set(got) == BEFORE | PROCESS, sorted(set(got) ^ (BEFORE | PROCESS))
        rss = got["process_resident_memory_bytes"].samples[0]
        assert rss.labels == {"site": "lab"} and rss.value > 0  # the --label labels, as on every series
        loaded = set(modules.read_text(encoding="utf-8").split())
        assert "smiquery.exporter.server" in loaded
        assert not {m for m in loaded if m.split(".")[0] in CLI_ONLY}, sorted(loaded)[:20]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_export_refuses_a_bad_option_before_handing_off(fake_smi: Any) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "smiquery",
            "export",
            "--port",
            "0",
            "--bind",
            "192.0.2.1",
            "--nvidia-smi",
            str(fake_smi()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    # found by the lean process (it binds), worded and coded as typer words its own usage errors
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("smiquery: usage error: Invalid value for '--bind': "), done.stderr
    assert "the address is not on this machine" in done.stderr


def test_export_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "smiquery", "export", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    from smiquery import __version__

    assert (done.returncode, done.stdout, done.stderr) == (0, f"smiquery {__version__}\n", "")


def test_build_info_names_the_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    revision.cache_clear()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False)
    if head.returncode == 0 and importlib.util.find_spec("smiquery._revision") is None:
        assert revision() == head.stdout.strip()  # a checkout: its HEAD, read without running git
    baked = types.ModuleType("smiquery._revision")
    baked.REVISION = "0123456789abcdef0123456789abcdef01234567"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "smiquery._revision", baked)
    revision.cache_clear()
    try:
        assert revision() == baked.REVISION  # type: ignore[attr-defined]  # what the build wrote wins
    finally:
        revision.cache_clear()


def test_build_info_revision_label_is_served(fake_smi: Any) -> None:
    from smiquery.exporter import serve

    with serve(port=0, interval=0.1, nvidia_smi=fake_smi(), kernel_log=None) as exp:
        fams = wait_for(lambda: _once_served(exp.url, {"smiquery_build_info"}), what="build info")
    (sample,) = fams["smiquery_build_info"].samples
    assert sample.labels["revision"] == revision() and sample.labels["revision"]


def test_dcgm_allocation_help_names_the_uuid_label_it_has() -> None:
    pytest.importorskip("grpc", reason="pod attribution needs the k8s extra")
    from smiquery.attribution import Attribution
    from smiquery.attribution.kubernetes import KubernetesBackend
    from smiquery.exporter.families import attribution_families
    from tests.attribution.kubelet import StandInKubelet

    gpu = "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b"
    short = tempfile.mkdtemp(prefix="lean-", dir="/tmp")  # a unix socket path must stay under 108 bytes
    kubelet = StandInKubelet(str(Path(short) / "k.sock")).start()
    try:
        kubelet.grants = [("team-a", "train-0", "main", "nvidia.com/gpu", (gpu,))]
        att = Attribution(KubernetesBackend(kubelet.socket_path, timeout=5.0), interval=0.1, mig_listing=lambda: "")
        assert att.refresh()
        for label in ("uuid", "UUID"):
            (info,) = [f for f in attribution_families(att, {gpu: 0}, label, {}) if f.name.endswith("allocation_info")]
            assert f"on({label})" in info.documentation and label in info.samples[0].labels
    finally:
        kubelet.stop()
        shutil.rmtree(short, ignore_errors=True)
