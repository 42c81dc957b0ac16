"""The Slurm backend in-process: GRES parsing, IDX -> GPU by minor number, cgroups, failures, unallocated use."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smiquery.attribution import Attribution
from smiquery.attribution.slurm import (
    MAX_LABEL_CHARS,
    SlurmBackend,
    expand_hostlist,
    gpu_indices,
    job_of_cgroup,
    job_of_pid,
    minor_numbers,
    parse_job,
)
from smiquery.exporter.families import attribution_families, workload_families
from smiquery.exporter.naming import render
from smiquery.runner import Completed
from smiquery.sources.apps import GpuProcess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
A, B, C, D = (f"GPU-{c * 8}-0000-0000-0000-000000000000" for c in "abcd")
GPUS = {A: 0, B: 1, C: 2, D: 3}  # nvidia-smi's index
# the driver numbered the device files otherwise: /dev/nvidia0 is the GPU nvidia-smi calls 3
XML = f"""<?xml version="1.0" ?>
<nvidia_smi_log>
  <gpu id="00000000:18:00.0"><uuid>{A}</uuid><minor_number>3</minor_number></gpu>
  <gpu id="00000000:2A:00.0"><uuid>{B}</uuid><minor_number>2</minor_number></gpu>
  <gpu id="00000000:3A:00.0"><uuid>{C}</uuid><minor_number>1</minor_number></gpu>
  <gpu id="00000000:5D:00.0"><uuid>{D}</uuid><minor_number>0</minor_number></gpu>
</nvidia_smi_log>
"""


def record(job: str, name: str, gres: str, node: str = "gpu07") -> str:
    return (
        f"JobId={job} JobName={name}\n   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A\n"
        f"   JOB_GRES={gres.split('(')[0]}\n     Nodes={node} CPU_IDs=0 Mem=0 GRES={gres}\n"
        "   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0\n   Command=(null)\n\n"
    )


class FakeSlurm:
    """squeue and scontrol answers by argv; ``down`` answers as a client does with slurmctld stopped."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[str, str, str, str, str]] = {}  # id -> (user, account, partition, name, gres)
        self.down: str | None = None
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> Completed:
        argv = list(argv)
        self.calls.append(argv)
        if self.down is not None:
            return Completed(tuple(argv), 1, "", self.down, 0.01)
        tool = Path(argv[0]).name
        if tool == "squeue" and "-w" in argv:
            out = "".join(
                f"{j}|2026-12-05T17:01:03|{u}|{a or '(null)'}|{p}\n" for j, (u, a, p, _, _) in self.jobs.items()
            )
        elif tool == "squeue":
            out = self.jobs[argv[argv.index("-j") + 1]][3] + "\n"
        else:
            job = argv[-1]
            out = record(job, self.jobs[job][3], self.jobs[job][4])
        return Completed(tuple(argv), 0, out, "", 0.01)


def backend(fake: FakeSlurm, **kw: Any) -> SlurmBackend:
    return SlurmBackend("gpu07", run=fake, minors=lambda: minor_numbers(XML), **kw)


def samples(fams: list[Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = render(fams)
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_gres_and_host_lists_as_slurm_writes_them() -> None:
    assert gpu_indices("gpu:1(IDX:0)") == [0]
    assert gpu_indices("gpu:a100:3(IDX:0,2-3)") == [0, 2, 3]
    assert gpu_indices("gpu(IDX:5)") == [5]  # older Slurm: no count
    assert gpu_indices("gpu:2(IDX:0-1),shard:4(3/4,1/4)") == [0, 1]
    assert gpu_indices("shard:gpu:1(IDX:0)") == []  # a shard is not the GPU
    assert gpu_indices("gpu:0(IDX:N/A)") == []
    assert expand_hostlist("gpu[06-07,10],login1") == ["gpu06", "gpu07", "gpu10", "login1"]


def test_only_this_nodes_line_counts_and_a_job_name_cannot_claim_gpus() -> None:
    text = (FIXTURES / "scontrol-job-two-nodes.txt").read_text(encoding="utf-8")
    # the name holds a fake per-node line; the comment another: neither is read
    name = "fake\n     Nodes=gpu07 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)"
    assert parse_job(text, name, "gpu07") == [0, 2]
    assert parse_job(text, name, "gpu06") == [3]
    assert parse_job(text, name, "gpu99") == []


def test_idx_is_the_gpu_by_minor_number_never_by_index() -> None:
    fake = FakeSlurm()
    fake.jobs = {"4242": ("alice", "physics", "a100", "train", "gpu:2(IDX:0-1)")}
    att = Attribution(backend(fake), interval=60)
    assert att.refresh()
    view = att.view(GPUS)
    # IDX 0 -> minor 0 -> the GPU nvidia-smi calls 3; IDX 1 -> minor 1 -> index 2
    assert {u for u, s in view.states.items() if s == "exclusive"} == {D, C}
    assert att.gpu_labels(D, GPUS) == {
        "slurm_job_id": "4242",
        "slurm_user": "alice",
        "slurm_account": "physics",
        "slurm_partition": "a100",
        "slurm_job_name": "train",
    }
    assert att.gpu_labels(A, GPUS) == {}


def test_a_job_is_read_once_and_its_labels_go_with_it() -> None:
    fake = FakeSlurm()
    fake.jobs = {"7": ("bob", "", "debug", "x", "gpu:1(IDX:3)")}
    att = Attribution(backend(fake), interval=60)
    att.refresh()
    att.refresh()
    assert sum(1 for c in fake.calls if "scontrol" in c[0]) == 1  # a job's allocation is kept while it runs
    info = samples(attribution_families(att, GPUS, "uuid", {}))["smiquery_gpu_allocation_info"]
    assert [(s["uuid"], s["slurm_job_id"], s["slurm_account"]) for s, _ in info] == [(A, "7", "")]
    fake.jobs = {}
    att.refresh()
    fams = samples(attribution_families(att, GPUS, "uuid", {}))
    assert "smiquery_gpu_allocation_info" not in fams
    assert att.gpu_labels(A, GPUS) == {}


def test_label_values_are_bounded_and_escaped() -> None:
    fake = FakeSlurm()
    name = 'say "hi"\\\nnext line ' + "x" * 300
    fake.jobs = {"9": ("carol", "acct", "gpu", name, "gpu:1(IDX:0)")}
    att = Attribution(backend(fake), interval=60)
    att.refresh()
    text = render(attribution_families(att, GPUS, "uuid", {}))
    line = next(ln for ln in text.splitlines() if ln.startswith("smiquery_gpu_allocation_info{"))
    assert '\\"hi\\"\\\\\\nnext line' in line  # quotes, backslash and newline escaped: still one line
    (sample,) = samples(attribution_families(att, GPUS, "uuid", {}))["smiquery_gpu_allocation_info"]
    assert len(sample[0]["slurm_job_name"]) == MAX_LABEL_CHARS
    assert sample[0]["slurm_job_name"].startswith('say "hi"\\\nnext line')


@pytest.mark.parametrize(
    ("stderr", "kind", "says"),
    [
        (
            "squeue: error: Unable to contact slurm controller (connect failure)\n",
            "controller_unreachable",
            "slurmctld does not answer",
        ),
        (
            "squeue: error: Munge decode failed: Invalid credential\n"
            "squeue: error: authentication: Invalid credential\n",
            "auth",
            "munge authentication failed",
        ),
    ],
)
def test_slurm_down_is_up_0_no_label_and_one_line(
    caplog: pytest.LogCaptureFixture, stderr: str, kind: str, says: str
) -> None:
    fake = FakeSlurm()
    fake.jobs = {"7": ("bob", "", "debug", "x", "gpu:1(IDX:3)")}
    att = Attribution(backend(fake), interval=60)
    att.refresh()
    assert att.gpu_labels(A, GPUS)
    fake.down = stderr
    with caplog.at_level(logging.WARNING, logger="smiquery"):
        for _ in range(3):
            assert not att.refresh()
    assert att.gpu_labels(A, GPUS) == {}  # never a stale job label
    fams = samples(attribution_families(att, GPUS, "uuid", {}))
    assert fams["smiquery_slurm_attribution_up"][0][1] == 0.0
    assert "smiquery_gpu_allocation_info" not in fams
    assert {s["type"]: v for s, v in fams["smiquery_slurm_attribution_errors"]} == {kind: 3.0}
    lines = [r.getMessage() for r in caplog.records if "Slurm attribution" in r.getMessage()]
    assert len(lines) == 1 and says in lines[0] and "without job labels" in lines[0], lines


def test_missing_commands_say_what_to_install(tmp_path: Path) -> None:
    att = Attribution(SlurmBackend("gpu07", bin_dir=str(tmp_path), minors=dict), interval=60)
    assert not att.refresh()
    assert dict(att.errors) == {"not_found": 1}


def test_cgroup_layouts_v1_and_v2() -> None:
    proc = str(FIXTURES / "proc")
    assert job_of_pid(4101, proc) == "4242"  # v1: /slurm/uid_1000/job_4242/step_0/task_0
    assert job_of_pid(4102, proc) == "4343"  # v2: .../slurmstepd.scope/job_4343/step_batch/...
    assert job_of_pid(4103, proc) is None  # a login session
    assert job_of_pid(9999, proc) is None  # gone
    assert job_of_cgroup("0::/slurm_gpu07/uid_0/job_12/step_0\n") == "12"  # one slurmd of several on a host
    assert job_of_cgroup("0::/system.slice/myjob_12.scope\n") is None


def test_a_process_on_a_gpu_its_job_was_not_given_is_a_finding() -> None:
    fake = FakeSlurm()
    fake.jobs = {
        "4242": ("alice", "physics", "a100", "train", "gpu:1(IDX:0)"),  # holds D (minor 0)
        "4343": ("bob", "bio", "a100", "fold", "gpu:1(IDX:1)"),  # holds C (minor 1)
    }
    proc = str(FIXTURES / "proc")
    att = Attribution(backend(fake, job_of=lambda pid: job_of_pid(pid, proc)), interval=60)
    att.refresh()
    procs = [
        GpuProcess(4101, "python", D, 3, 1000),  # alice on her own GPU
        GpuProcess(4102, "python", C, 2, 1000),  # bob on his
        GpuProcess(4102, "python", A, 0, 500),  # bob also on a GPU nobody was given
        GpuProcess(4101, "python", C, 2, 500),  # alice on bob's GPU
        GpuProcess(4103, "python", B, 1, 500),  # not a job: not a finding
        GpuProcess(4104, "python", B, 1, 500),  # a job newer than the listing: not yet known
    ]
    fams = samples(workload_families(att, GPUS, None, procs, "uuid", {}))
    found = {(s["uuid"], s["gpu"], s["slurm_job_id"], s["slurm_user"]) for s, _ in fams["smiquery_gpu_unallocated_use"]}
    assert found == {(A, "0", "4343", "bob"), (C, "2", "4242", "alice")}
    fake.down = "squeue: error: Unable to contact slurm controller (connect failure)\n"
    att.refresh()  # never from a failed listing
    assert "smiquery_gpu_unallocated_use" not in samples(workload_families(att, GPUS, None, procs, "uuid", {}))
