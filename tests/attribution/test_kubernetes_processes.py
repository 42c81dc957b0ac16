"""Per-pod use of shared GPUs: /proc cgroup fixtures (v1, v2; containerd, CRI-O, docker) and a stand-in API server
answering a node's pods list, read by the official ``kubernetes`` client through a kubeconfig."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from smiquery.attribution import Attribution
from smiquery.attribution.cgroups import PodCgroup, parse_cgroup, pod_of_pid
from smiquery.attribution.kubernetes import KubernetesBackend, PodDirectory
from smiquery.exporter.families import workload_usage_families
from smiquery.exporter.pmonwatch import ProcessInstant
from smiquery.sources.apps import GpuProcess
from smiquery.sources.pmon import PmonRow

if importlib.util.find_spec("kubernetes") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("the kubernetes client is missing: make test installs the k8s extra")
    pytest.skip("the kubernetes client is not installed (the k8s extra)", allow_module_level=True)

UID_A = "6b2a3f0e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
UID_B = "9f8e7d6c-5b4a-4321-9876-543210fedcba"
CID = {n: (c * 64) for n, c in (("a", "a"), ("b", "b"), ("c", "c"), ("d", "d"))}
GPU1 = "GPU-c1b0d0c2-7b24-505e-e600-706601380be7"

# Hand-written fixtures, one per runtime and cgroup layout.
CGROUPS = {
    "containerd-v2-systemd": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/"
        f"cri-containerd-{CID['a']}.scope\n",
        PodCgroup(UID_A, CID["a"]),
    ),
    "crio-v2-systemd": (
        f"0::/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/crio-{CID['b']}.scope\n",
        PodCgroup(UID_B, CID["b"]),
    ),
    "docker-v1-cgroupfs": (
        "12:memory:/kubepods/besteffort/pod" + UID_A + "/" + CID["c"] + "\n"
        "11:cpu,cpuacct:/kubepods/besteffort/pod" + UID_A + "/" + CID["c"] + "\n1:name=systemd:/\n",
        PodCgroup(UID_A, CID["c"]),
    ),
    "docker-v1-systemd": (
        f"4:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_B.replace('-', '_')}"
        f".slice/docker-{CID['d']}.scope\n0::/\n",
        PodCgroup(UID_B, CID["d"]),
    ),
    "containerd-v1-cgroupfs-guaranteed": (
        f"7:pids:/kubepods/pod{UID_B}/{CID['a']}\n",
        PodCgroup(UID_B, CID["a"]),
    ),
    "host-process-v2": ("0::/system.slice/sshd.service\n", None),
    "crio-conmon": (
        f"0::/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/crio-conmon-{CID['b']}.scope\n",
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CGROUPS))
def test_cgroup_paths_name_pod_and_container(case: str) -> None:
    text, want = CGROUPS[case]
    assert parse_cgroup(text) == want


def test_pod_of_pid_reads_a_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(CGROUPS["crio-v2-systemd"][0])
    assert pod_of_pid(4242, str(tmp_path)) == PodCgroup(UID_B, CID["b"])
    assert pod_of_pid(4243, str(tmp_path)) is None  # gone, or in another PID namespace


def _pod(uid: str, ns: str, name: str, node: str, containers: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "namespace": ns, "name": name},
        "spec": {"nodeName": node, "containers": [{"name": c} for c in containers]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": c,
                    "containerID": cid,
                    "image": "x",
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                }
                for c, cid in containers.items()
            ],
        },
    }


class _ApiServer:
    """Answers GET /api/v1/pods?fieldSelector=spec.nodeName=N as the real API server does (a PodList)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.selectors: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path != "/api/v1/pods":
                    self.send_error(404)
                    return
                sel = parse_qs(url.query).get("fieldSelector", [""])[0]
                outer.selectors.append(sel)
                node = sel.removeprefix("spec.nodeName=")
                items = [p for p in outer.pods if p["spec"]["nodeName"] == node]
                body = json.dumps(
                    {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_ApiServer]:
    server = _ApiServer(
        [
            _pod(UID_A, "team-b", "infer-1", "node-7", {"srv": f"containerd://{CID['a']}"}),
            _pod(UID_B, "team-c", "infer-2", "node-7", {"srv": f"cri-o://{CID['b']}"}),
            _pod("11111111-2222-3333-4444-555555555555", "team-x", "elsewhere", "node-8", {"x": "containerd://e"}),
        ]
    )
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield server
    server.close()


def test_shared_gpu_use_is_split_by_pod_and_sums_to_the_device(api: _ApiServer, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, case in ((101, "containerd-v2-systemd"), (202, "crio-v2-systemd"), (303, "host-process-v2")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(CGROUPS[case][0])
    pods = PodDirectory(node="node-7")
    assert pods.refresh()
    assert api.selectors == ["spec.nodeName=node-7"]  # only this node's pods are asked for
    rows = (
        (PmonRow(1, 101, "C", 40, 20), None),
        (PmonRow(1, 202, "C", 25, 10), None),
        (PmonRow(1, 303, "C", 5, 1), None),
        (PmonRow(1, None, None, 3, 2, command="other"), None),  # pmon's own rest row
    )
    instant = ProcessInstant(rows, {1: 4}, 0.0, 0.0)
    procs = [
        GpuProcess(pid=101, process_name="python", gpu_uuid=GPU1, gpu_index=1, used_memory=1024),
        GpuProcess(pid=202, process_name="python", gpu_uuid=GPU1, gpu_index=1, used_memory=512),
    ]
    backend = KubernetesBackend(pods=pods, cgroup_of=lambda pid: pod_of_pid(pid, str(proc)))
    fams = workload_usage_families(Attribution(backend), {GPU1: 1}, instant, procs, "uuid", {})
    got = {
        f.name: {(s.labels["namespace"], s.labels["pod"], s.labels["container"]): s.value for s in f.samples}
        for f in fams
    }
    util = got["smiquery_pod_gpu_utilization_ratio"]
    assert util[("team-b", "infer-1", "srv")] == pytest.approx(0.40)
    assert util[("team-c", "infer-2", "srv")] == pytest.approx(0.25)
    assert util[("", "other", "")] == pytest.approx(0.08)  # the host process and pmon's rest
    assert sum(util.values()) == pytest.approx(0.73)  # what pmon saw on the GPU, counted once
    mem = got["smiquery_pod_gpu_memory_used_bytes"]
    assert mem == {("team-b", "infer-1", "srv"): 1024 * 1048576.0, ("team-c", "infer-2", "srv"): 512 * 1048576.0}


def test_api_server_gone_is_said_once_and_use_goes_to_other(api: _ApiServer, caplog: pytest.LogCaptureFixture) -> None:
    pods = PodDirectory(node="node-7", timeout=5.0)
    assert pods.refresh() and pods.up
    api.close()
    assert not pods.refresh() and not pods.refresh()
    assert not pods.up and sum(pods.failures.errors.values()) == 2
    assert sum("listing the pods of node node-7 failed" in r.getMessage() for r in caplog.records) == 1
