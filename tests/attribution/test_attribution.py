"""Pod attribution against a stand-in kubelet: a real gRPC server on a unix socket (pod-resources v1 List)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smiquery.attribution import Attribution, resolve_device
from smiquery.attribution.kubernetes import KubernetesBackend
from smiquery.exporter import serve
from smiquery.exporter.families import attribution_families
from tests.attribution.kubelet import StandInKubelet
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
GPU0 = "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b"
GPU1 = "GPU-c1b0d0c2-7b24-505e-e600-706601380be7"
GPU2 = "GPU-08d66bca-5784-0341-346c-86e41bd1addc"
GPU3 = "GPU-32a57ec6-2a4c-9f45-b3d1-40734f584a12"
MIG = "MIG-4f1c3c5e-0d2a-5b8e-9c1f-2e7d6a9b0c11"
LISTING = f"GPU 3: NVIDIA A100-SXM4-40GB (UUID: {GPU3})\n  MIG 1g.5gb      Device  0: (UUID: {MIG})\n"
GPUS = {GPU0: 0, GPU1: 1, GPU2: 2, GPU3: 3}


@pytest.fixture
def kubelet() -> Iterator[StandInKubelet]:
    short = tempfile.mkdtemp(prefix="k25-", dir="/tmp")  # a unix socket path must stay under 108 bytes
    k = StandInKubelet(str(Path(short) / "kubelet.sock")).start()
    yield k
    k.stop()
    shutil.rmtree(short, ignore_errors=True)


def usual(k: StandInKubelet) -> None:
    k.grants = [
        ("team-a", "train-0", "main", "nvidia.com/gpu", (GPU0,)),  # exclusive
        ("team-b", "infer-1", "srv", "nvidia.com/gpu", (f"{GPU1}::0",)),  # time-sliced to two pods
        ("team-c", "infer-2", "srv", "nvidia.com/gpu", (f"{GPU1}::1",)),
        ("team-d", "nb-3", "jupyter", "nvidia.com/mig-1g.5gb", (MIG,)),  # a MIG device of GPU 3
        ("team-e", "ghost-4", "main", "nvidia.com/gpu", ("GPU-00000000-0000-0000-0000-000000000000",)),  # unknown
        ("team-f", "nic-5", "main", "example.com/nic", ("eth9",)),  # another resource: ignored
    ]  # GPU 2: unallocated


def samples(fams: list[Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = "".join(_render(f) for f in fams)
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def _render(fam: Any) -> str:
    from smiquery.exporter.naming import render

    return render([fam])


def attribution(k: StandInKubelet, timeout: float = 5.0) -> Attribution:
    return Attribution(KubernetesBackend(k.socket_path, timeout=timeout), interval=0.1, mig_listing=lambda: LISTING)


def families(att: Attribution) -> list[Any]:
    return attribution_families(att, GPUS, "uuid", {})


def test_allocations_states_and_labels_from_a_real_grpc_list(kubelet: StandInKubelet) -> None:
    usual(kubelet)
    att = attribution(kubelet)
    assert att.refresh() and att.up
    got = samples(families(att))
    info = {
        (d["uuid"], d["namespace"], d["pod"], d["container"], d["mig_uuid"])
        for d, _ in got["smiquery_gpu_allocation_info"]
    }
    assert info == {
        (GPU0, "team-a", "train-0", "main", ""),
        (GPU1, "team-b", "infer-1", "srv", ""),
        (GPU1, "team-c", "infer-2", "srv", ""),
        (GPU3, "team-d", "nb-3", "jupyter", MIG),
    }
    states = {d["uuid"]: d["state"] for d, v in got["smiquery_kubernetes_gpu_attribution_state"] if v == 1.0}
    assert states == {GPU0: "exclusive", GPU1: "shared", GPU2: "unallocated", GPU3: "partitioned"}
    unknown = got["smiquery_kubernetes_unknown_device_info"]
    assert [(d["pod"], d["device_id"]) for d, _ in unknown] == [("ghost-4", "GPU-00000000-0000-0000-0000-000000000000")]
    assert got["smiquery_kubernetes_attribution_up"] == [({}, 1.0)]
    # only the GPU one container holds whole carries pod labels on its device series
    assert att.gpu_labels(GPU0, GPUS) == {"pod": "train-0", "namespace": "team-a", "container": "main"}
    assert att.gpu_labels(GPU1, GPUS) == {} and att.gpu_labels(GPU2, GPUS) == {} and att.gpu_labels(GPU3, GPUS) == {}


def test_device_ids_as_the_device_plugin_writes_them() -> None:
    migs = {MIG: (GPU3, "1g.5gb")}
    assert resolve_device(GPU0, migs, GPUS).gpu_uuid == GPU0
    r = resolve_device(f"{GPU0}::7", migs, GPUS)
    assert (r.gpu_uuid, r.replica) == (GPU0, 7)
    r = resolve_device(MIG, migs, GPUS)
    assert (r.gpu_uuid, r.mig_uuid, r.mig_profile) == (GPU3, MIG, "1g.5gb")
    assert resolve_device(f"MIG-{GPU2}/1/0", {}, GPUS).gpu_uuid == GPU2  # the old MIG id form names its parent
    assert resolve_device("MIG-ffffffff-0000-0000-0000-000000000000", migs, GPUS).gpu_uuid is None
    assert resolve_device("0000:3b:00.0", migs, GPUS).gpu_uuid is None


def test_changes_are_followed_and_logged_once(kubelet: StandInKubelet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="smiquery")
    kubelet.grants = [("team-a", "train-0", "main", "nvidia.com/gpu", (GPU0,))]
    att = attribution(kubelet)
    att.refresh()
    families(att)
    att.refresh()
    families(att)  # nothing changed: nothing logged again
    assert sum("GPU 0" in r.getMessage() and "exclusive" in r.getMessage() for r in caplog.records) == 1
    kubelet.grants = [("team-b", "train-9", "main", "nvidia.com/gpu", (GPU0,))]
    att.refresh()
    assert att.gpu_labels(GPU0, GPUS)["pod"] == "train-9"
    kubelet.grants = []
    att.refresh()
    assert att.gpu_labels(GPU0, GPUS) == {}
    lines = [r.getMessage() for r in caplog.records if "GPU 0 " in r.getMessage()]
    assert len(lines) == 2 and "train-9" not in lines[0] and lines[1].endswith("unallocated")


def test_socket_gone_and_back_is_never_silent(kubelet: StandInKubelet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="smiquery")
    usual(kubelet)
    att = attribution(kubelet, timeout=2.0)
    att.refresh()
    kubelet.stop()
    assert not att.refresh() and not att.up
    assert not att.refresh()
    got = samples(families(att))
    assert got["smiquery_kubernetes_attribution_up"] == [({}, 0.0)]
    states = {d["uuid"]: d["state"] for d, v in got["smiquery_kubernetes_gpu_attribution_state"] if v == 1.0}
    assert set(states.values()) == {"unreachable"} and len(states) == 4
    assert "smiquery_gpu_allocation_info" not in got and att.gpu_labels(GPU0, GPUS) == {}
    errs = got["smiquery_kubernetes_attribution_errors"]
    assert [(d["type"], v) for d, v in errs] == [("unavailable", 2.0)]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "pod-resources" in r.getMessage()]
    assert len(warned) == 1 and kubelet.socket_path in warned[0].getMessage()  # once per change, not per call
    kubelet.start()
    assert att.refresh() and att.gpu_labels(GPU0, GPUS)["pod"] == "train-0"
    assert any("answers again" in r.getMessage() for r in caplog.records)


_AS_USER = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from smiquery.attribution import Attribution
from smiquery.attribution.kubernetes import KubernetesBackend
att = Attribution(KubernetesBackend(sys.argv[1], timeout=5.0), interval=1.0, mig_listing=lambda: "")
if sys.argv[2] != "0":  # imports done (the interpreter may live under /root): now become the exporter's user
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
print("ok" if att.refresh() else "failed", dict(att.errors))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_a_socket_only_root_may_use_says_so_and_how_to_fix_it(kubelet: StandInKubelet) -> None:
    """The kubelet's socket is ``srwxr-xr-x root root``: the exporter's non-root user cannot connect, and the log
    line says that, not gRPC's bare UNAVAILABLE."""
    usual(kubelet)
    os.chmod(kubelet.socket_path, 0o755)
    os.chmod(Path(kubelet.socket_path).parent, 0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", _AS_USER, kubelet.socket_path]
    as_nobody = subprocess.run([*argv, "65532"], capture_output=True, text=True, timeout=120, env=env)
    assert as_nobody.stdout.startswith("failed {'permission_denied': 1}"), as_nobody.stdout + as_nobody.stderr
    assert f"{kubelet.socket_path} is srwxr-xr-x owned by uid 0 and this process runs as uid 65532" in as_nobody.stderr
    assert "runAsUser: 0" in as_nobody.stderr
    as_root = subprocess.run([*argv, "0"], capture_output=True, text=True, timeout=120, env=env)
    assert as_root.stdout.startswith("ok"), as_root.stdout + as_root.stderr


def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("naming", ["smiquery", "dcgm"])
def test_exporter_serves_pod_labels_and_follows_the_kubelet(kubelet: StandInKubelet, inproc: Any, naming: str) -> None:
    usual(kubelet)
    exp = serve(port=0, interval=0.1, naming=naming, attribution=attribution(kubelet))  # type: ignore[arg-type]
    try:
        temp = "DCGM_FI_DEV_GPU_TEMP" if naming == "dcgm" else "smiquery_temperature_gpu_celsius"
        uu = "UUID" if naming == "dcgm" else "uuid"

        def by_uuid() -> dict[str, dict[str, str]]:
            return {d[uu]: d for d, _ in _metrics(exp.url).get(temp, [])}

        wait_for(lambda: by_uuid().get(GPU0, {}).get("pod") == "train-0", timeout=30, what="pod labels")
        series = by_uuid()
        assert series[GPU0]["namespace"] == "team-a" and series[GPU0]["container"] == "main"
        assert "pod" not in series[GPU1] and "pod" not in series[GPU2]  # shared: one series, no pod labels
        assert sum(1 for d, _ in _metrics(exp.url)[temp] if d[uu] == GPU1) == 1
        # the kubelet changes its mind while the exporter runs
        kubelet.grants = [("team-z", "new-7", "main", "nvidia.com/gpu", (GPU2,))]
        wait_for(lambda: by_uuid().get(GPU2, {}).get("pod") == "new-7", timeout=30, what="the new allocation")
        assert "pod" not in by_uuid()[GPU0]
        kubelet.stop()  # the kubelet goes away: device series keep flowing, without pod labels
        wait_for(lambda: _metrics(exp.url)["smiquery_kubernetes_attribution_up"][0][1] == 0.0, timeout=30, what="down")
        series = by_uuid()
        assert len(series) == 8 and all("pod" not in d for d in series.values())
    finally:
        exp.stop()
