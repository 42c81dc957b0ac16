"""Metric families from what the collector reads: processes, pmon, MIG instances, attribution, Xid; helpers."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from smiquery.attribution import STATES, Workload
from smiquery.exporter.naming import MIG_SERIES, NVSMI_WORDS, PMON_SERIES, bare_uuid
from smiquery.kinds import to_number
from smiquery.sources.xid import XID_CATALOGUE

if TYPE_CHECKING:
    from smiquery.attribution import Attribution
    from smiquery.exporter.pmonwatch import PmonWatcher, ProcessInstant
    from smiquery.sample import BusKey, Value
    from smiquery.sources.apps import GpuProcess
    from smiquery.sources.details import GpuDetails
    from smiquery.sources.latest import Latest
    from smiquery.sources.xid import XidWatcher

__all__ = [
    "DETAILS_TIMEOUT",
    "attribution_families",
    "details_health",
    "fresh_details",
    "gauge",
    "merge_families",
    "mig_families",
    "nvsmi_number",
    "pmon_families",
    "pmon_health",
    "process_families",
    "pstate_number",
    "workload_families",
    "xid_families",
]

#: Seconds one details poll may take (``-q -x`` and, with MIG, ``-L``).
DETAILS_TIMEOUT = 45.0


def gauge(name: str, doc: str, *samples: tuple[Mapping[str, str], float]) -> Metric:
    """A gauge family with these ``(labels, value)`` samples."""
    fam = Metric(name, doc, "gauge")
    for labels, value in samples:
        fam.add_sample(name, dict(labels), value)
    return fam


def merge_families(fams: Sequence[Metric]) -> list[Metric]:
    """One family per name, in first-seen order (a name's header once per scrape), later samples appended."""
    out: dict[str, Metric] = {}
    for fam in fams:
        first = out.setdefault(fam.name, fam)
        if first is not fam:
            first.samples.extend(fam.samples)
    return list(out.values())


def nvsmi_number(field: str, value: Value) -> float | None:
    """A value of nvidia_gpu_exporter's naming as a number (P-states, words, versions); None for other text."""
    number = to_number(value)
    if number is not None:
        return number
    text = str(value).strip()
    words = NVSMI_WORDS.get(field)
    if words is not None:
        return words.get(text)
    pstate = pstate_number(text)
    if pstate is not None:
        return pstate
    try:
        return float(text)  # version-like numbers (inforom.ecc 7.16, compute_cap 9.0)
    except ValueError:
        return None  # text that is no number is not made one


def pstate_number(value: Value) -> float | None:
    """``P2`` -> 2.0; None for anything else."""
    if isinstance(value, str) and value[:1] in "Pp" and value[1:].isdigit():
        return float(value[1:])
    return None


def process_families(procs: Sequence[GpuProcess], labels: Mapping[str, str], *, nvsmi: bool = False) -> list[Metric]:
    """The non-empty per-process GPU memory families (``nvsmi``: nvidia_gpu_exporter's memory, info and count)."""
    # One series per (pid, GPU): a process listed twice on one GPU (one row per MIG instance) is summed, as
    # Prometheus rejects a whole scrape that repeats a series. Its memory is None when no row gave one.
    total: dict[tuple[str, str, str, str], float | None] = {}
    for p in procs:
        gpu = "" if p.gpu_index is None or nvsmi else str(p.gpu_index)
        key = (str(p.pid), p.process_name, gpu, bare_uuid(p.gpu_uuid) if nvsmi else p.gpu_uuid)
        mem = None if p.used_memory is None else float(p.used_memory) * 1048576.0
        prev = total.get(key)
        total[key] = mem if prev is None else prev + (mem or 0.0)
    if not nvsmi:
        doc = "GPU memory used by a compute process, in bytes (nvidia-smi --query-compute-apps used_memory)."
        fam = gauge("smiquery_process_used_memory_bytes", doc)
        for (pid, pname, gpu, uuid), used in total.items():
            if used is not None:
                fam.add_sample(fam.name, {"pid": pid, "process_name": pname, "gpu": gpu, "uuid": uuid, **labels}, used)
        return [fam] if fam.samples else []
    used_fam = gauge("nvidia_smi_compute_app_used_memory_bytes", "used_memory [MiB] of a compute process, in bytes.")
    info = gauge("nvidia_smi_compute_app_info", "A compute process on the GPU; always 1.")
    count = gauge("nvidia_smi_compute_apps", "Compute processes on the GPU.")
    for (pid, pname, _, uuid), used in total.items():
        one = {"pid": pid, "process_name": pname, "uuid": uuid, **labels}
        info.add_sample(info.name, one, 1.0)
        if used is not None:
            used_fam.add_sample(used_fam.name, one, used)
    for uuid, n in Counter(uuid for *_, uuid in total).items():
        count.add_sample(count.name, {"uuid": uuid, **labels}, float(n))
    return [f for f in (used_fam, info, count) if f.samples]


def pmon_families(instant: ProcessInstant, uuids: Mapping[int, str], labels: Mapping[str, str]) -> list[Metric]:
    """The busiest processes of each GPU from one pmon instant (``top + 1`` series per GPU), and the process counts.

    Labelled ``gpu``, ``uuid`` (``uuids``: GPU index -> UUID; empty until the stream has seen the GPU) and
    ``command`` (pmon's, ``other`` for the summed rest); an instant cut by pid adds ``pid`` and ``user`` (empty when
    this host cannot see the process). A value pmon printed as ``-`` has no sample (never 0).
    """
    fams = {col: gauge(name, f"{text} (nvidia-smi pmon {col}).") for col, (name, text) in PMON_SERIES.items()}
    by_pid = instant.by == "pid"
    for row, user in instant.rows:
        gpu = -1 if row.gpu is None else row.gpu
        other = row.pid is None
        command = "other" if other else row.command or ""
        if not other and not by_pid and command == "other":
            command = "other (process)"  # a process named "other" is not the bucket of the rest
        one = {"gpu": str(gpu), "uuid": uuids.get(gpu, ""), "command": command}
        if by_pid:
            one.update(pid="other" if other else str(row.pid), user=user or "")
        one.update(labels)
        for col, fam in fams.items():
            value = getattr(row, col)
            if value is not None:
                fam.add_sample(fam.name, one, value * 1048576.0 if col == "fb" else value / 100.0)
    doc = "Processes nvidia-smi pmon listed on the GPU (all of them, not only the top)."
    count = gauge("smiquery_gpu_processes", doc)
    for gpu, n in sorted(instant.processes.items()):
        count.add_sample(count.name, {"gpu": str(gpu), "uuid": uuids.get(gpu, ""), **labels}, float(n))
    return [f for f in (*fams.values(), count) if f.samples]


def pmon_health(pmon: PmonWatcher, labels: Mapping[str, str]) -> list[Metric]:
    """The pmon watcher's health: up, state, newest instant's time."""
    up = f"1 when nvidia-smi pmon delivers fresh instants (newest under {pmon.stale_after:g} s old), else 0."
    info = "The nvidia-smi pmon stream's state (starting, running, retrying, failed) and last error type; always 1."
    state = {"state": pmon.state, "last_error_type": pmon.last_error_type or ""}
    out = [
        gauge("smiquery_process_up", up, (labels, 1.0 if pmon.fresh() is not None else 0.0)),
        gauge("smiquery_process_stream_info", info, ({**labels, **state}, 1.0)),
    ]
    got = pmon.poll.get().value
    if got is not None:
        doc = "Unix time of the newest nvidia-smi pmon instant."
        out.append(gauge("smiquery_process_last_sample_timestamp_seconds", doc, (labels, got.wall)))
    return out


def _gpu(uuid: str, gpus: Mapping[str, int | None], uuid_label: str) -> dict[str, str]:
    idx = gpus.get(uuid)
    return {uuid_label: uuid, "gpu": "" if idx is None else str(idx)}


def attribution_families(
    att: Attribution, gpus: Mapping[str, int | None], uuid_label: str, labels: Mapping[str, str]
) -> list[Metric]:
    """The attribution series: ``allocation_info``, the per-GPU state, unknown devices and the listing's health.

    ``gpus``: GPU UUID -> index (from the newest sweep); ``uuid_label``: ``uuid``, or ``UUID`` in DCGM naming.
    """
    view = att.view(gpus)
    b = att.backend

    gpu = functools.partial(_gpu, gpus=gpus, uuid_label=uuid_label)
    # the backends' help says how to join on the GPU's label: under DCGM naming that label is UUID
    info = gauge("smiquery_gpu_allocation_info", b.words.allocated.replace("on(uuid)", f"on({uuid_label})"))
    for uuid, holder, res, mig, profile in view.allocations:
        one = {**gpu(uuid), **holder.labels(b.labels), "resource": res, "mig_uuid": mig, "mig_profile": profile}
        info.add_sample(info.name, {**one, **labels}, 1.0)
    prefix = f"smiquery_{b.name}"
    doc = "The GPU's attribution state (1 for the current one): " + ", ".join(STATES) + "."
    state = gauge(f"{prefix}_gpu_attribution_state", doc)
    for uuid, now in sorted(view.states.items()):
        for s in STATES:
            state.add_sample(state.name, {**gpu(uuid), "state": s, **labels}, 1.0 if s == now else 0.0)
    unknown = gauge(f"{prefix}_unknown_device_info", b.words.unknown_help)
    for g in sorted(set(view.unknown), key=lambda g: (g.workload, g.device_id)):
        one = {"device_id": g.device_id, "resource": g.resource, **g.workload.labels(b.labels)}
        unknown.add_sample(unknown.name, {**one, **labels}, 1.0)
    up = gauge(f"{prefix}_attribution_up", b.words.up, (labels, 1.0 if att.up else 0.0))
    took = gauge(f"{prefix}_attribution_refresh_seconds", b.words.took, (labels, att.last_duration))
    errs = Metric(f"{prefix}_attribution_errors", b.words.errors, "counter")
    for kind, n in sorted(att.errors.items()):
        errs.add_sample(errs.name + "_total", {"type": kind, **labels}, float(n))
    return [f for f in (info, state, unknown) if f.samples] + [up, took] + ([errs] if errs.samples else [])


def workload_families(
    att: Attribution,
    gpus: Mapping[str, int | None],
    instant: ProcessInstant | None,
    procs: Sequence[GpuProcess] | None,
    uuid_label: str,
    labels: Mapping[str, str],
) -> list[Metric]:
    """Per-workload use of each GPU, and ``smiquery_gpu_unallocated_use``: a process on a GPU not given its workload.

    Use: pmon SM and memory use (0-1) and GPU memory (compute apps), summed by workload. The backend ties each
    process to its workload; what it cannot (host processes, pods not listed yet, pmon's ``other`` row) goes to its
    ``other`` bucket, so a GPU's series sum to what pmon saw on it. The findings come only while the listing works
    (never from a stale or failed one), only for processes tied to a workload it listed. Arguments as
    :func:`attribution_families`, with the newest pmon ``instant`` and compute-process list ``procs`` (or None).
    """
    b = att.backend
    by_index = {idx: uuid for uuid, idx in gpus.items() if idx is not None}

    @functools.cache
    def holder(pid: int | None) -> Workload:
        return b.other if pid is None else b.owner(pid) or b.other

    sm: dict[tuple[str, Workload], float] = {}
    mem: dict[tuple[str, Workload], float] = {}
    for row, _ in instant.rows if instant is not None else ():
        uuid = by_index.get(row.gpu) if row.gpu is not None else None
        if uuid is None:
            continue
        key = (uuid, holder(row.pid))
        if row.sm is not None:
            sm[key] = sm.get(key, 0.0) + row.sm / 100.0
        if row.mem is not None:
            mem[key] = mem.get(key, 0.0) + row.mem / 100.0
    used: dict[tuple[str, Workload], float] = {}
    found: dict[tuple[str, Workload], float] = {}
    held = att.view(gpus).holders if att.up else None  # no findings from a stale or failed listing
    for p in procs or ():
        if p.gpu_uuid not in gpus:
            continue
        key = (p.gpu_uuid, holder(p.pid))
        if p.used_memory is not None:
            used[key] = used.get(key, 0.0) + float(p.used_memory) * 1048576.0
        if held is not None and key[1] != b.other and key[1] not in held.get(p.gpu_uuid, ()):
            found[key] = 1.0
    whose, other, pre = f"the {b.words.holder}'s processes", b.words.other, f"smiquery_{b.workload}_gpu"
    finding = f"A {b.words.holder} running on a GPU the scheduler did not allocate to it (1): a finding."
    fams = []
    for name, doc, values in (
        (f"{pre}_utilization_ratio", f"SM use of {whose} on the GPU (pmon sm), 0-1. {other}", sm),
        (f"{pre}_memory_utilization_ratio", f"Memory-controller use of {whose} (pmon mem), 0-1. {other}", mem),
        (f"{pre}_memory_used_bytes", f"GPU memory used by {whose}, in bytes. {other}", used),
        ("smiquery_gpu_unallocated_use", finding, found),
    ):
        fam = gauge(name, doc)
        for (uuid, h), value in sorted(values.items()):
            fam.add_sample(fam.name, {**_gpu(uuid, gpus, uuid_label), **h.labels(b.labels), **labels}, value)
        fams.append(fam)
    return [f for f in fams if f.samples]


def xid_families(
    xid: XidWatcher,
    gpus: Callable[[BusKey], Mapping[str, str] | None],
    labels: Mapping[str, str],
    *,
    inventory_known: bool = True,
) -> list[Metric]:
    """``smiquery_xid_errors_total`` (every event counts), ``..._rejected_lines_total`` and ``smiquery_xid_source_up``.

    ``gpus``: PCI key -> ``{"gpu": ..., "uuid": ...}`` of the GPU there; None for an address no GPU has (it fell
    off the bus before the exporter saw it): its events have ``gpu`` and ``uuid`` empty. Until ``inventory_known``
    (the GPUs have been listed), such events are held back, so that their series do not change labels later.
    """
    doc = f"1 while the kernel log ({xid.path}) is read for Xid errors, else 0 (no permission, missing)."
    up = gauge("smiquery_xid_source_up", doc, ({**labels, "path": xid.path}, 1.0 if xid.up else 0.0))
    doc = "Xid errors the NVIDIA driver logged in the kernel log, by GPU and code (every event counts)."
    fam = Metric("smiquery_xid_errors", doc, "counter")
    for key, code, bus, n in xid.series():
        found = gpus(key)
        if found is None and not inventory_known:
            continue
        gpu = found or {}
        info = XID_CATALOGUE.get(code)
        action = info.action if info is not None else "unknown"
        one = {"gpu": gpu.get("gpu", ""), "uuid": gpu.get("uuid", ""), "pci_bus_id": bus, "xid": str(code)}
        fam.add_sample(fam.name + "_total", {**labels, **one, "action": action}, float(n))
    if xid.other:
        other = {"gpu": "", "uuid": "", "pci_bus_id": "other", "xid": "other", "action": "unknown"}
        fam.add_sample(fam.name + "_total", {**labels, **other}, float(xid.other))
    rejected = Metric(
        "smiquery_xid_rejected_lines",
        "Kernel-log lines that look like an Xid but were not counted: not_kernel (not written by the kernel), "
        "unknown_format (no kernel-log line format), malformed (the bus id or code does not parse).",
        "counter",
    )
    for reason, n in xid.rejected().items():
        rejected.add_sample(rejected.name + "_total", {**labels, "reason": reason}, float(n))
    return [up, fam, rejected] if fam.samples else [up, rejected]


def _details_stale_after(poller: Latest[tuple[GpuDetails, ...]]) -> float:
    return 3 * poller.interval + DETAILS_TIMEOUT  # three polls missed


def fresh_details(poller: Latest[tuple[GpuDetails, ...]]) -> tuple[GpuDetails, ...] | None:
    """The newest ``nvidia-smi -q -x`` details while fresh (three polls missed at most), else None."""
    return poller.get().fresh(_details_stale_after(poller))


def details_health(poller: Latest[tuple[GpuDetails, ...]], labels: Mapping[str, str]) -> list[Metric]:
    """The details poll's health: whether its newest result is fresh, and when it was taken."""
    stale = _details_stale_after(poller)
    doc = f"1 when nvidia-smi -q -x answered within the last {stale:g} s (MIG series are served), else 0."
    out = [gauge("smiquery_details_up", doc, (labels, 1.0 if fresh_details(poller) is not None else 0.0))]
    wall = poller.get().at
    if wall is not None:
        doc = "Unix time of the newest nvidia-smi -q -x."
        out.append(gauge("smiquery_details_last_success_timestamp_seconds", doc, (labels, wall)))
    return out


def mig_families(
    details: tuple[GpuDetails, ...], *, dcgm: bool, gpu_labels: Callable[[GpuDetails], Mapping[str, str]]
) -> list[Metric]:
    """Per-MIG-instance memory (used, free, total) from one details poll; ``gpu_labels``: a parent GPU's labels.

    Native naming: ``smiquery_mig_memory_{used,free,total}_bytes`` labelled with the parent GPU's labels plus
    ``mig_uuid``, ``gpu_instance_id``, ``compute_instance_id`` and ``profile``. DCGM naming: dcgm-exporter's
    ``DCGM_FI_DEV_FB_{USED,FREE,TOTAL}`` (MiB) with the parent GPU's labels plus ``GPU_I_ID`` and ``GPU_I_PROFILE``.
    A value nvidia-smi did not give has no sample (never 0); nvidia-smi gives no utilisation per instance.
    """
    unit = "MiB" if dcgm else "bytes"
    fams = [
        (gauge(dcgm_name if dcgm else name, f"{text} of a MIG instance, in {unit} (nvidia-smi -q -x)."), attr)
        for name, dcgm_name, attr, text in MIG_SERIES
    ]
    for gpu in details:
        parent = dict(gpu_labels(gpu)) if gpu.mig_devices else {}
        for mig in gpu.mig_devices:
            gi = "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id)
            ci = "" if mig.compute_instance_id is None else str(mig.compute_instance_id)
            if dcgm:
                labels = {**parent, "GPU_I_ID": gi, "GPU_I_PROFILE": mig.profile or ""}
            else:
                mig_labels = {"mig_uuid": mig.uuid or "", "gpu_instance_id": gi, "compute_instance_id": ci}
                labels = {**parent, **mig_labels, "profile": mig.profile or ""}
            for fam, attr in fams:
                value = getattr(mig, attr)
                if value is not None:
                    fam.add_sample(fam.name, labels, float(value) * (1.0 if dcgm else 1048576.0))
    return [fam for fam, _ in fams if fam.samples]
