"""One Slurm job's GPUs read back from Prometheus (``--slurm-job ID``), and the summary its epilog appends.

The job's GPUs are those ``smiquery export --slurm``'s allocation series names, its time range from the series'
first sample to its last (see docs/slurm.md).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smiquery.errors import PrometheusError, UsageError
from smiquery.fleet.naming import GpuKey
from smiquery.printable import printable

if TYPE_CHECKING:
    import pandas as pd

    from smiquery.analysis import FieldStats, Report
    from smiquery.fleet.client import PrometheusClient

__all__ = ["ALLOCATION_METRIC", "JOB_LOOKBACK", "SlurmJob", "host_pattern", "job_range", "job_summary"]

#: The series ``smiquery export --slurm`` writes per allocated GPU.
ALLOCATION_METRIC = "smiquery_gpu_allocation_info"
#: How far back the job is looked for when no ``--start`` is given (seconds).
JOB_LOOKBACK = 30 * 86400.0
#: A GPU under the stall utilization for at least this share of the job is called idle in the advice.
IDLE_SHARE = 0.8


@dataclass(frozen=True)
class SlurmJob:
    """A job as Prometheus saw it: from its first sample to its last (Unix seconds), the GPUs it held.

    Attributes:
        step: the median seconds between two samples of one GPU (None with fewer than two samples).
        labels: ``slurm_user``, ``slurm_account``, ``slurm_partition``, ``slurm_job_name`` as exported.
    """

    job_id: str
    start: float
    end: float
    step: float | None
    gpus: tuple[GpuKey, ...]
    labels: Mapping[str, str] = field(default_factory=dict)

    def title(self) -> str:
        """``Slurm job 42 (alice)``, the job's own text made printable."""
        user = self.labels.get("slurm_user", "")
        return f"Slurm job {printable(self.job_id)}" + (f" ({printable(user)})" if user else "")


def job_range(client: PrometheusClient, job_id: str, start: float, end: float) -> SlurmJob:
    """The GPUs job ``job_id`` held and its time range, from the raw samples of :data:`ALLOCATION_METRIC`.

    Only samples between ``start`` and ``end`` (Unix seconds) are searched. UsageError for an empty job id or
    ``end`` not after ``start``; PrometheusError when no allocation series names the job in that time.
    """
    if not job_id:
        raise UsageError("--slurm-job needs a job id, e.g. --slurm-job 4242")
    if not end > start:
        raise UsageError("--end must be after --start")
    window = max(1, math.ceil(end - start))
    rows = client.query(f"{ALLOCATION_METRIC}{{slurm_job_id={json.dumps(job_id)}}}[{window}s]", end)
    stamps: list[float] = []
    steps: list[float] = []
    gpus: set[GpuKey] = set()
    labels: dict[str, str] = {}
    for r in rows:
        times = sorted(float(p[0]) for p in r.get("values", []))
        if not times:
            continue
        metric = r.get("metric", {})
        gpus.add(GpuKey(metric.get("instance", ""), metric.get("gpu", ""), metric.get("uuid", "")))
        for k in ("slurm_user", "slurm_account", "slurm_partition", "slurm_job_name"):
            labels.setdefault(k, metric.get(k, ""))
        stamps += [times[0], times[-1]]
        if len(times) > 1:
            steps.append(statistics.median(b - a for a, b in itertools.pairwise(times)))
    if not stamps:
        raise PrometheusError(
            f"no GPU of Slurm job {printable(job_id)} in Prometheus at {client.url} for that time "
            f"({ALLOCATION_METRIC}); check the job id, --start (the search goes back 30 days by default) and that "
            "the nodes' exporters run with --slurm"
        )
    step = round(statistics.median(steps), 3) if steps else None
    return SlurmJob(job_id, min(stamps), max(stamps), step, tuple(sorted(gpus, key=GpuKey.sort_key)), labels)


def host_pattern(gpus: tuple[GpuKey, ...]) -> str:
    """A ``--node`` regex for the job's hosts on any port (its GPUs' other exporters, dcgm-exporter, match too)."""
    hosts = sorted({_host(g.instance) for g in gpus})
    return "(?:" + "|".join(re.escape(h) for h in hosts) + ")(?::[0-9]+)?"


def _host(instance: str) -> str:
    head, sep, port = instance.rpartition(":")
    return head if sep and port.isdigit() else instance


def job_summary(report: Report, df: pd.DataFrame) -> str:
    """A few lines for a job's output: per GPU utilization, memory, energy and stalls, then one line of advice.

    GPUs are named by node (``node07 GPU 1``) when ``df`` came from Prometheus, else by their number. A GPU is
    idle while under the report's stall utilization; one idle for :data:`IDLE_SHARE` of the job or more is
    named in the advice.
    """
    from smiquery.fleet.history import gpu_names

    names = gpu_names(df)
    job = df.attrs.get("slurm_job")
    title = job.title() if isinstance(job, SlurmJob) else printable(report.source)
    out = [f"GPU summary of {title}: {len(report.gpus)} GPU(s), {report.duration / 60:.1f} min"]
    stats = {(s.field, s.gpu): s for s in report.stats}
    column = next((c for c in ("utilization_gpu", "utilization.gpu") if c in df.columns), None)
    idle: dict[int, float] = {}
    label: dict[int, str] = {}
    for gpu in report.gpus:
        info = names.get(gpu)
        label[gpu] = f"{printable(_host(info.instance))} GPU {printable(info.gpu)}" if info else f"GPU {gpu}"
        util = None if column is None else df.loc[df["index"] == gpu, column].dropna().astype(float)
        parts = [label[gpu] + ":"]
        if util is not None and len(util):
            idle[gpu] = float((util < report.stall_utilization).mean())
            parts.append(f"utilization mean {util.mean():.0f} % peak {util.max():.0f} %,")
        else:
            parts.append("utilization not recorded,")
        used_max = _most(report, stats, "memory.used", gpu)
        total_max = _most(report, stats, "memory.total", gpu)
        if used_max is not None:
            of = f" of {total_max / 1024:.1f}" if total_max else ""
            parts.append(f"memory peak {used_max / 1024:.1f}{of} GiB,")
        if gpu in report.energy_wh:
            parts.append(f"energy {report.energy_wh[gpu]:.1f} Wh,")
        stalled = sum(s.seconds for s in report.stalls if s.gpu == gpu)
        parts.append(f"stalled {stalled / 60:.1f} min")
        out.append("  " + " ".join(parts))
    out.append("Advice: " + _advice(idle, label, report.stall_utilization))
    return "\n".join(out) + "\n"


def _most(report: Report, stats: dict[tuple[str, int], FieldStats], fld: str, gpu: int) -> float | None:
    """The highest value of ``fld`` on ``gpu``: its statistics' maximum, or the value it kept."""
    stat = stats.get((fld, gpu))
    value = stat.max if stat is not None else report.constants.get(fld, {}).get(gpu)
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _advice(idle: dict[int, float], label: dict[int, str], threshold: float) -> str:
    if not idle:
        return "no utilization recorded; check that the nodes' exporters run with --slurm"
    lazy = [g for g, share in idle.items() if share >= IDLE_SHARE]
    busy = len(idle) - len(lazy)
    if lazy and busy:
        worst = max(lazy, key=lambda g: idle[g])
        more = f" (and {len(lazy) - 1} more)" if len(lazy) > 1 else ""
        return (
            f"{label[worst]} idle {idle[worst] * 100:.0f} % of the job{more}: request "
            f"{busy} GPU{'s' if busy > 1 else ''} (--gres=gpu:{busy})"
        )
    if lazy:
        return (
            f"every GPU under {threshold:.0f} % utilization for most of the job: check that the job uses the GPU "
            "(CUDA_VISIBLE_DEVICES, data loading), or run it on CPUs"
        )
    return "the GPUs were busy; nothing to change"
