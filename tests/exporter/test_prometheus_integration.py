"""The real thing: `smiquery export` on the fake nvidia-smi, scraped every second by a real Prometheus server.

Three exporters run as processes on 127.0.0.1 with free ports: native naming with --processes (job
"smiquery-exporter"), DCGM naming (job "dcgm"), and one whose nvidia-smi loses GPU 3 and crashes now and then (job
"faulty"). Prometheus gets a temporary config, data directory and port, and loads the alert rules. Every
process is stopped on every path (fixture finalizers: SIGTERM, then SIGKILL, then wait).

Needs promtool and prometheus (Debian's ``prometheus`` package, installed by ``scripts/install-prometheus``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smiquery.exporter import DCGM_MAP
from tests.exporter.test_exporter import SHARED, recorded, write_recording
from tests.exporter.test_rules import DASHBOARD, RULES, load_rules, require_tool

# One worker under pytest-xdist: the module's Prometheus stack (a server and three exporters) starts once.
pytestmark = pytest.mark.xdist_group("prometheus")

ROOT = Path(__file__).resolve().parents[2]
DCGM_DASHBOARD = SHARED / "dcgm" / "dcgm-exporter-dashboard.json"
MiB = 1048576.0
# What promtool's linter says about the DCGM exporter's own names (documented in docs/exporter.md).
DCGM_FINDINGS = (
    'counter metrics should have "_total" suffix',
    "label names should be written in 'snake_case' not 'camelCase'",
)
# DCGM dashboard panels whose metric nvidia-smi cannot supply (docs/exporter.md, "What cannot be supplied").
DCGM_UNSUPPLIED = ("DCGM_FI_PROF_",)
NVSMI_DASHBOARD = SHARED / "nvidia_gpu_exporter" / "dashboard.json"
NVSMI_CAPTURE = (
    SHARED / "nvsmi-corpus" / "csv" / "utkuozdemir__linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01__load.csv"
)
# Panels of nvidia_gpu_exporter's dashboard (Grafana 14574) that get no data from --naming nvidia_smi, because
# nvidia-smi --query-gpu has no such field (docs/exporter.md lists them too).
NVSMI_NO_DATA = {
    "XID Errors",
    "Last XID",
    "XID Errors by Code",
    "PCIe Throughput",
    "Power (energy counter vs sampled)",
    "Energy (trailing 24h)",
    "MIG Memory Used",
    "MIG SM Activity",
    "MIG Tensor Activity",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output goes to a file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, argv: list[str], log: Path, **kw: Any) -> None:
        self.log = log
        self._fh = log.open("w")
        self.popen = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, cwd=ROOT, **kw)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._fh.close()
        return self.popen.returncode


def wait_until(predicate: Any, timeout: float, what: str, procs: tuple[Proc, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        for p in procs:
            if p.popen.poll() is not None:
                raise AssertionError(f"{p.popen.args[0]} exited with {p.popen.returncode}:\n{p.text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(p.text()[-2000:] for p in procs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


class Stack:
    """The running exporters and Prometheus."""

    def __init__(self, tmp: Path, recording: Path) -> None:
        self.tmp = tmp
        self.recording = recording
        self.procs: list[Proc] = []
        self.exporters: dict[str, str] = {}
        self.prom_url = ""

    def exporter(
        self,
        job: str,
        *args: str,
        fault: str | None = None,
        recording: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        from smiquery.testing import fake_nvidia_smi

        fake = fake_nvidia_smi(self.tmp / f"bin-{job}", recording=recording or self.recording, fault=fault)
        argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--nvidia-smi", str(fake), *args]
        proc = Proc(argv, self.tmp / f"exporter-{job}.log", env={**os.environ, **(env or {})})
        self.procs.append(proc)
        found = wait_until(
            lambda: re.search(r"serving (http://127\.0\.0\.1:\d+)/metrics", proc.text()), 20, f"exporter {job}", (proc,)
        )
        self.exporters[job] = found.group(1)

    def prometheus(self) -> None:
        port = free_port()
        scrape = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{url.split('//')[1]}']\n"
            for job, url in self.exporters.items()
        )
        config = self.tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\nscrape_configs:\n{scrape}",
            encoding="utf-8",
        )
        argv = [
            require_tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        proc = Proc(argv, self.tmp / "prometheus.log")
        self.procs.append(proc)
        self.prom_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_get(self.prom_url + "/-/ready")[0] == 200, 30, "Prometheus to be ready", (proc,))

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = self.prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        code, body = http_get(url, timeout=10)
        doc = json.loads(body or b"{}")
        assert code == 200 and doc.get("status") == "success", f"{expr!r}: HTTP {code} {doc.get('error', body[:300])}"
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def stop(self) -> dict[str, int | None]:
        return {p.popen.args[0] if isinstance(p.popen.args, list) else "?": p.stop() for p in reversed(self.procs)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_tool("promtool")
    require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prom-stack")
    st = Stack(tmp, write_recording(tmp / "sweep.csv"))
    ready = False
    try:
        # MIG instances from a -q -x capture polled every second, and an Xid in a kernel log file (the dashboard's
        # MIG and Xid panels)
        kern = tmp / "kern.log"
        kern.write_text("[ 12.000001] NVRM: Xid (PCI:0000:07:00): 48, pid=42, name=python, DBE\n", encoding="utf-8")
        st.exporter(
            "smiquery-exporter",
            *("--interval", "1", "--processes", "--processes-interval", "1"),
            *("--details-interval", "1", "--kernel-log", str(kern)),
            env={"SMIQUERY_FAKE_XML": str(ROOT / "tests" / "fixtures" / "details-2gpu-mig.xml")},
        )
        st.exporter("dcgm", "--interval", "1", "--naming", "dcgm")
        # a real H100 capture: every field nvidia_gpu_exporter's dashboard reads (fans: [N/A] on an H100)
        st.exporter(
            "nvsmi",
            *("--interval", "1", "--naming", "nvidia_smi", "--processes", "--processes-interval", "1"),
            recording=NVSMI_CAPTURE if NVSMI_CAPTURE.is_file() else None,
        )
        st.exporter("faulty", "--interval", "0.2", fault="gpu-lost-after:16:3,crash-after:80")
        st.prometheus()
        procs = tuple(st.procs)

        def has_data() -> bool:
            return (
                len(st.query('smiquery_temperature_gpu_celsius{job="smiquery-exporter"}')) == 7
                and len(st.query('DCGM_FI_DEV_GPU_TEMP{job="dcgm"}')) == 7
                and len(st.query('nvidia_smi_compute_app_used_memory_bytes{job="nvsmi"}')) >= 1
                and len(st.query('smiquery_process_used_memory_bytes{job="smiquery-exporter"}')) == 8
                and len(st.query('count_over_time(smiquery_up{job="smiquery-exporter"}[1m]) >= 3')) == 1
                and len(st.query('max_over_time(smiquery_gpu_lost{job="faulty", gpu="3"}[1m]) == 1')) == 1
                and len(st.query('smiquery_nvidia_smi_errors_total{job="faulty"}')) >= 1
                and len(st.query('smiquery_mig_memory_used_bytes{job="smiquery-exporter"}')) == 2
                and len(st.query('smiquery_xid_errors_total{job="smiquery-exporter", xid="48"}')) == 1
            )

        wait_until(has_data, 45, "Prometheus to store data from the three exporters", procs)
        ready = True
        yield st
    finally:
        codes = st.stop()
        leftover = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout.split()
        if ready:  # on a failed start-up, the start-up error is the one to report
            assert not leftover, f"processes left running: {leftover}"
            expected = {name: 143 if name == sys.executable else 0 for name in codes}  # exporters: 143, as documented
            assert codes == expected, codes  # SIGTERM stops exporters and Prometheus cleanly


def by_gpu(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["gpu"]: float(r["value"][1]) for r in result}


# ---------------------------------------------------------------------------------------------- stored values


def test_stored_values_equal_the_replayed_recording(stack):
    rec = recorded(stack.recording)
    checks = [
        ("smiquery_temperature_gpu_celsius", "temperature.gpu", 1.0),
        ("smiquery_memory_used_bytes", "memory.used", MiB),
        ("smiquery_utilization_gpu_ratio", "utilization.gpu", 0.01),
        ("smiquery_power_draw_watts", "power.draw", 1.0),
        ("smiquery_clocks_current_sm_hertz", "clocks.current.sm", 1e6),
    ]
    for metric, field, scale in checks:
        got = by_gpu(stack.query(f'{metric}{{job="smiquery-exporter"}}'))
        want = {str(g): float(r[field]) * scale for g, r in rec.items() if not r[field].startswith("[")}
        assert got.keys() == want.keys(), metric  # GPUs with a status token have no series
        for gpu, value in want.items():
            assert got[gpu] == pytest.approx(value, rel=1e-12), (metric, gpu)
    labels = stack.query('smiquery_power_limit_watts{job="smiquery-exporter", gpu="0"}')[0]["metric"]
    assert labels["uuid"] == rec[0]["uuid"] and labels["name"] == rec[0]["name"]
    assert labels["pci_bus_id"] == rec[0]["pci.bus_id"]
    dcgm = by_gpu(stack.query('DCGM_FI_DEV_FB_USED{job="dcgm"}'))
    assert dcgm == {str(g): float(r["memory.used"]) for g, r in rec.items()}  # MiB, as DCGM
    one = stack.query('DCGM_FI_DEV_GPU_TEMP{job="dcgm", gpu="0"}')[0]["metric"]
    assert one["UUID"] == rec[0]["uuid"] and one["modelName"] == rec[0]["name"] and one["device"] == "nvidia0"
    assert one["DCGM_FI_DRIVER_VERSION"] == rec[0]["driver_version"] and one["Hostname"]
    procs = stack.query('smiquery_process_used_memory_bytes{job="smiquery-exporter", pid="48213"}')
    assert float(procs[0]["value"][1]) == 69126 * MiB and procs[0]["metric"]["gpu"] == "0"


def test_gpu_lost_mid_stream_shows_in_the_health_metrics(stack):
    assert stack.query('max_over_time(smiquery_gpu_lost{job="faulty", gpu="3"}[1m]) == 1')
    assert not stack.query('max_over_time(smiquery_gpu_lost{job="faulty", gpu="2"}[1m]) == 1')
    assert stack.query('smiquery_nvidia_smi_restarts_total{job="faulty"} > 0')
    assert stack.query(
        'smiquery_nvidia_smi_starts_total{job="smiquery-exporter"} == 1'
    )  # the healthy loop never restarted


# ------------------------------------------------------------------------------------------ every expression


def substitute(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("${instance}", ".*")
        .replace("$instance", ".*")
        .replace("${gpu}", ".*")
        .replace("$gpu", ".*")
    )


def selectors(expr: str) -> list[str]:
    """The metric selectors of an expression (name plus any {matchers})."""
    return [m.group(0) for m in re.finditer(r"\b(?:smiquery_[a-z0-9_]+|up)(?:\{[^}]*\})?", expr)]


def test_every_rule_expression_evaluates_and_its_metrics_have_series(stack):
    for rule in load_rules():
        expr = rule["expr"]
        stack.query(expr)  # evaluates without error (alerts are legitimately empty on healthy data)
        for sel in selectors(expr):
            name = sel.split("{")[0]
            if name.startswith("smiquery_training_"):
                continue  # the training monitor's metrics, from another process (tests/training/test_deployed.py)
            if name == "smiquery_gpu_allocation_info":
                continue  # --kubernetes, against a stand-in kubelet: tests/attribution/
            # by name: a matcher such as permanent="true" is legitimately empty on a healthy exporter
            assert stack.query(name), f"{rule['alert']}: {name} has no series"


def test_prometheus_evaluates_the_loaded_rules_without_error(stack):
    def loaded() -> list[dict[str, Any]]:
        groups = json.loads(http_get(stack.prom_url + "/api/v1/rules")[1])["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    assert len(loaded()) == len(load_rules())
    wait_until(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in loaded()), 10, "rule evaluations")
    rules = loaded()
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules


def test_every_dashboard_expression_returns_series(stack):
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            text = q["query"] if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text)
            assert m, text
            if "smiquery_gpu_allocation_info" in text:
                continue  # --kubernetes only
            assert stack.query(substitute(m.group(1))), text
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            if "smiquery_training_" in target["expr"]:
                continue  # the training row needs a training job's own metrics (tests/test_monitor.py serves them)
            if "smiquery_gpu_allocation_info" in target["expr"]:
                continue  # the by-pod row needs --kubernetes and a kubelet (tests/attribution/)
            expr = substitute(target["expr"])
            assert stack.query(expr), f"{panel['title']}: {expr} returned no series"


def test_the_dcgm_exporter_dashboard_works_unchanged(stack):
    if not DCGM_DASHBOARD.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{DCGM_DASHBOARD} is missing")
        pytest.skip(f"{DCGM_DASHBOARD} is not available")
    dash = json.loads(DCGM_DASHBOARD.read_text(encoding="utf-8"))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"])
            assert m and stack.query(f'{m.group(1)}{{job="dcgm"}}'), var["query"]
    empty = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = substitute(target["expr"])
            result = stack.query(expr)
            if any(name in expr for name in DCGM_UNSUPPLIED):
                empty.append(panel["title"])
                assert not result
            else:
                assert result, f"{panel['title']}: {expr} returned no series"
    assert empty == ["Tensor Core Utilization"]


# ------------------------------------------------------------------------------------- promtool check metrics


def promtool_check_metrics(url: str) -> tuple[int, list[str]]:
    code, body = http_get(url + "/metrics")
    assert code == 200 and body
    done = subprocess.run([require_tool("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=60)
    lines = (done.stdout + done.stderr).decode().splitlines()
    return done.returncode, [ln for ln in lines if ln.strip()]


def test_promtool_check_metrics_native_is_clean(stack):
    for job in ("smiquery-exporter", "faulty"):
        code, findings = promtool_check_metrics(stack.exporters[job])
        assert (code, findings) == (0, []), job


def test_promtool_check_metrics_dcgm_reports_only_what_dcgm_names_cause(stack):
    _, findings = promtool_check_metrics(stack.exporters["dcgm"])
    assert findings, "expected the DCGM names' own findings"
    dcgm_names = {name for entries in DCGM_MAP.values() for name, _, _ in entries}
    for line in findings:
        name, _, message = line.partition(" ")
        # smiquery's per-GPU health series carry the DCGM labels (UUID, modelName) so that they join on UUID
        dcgm_labelled = name in ("smiquery_gpu_lost", "smiquery_alert_firing", "smiquery_alert_fired_total")
        assert (name in dcgm_names or (dcgm_labelled and "camelCase" in message)) and message in DCGM_FINDINGS, line
    doc = (ROOT / "docs" / "exporter.md").read_text(encoding="utf-8")
    for message in {ln.partition(" ")[2] for ln in findings}:
        assert message in doc, f"docs/exporter.md does not list the promtool finding: {message}"


@pytest.mark.parametrize("naming", ["smiquery", "dcgm", "nvidia_smi"])
def test_promtool_check_metrics_on_every_catalogue_field(naming):
    from smiquery.exporter import SmiCollector
    from smiquery.fields import CATALOGUE
    from tests.exporter.test_exporter import FrozenSource

    body = SmiCollector(FrozenSource(), fields=list(CATALOGUE), naming=naming).exposition()
    done = subprocess.run([require_tool("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=60)
    findings = [ln for ln in (done.stdout + done.stderr).decode().splitlines() if ln.strip()]
    if naming == "smiquery":
        assert (done.returncode, findings) == (0, [])
    elif naming == "nvidia_smi":
        # it parses; the lint findings are about the peer's own names (gauges ending in _total...), kept for drop-in
        assert done.returncode in (0, 3) and all(ln.startswith("nvidia_smi_") for ln in findings), findings
    else:
        dcgm_names = {name for entries in DCGM_MAP.values() for name, _, _ in entries}
        dcgm_labelled = {"smiquery_gpu_lost", "smiquery_alert_firing", "smiquery_alert_fired_total"}
        assert findings and all(
            ln.partition(" ")[0] in dcgm_names | dcgm_labelled and ln.partition(" ")[2] in DCGM_FINDINGS
            for ln in findings
        ), findings


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def test_the_nvidia_gpu_exporter_dashboard_gets_data(stack):
    if not NVSMI_DASHBOARD.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{NVSMI_DASHBOARD} is missing")
        pytest.skip(f"{NVSMI_DASHBOARD} is not available")
    dash = json.loads(NVSMI_DASHBOARD.read_text(encoding="utf-8"))
    instance = stack.exporters["nvsmi"].split("//")[1]
    info = stack.query('nvidia_smi_gpu_info{job="nvsmi"}')
    assert info and all(not r["metric"]["uuid"].startswith("GPU-") for r in info)
    uuid = sorted(r["metric"]["uuid"] for r in info)[0]
    # the job and node variables (label_values of nvidia_smi_index)
    assert stack.query('nvidia_smi_index{job="nvsmi"}')
    empty: set[str] = set()
    for panel in _panels(dash["panels"]):
        for target in panel.get("targets", []):
            expr = (
                target["expr"].replace("$gpu", uuid).replace("$node", instance).replace("$job", "nvsmi")
                .replace("$__rate_interval", "1m")
            )  # fmt: skip
            assert stack.query(expr) is not None  # every query is valid PromQL here
            # data means: a metric the panel is about (not only the gpu_info fallback) has series
            names = set(re.findall(r"nvidia_smi_\w+", expr)) - {"nvidia_smi_gpu_info"}
            names = {n for n in names if "throttle_reasons" not in n}  # the pre-535 alternatives
            pattern = "|".join(sorted(names)) or "nvidia_smi_gpu_info"
            if "__name__=~" in expr:
                pattern = re.search(r'__name__=~"([^"]+)"', expr).group(1)  # type: ignore[union-attr]
            if not stack.query(f'{{__name__=~"{pattern}", job="nvsmi"}}'):
                empty.add(panel["title"])
    # an H100 has no fans (nvidia-smi says [N/A]): those panels are empty for this GPU, not for every GPU
    assert empty == NVSMI_NO_DATA | {"Fan", "Fan Speed %"}
    doc = (ROOT / "docs" / "exporter.md").read_text(encoding="utf-8")
    for title in NVSMI_NO_DATA:
        assert title in doc, f"docs/exporter.md does not say that {title!r} gets no data"
