"""``smiquery report --prometheus URL --slurm-job ID`` and the Slurm epilog, against a real, backfilled Prometheus.

Two nodes as ``smiquery export --slurm`` exports them: job 101 (alice) holds both GPUs of node-a for samples
20..80, busy on GPU 0 and idle on GPU 1; job 202 (bob, a job name with quotes, a newline and ``$(...)``) holds
node-b's GPU 0 for samples 50..110. Outside its job each GPU runs at 5 %, so a report over the wrong range or of
the wrong GPU shows in the means.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.exporter.test_rules import require_tool
from tests.fleet.fleetdata import MiB, backfill, started

pytestmark = pytest.mark.xdist_group("prometheus")

ROOT = Path(__file__).resolve().parents[2]
EPILOG = ROOT / "deploy" / "slurm" / "smiquery-epilog.sh"
STEP = 15
SAMPLES = 120
TOTAL_MIB = 81559
# (instance, gpu, job id or "", first sample, last sample, utilization in the job, memory MiB in the job)
GPUS = [
    ("node-a:9849", 0, "101", 20, 80, 80, 30000),
    ("node-a:9849", 1, "101", 20, 80, 0, 500),
    ("node-b:9849", 0, "202", 50, 110, 40, 10000),
    ("node-b:9849", 1, "", 0, -1, 0, 0),
]
JOBS = {
    "101": {"slurm_user": "alice", "slurm_job_name": "train", "slurm_account": "ml", "slurm_partition": "gpu"},
    "202": {
        "slurm_user": "bob",
        "slurm_job_name": 'x"; $(touch pwned)\nrm',
        "slurm_account": "",
        "slurm_partition": "gpu",
    },
}


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _write(path: Path, start: int) -> None:
    metrics = [
        ("smiquery_utilization_gpu_ratio", lambda u, m: u / 100),
        ("smiquery_memory_used_bytes", lambda u, m: m * MiB),
        ("smiquery_memory_total_bytes", lambda u, m: TOTAL_MIB * MiB),
        ("smiquery_power_draw_watts", lambda u, m: 60 + 3 * u),
    ]
    with path.open("w", encoding="utf-8") as fh:
        for name, value in metrics:
            fh.write(f"# TYPE {name} gauge\n")
            for inst, gpu, job, a, b, util, mem in GPUS:
                base = f'instance="{inst}",job="smiquery",gpu="{gpu}",uuid="GPU-{inst[:6]}-{gpu}",name="H100"'
                slurm = ",".join(f'{k}="{_esc(v)}"' for k, v in {"slurm_job_id": job, **JOBS.get(job, {})}.items())
                for i in range(SAMPLES):
                    inside = a <= i <= b
                    labels = f"{base},{slurm}" if inside else base
                    v = value(util, mem) if inside else value(5, 1000)
                    fh.write(f"{name}{{{labels}}} {v:g} {start + i * STEP}\n")
        fh.write("# TYPE smiquery_gpu_allocation_info gauge\n")
        for inst, gpu, job, a, b, _, _ in GPUS:
            if job:
                labels = f'instance="{inst}",job="smiquery",gpu="{gpu}",uuid="GPU-{inst[:6]}-{gpu}",resource="gpu",'
                labels += ",".join(f'{k}="{_esc(v)}"' for k, v in {"slurm_job_id": job, **JOBS[job]}.items())
                for i in range(a, b + 1):
                    fh.write(f"smiquery_gpu_allocation_info{{{labels}}} 1 {start + i * STEP}\n")
        fh.write("# EOF\n")


@dataclass
class Cluster:
    url: str
    start: int

    def at(self, i: int) -> int:
        return self.start + i * STEP


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    promtool = require_tool("promtool")
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("slurmjobs")
    start = (int(time.time()) // STEP * STEP) - SAMPLES * STEP - 600
    om = tmp / "jobs.om"
    _write(om, start)
    backfill(promtool, om, tmp / "data")
    with started(prometheus, tmp / "data", tmp / "prom.log") as server:
        yield Cluster(server.url, start)


def smiquery(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "smiquery", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_the_report_of_a_job_holds_its_gpus_over_its_own_time(cluster):
    doc = json.loads(smiquery("report", "--prometheus", cluster.url, "--slurm-job", "101", "-F", "json").stdout)
    assert sorted((v["instance"], v["gpu"]) for v in doc["gpu_names"].values()) == [
        ("node-a:9849", "0"),
        ("node-a:9849", "1"),
    ]
    assert doc["duration_seconds"] == (80 - 20) * STEP
    busy = next(k for k, v in doc["gpu_names"].items() if v["gpu"] == "0")
    assert doc["constants"]["utilization.gpu"][busy] == 80  # never the 5 % before and after the job
    assert "Slurm job 101 (alice)" in doc["source"]

    doc = json.loads(smiquery("report", "--prometheus", cluster.url, "--slurm-job", "202", "-F", "json").stdout)
    assert [(v["instance"], v["gpu"]) for v in doc["gpu_names"].values()] == [("node-b:9849", "0")]
    assert doc["duration_seconds"] == (110 - 50) * STEP


def test_start_and_end_only_bound_the_search(cluster):
    t = ["--start", str(cluster.at(0)), "--end", str(cluster.at(SAMPLES - 1))]
    doc = json.loads(smiquery("report", "--prometheus", cluster.url, "--slurm-job", "202", *t, "-F", "json").stdout)
    assert doc["duration_seconds"] == (110 - 50) * STEP
    t = ["--start", str(cluster.at(0)), "--end", str(cluster.at(10))]  # before job 202
    done = smiquery("report", "--prometheus", cluster.url, "--slurm-job", "202", *t, check=False)
    assert done.returncode == 1
    assert "no GPU of Slurm job 202" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_unknown_job_and_a_job_without_prometheus_are_one_line_each(cluster):
    done = smiquery("report", "--prometheus", cluster.url, "--slurm-job", "999", check=False)
    assert done.returncode == 1 and "--slurm" in done.stderr
    done = smiquery("report", "run.csv", "--slurm-job", "101", check=False)
    assert done.returncode == 2 and "--slurm-job goes with --prometheus" in done.stderr


def test_the_summary_names_the_idle_gpu_and_the_node(cluster):
    out = smiquery("report", "--prometheus", cluster.url, "--slurm-job", "101", "-F", "summary").stdout
    lines = out.splitlines()
    assert lines[0] == "GPU summary of Slurm job 101 (alice): 2 GPU(s), 15.0 min"
    assert lines[1].startswith("  node-a GPU 0: utilization mean 80 % peak 80 %, memory peak 29.3 of 79.6 GiB")
    assert lines[2].startswith("  node-a GPU 1: utilization mean 0 % peak 0 %, memory peak 0.5 of 79.6 GiB")
    assert lines[3] == "Advice: node-a GPU 1 idle 100 % of the job: request 1 GPU (--gres=gpu:1)"


def _stand_in(tmp_path: Path) -> Path:
    """``smiquery`` as the epilog calls it: this checkout's, through the interpreter running the tests."""
    exe = tmp_path / "bin" / "smiquery"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\ncd "{ROOT}" && exec "{sys.executable}" -m smiquery "$@"\n', encoding="utf-8")
    exe.chmod(0o755)
    return exe


def epilog(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["bash", str(EPILOG)], env=base | env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_epilog_appends_the_summary_to_the_jobs_output(cluster, tmp_path):
    exe = _stand_in(tmp_path)
    out = tmp_path / "slurm-101 $(touch pwned).out"
    out.write_text("training done\n", encoding="utf-8")
    env = {"SLURM_JOB_ID": "101", "SMIQUERY_PROMETHEUS": cluster.url, "SMIQUERY": str(exe)}
    done = epilog(env | {"SMIQUERY_EPILOG_OUTPUT": "job", "SLURM_JOB_STDOUT": str(out)}, tmp_path)
    assert done.returncode == 0, done.stderr
    text = out.read_text(encoding="utf-8")
    assert text.startswith("training done\n\nGPU summary of Slurm job 101 (alice): 2 GPU(s), 15.0 min\n")
    assert "  node-a GPU 0: utilization mean 80 % peak 80 %" in text
    assert text.endswith("Advice: node-a GPU 1 idle 100 % of the job: request 1 GPU (--gres=gpu:1)\n")
    assert not (tmp_path / "pwned").exists()

    done = epilog(env | {"SLURM_JOB_ID": "202"}, tmp_path)  # to its own stdout
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "GPU summary of Slurm job 202 (bob): 1 GPU(s), 15.0 min"
    assert done.stdout.splitlines()[-1] == "Advice: the GPUs were busy; nothing to change"
    assert not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()


def test_the_epilog_refuses_a_job_id_that_is_not_one_and_never_fails_the_job(cluster, tmp_path):
    exe = _stand_in(tmp_path)
    env = {"SMIQUERY_PROMETHEUS": cluster.url, "SMIQUERY": str(exe)}
    done = epilog(env | {"SLURM_JOB_ID": "101; touch pwned"}, tmp_path)
    assert done.returncode == 0 and done.stdout == ""
    assert "SLURM_JOB_ID is not a job id" in done.stderr
    assert not (tmp_path / "pwned").exists()
    done = epilog(env | {"SLURM_JOB_ID": "999"}, tmp_path)  # unknown: smiquery fails, the epilog does not
    assert done.returncode == 0 and done.stdout == ""
    assert "no GPU summary for job 999" in done.stderr
    down = {"SMIQUERY_PROMETHEUS": "http://127.0.0.1:9", "SMIQUERY": str(exe), "SLURM_JOB_ID": "101"}
    assert epilog(down, tmp_path).returncode == 0
    assert os.listdir(tmp_path) == ["bin"]
