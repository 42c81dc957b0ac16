"""`smiquery export --slurm` beside a real slurmctld and slurmd, on the stand-in nvidia-smi, scraped over HTTP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smiquery.testing import fake_nvidia_smi
from tests.attribution.slurm_cluster import SlurmCluster, need_slurm

pytestmark = pytest.mark.xdist_group("slurm")

ROOT = Path(__file__).resolve().parents[2]
GPUS = 8  # the stand-in's bundled recording
Families = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    need_slurm()
    c = SlurmCluster(GPUS)
    try:
        yield c.start()
    finally:
        c.stop()


class Exporter:
    def __init__(self, cluster: SlurmCluster, tmp: Path) -> None:
        fake = fake_nvidia_smi(tmp / "bin")
        env = {**cluster.env, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--nvidia-smi", str(fake)]
        argv += ["--interval", "1", "--kernel-log", "", "--details-interval", "off"]
        argv += ["--slurm", "--slurm-interval", "2", "--slurm-node", cluster.node]
        self.log = tmp / "exporter.log"
        with self.log.open("w", encoding="utf-8") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def scrape(self) -> Families:
        if not self.url:
            found = re.search(r"serving (http://127\.0\.0\.1:\d+)/metrics", self.log.read_text(encoding="utf-8"))
            if not found:
                return {}
            self.url = found.group(1) + "/metrics"
        with urllib.request.urlopen(self.url, timeout=10) as resp:
            text = resp.read().decode()
        return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}

    def until(self, ok: Callable[[Families], bool], what: str, timeout: float = 40.0) -> Families:
        deadline = time.monotonic() + timeout
        fams: Families = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text(encoding="utf-8")
            fams = self.scrape()
            if fams and ok(fams):
                return fams
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {timeout:g} s; last scrape {fams}\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def exporter(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Exporter]:
    exp = Exporter(cluster, tmp_path)
    try:
        yield exp
    finally:
        exp.stop()


def held(fams: Families, job: str) -> list[dict[str, str]]:
    return [s for s, _ in fams.get("smiquery_gpu_allocation_info", []) if s.get("slurm_job_id") == job]


def naming(fams: Families, job: str) -> list[str]:
    """The series that name the job anywhere."""
    return [n for n, samples in fams.items() for s, _ in samples if s.get("slurm_job_id") == job]


def up(fams: Families) -> float | None:
    got = fams.get("smiquery_slurm_attribution_up")
    return got[0][1] if got else None


def test_a_job_shows_on_exactly_its_gpu_and_goes_when_it_ends(cluster: SlurmCluster, exporter: Exporter) -> None:
    name = 'it\'s "quoted"\nand a second line'
    job = cluster.submit("gpu:1", name)
    fams = exporter.until(lambda f: len(held(f, job)) == 1, f"allocation_info for job {job}")
    (one,) = held(fams, job)
    assert (one["slurm_user"], one["slurm_partition"], one["slurm_job_name"]) == ("root", "gpus", name)
    assert up(fams) == 1.0
    # the device series of that GPU carry the job (both namings use these labels), and no other GPU's do
    util = [s for s, _ in fams["smiquery_utilization_gpu_ratio"] if s.get("slurm_job_id") == job]
    assert [s["uuid"] for s in util] == [one["uuid"]]
    # Slurm's IDX 0 is the GPU of minor number 0, which the stand-in gives its first GPU
    assert one["gpu"] == "0"
    cluster.cancel(job)
    exporter.until(lambda f: not naming(f, job), f"no series naming job {job} after scancel")


def test_two_jobs_one_on_two_gpus_hold_three_distinct_gpus(cluster: SlurmCluster, exporter: Exporter) -> None:
    pair = cluster.submit("gpu:2", "pair")
    single = cluster.submit("gpu:1", "single")
    fams = exporter.until(lambda f: len(held(f, pair)) == 2 and len(held(f, single)) == 1, "both jobs")
    uuids = [s["uuid"] for s in held(fams, pair) + held(fams, single)]
    assert len(set(uuids)) == 3
    states = {s["uuid"]: s["state"] for s, v in fams["smiquery_slurm_gpu_attribution_state"] if v == 1.0}
    assert sorted(states.values()).count("exclusive") == 3
    assert sorted(states.values()).count("unallocated") == GPUS - 3
    cluster.cancel(pair)
    cluster.cancel(single)
    exporter.until(lambda f: not naming(f, pair) and not naming(f, single), "both jobs gone")


def test_slurmctld_down_means_no_job_labels_and_up_0_then_back(cluster: SlurmCluster, exporter: Exporter) -> None:
    job = cluster.submit("gpu:1", "survivor")
    exporter.until(lambda f: len(held(f, job)) == 1, f"allocation_info for job {job}")
    cluster.stop_controller()
    try:
        fams = exporter.until(lambda f: up(f) == 0.0, "attribution_up 0 with slurmctld stopped")
        assert not naming(fams, job)
        assert fams["smiquery_utilization_gpu_ratio"], "the device series keep flowing"
        log = exporter.log.read_text(encoding="utf-8")
        assert "slurmctld does not answer" in log or "did not answer within" in log, log
    finally:
        cluster.start_controller()
    fams = exporter.until(lambda f: up(f) == 1.0 and len(held(f, job)) == 1, "attribution back with slurmctld", 90)
    cluster.cancel(job)
    exporter.until(lambda f: not naming(f, job), f"no series naming job {job} after scancel")


def test_without_slurm_commands_it_says_what_to_install(tmp_path: Path) -> None:
    fake = fake_nvidia_smi(tmp_path / "bin")
    argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--nvidia-smi", str(fake), "--interval", "1"]
    argv += ["--kernel-log", "", "--slurm", "--slurm-bin-dir", str(tmp_path / "nowhere")]
    log = tmp_path / "log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "squeue not found" not in log.read_text():
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "squeue not found in" in text and "install Slurm's client commands" in text, text
    assert text.count("squeue not found") == 1, text
