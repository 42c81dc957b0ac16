"""`smiquery export --kubernetes` end to end: the CLI, the fake nvidia-smi and the stand-in kubelet's socket."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from smiquery.testing import fake_nvidia_smi
from tests.attribution.kubelet import StandInKubelet

GPU0 = "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b"
GPU1 = "GPU-c1b0d0c2-7b24-505e-e600-706601380be7"
ROOT = Path(__file__).resolve().parents[2]


def test_export_kubernetes_serves_pod_labels_from_the_kubelet_socket(tmp_path: Path) -> None:
    short = tempfile.mkdtemp(prefix="k25c-", dir="/tmp")  # a unix socket path must stay under 108 bytes
    kubelet = StandInKubelet(str(Path(short) / "kubelet.sock")).start()
    kubelet.grants = [
        ("team-a", "train-0", "main", "nvidia.com/gpu", (GPU0,)),
        ("team-b", "infer-1", "srv", "nvidia.com/gpu", (f"{GPU1}::0",)),
        ("team-c", "infer-2", "srv", "nvidia.com/gpu", (f"{GPU1}::1",)),
    ]
    fake = fake_nvidia_smi(tmp_path / "bin")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--nvidia-smi", str(fake), "--interval", "1"]
    argv += ["--kubernetes", "--pod-resources-socket", kubelet.socket_path]
    log = tmp_path / "exporter.log"
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        families: dict[str, list[tuple[dict[str, str], float]]] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"serving (http://127\.0\.0\.1:\d+)/metrics", log.read_text(encoding="utf-8"))
            if found:
                with urllib.request.urlopen(found.group(1) + "/metrics", timeout=10) as resp:
                    text = resp.read().decode()
                families = {
                    f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)
                }
                if families.get("smiquery_gpu_allocation_info") and families.get("smiquery_utilization_gpu_ratio"):
                    break
            time.sleep(0.2)
        assert families.get("smiquery_gpu_allocation_info"), log.read_text(encoding="utf-8")
    finally:
        proc.terminate()
        proc.wait(30)
        kubelet.stop()
        shutil.rmtree(short, ignore_errors=True)
    held = {(s["uuid"], s["namespace"], s["pod"], s["container"]) for s, _ in families["smiquery_gpu_allocation_info"]}
    assert held == {
        (GPU0, "team-a", "train-0", "main"),
        (GPU1, "team-b", "infer-1", "srv"),
        (GPU1, "team-c", "infer-2", "srv"),
    }
    assert families["smiquery_kubernetes_attribution_up"][0][1] == 1.0
    util = {s["uuid"]: s for s, _ in families["smiquery_utilization_gpu_ratio"]}
    # one holder: pod labels on the device series; a shared GPU: none, and never one series per pod
    assert (util[GPU0]["pod"], util[GPU0]["namespace"], util[GPU0]["container"]) == ("train-0", "team-a", "main")
    assert util[GPU1].get("pod", "") == ""
    assert sum(1 for s, _ in families["smiquery_utilization_gpu_ratio"] if s["uuid"] == GPU1) == 1
