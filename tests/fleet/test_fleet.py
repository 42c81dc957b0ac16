"""``smiquery top`` and ``smiquery report/plot --prometheus`` against a real Prometheus with backfilled history.

Six nodes of two GPUs (two nodes per naming: smiquery, DCGM_FI_*, nvidia_smi_*), three hours at 15 s: a hot GPU
with an alert firing, an idle one holding memory (in a Kubernetes namespace), a free one, one that stalls for
ten minutes, one lost ten minutes before the end, and one GPU exported twice (smiquery and dcgm naming, same
UUID). The same samples are also an nvidia-smi CSV recording, which the report must agree with exactly.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from smiquery.analysis import load_recording, report
from smiquery.errors import PrometheusError, PrometheusQueryError, PrometheusUnreachableError, UsageError
from smiquery.fleet import (
    FleetGpu,
    HttpConfig,
    PrometheusClient,
    estimate_step,
    fleet_frame,
    load_http_config,
    naming_by_name,
    parse_time,
    snapshot,
)
from smiquery.fleet.history import chunks
from tests.fleet.conftest import STEP, Fleet
from tests.fleet.fleetdata import free_port, sorted_keys, unnamed

pytestmark = pytest.mark.xdist_group("prometheus")

ROOT = Path(__file__).resolve().parents[2]


def smiquery(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "smiquery", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def top_json(fleet: Fleet, *args: str) -> list[dict[str, Any]]:
    out = smiquery("top", "--prometheus", fleet.url, "--once", "--format", "json", "--at", str(fleet.end), *args)
    rows = json.loads(out.stdout)
    assert isinstance(rows, list)
    return rows


def where(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["instance"], r["gpu"]) for r in rows]


def sim(fleet: Fleet, profile: str) -> tuple[str, str]:
    (g,) = [g for g in fleet.gpus if g.profile == profile]
    return (g.instance, str(g.index))


# ---------------------------------------------------------------------------------------------------------------
# top


def test_top_lists_every_gpu_once_in_all_three_namings(fleet):
    rows = top_json(fleet)
    assert sorted(where(rows)) == sorted((g.instance, str(g.index)) for g in fleet.gpus)
    assert len({r["uuid"] for r in rows}) == len(rows) == 12
    assert "node-00:9400" not in {r["instance"] for r in rows}  # the twin exporter's copy of node-00 GPU 0
    assert {r["naming"] for r in rows} == {"smiquery", "dcgm", "nvidia_smi"}
    assert all(r["name"] == "NVIDIA H100 80GB HBM3" for r in rows)  # nvidia_smi: from nvidia_smi_gpu_info


def test_top_values_are_in_nvidia_smi_units_whatever_the_naming(fleet):
    rows = {(r["instance"], r["gpu"]): r for r in top_json(fleet)}
    hot = rows[sim(fleet, "hot")]
    assert (hot["utilization.gpu"], hot["memory.used"], hot["temperature.gpu"]) == (100, 70000, 91)
    idle = rows[sim(fleet, "idle")]  # dcgm naming: MiB and percent as they are
    assert (idle["utilization.gpu"], idle["memory.used"], idle["memory.total"]) == (0, 20000, 81559)
    busy_nvsmi = rows[("node-05:9835", "1")]  # nvidia_smi naming: bytes and ratios converted back
    assert busy_nvsmi["memory.used"] == 30000
    assert busy_nvsmi["utilization.gpu"] == pytest.approx(86)


def test_top_marks_the_lost_gpu_and_the_alert_firing(fleet):
    rows = {(r["instance"], r["gpu"]): r for r in top_json(fleet)}
    lost = rows[sim(fleet, "lost")]
    assert lost["state"] == "lost"
    assert lost["utilization.gpu"] is None
    assert [k for k, r in rows.items() if r["state"] == "lost"] == [sim(fleet, "lost")]
    assert rows[sim(fleet, "hot")]["alerts"] == ["GpuTemperatureCritical"]
    assert [k for k, r in rows.items() if r["alerts"]] == [sim(fleet, "hot")]


def test_idle_finds_exactly_the_gpu_idle_while_holding_memory(fleet):
    rows = top_json(fleet, "--idle")
    # not the free GPU (0 % but no memory held), not the one that stalled for ten minutes two hours ago
    assert where(rows) == [sim(fleet, "idle")]
    assert rows[0]["namespace"] == "research"
    assert rows[0]["pod"] == "notebook-1"


def test_sort_puts_the_largest_first_and_missing_values_last(fleet):
    by_temp = top_json(fleet, "--sort", "temp")
    assert where(by_temp)[0] == sim(fleet, "hot")
    temps = [r["temperature.gpu"] for r in by_temp]
    assert temps[-1] is None  # the lost GPU
    assert temps[:-1] == sorted(temps[:-1], reverse=True)
    by_power = top_json(fleet, "--sort", "power")
    assert where(by_power)[0] == sim(fleet, "hot")
    by_mem = top_json(fleet, "--sort", "mem")
    assert [r["memory.used"] for r in by_mem][:2] == [70000, 30000]
    by_node = top_json(fleet)
    assert where(by_node) == sorted(where(by_node), key=lambda k: (k[0], int(k[1])))


def test_node_and_namespace_filters(fleet):
    rows = top_json(fleet, "--node", "node-0[12]:.*")
    assert {r["instance"] for r in rows} == {"node-01:9400", "node-02:9835"}
    assert len(rows) == 4
    # anchored, as in PromQL: "node-0" alone matches no instance
    done = smiquery("top", "-p", fleet.url, "--once", "--at", str(fleet.end), "--node", "node-0", check=False)
    assert done.returncode == 1
    assert "no GPU metrics in Prometheus" in done.stderr
    assert "on instances matching 'node-0'" in done.stderr
    train = top_json(fleet, "--namespace", "train")
    assert {r["pod"] for r in train} == {"job-1-0", "job-4-0", "job-4-1"}
    assert where(top_json(fleet, "--pod", "notebook-.*")) == [sim(fleet, "idle")]


def test_csv_has_one_row_per_gpu(fleet):
    out = smiquery("top", "-p", fleet.url, "--once", "--format", "csv", "--at", str(fleet.end)).stdout
    lines = out.splitlines()
    assert lines[0].startswith("instance,gpu,uuid,name,naming,utilization.gpu")
    assert len(lines) == 13
    hot = next(x for x in lines if x.startswith(f"{sim(fleet, 'hot')[0]},1,"))
    assert hot.endswith(",GpuTemperatureCritical,ok")


def test_table_fits_the_terminal_and_counts_what_is_not_shown(fleet):
    from smiquery.cli.top import render_screen

    gpus = snapshot(PrometheusClient(fleet.url), at=fleet.end)
    screen = render_screen(gpus, 60, 10, "title")
    assert len(screen) <= 10
    assert all(len(line) <= 60 for line in screen)
    assert "5 of 12 GPUs shown" in "\n".join(screen)
    full = render_screen(gpus, 0, 0, "title")
    assert not any("shown" in line for line in full)
    assert sum(1 for line in full if line.startswith("node-")) == 12


def test_the_table_command_shows_states(fleet):
    out = smiquery("top", "-p", fleet.url, "--once", "--at", str(fleet.end)).stdout
    lost_line = next(x for x in out.splitlines() if x.startswith("node-04:9400") and " 1 " in x)
    assert "LOST" in lost_line
    assert "12 GPUs, 1 idle, 1 lost" in out


# ---------------------------------------------------------------------------------------------------------------
# range queries and the report


def test_step_is_the_scrape_interval(fleet):
    client = PrometheusClient(fleet.url)
    for name in ("smiquery", "dcgm", "nvidia_smi"):
        assert estimate_step(client, naming_by_name(name), fleet.start, fleet.end, None) == STEP


def test_chunks_respect_the_point_limit():
    pieces = chunks(0, 7 * 86400, 15, 11_000)
    assert all((b - a) / 15 + 1 <= 11_000 for a, b in pieces)
    assert pieces[0][0] == 0
    assert pieces[-1][1] == 7 * 86400
    assert [a for a, _ in pieces[1:]] == [b + 15 for _, b in pieces[:-1]]  # no point twice, none left out


class CountingClient(PrometheusClient):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges: list[tuple[float, float]] = []
        self.unparsed = self.most_unparsed = 0  # answers fetched and not yet parsed
        self._lock = threading.Lock()

    def query_raw(self, expr: str, at: float | None = None) -> bytes:
        width = int(re.search(r"\[(\d+)ms\]$", expr).group(1)) / 1000  # type: ignore[union-attr]
        assert at is not None
        self.ranges.append((at - width, at))
        assert width <= 100 * STEP  # at most 100 samples of each series per query
        raw = super().query_raw(expr, at)
        with self._lock:
            self.unparsed += 1
            self.most_unparsed = max(self.most_unparsed, self.unparsed)
        return raw

    def samples(self, raw: bytes, expr: str) -> list[tuple[dict[str, str], Any, Any]]:
        with self._lock:
            self.unparsed -= 1
        return super().samples(raw, expr)


def test_a_range_in_many_chunks_gives_the_same_frame(fleet, monkeypatch):
    import pandas as pd

    import smiquery.fleet.history

    whole = fleet_frame(PrometheusClient(fleet.url), fleet.start, fleet.end)
    counting = CountingClient(fleet.url)
    pieces = fleet_frame(counting, fleet.start, fleet.end, max_points=100)
    assert len(counting.ranges) > 3 * 6  # several chunks per field
    pd.testing.assert_frame_equal(whole, pieces)
    # answers too big to hold many: at most four fetched and not yet parsed at any time (memory stays bounded)
    monkeypatch.setattr(smiquery.fleet.history, "_AHEAD_BYTES", 1)
    bounded = CountingClient(fleet.url)
    pd.testing.assert_frame_equal(whole, fleet_frame(bounded, fleet.start, fleet.end, max_points=100))
    assert 1 <= bounded.most_unparsed <= 4


def test_the_report_from_prometheus_equals_the_report_of_the_recording(fleet):
    df = fleet_frame(PrometheusClient(fleet.url), fleet.start, fleet.end)
    named = report(df, name="x")
    rec = load_recording(fleet.recording, tz="UTC")
    from_rec = report(rec, name="x").to_dict()
    # the same analysis: the same stalls, alerts, thresholds, energy and findings; only the names differ (the
    # recording told which node each GPU is on, as the fleet knows it, so that stragglers are judged per node)
    rec.attrs["gpu_names"] = df.attrs["gpu_names"]
    assert unnamed(named.to_dict()) == unnamed(report(rec, name="x").to_dict())
    assert {k: v for k, v in unnamed(named.to_dict()).items() if k != "findings"} == {
        k: v for k, v in sorted_keys(from_rec).items() if k != "findings"
    }
    bare = df.copy()
    bare.attrs = {k: v for k, v in df.attrs.items() if k != "gpu_names"}
    from_prom = report(bare, name="x").to_dict()  # without names, word for word the recording's report
    assert from_prom == from_rec
    # and the report is about something: the stall, the idle GPU's alert, the hot GPU's energy
    order = sorted(fleet.gpus, key=lambda g: (g.instance, g.index))
    stalled = {s["gpu"] for s in from_prom["stalls"]}
    assert {order[i].profile for i in stalled} == {"idle", "stall"}
    hot = next(i for i, g in enumerate(order) if g.profile == "hot")
    assert {a["gpu"] for a in from_prom["alerts"] if a["rule"].startswith("temperature.gpu > 85")} == {hot}
    assert from_prom["energy_wh"][str(hot)] == pytest.approx(2076.0)
    lost = next(i for i, g in enumerate(order) if g.profile == "lost")
    assert from_prom["energy_wh"][str(lost)] < from_prom["energy_wh"]["0"]


def test_report_command_names_each_gpu_by_instance_and_uuid(fleet):
    out = smiquery(
        "report", "--prometheus", fleet.url, "--start", str(fleet.start), "--end", str(fleet.end), "--format", "json"
    ).stdout
    doc = json.loads(out)
    rec = json.loads(smiquery("report", str(fleet.recording), "--tz", "UTC", "--format", "json").stdout)
    plain, want = unnamed(doc), sorted_keys(rec)
    for key in ("stalls", "alerts", "energy_wh", "thresholds", "stats", "health"):
        assert plain[key] == want[key], key
    # the same findings, but stragglers: the recording's GPUs all work together, the fleet's per node
    assert [f for f in plain["findings"] if f["kind"] != "imbalance"] == [
        f for f in want["findings"] if f["kind"] != "imbalance"
    ]
    assert any(f["kind"] == "imbalance" for f in doc["findings"])
    for f in doc["findings"]:
        if f["kind"] == "imbalance":
            assert len({g["instance"] for g in f["gpus"]}) == 1, f
            assert f"on the other GPUs of {f['gpus'][0].get('node', f['gpus'][0]['instance'])}" in f["verdict"], f
    order = sorted(fleet.gpus, key=lambda g: (g.instance, g.index))
    assert {int(k): (v["instance"], v["uuid"]) for k, v in doc["gpu_names"].items()} == {
        i: (g.instance, g.uuid) for i, g in enumerate(order)
    }


def test_every_finding_names_its_gpus_by_node_and_index_on_the_node(fleet):
    t = ["--start", str(fleet.start), "--end", str(fleet.end)]
    doc = json.loads(smiquery("report", "-p", fleet.url, *t, "--format", "json").stdout)
    order = sorted(fleet.gpus, key=lambda g: (g.instance, g.index))
    assert doc["findings"]
    # every GPU reference in JSON: instance, the index on the node, uuid; they are the fleet's GPUs
    refs = [r for f in doc["findings"] for r in f["gpus"]]
    refs += [r for key in ("stalls", "alerts", "thresholds", "stats") for r in doc[key]]
    assert refs
    for r in refs:
        g = order[r["index"]]
        assert (r["instance"], r["gpu"], r["uuid"]) == (g.instance, str(g.index), g.uuid)
    for f in doc["findings"]:
        if f["kind"] == "clock":
            continue
        for r in f["gpus"]:
            node = r.get("node", r["instance"])
            assert f"{node} GPU" in f["verdict"] or f"{node} GPUs" in f["verdict"], f["verdict"]
        # the report's own numbers (0..11) never stand for a GPU: each node has GPUs 0 and 1 only
        assert re.search(r"GPUs? (?:[2-9]|1\d)\b", f["verdict"]) is None, f["verdict"]
    # the dcgm nodes go by their Hostname label, the pod that held the GPU where known
    hot = next(g for g in order if g.profile == "hot")
    text = smiquery("report", "-p", fleet.url, *t).stdout
    assert f"{hot.instance} GPU {hot.index}" in text
    assert re.search(r"GPUs? (?:[2-9]|1\d)\b", text.split("\nGPUs:")[0]) is None
    pods = [g for g in order if g.pod]
    if pods:
        assert any(f"({g.namespace}/{g.pod})" in text for g in pods)


def test_report_of_one_job_by_pod_and_of_one_node(fleet):
    t = ["--start", str(fleet.start), "--end", str(fleet.end), "--format", "json"]
    doc = json.loads(smiquery("report", "--prometheus", fleet.url, "--pod", "job-4-.*", *t).stdout)
    assert sorted((v["instance"], v["gpu"]) for v in doc["gpu_names"].values()) == [
        ("node-04:9400", "0"),
        ("node-04:9400", "1"),
    ]
    doc = json.loads(smiquery("report", "--prometheus", fleet.url, "--node", "node-00:.*", *t).stdout)
    assert [v["gpu"] for v in doc["gpu_names"].values()] == ["0", "1"]
    assert doc["gpus"] == [0, 1]
    md = smiquery("report", "--prometheus", fleet.url, "--node", "node-00:.*", *t[:-2], "--format", "markdown")
    assert "| 1 | node-00:9849 | 1 |" in md.stdout


def test_plot_draws_a_range_of_the_fleet(fleet, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "fleet.png"
    args = ["--start", str(fleet.start), "--end", str(fleet.end), "-o", str(target)]
    smiquery("plot", "--prometheus", fleet.url, "--node", "node-0[01]:.*", *args)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# errors: one line each


def test_unreachable_server_is_one_line_and_exit_1():
    done = smiquery("top", "-p", f"http://127.0.0.1:{free_port()}", "--once", "--timeout", "5", check=False)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "cannot reach Prometheus at http://127.0.0.1:" in lines[0]


def test_a_rejected_query_says_why(fleet):
    client = PrometheusClient(fleet.url)
    with pytest.raises(PrometheusQueryError, match=r"Prometheus rejected the query 'sum\(' \(bad_data\)"):
        client.query("sum(")
    with pytest.raises(PrometheusQueryError, match="exceeded maximum resolution of 11,000 points"):
        client.query_range("up", 0, 86400, 1)


def test_not_the_api_and_no_gpu_metrics(fleet):
    with pytest.raises(PrometheusError, match="without the Prometheus API's JSON"):
        PrometheusClient(fleet.url + "/nothing").query("up")
    with pytest.raises(PrometheusError, match="no GPU metrics in Prometheus"):
        snapshot(PrometheusClient(fleet.url), at=fleet.start - 86400)
    done = smiquery("report", "--prometheus", fleet.url, "--start", "yesterday", check=False)
    assert done.returncode == 2
    assert "--start: 'yesterday' is not a time" in done.stderr


def test_report_needs_a_recording_or_prometheus_not_both(fleet):
    done = smiquery("report", check=False)
    assert done.returncode == 2
    assert "give a recording (REC) or --prometheus URL" in done.stderr
    done = smiquery("report", str(fleet.recording), "--node", "x", check=False)
    assert done.returncode == 2
    assert "--node goes with --prometheus" in done.stderr


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []
    status = 200

    def do_POST(self) -> None:
        type(self).seen.append(dict(self.headers))
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_bearer_token_and_basic_auth_from_a_promtool_http_config(recorder, tmp_path):
    url, handler = recorder
    (tmp_path / "token").write_text("s3cret\n")
    cfg = tmp_path / "bearer.yml"
    cfg.write_text(f"authorization:\n  type: Bearer\n  credentials_file: {tmp_path / 'token'}\n")
    PrometheusClient(url, config=load_http_config(cfg)).query("up")
    assert handler.seen[-1]["Authorization"] == "Bearer s3cret"
    cfg.write_text("basic_auth:\n  username: ops\n  password: pw\n")
    PrometheusClient(url, config=load_http_config(cfg)).query("up")
    assert handler.seen[-1]["Authorization"] == "Basic b3BzOnB3"
    cfg.write_text("oauth2: {}\n")
    with pytest.raises(UsageError, match="unknown key 'oauth2'"):
        load_http_config(cfg)


def test_refused_credentials_are_one_clear_line(recorder):
    url, handler = recorder
    handler.status = 401
    with pytest.raises(PrometheusUnreachableError, match=r"refused the credentials \(HTTP 401\)"):
        PrometheusClient(url, config=HttpConfig(bearer_token="wrong")).query("up")


def test_tls_needs_the_servers_ca(recorder):
    url, _ = recorder
    # a plain HTTP server spoken to in TLS: the handshake fails, and the message says where the CA goes
    with pytest.raises(PrometheusUnreachableError, match="TLS with Prometheus at https://"):
        PrometheusClient(url.replace("http://", "https://"), timeout=5).query("up")


def test_times_as_the_http_api_takes_them():
    assert parse_time("1700000000") == 1700000000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1700000000.0
    assert parse_time("2023-11-14T23:13:20+01:00") == 1700000000.0
    assert parse_time("now-2h", now=10_000.0) == 2800.0
    with pytest.raises(UsageError, match="has no zone"):
        parse_time("2023-11-14T22:13:20")


def test_fleet_gpu_json_keys_are_field_names():
    g = FleetGpu("n:1", "0", "GPU-x", "H100", "dcgm", 1.0, 2.0, 3.0, 4.0, 5.0)
    assert list(g.to_dict())[5:10] == [
        "utilization.gpu",
        "memory.used",
        "memory.total",
        "temperature.gpu",
        "power.draw",
    ]


# ---------------------------------------------------------------------------------------------------------------
# a Prometheus behind TLS and basic auth (its own --web.config.file), as production servers often are


@pytest.fixture
def secured(pki: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    import time

    import bcrypt

    from tests.exporter.test_rules import require_tool
    from tests.fleet.fleetdata import PromServer

    prometheus = require_tool("prometheus")
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki['cert']}\n  key_file: {pki['key']}\n"
        f"basic_auth_users:\n  ops: {hashed}\n"
    )
    (tmp_path / "data").mkdir()
    server = PromServer(prometheus, tmp_path / "data", tmp_path / "prom.log", [f"--web.config.file={web}"])
    url = f"https://127.0.0.1:{server.port}"
    client = PrometheusClient(url, config=HttpConfig(username="ops", password="pw", ca_file=str(pki["ca"])))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.query("vector(1)")
                break
            except PrometheusUnreachableError:
                assert server.popen.poll() is None, server.log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the TLS Prometheus did not answer in 120 s"
                time.sleep(0.3)
        yield url
    finally:
        server.stop()


def test_tls_with_the_ca_file_and_basic_auth_from_an_http_config(secured, pki, tmp_path):
    cfg = tmp_path / "http.yml"
    cfg.write_text(f"basic_auth:\n  username: ops\n  password: pw\ntls_config:\n  ca_file: {pki['ca']}\n")
    got = PrometheusClient(secured, config=load_http_config(cfg)).query("vector(7)")
    assert got[0]["value"][1] == "7"
    cfg.write_text(f"basic_auth:\n  username: ops\n  password: wrong\ntls_config:\n  ca_file: {pki['ca']}\n")
    done = smiquery("top", "-p", secured, "--http-config", str(cfg), "--once", check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"smiquery: error: Prometheus at {secured} refused the credentials (HTTP 401); check the bearer token or "
        "basic_auth in --http-config"
    ]
    with pytest.raises(PrometheusUnreachableError, match=r"CERTIFICATE_VERIFY_FAILED.*give the server's CA"):
        PrometheusClient(secured, config=HttpConfig(username="ops", password="pw")).query("vector(1)")


def _frames(argv: list[str], wanted: int) -> tuple[list[list[str]], subprocess.Popen[bytes], threading.Thread]:
    """Run a live ``top`` on a terminal (a pty) until it has drawn ``wanted`` screens (each starts with its title)."""
    import fcntl
    import pty
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(slave)
    frames: list[list[str]] = []
    lines: list[str] = []
    got = threading.Event()

    def read() -> None:
        with open(master, "rb", buffering=0) as fh:
            pending = b""
            while True:
                try:
                    piece = fh.read(4096)
                except OSError:  # the child closed the terminal
                    return
                if not piece:
                    return
                pending += piece
                *done, pending = pending.split(b"\n")
                for raw in done:
                    line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode()).rstrip("\r")  # the redraw's codes
                    if line.startswith("smiquery top") and lines:
                        frames.append(list(lines))
                        lines.clear()
                        if len(frames) >= wanted:
                            got.set()
                    lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not got.is_set() and proc.poll() is None and time.monotonic() < deadline:
        got.wait(0.5)
    return frames, proc, reader


def _interrupt(proc: subprocess.Popen[bytes], reader: threading.Thread) -> int:
    import signal

    proc.send_signal(signal.SIGINT)
    rc = proc.wait(60)
    reader.join(60)
    if proc.stderr is not None:
        proc.stderr.close()
    return rc


def test_gpus_in_trouble_are_never_the_ones_cut_and_the_title_stays(fleet):
    from smiquery.cli.top import render_screen

    gpus = snapshot(PrometheusClient(fleet.url), at=fleet.end)
    trouble = {(g.instance, g.gpu) for g in gpus if g.lost or g.alerts}
    assert len(trouble) >= 2  # the lost GPU and the hot one with its alert firing
    screen = render_screen(gpus, 100, 7, "title")
    assert screen[0] == "title" and len(screen) <= 7
    shown = {tuple(line.split()[:2]) for line in screen if line.startswith("node-")}
    assert trouble <= shown, screen  # both past the rows that fit in node order, both kept
    assert f"{len(shown)} of 12 GPUs shown" in "\n".join(screen)


def test_live_top_redraws_until_interrupted_and_exits_130(fleet):
    argv = [sys.executable, "-m", "smiquery", "top", "-p", fleet.url, "--at", str(fleet.end), "--interval", "0.5"]
    frames, proc, reader = _frames(argv, 2)
    try:
        assert len(frames) >= 2
        for frame in frames[:2]:
            assert sum(1 for line in frame if line.startswith("node-")) == 12
            assert frame[-1] == "12 GPUs, 1 idle, 1 lost"
    finally:
        assert _interrupt(proc, reader) == 130  # Ctrl-C: 130, as stream and ps --watch


def test_live_top_keeps_going_while_the_server_is_down():
    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "smiquery", "top", "-p", url, "--interval", "0.5", "--timeout", "5"]
    frames, proc, reader = _frames(argv, 2)
    try:
        assert len(frames) >= 2
        assert frames[1][-1].startswith(f"last error: cannot reach Prometheus at {url}")
    finally:
        assert _interrupt(proc, reader) == 130  # Ctrl-C: 130, as stream and ps --watch


def test_piped_top_prints_one_document_and_exits(fleet):
    # not a terminal: one table, or one CSV/JSON document, then exit 0 (no --once needed), so `> fleet.csv` is a CSV
    t = ["--at", str(fleet.end), "--interval", "0.5"]
    for fmt, check in (
        ("table", lambda out: out.count("smiquery top") == 1),
        ("csv", lambda out: len(list(csv.reader(io.StringIO(out)))) == 13),
        ("json", lambda out: len(json.loads(out)) == 12),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "smiquery", "top", "-p", fleet.url, "--format", fmt, *t],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        assert check(done.stdout), (fmt, done.stdout[:300])


def test_report_and_plot_take_p_for_prometheus(fleet):
    t = ["--start", str(fleet.start), "--end", str(fleet.end), "--node", "node-00:.*", "--format", "json"]
    doc = json.loads(smiquery("report", "-p", fleet.url, *t).stdout)
    assert doc["gpus"] == [0, 1]


# ---------------------------------------------------------------------------------------------------------------
# a second engine: VictoriaMetrics serves the same API, and top and report give the same answers from it


def test_top_gives_the_same_answer_from_victoria_metrics(fleet, vm_fleet):
    t = ["--at", str(fleet.end), "--format", "json", "--once"]
    prom = json.loads(smiquery("top", "-p", fleet.url, *t).stdout)
    vm = json.loads(smiquery("top", "-p", vm_fleet.url, *t).stdout)
    assert len(prom) == 12
    assert vm == prom


def test_report_gives_the_same_answer_from_victoria_metrics(fleet, vm_fleet):
    t = ["--start", str(fleet.start), "--end", str(fleet.end), "--format", "json"]
    prom = json.loads(smiquery("report", "-p", fleet.url, *t).stdout)
    vm = json.loads(smiquery("report", "-p", vm_fleet.url, *t).stdout)
    prom.pop("source")
    vm.pop("source")
    assert vm == prom
    assert prom["findings"] and prom["stalls"]
