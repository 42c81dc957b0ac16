"""The stall alert where smiquery is deployed: compose's Prometheus config, a real Prometheus, and the alert fires.

Prometheus runs on 127.0.0.1 with docker/compose/prometheus.yml as compose mounts it, changed only where a test must:
scrape and evaluation every second, the two targets pointed at this test's stand-ins (their free ports instead of
9849 and 9400), no Alertmanager, and, in the test's copy of smiquery-rules.yml only, GpuStalledPipeline's
``for: 30m`` shortened to 5 s (tests/exporter/test_rules.py checks the real 30 minutes with promtool). The trainer is
a real :class:`~smiquery.training.monitor.RunMonitor` serving its metrics (on the in-process fake nvidia-smi),
stepping all along; the exporter is a stand-in serving two of the same GPUs: GPU 0 at 5 % (starved), GPU 1 at 90 %.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from smiquery.training.monitor import RunMonitor
from smiquery.training.outputs import JobMetrics
from tests.exporter.test_rules import require_tool
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _StandInExporter:
    """Serves the exporter's series the training rules read, for the GPUs given (uuid -> utilisation ratio)."""

    def __init__(self, gpus: dict[str, tuple[int, float]]) -> None:
        lines = []
        for uuid, (idx, util) in gpus.items():
            labels = f'gpu="{idx}",uuid="{uuid}",name="NVIDIA H100",pci_bus_id="00000000:1{idx}:00.0"'
            lines.append(f"smiquery_utilization_gpu_ratio{{{labels}}} {util}")
            lines.append(f"smiquery_memory_used_bytes{{{labels}}} 4e10")
        body = ("\n".join(lines) + "\n").encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _prometheus_files(tmp: Path, exporter_port: int, trainer_port: int) -> Path:
    rules = yaml.safe_load((DOCKER / "prometheus" / "smiquery-rules.yml").read_text(encoding="utf-8"))
    (stalled,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "GpuStalledPipeline"]
    assert stalled["for"] == "30m"
    stalled["for"] = "5s"  # the test's copy only
    (tmp / "smiquery-rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False), encoding="utf-8")
    cfg = yaml.safe_load((DOCKER / "compose" / "prometheus.yml").read_text(encoding="utf-8"))
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg.pop("alerting")
    targets = {"127.0.0.1:9849": exporter_port, "127.0.0.1:9400": trainer_port}
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [f"127.0.0.1:{targets[t]}" for t in sc["targets"]]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_the_compose_prometheus_fires_the_stall_alert_for_the_starved_gpu_only(inproc, tmp_path):
    prometheus = require_tool("prometheus")
    metrics = JobMetrics(metrics_port=0, run_id="compose-run")
    monitor = RunMonitor(interval=0.2, alerts=(), gpus=[0, 1], outputs=[metrics]).start()
    stop = threading.Event()
    exporter: _StandInExporter | None = None
    proc: subprocess.Popen[bytes] | None = None

    def train() -> None:
        batch = 0
        while not stop.wait(0.05):
            monitor.step(epoch=0, batch=batch, samples=32)
            batch += 1

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        assert wait_for(lambda: len(monitor.uuids()) == 2)
        uuids = monitor.uuids()
        exporter = _StandInExporter({uuids[0]: (0, 0.05), uuids[1]: (1, 0.9)})
        port = metrics.port
        assert port
        config = _prometheus_files(tmp_path, exporter.port, port)
        prom_port = _free_port()
        url = f"http://127.0.0.1:{prom_port}"
        with (tmp_path / "prometheus.log").open("wb") as log:
            proc = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=log,
                stderr=log,
            )
        assert wait_for(lambda: _ready(url), timeout=60)
        firing = 'ALERTS{alertname="GpuStalledPipeline", alertstate="firing"}'
        try:
            assert wait_for(lambda: _query(url, firing), timeout=120)
        except AssertionError:
            pytest.fail("GpuStalledPipeline never fired:\n" + (tmp_path / "prometheus.log").read_text()[-3000:])
        # both scrape jobs of the compose config are up, and only the starved GPU fires
        assert {r["metric"]["job"] for r in _query(url, "up == 1")} == {"smiquery-exporter", "training"}
        alerts = _query(url, firing)
        assert [a["metric"]["uuid"] for a in alerts] == [uuids[0]]
        assert alerts[0]["metric"]["gpu"] == "0" and alerts[0]["metric"]["job"] == "smiquery-exporter"
    finally:
        stop.set()
        trainer.join(5)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if exporter is not None:
            exporter.close()
        monitor.close()
