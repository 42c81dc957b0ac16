"""The Slurm backend: which job holds each GPU of this node (``squeue``, ``scontrol -d show job``), whose a process is.

A job's GRES ``IDX`` positions are GPUs by minor number (``nvidia-smi -q -x``), never by nvidia-smi's index, and a
process is tied to its job through ``/proc/<pid>/cgroup`` (``docs/slurm.md`` says how and what Slurm must allow).
"""

from __future__ import annotations

import os
import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from smiquery._log import RateLimiter
from smiquery.attribution import Grant, Words, Workload, cgroup_paths, read_cgroup
from smiquery.errors import NvidiaSmiNotFoundError, NvidiaSmiTimeoutError, SlurmError
from smiquery.retry import one_line
from smiquery.runner import Completed, SubprocessRunner, default_runner, find_nvidia_smi
from smiquery.sources.latest import Latest

__all__ = [
    "JOB_LABELS",
    "MAX_LABEL_CHARS",
    "OTHER",
    "SlurmBackend",
    "SlurmJob",
    "expand_hostlist",
    "gpu_indices",
    "job_of_cgroup",
    "job_of_pid",
    "minor_numbers",
    "node_name",
    "parse_job",
]

#: The labels of a job, in :class:`~smiquery.attribution.Workload` order.
JOB_LABELS: tuple[str, ...] = ("slurm_job_id", "slurm_user", "slurm_account", "slurm_partition", "slurm_job_name")
#: Use of processes no job is found for.
OTHER = Workload(("other", "", "", "", ""))
#: The longest label value served (a job's name is its user's text); longer ones are cut.
MAX_LABEL_CHARS = 128
#: The GPU resource read from GRES (``gpu``, ``gpu:a100``...; not ``shard`` or ``mps``).
RESOURCE = "gres/gpu"

_MINORS_EVERY = 60.0  # seconds between nvidia-smi -q -x runs while an IDX names no GPU
_GPU_GRES_RE = re.compile(r"(?:^|,)gpu(?::[^:(),\s]+)*\(IDX:([^)]*)\)")
_NODES_LINE_RE = re.compile(r"^\s+Nodes=(\S+)\s.*?\bGRES(?:_IDX)?=(\S*)")
_TOP_COMMA_RE = re.compile(r",(?![^\[]*\])")  # a comma outside brackets
_CGROUP_JOB_RE = re.compile(r"/(?:slurm[^/]*/uid_\d+|slurmstepd\.scope)/job_(\d+)(?:/|$)")


def node_name() -> str:
    """This node's Slurm name: ``SLURMD_NODENAME`` when set, else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's host list (``gpu[01-03,07],login1``) as names; ValueError for an unbalanced bracket or a bad range."""
    names: list[str] = []
    for part in filter(None, _TOP_COMMA_RE.split(expr)):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise ValueError(f"bad host list {expr!r}")
            names.append(part)
            continue
        head, ranges, tail = m.groups()
        for rng in ranges.split(","):
            lo, _, hi = rng.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad host list {expr!r}")
            for n in range(int(lo), int(hi or lo) + 1):
                for rest in expand_hostlist(tail) if tail else [""]:
                    names.append(f"{head}{n:0{len(lo)}d}{rest}")
    return names


def gpu_indices(gres: str) -> list[int]:
    """The GPU ``IDX`` positions of one node's GRES (``gpu:a100:2(IDX:0,2-3)``, ``gpu(IDX:0)``); shards ignored."""
    out: list[int] = []
    for m in _GPU_GRES_RE.finditer(gres):
        for rng in m.group(1).split(","):
            lo, _, hi = rng.partition("-")
            if lo.isdigit() and (not hi or hi.isdigit()):
                out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


@dataclass(frozen=True)
class SlurmJob:
    """One job running on this node: its id (an array task's own), labels and the GRES ``IDX`` of its GPUs here."""

    job_id: str
    workload: Workload
    indices: tuple[int, ...]


def parse_job(text: str, name: str, node: str) -> list[int]:
    """The GPU ``IDX`` positions a job holds on ``node``, from ``scontrol -d show job ID``.

    The job's name (exactly, from squeue) is found first: whatever it holds (newlines, a fake ``GRES=`` line) is
    skipped, and only the per-node lines before ``MinCPUsNode=`` (before any other text a user chooses) are read.
    """
    at = text.find(f" JobName={name}\n")
    if at < 0:
        raise SlurmError(f"scontrol -d show job gave no record for job {name!r}: Slurm's output format changed?")
    found: list[int] = []
    for line in text[at + len(name) + 10 :].splitlines():
        if line.lstrip().startswith(("MinCPUsNode=", "Command=", "WorkDir=", "Comment=")):
            break
        m = _NODES_LINE_RE.match(line)
        if m is None:
            continue
        try:
            here = node in expand_hostlist(m.group(1))
        except ValueError:
            here = False
        if here:
            found.extend(gpu_indices(m.group(2)))
    return sorted(set(found))


def minor_numbers(xml_text: str) -> dict[int, str]:
    """Minor number -> GPU UUID, from ``nvidia-smi -q -x`` (GPUs whose ``<minor_number>`` is N/A are left out)."""
    root = ET.fromstring(xml_text)
    out: dict[int, str] = {}
    for gpu in root.iter("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        minor = (gpu.findtext("minor_number") or "").strip()
        if uuid and minor.isdigit():
            out[int(minor)] = uuid
    return out


def job_of_cgroup(text: str) -> str | None:
    """The Slurm job id in the text of ``/proc/<pid>/cgroup`` (cgroup v1 or v2 layout), or None."""
    found = (_CGROUP_JOB_RE.search(path) for path in cgroup_paths(text))
    return next((m.group(1) for m in found if m), None)


def job_of_pid(pid: int, proc: str = "/proc") -> str | None:
    """The Slurm job of a process (host pid), or None (no job, gone, or not visible from here)."""
    text = read_cgroup(pid, proc)
    return None if text is None else job_of_cgroup(text)


def _why(tool: str, done: Completed) -> SlurmError:
    text = " ".join((done.stderr or done.stdout).replace(f"{tool}: ", "").split())[:300]
    text = text or f"exit status {done.returncode}"
    low = text.lower()
    if "munge" in low or "authentication" in low or "credential" in low:
        fix = "munge authentication failed; start munged and give every host the same munge.key"
        return SlurmError(f"{tool}: {text}: {fix}", "auth")
    if "unable to contact slurm controller" in low or "connection refused" in low or "connect failure" in low:
        fix = "slurmctld does not answer; start it, or check SlurmctldHost in slurm.conf (SLURM_CONF)"
        return SlurmError(f"{tool}: {text}: {fix}", "controller_unreachable")
    return SlurmError(f"{tool}: {text}", "failed")


class SlurmBackend:
    """Slurm for :class:`~smiquery.attribution.Attribution`: the node's running jobs, their GPUs, and jobs by process.

    ``node``: this node's Slurm name (default :func:`node_name`); ``timeout``: each command's deadline;
    ``bin_dir``: where squeue and scontrol are (default: PATH); ``processes``: tie processes to jobs (cgroups) for
    per-job use and ``smiquery_gpu_unallocated_use``. Tests inject ``run`` (``(argv, timeout) -> Completed``),
    ``minors`` (minor number -> GPU UUID; default: ``nvidia_smi -q -x``) and ``job_of`` (pid -> job id).
    """

    name = "slurm"
    workload = "job"
    labels = JOB_LABELS
    other = OTHER

    def __init__(
        self,
        node: str | None = None,
        *,
        timeout: float = 10.0,
        bin_dir: str | None = None,
        nvidia_smi: str | None = None,
        processes: bool = True,
        run: Callable[[Sequence[str], float], Completed] | None = None,
        minors: Callable[[], dict[int, str]] | None = None,
        job_of: Callable[[int], str | None] = job_of_pid,
    ) -> None:
        if timeout <= 0:
            raise ValueError("the attribution timeout must be positive")
        self.node = node or node_name()
        self.timeout = float(timeout)
        self.bin_dir = bin_dir
        self.words = Words(
            failed=f"Slurm attribution on node {self.node}: {{why}}; GPU series go out without job labels",
            again=f"Slurm answers again for node {self.node}",
            unknown="Slurm lists {resource} {device!r} for a job on this node, which is no GPU of this node "
            "(its gres.conf lists more GPUs than nvidia-smi sees?)",
            allocated="A GPU Slurm allocated to a running job (1); join with * on(uuid) group_left(slurm_job_id, "
            "slurm_user, slurm_account, slurm_partition, slurm_job_name).",
            unknown_help="A GPU index (IDX) Slurm allocated that names no GPU of this node (1).",
            up="1 when the last Slurm listing (squeue, scontrol) worked; 0: GPU series carry no job labels.",
            took="Seconds the last Slurm listing took.",
            errors="Failed Slurm listings by error type.",
            holder="job",
            other='slurm_job_id="other": what no job of this node could be found for.',
        )
        self.processes = processes
        self.polls: tuple[Latest[Any], ...] = ()
        self._run = run or SubprocessRunner().run
        self._minors = minors or self._read_minors
        self._nvidia_smi = nvidia_smi
        self._job_of = job_of
        self._known: dict[tuple[str, str], SlurmJob] = {}  # (job id, start time) -> job
        self._jobs: dict[str, SlurmJob] = {}  # the newest listing's jobs by id
        self._by_minor: dict[int, str] = {}
        self._minors_reads = RateLimiter(1, _MINORS_EVERY)

    def _call(self, argv: list[str]) -> str:
        tool = argv[0]
        argv = [os.path.join(self.bin_dir, tool) if self.bin_dir else tool, *argv[1:]]
        try:
            done = self._run(argv, self.timeout)
        except NvidiaSmiNotFoundError:
            where = f"in {self.bin_dir}" if self.bin_dir else "on PATH"
            fix = "install Slurm's client commands (Debian: slurm-client) or pass --slurm-bin-dir"
            raise SlurmError(f"{tool} not found {where}: {fix}", "not_found") from None
        except NvidiaSmiTimeoutError:
            why = f"{tool} did not answer within {self.timeout:g} s: slurmctld is overloaded or unreachable"
            raise SlurmError(why, "timeout") from None
        if done.returncode != 0:
            raise _why(tool, done)
        return done.stdout

    def _read_minors(self) -> dict[int, str]:
        runner = default_runner()
        done = runner.run([find_nvidia_smi(self._nvidia_smi, runner=runner), "-q", "-x"], 30.0)
        if done.returncode != 0:
            raise SlurmError(f"nvidia-smi -q -x failed with exit status {done.returncode}: no minor numbers", "minors")
        return minor_numbers(done.stdout)

    def _gpu_at(self, idx: int) -> str | None:
        ranked = [self._by_minor[m] for m in sorted(self._by_minor)]
        return ranked[idx] if idx < len(ranked) else None

    def _job(self, job_id: str, user: str, account: str, partition: str) -> SlurmJob:
        name = self._call(["squeue", "-h", "-j", job_id, "-o", "%j"]).removesuffix("\n")
        text = self._call(["scontrol", "-d", "show", "job", job_id])
        values = (job_id, user, account, partition, name)
        cut = tuple(v if len(v) <= MAX_LABEL_CHARS else v[: MAX_LABEL_CHARS - 1] + "…" for v in values)
        return SlurmJob(job_id, Workload(cut), tuple(parse_job(text, name, self.node)))

    def refresh(self) -> list[Grant]:
        """List the node's running (or suspended) jobs once: one grant per GPU a job holds.

        The device id is the GPU's UUID, or ``IDX:k`` when no GPU has that position. Raises :class:`SlurmError`.
        """
        out = self._call(["squeue", "-h", "-w", self.node, "-t", "R,S", "-o", "%A|%S|%u|%a|%P"])
        jobs: dict[tuple[str, str], SlurmJob] = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 5 and parts[0].isdigit():
                job_id, start, user, account, partition = (p if p != "(null)" else "" for p in parts)
                key = (job_id, start)
                jobs[key] = self._known.get(key) or self._job(job_id, user, account, partition)
        self._known = jobs
        self._jobs = {j.job_id: j for j in jobs.values()}
        unknown = any(self._gpu_at(i) is None for j in jobs.values() for i in j.indices)
        if unknown and self._minors_reads.take(None) is not None:
            self._by_minor = self._minors()
        return [Grant(j.workload, RESOURCE, self._gpu_at(i) or f"IDX:{i}") for j in jobs.values() for i in j.indices]

    def failure(self, exc: Exception) -> tuple[str, str]:
        """A failed listing: its kind (``not_found``, ``controller_unreachable``, ``auth``, ``timeout``...) and why."""
        return exc.kind if isinstance(exc, SlurmError) else type(exc).__name__, one_line(exc)

    def owner(self, pid: int) -> Workload | None:
        """The job of a process (its cgroup names the job; the newest listing names its user, account...)."""
        if not self.processes:
            return None
        job_id = self._job_of(pid)
        if job_id is None:
            return None
        job = self._jobs.get(job_id)  # a job newer than the listing: known at the next refresh
        return job.workload if job is not None else None
