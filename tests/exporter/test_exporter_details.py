"""The exporter's slow paths: ``nvidia-smi -q -x`` on its own cadence (per-MIG-instance memory) and Xid errors
counted from a kernel log (a plain file here, followed like ``tail -F``).

The fake answers ``-q -x`` from ``SMIQUERY_FAKE_XML`` (tests/fixtures/details-2gpu-mig.xml, or the corpus's A100 MIG
capture read in place) and ``-L`` with stable made-up MIG UUIDs and profiles.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from smiquery.exporter.families import fresh_details
from smiquery.exporter.server import details_poller
from smiquery.testing import InProcessRunner
from tests.corpus import require_corpus
from tests.helpers import wait_for

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "details-2gpu-mig.xml"
MIG_GPU = "GPU-11111111-2222-3333-4444-555555555555"  # GPU 0 of the fixture: MIG on, GI 2 (3g) and GI 9 (1g)
CSV_GPU0 = ("00000000:18:00.0", "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b")  # GPU 0 of the fake's recording


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def samples(body: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for fam in text_string_to_metric_families(body):  # also checks the whole body parses
        for s in fam.samples:
            if s.name == name:
                out.append((dict(s.labels), s.value))
    return out


def mig_served(url: str, name: str = "smiquery_mig_memory_used_bytes") -> list[tuple[dict[str, str], float]]:
    return samples(scrape(url), name)


def q_calls(runner: InProcessRunner) -> int:
    return sum(1 for argv in runner.calls if "-q" in argv)


# ------------------------------------------------------------------------------------------------- MIG memory


def test_mig_instances_get_memory_series_with_native_labels(exporter: Any, inproc: InProcessRunner) -> None:
    inproc.env = {"SMIQUERY_FAKE_XML": str(FIXTURE)}
    exp = exporter(interval=0.1, details_interval=30)
    got = wait_for(lambda: mig_served(exp.url), what="MIG series")
    by_gi = {labels["gpu_instance_id"]: (labels, value) for labels, value in got}
    assert set(by_gi) == {"2", "9"}
    labels, used = by_gi["2"]
    assert used == 1200 * 1048576
    assert labels["uuid"] == MIG_GPU and labels["pci_bus_id"] == "00000000:07:00.0"
    assert labels["mig_uuid"].startswith("MIG-") and labels["profile"] and labels["compute_instance_id"] == "0"
    body = scrape(exp.url)
    totals = {lab["gpu_instance_id"]: v for lab, v in samples(body, "smiquery_mig_memory_total_bytes")}
    assert totals["2"] == 40192 * 1048576
    free = {lab["gpu_instance_id"]: v for lab, v in samples(body, "smiquery_mig_memory_free_bytes")}
    assert free["2"] == 38992 * 1048576
    # nvidia-smi has no per-instance utilisation: no series at all, never a 0
    assert not [line for line in body.splitlines() if "mig" in line.lower() and "util" in line.lower()]
    assert samples(body, "smiquery_details_up") == [({}, 1.0)]


def test_dcgm_naming_puts_mig_samples_in_dcgm_families_with_gpu_i_labels(
    exporter: Any, inproc: InProcessRunner
) -> None:
    inproc.env = {"SMIQUERY_FAKE_XML": str(FIXTURE)}
    exp = exporter(interval=0.1, details_interval=30, naming="dcgm")
    wait_for(lambda: all(s in scrape(exp.url) for s in ("GPU_I_ID", "DCGM_FI_DEV_GPU_TEMP{")), what="MIG and CSV")
    body = scrape(exp.url)
    # the GPUs' own FB series and the instances' share one family: the text format allows one header per name
    assert body.count("# TYPE DCGM_FI_DEV_FB_USED gauge") == 1
    fb = samples(body, "DCGM_FI_DEV_FB_USED")
    mig = {lab["GPU_I_ID"]: (lab, v) for lab, v in fb if "GPU_I_ID" in lab}
    assert set(mig) == {"2", "9"}
    lab, used = mig["2"]
    assert used == 1200.0  # MiB, as dcgm-exporter
    assert lab["UUID"] == MIG_GPU and lab["GPU_I_PROFILE"] and lab["modelName"] == "NVIDIA A100-SXM4-80GB"
    assert "mig_uuid" not in lab
    assert any("GPU_I_ID" not in lab for lab, _ in fb)  # the CSV's per-GPU series are still there


def test_the_a100_mig_capture_yields_both_instances(exporter: Any, inproc: InProcessRunner) -> None:
    xml = require_corpus() / "xml" / "netdata__a100-sxm4-mig.xml"
    inproc.env = {"SMIQUERY_FAKE_XML": str(xml)}
    exp = exporter(interval=0.1, details_interval=30)
    got = wait_for(lambda: mig_served(exp.url, "smiquery_mig_memory_total_bytes"), what="MIG series")
    assert sorted(lab["gpu_instance_id"] for lab, _ in got) == ["1", "2"]
    assert {v for _, v in got} == {19968 * 1048576}
    assert {lab["uuid"] for lab, _ in got} == {"GPU-27b94a00-ed54-5c24-b1fd-1054085de32a"}


def test_mig_series_have_no_gaps_while_the_csv_runs_faster_and_details_never_run_on_a_scrape(
    exporter: Any, inproc: InProcessRunner
) -> None:
    inproc.env = {"SMIQUERY_FAKE_XML": str(FIXTURE)}
    exp = exporter(interval=0.05, details_interval=300)
    wait_for(lambda: mig_served(exp.url), what="MIG series")
    sweeps = exp.stream.stats.sweeps
    scrapes = 0
    while exp.stream.stats.sweeps < sweeps + 10 or scrapes < 30:  # many CSV sweeps between two -q -x polls
        assert len(mig_served(exp.url)) == 2, "a scrape without the MIG series"
        scrapes += 1
    assert q_calls(inproc) == 1  # one poll so far; 30+ scrapes ran none


def test_a_mig_reconfiguration_updates_the_series_without_a_restart(
    exporter: Any, inproc: InProcessRunner, tmp_path: Path
) -> None:
    xml = tmp_path / "q.xml"
    shutil.copyfile(FIXTURE, xml)
    inproc.env = {"SMIQUERY_FAKE_XML": str(xml)}
    exp = exporter(interval=0.1, details_interval=0.2)
    wait_for(lambda: len(mig_served(exp.url)) == 2, what="two instances")
    text = xml.read_text(encoding="utf-8")
    start = text.index("<mig_device>", text.index("<mig_device>") + 1)  # the second instance (GI 9) destroyed
    end = text.index("</mig_device>", start) + len("</mig_device>")
    xml.write_text(text[:start] + text[end:], encoding="utf-8")
    wait_for(lambda: len(mig_served(exp.url)) == 1, what="one instance left")
    assert [lab["gpu_instance_id"] for lab, _ in mig_served(exp.url)] == ["2"]
    xml.write_text(text, encoding="utf-8")  # created again
    wait_for(lambda: len(mig_served(exp.url)) == 2, what="the instance back")


def test_a_failing_details_poll_is_counted_and_leaves_the_mig_series_out() -> None:
    poller = details_poller(60, runner=InProcessRunner(fault="garbage", env={"SMIQUERY_FAKE_XML": str(FIXTURE)}))
    poller.poll()
    assert sum(poller.get().failures.values()) == 1 and poller.get().error
    assert fresh_details(poller) is None
    with pytest.raises(ValueError, match="positive"):
        details_poller(0)


# ------------------------------------------------------------------------------------------------------- Xid


def xids(url: str) -> dict[tuple[str, str], float]:
    return {(lab["uuid"], lab["xid"]): v for lab, v in samples(scrape(url), "smiquery_xid_errors_total")}


def test_xid_lines_in_kmsg_and_dmesg_formats_count_per_gpu_and_code(
    exporter: Any, inproc: InProcessRunner, tmp_path: Path
) -> None:
    inproc.env = {"SMIQUERY_FAKE_XML": str(FIXTURE)}
    log = tmp_path / "kern.log"
    log.write_text(
        "4,812,1000812,-;NVRM: Xid (PCI:0000:18:00): 79, pid=0, name=python, GPU has fallen off the bus.\n"
        "[ 5678.901234] NVRM: Xid (PCI:0000:07:00): 48, pid=1234, name=train, DBE (double bit error).\n",
        encoding="utf-8",
    )
    exp = exporter(interval=0.1, details_interval=30, kernel_log=str(log))
    wait_for(lambda: len(xids(exp.url)) == 2, what="two Xid series")
    got = xids(exp.url)
    assert got == {(CSV_GPU0[1], "79"): 1.0, (MIG_GPU, "48"): 1.0}  # by the CSV's GPUs and by the details'
    with log.open("a", encoding="utf-8") as f:  # a repeat counts, and a new code on the same GPU
        f.write("4,813,1000900,-;NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n")
        f.write("[ 5679.000001] NVRM: Xid (PCI:0000:18:00): 94, pid=77, Contained: SM (0x1).\n")
        f.write("[ 5679.5] some other kernel line\n")
    wait_for(lambda: xids(exp.url).get((CSV_GPU0[1], "94")) == 1.0, what="the new Xid")
    got = xids(exp.url)
    assert got[(CSV_GPU0[1], "79")] == 2.0 and got[(MIG_GPU, "48")] == 1.0
    body = scrape(exp.url)
    labels = next(lab for lab, _ in samples(body, "smiquery_xid_errors_total") if lab["xid"] == "79")
    assert labels["gpu"] == "0" and labels["action"] == "drain" and labels["pci_bus_id"] == "0000:18:00"
    assert samples(body, "smiquery_xid_source_up") == [({"path": str(log)}, 1.0)]


def rejected(url: str) -> dict[str, float]:
    return {lab["reason"]: v for lab, v in samples(scrape(url), "smiquery_xid_rejected_lines_total")}


def test_xid_lines_the_kernel_did_not_write_are_refused_and_counted_by_reason(
    exporter: Any, inproc: InProcessRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="smiquery")
    log = tmp_path / "syslog"
    log.write_text("Dec  5 09:59:59 node7 systemd[1]: Started Session 1 of user bob.\n", encoding="utf-8")
    exp = exporter(interval=0.1, kernel_log=str(log))
    wait_for(lambda: rejected(exp.url) == {"not_kernel": 0.0, "unknown_format": 0.0, "malformed": 0.0},
             what="the rejected-lines counter at 0")  # fmt: skip
    fell_off = "NVRM: Xid (PCI:0000:18:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    with log.open("a", encoding="utf-8") as f:  # what `logger`, a program's own tag and a relay write
        for forged in ("user: ", "bob[4242]: ", "kernelx: ", "mallory: [ 1.0] kernel: "):
            f.write(f"Dec  5 10:00:00 node7 {forged}{fell_off}\n")
        f.write(f"<14>1 2026-12-05T10:00:00.123456+00:00 node7 bob - - - {fell_off}\n<14>{fell_off}\n")
    wait_for(lambda: sum(rejected(exp.url).values()) == 6, what="six refused lines")
    assert rejected(exp.url) == {"not_kernel": 5.0, "unknown_format": 1.0, "malformed": 0.0}
    assert xids(exp.url) == {}  # a healthy GPU shows no Xid
    with log.open("a", encoding="utf-8") as f:  # the kernel's own line, as rsyslog writes it
        f.write(f"Dec  5 10:00:01 node7 kernel: [ 5678.901234] {fell_off}\n")
    wait_for(lambda: xids(exp.url) == {(CSV_GPU0[1], "79"): 1.0}, what="the kernel's Xid 79")
    assert sum(rejected(exp.url).values()) == 6
    refused = [r.getMessage() for r in caplog.records if "looks like an Xid" in r.getMessage()]
    assert len(refused) == 1 and "(not_kernel)" in refused[0]  # one note a minute, not one per line


def test_an_unreadable_kernel_log_warns_once_and_the_gpu_metrics_go_on(
    exporter: Any, inproc: InProcessRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-kmsg"
    caplog.set_level(logging.WARNING, logger="smiquery")
    exp = exporter(interval=0.1, kernel_log=str(missing))
    wait_for(lambda: "smiquery_temperature_gpu_celsius{" in scrape(exp.url), what="GPU metrics")
    body = scrape(exp.url)
    assert samples(body, "smiquery_xid_source_up") == [({"path": str(missing)}, 0.0)]
    assert samples(body, "smiquery_up") == [({}, 1.0)]
    warned = [r for r in caplog.records if "cannot read the kernel log" in r.getMessage()]
    assert len(warned) == 1  # retries go on quietly (tests/sources/test_xid.py: one on_error, many attempts)
    assert "CAP_SYSLOG" in warned[0].getMessage()


# ------------------------------------------------------------------------------------------- the DaemonSet


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed; CI must check the Kubernetes manifests")
        pytest.skip(f"{name} is not installed")
    return found


def test_the_kmsg_component_gives_the_daemonset_what_reading_dev_kmsg_needs_and_no_more(tmp_path: Path) -> None:
    k8s = Path(__file__).resolve().parents[2] / "docker" / "k8s"
    docs = [d for d in yaml.safe_load_all((k8s / "base" / "exporter.yaml").read_text(encoding="utf-8")) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    base = ds["spec"]["template"]["spec"]["containers"][0]
    assert base["args"][-2:] == ["--kernel-log", ""]  # restricted level: off unless the component turns it on
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(Path("..") / Path(os.path.relpath(k8s / "base", tmp_path)))],
                "components": [str(Path("..") / Path(os.path.relpath(k8s / "components" / "xid-kmsg", tmp_path)))],
            }
        ),
        encoding="utf-8",
    )
    done = subprocess.run(
        [_tool("kubectl"), "kustomize", str(mine)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    ds_out = next(d for d in built if d["kind"] == "DaemonSet")
    out = tmp_path / "patched.yaml"
    out.write_text(yaml.safe_dump(ds_out), encoding="utf-8")
    spec = ds_out["spec"]["template"]["spec"]
    ctr = spec["containers"][0]
    assert ctr["args"][-2:] == ["--kernel-log", "/dev/kmsg"]
    assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False and not ctr["securityContext"]["privileged"]
    assert {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True} in ctr["volumeMounts"]
    assert {v["name"] for v in spec["volumes"]} == {"tmp", "kmsg"}
    validate = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "-k", "1.30.0", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert validate.returncode == 0 and "passed" in validate.stdout, validate.stdout + validate.stderr
