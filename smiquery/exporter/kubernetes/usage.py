"""Per-pod GPU use on shared GPUs: each process's pmon SM and memory use and its GPU memory, summed by container.

A process is tied to its container through ``/proc/<pid>/cgroup`` (:mod:`.cgroups`) and the node's pods
(:mod:`.pods`); what cannot be tied (host processes, processes of another PID namespace, pods not listed yet, and
pmon's own ``other`` row) goes to one bucket per GPU with ``pod="other"`` and an empty namespace, so the series of a
GPU sum to what pmon saw on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from smiquery.exporter.kubernetes.attribution import Holder
from smiquery.exporter.kubernetes.cgroups import PodCgroup, pod_of_pid
from smiquery.exporter.kubernetes.pods import NodePods

if TYPE_CHECKING:
    from smiquery.exporter.pmonwatch import ProcessInstant
    from smiquery.sources.apps import GpuProcess

__all__ = ["OTHER", "pod_usage_families"]

#: The bucket of use no container can be found for.
OTHER = Holder("", "other", "")


def _holder(pid: int | None, pods: NodePods, cgroup_of: Callable[[int], PodCgroup | None]) -> Holder:
    if pid is None:
        return OTHER
    cg = cgroup_of(pid)
    if cg is None:
        return OTHER
    return pods.holder(cg.pod_uid, cg.container_id) or OTHER


def pod_usage_families(
    gpus: Mapping[str, int | None],
    instant: ProcessInstant | None,
    procs: Sequence[GpuProcess] | None,
    pods: NodePods,
    *,
    uuid_label: str = "uuid",
    labels: Mapping[str, str] | None = None,
    cgroup_of: Callable[[int], PodCgroup | None] = pod_of_pid,
) -> list[Metric]:
    """Per-container use of each GPU: pmon SM and memory use (0-1) and GPU memory (compute apps).

    Series: ``smiquery_pod_gpu_utilization_ratio``, ``smiquery_pod_gpu_memory_utilization_ratio``,
    ``smiquery_pod_gpu_memory_used_bytes``, labelled uuid, gpu, pod, namespace, container.

    Args:
        gpus: GPU UUID -> index (from the newest sweep).
        instant: the newest pmon instant, or None.
        procs: the newest compute-process list, or None.
        pods: the node's pods.
        uuid_label: ``uuid`` or ``UUID`` (dcgm naming).
        labels: constant labels.
        cgroup_of: pid -> its pod cgroup (tests pass a fixture reader).
    """
    extra = dict(labels or {})
    by_index = {idx: uuid for uuid, idx in gpus.items() if idx is not None}
    seen: dict[int, Holder] = {}

    def holder(pid: int | None) -> Holder:
        if pid is None:
            return OTHER
        if pid not in seen:
            seen[pid] = _holder(pid, pods, cgroup_of)
        return seen[pid]

    sm: dict[tuple[str, Holder], float] = {}
    mem: dict[tuple[str, Holder], float] = {}
    if instant is not None:
        for row, _ in instant.rows:
            uuid = by_index.get(row.gpu) if row.gpu is not None else None
            if uuid is None:
                continue
            key = (uuid, holder(row.pid))
            if row.sm is not None:
                sm[key] = sm.get(key, 0.0) + row.sm / 100.0
            if row.mem is not None:
                mem[key] = mem.get(key, 0.0) + row.mem / 100.0
    used: dict[tuple[str, Holder], float] = {}
    for p in procs or ():
        if p.used_memory is None or p.gpu_uuid not in gpus:
            continue
        key = (p.gpu_uuid, holder(p.pid))
        used[key] = used.get(key, 0.0) + float(p.used_memory) * 1048576.0
    out = []
    for name, doc, values in (
        ("smiquery_pod_gpu_utilization_ratio", "SM use of the container's processes on the GPU (pmon sm), 0-1.", sm),
        (
            "smiquery_pod_gpu_memory_utilization_ratio",
            "Memory-controller use of the container's processes (pmon mem), 0-1.",
            mem,
        ),
        ("smiquery_pod_gpu_memory_used_bytes", "GPU memory used by the container's processes, in bytes.", used),
    ):
        fam = Metric(name, doc + ' pod="other": what no container of this node could be found for.', "gauge")
        for (uuid, h), value in sorted(values.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            idx = gpus.get(uuid)
            fam.add_sample(
                name,
                {
                    uuid_label: uuid,
                    "gpu": "" if idx is None else str(idx),
                    "pod": h.pod,
                    "namespace": h.namespace,
                    "container": h.container,
                    **extra,
                },
                value,
            )
        if fam.samples:
            out.append(fam)
    return out
