"""The exporter's slow polls, each in its own :class:`~smiquery.sources.latest.Latest` (a scrape reads the newest).

:func:`process_poller` lists the compute processes; :func:`details_poller` runs ``nvidia-smi -q -x``, which takes
0.4-6 s on big servers, every 60 s by default, and :func:`mig_families` turns its result into per-MIG-instance
memory series.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from smiquery.errors import SmiqueryError
from smiquery.exporter.families import gauge
from smiquery.sources.apps import GpuProcess, processes
from smiquery.sources.details import GpuDetails, details
from smiquery.sources.latest import Latest
from smiquery.streams.argv import normalize_gpus

if TYPE_CHECKING:
    import os

    from prometheus_client.metrics_core import Metric

    from smiquery.runner import Runner
    from smiquery.streams.argv import GpusArg

__all__ = [
    "DEFAULT_DETAILS_INTERVAL",
    "DETAILS_TIMEOUT",
    "MIG_METRICS",
    "details_health",
    "details_poller",
    "details_stale_after",
    "fresh_details",
    "mig_families",
    "process_poller",
]

#: Seconds between ``nvidia-smi -q -x`` runs by default (the CLI's ``--details-interval``).
DEFAULT_DETAILS_INTERVAL = 60.0
#: Seconds one details poll may take (``-q -x`` and, with MIG, ``-L``).
DETAILS_TIMEOUT = 45.0

#: The per-MIG-instance families: (native name, DCGM name, MigDevice attribute, help).
MIG_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("smiquery_mig_memory_used_bytes", "DCGM_FI_DEV_FB_USED", "memory_used", "Framebuffer memory used"),
    ("smiquery_mig_memory_free_bytes", "DCGM_FI_DEV_FB_FREE", "memory_free", "Framebuffer memory free"),
    ("smiquery_mig_memory_total_bytes", "DCGM_FI_DEV_FB_TOTAL", "memory_total", "Framebuffer memory"),
)


def process_poller(
    interval: float = 15.0,
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
) -> Latest[tuple[GpuProcess, ...]]:
    """:func:`smiquery.processes` every ``interval`` seconds in a background :class:`Latest`; scrapes read the newest.

    Each poll runs nvidia-smi twice (GPU list and compute apps, ``timeout`` seconds each); a failure is counted
    and logged, never raised.

    Raises:
        ValueError: an interval that is not positive.
        InvalidGpuIdError: a malformed GPU id.
    """
    ids = normalize_gpus(gpus) or None
    return Latest(
        lambda: tuple(processes(gpus=ids, nvidia_smi=nvidia_smi, timeout=timeout)),
        interval,
        name="listing processes",
        errors=(SmiqueryError,),
    )


def details_poller(
    interval: float = DEFAULT_DETAILS_INTERVAL,
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    runner: Runner | None = None,
) -> Latest[tuple[GpuDetails, ...]]:
    """:func:`smiquery.details` every ``interval`` seconds, in a background :class:`Latest` (scrapes read its newest).

    A poll may take :data:`DETAILS_TIMEOUT` seconds: a slow poll delays the next, it is not cut short. A failure
    is counted by type and logged once per message in a row. ``runner``: how to run nvidia-smi (tests inject one).

    Raises:
        ValueError: an interval that is not positive.
        InvalidGpuIdError: a malformed GPU id.
    """
    ids = normalize_gpus(gpus) or None
    return Latest(
        lambda: tuple(details(ids, nvidia_smi=nvidia_smi, timeout=DETAILS_TIMEOUT, runner=runner)),
        interval,
        name="nvidia-smi -q -x",
    )


def details_stale_after(poller: Latest[tuple[GpuDetails, ...]]) -> float:
    """Seconds after which the newest details are no longer served: three polls missed."""
    return 3 * poller.interval + DETAILS_TIMEOUT


def fresh_details(poller: Latest[tuple[GpuDetails, ...]]) -> tuple[GpuDetails, ...] | None:
    """The newest details while younger than :func:`details_stale_after`, else None."""
    return poller.get().fresh(details_stale_after(poller))


def mig_families(
    details: tuple[GpuDetails, ...],
    *,
    dcgm: bool,
    gpu_labels: Callable[[GpuDetails], Mapping[str, str]],
) -> list[Metric]:
    """Per-MIG-instance memory from one details poll: used, free and total.

    Native naming: ``smiquery_mig_memory_{used,free,total}_bytes`` labelled with the parent GPU's labels plus
    ``mig_uuid``, ``gpu_instance_id``, ``compute_instance_id`` and ``profile``. DCGM naming: dcgm-exporter's
    ``DCGM_FI_DEV_FB_{USED,FREE,TOTAL}`` (MiB) with the parent GPU's labels (its ``UUID``) plus ``GPU_I_ID`` and
    ``GPU_I_PROFILE``. A value nvidia-smi did not give has no sample (never 0). Utilisation per instance is not
    available through nvidia-smi, so there is none. ``gpu_labels``: the parent GPU's labels in the naming.
    """
    unit = "MiB" if dcgm else "bytes"
    fams = [
        (gauge(dcgm_name if dcgm else name, f"{text} of a MIG instance, in {unit} (nvidia-smi -q -x)."), attr)
        for name, dcgm_name, attr, text in MIG_METRICS
    ]
    for gpu in details:
        if not gpu.mig_devices:
            continue
        parent = dict(gpu_labels(gpu))
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


def details_health(poller: Latest[tuple[GpuDetails, ...]], labels: Mapping[str, str]) -> list[Metric]:
    """The details poll's health: whether its newest result is fresh, and when it was taken."""
    stale = details_stale_after(poller)
    doc = f"1 when nvidia-smi -q -x answered within the last {stale:g} s (MIG series are served), else 0."
    out = [gauge("smiquery_details_up", doc, (labels, 1.0 if fresh_details(poller) is not None else 0.0))]
    wall = poller.get().at
    if wall is not None:
        doc = "Unix time of the newest nvidia-smi -q -x."
        out.append(gauge("smiquery_details_last_success_timestamp_seconds", doc, (labels, wall)))
    return out
