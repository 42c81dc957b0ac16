"""The details poller: ``nvidia-smi -q -x`` on its own slow cadence, in its own thread, and the MIG families.

``-q -x`` takes 0.4-6 s on big servers, so it never runs on the scrape path: :class:`DetailsPoller` runs it every
``interval`` seconds (60 by default) and a scrape reads the newest result. :func:`mig_families` turns that result
into per-MIG-instance memory series.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.details import GpuDetails, inspect
from smiquery.errors import SmiqueryError
from smiquery.exporter.families import gauge
from smiquery.streams.argv import normalize_gpus

if TYPE_CHECKING:
    import os

    from prometheus_client.metrics_core import Metric

    from smiquery.runner import Runner
    from smiquery.streams.argv import GpusArg

__all__ = ["DEFAULT_DETAILS_INTERVAL", "MIG_METRICS", "DetailsPoller", "details_health", "mig_families"]

log = get_logger("smiquery.exporter")

#: Seconds between ``nvidia-smi -q -x`` runs by default (the CLI's ``--details-interval``).
DEFAULT_DETAILS_INTERVAL = 60.0

#: The per-MIG-instance families: (native name, DCGM name, MigDevice attribute, help).
MIG_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("smiquery_mig_memory_used_bytes", "DCGM_FI_DEV_FB_USED", "memory_used", "Framebuffer memory used"),
    ("smiquery_mig_memory_free_bytes", "DCGM_FI_DEV_FB_FREE", "memory_free", "Framebuffer memory free"),
    ("smiquery_mig_memory_total_bytes", "DCGM_FI_DEV_FB_TOTAL", "memory_total", "Framebuffer memory"),
)


class DetailsPoller:
    """Runs :func:`smiquery.inspect` every ``interval`` seconds in a supervised background thread.

    A failure (nvidia-smi's typed errors, or a bug) is counted by type and logged once per kind in a row; the
    thread goes on to the next poll. Scrapes read :meth:`latest` only.

    Args:
        interval: seconds between polls.
        gpus: only these GPUs.
        nvidia_smi: path of the binary.
        timeout: seconds one poll may take (``-q -x`` and, with MIG, ``-L``).
        runner: how to run nvidia-smi (tests inject one).
    """

    def __init__(
        self,
        interval: float = DEFAULT_DETAILS_INTERVAL,
        *,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        timeout: float = 45.0,
        runner: Runner | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError("the details interval must be positive")
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self.nvidia_smi = nvidia_smi
        self.timeout = float(timeout)  # not tied to the interval: a slow poll delays the next, it is not cut short
        self.runner = runner
        self.errors: Counter[str] = Counter()
        self.polls = 0
        self.last_error: str | None = None
        self._latest: tuple[tuple[GpuDetails, ...], float, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stale_after(self) -> float:
        """Seconds after which the newest result is no longer served: three polls missed."""
        return 3 * self.interval + self.timeout

    def poll(self) -> None:
        """Run one poll now (errors are counted, never raised)."""
        self.polls += 1
        try:
            got = inspect(self.gpus or None, nvidia_smi=self.nvidia_smi, timeout=self.timeout, runner=self.runner)
        except SmiqueryError as exc:
            self._failed(type(exc).__name__, str(exc))
            return
        self.last_error = None
        self._latest = (tuple(got), time.monotonic(), time.time())

    def _failed(self, kind: str, text: str) -> None:
        self.errors[kind] += 1
        line = text.splitlines()[0] if text else kind
        if self.last_error != line:  # one line per kind of failure in a row, not one per poll
            log.warning("smiquery exporter: nvidia-smi -q -x failed: %s", line)
        self.last_error = line

    def latest(self) -> tuple[tuple[GpuDetails, ...] | None, float | None, float | None]:
        """The newest details, their age in seconds and their wall-clock time; Nones before the first success."""
        got = self._latest
        if got is None:
            return None, None, None
        return got[0], time.monotonic() - got[1], got[2]

    def fresh(self) -> tuple[GpuDetails, ...] | None:
        """The newest details while younger than :attr:`stale_after`, else None."""
        got, age, _ = self.latest()
        if got is None or age is None or age > self.stale_after:
            return None
        return got

    def start(self) -> DetailsPoller:
        """Poll in a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-details", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll()
            except Exception as exc:  # a bug must not end the thread: counted, logged, the next poll runs
                log.exception("smiquery exporter: polling nvidia-smi -q -x failed")
                self._failed(type(exc).__name__, str(exc))
            # the cadence is kept from the start of each poll, so a slow -q -x does not stretch it
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    @property
    def running(self) -> bool:
        """True while the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling; wait up to ``timeout`` seconds for a poll in progress.

        A slow ``-q -x`` is not waited for to its end (a stopping exporter must exit within its grace period): its
        call stays bounded by the poll's own timeout.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


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
    available through nvidia-smi, so there is none.

    Args:
        details: the newest poll.
        dcgm: DCGM naming.
        gpu_labels: the parent GPU's labels (naming-specific, constant labels included).

    Returns:
        The non-empty families.
    """
    out: list[Metric] = []
    fams = []
    for native_name, dcgm_name, attr, text in MIG_METRICS:
        unit = "MiB" if dcgm else "bytes"
        fam = gauge(dcgm_name if dcgm else native_name, f"{text} of a MIG instance, in {unit} (nvidia-smi -q -x).")
        fams.append((fam, attr))
    for gpu in details:
        if not gpu.mig_devices:
            continue
        parent = dict(gpu_labels(gpu))
        for mig in gpu.mig_devices:
            if dcgm:
                labels = {
                    **parent,
                    "GPU_I_ID": "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id),
                    "GPU_I_PROFILE": mig.profile or "",
                }
            else:
                labels = {
                    **parent,
                    "mig_uuid": mig.uuid or "",
                    "gpu_instance_id": "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id),
                    "compute_instance_id": "" if mig.compute_instance_id is None else str(mig.compute_instance_id),
                    "profile": mig.profile or "",
                }
            for fam, attr in fams:
                value = getattr(mig, attr)
                if value is not None:
                    fam.add_sample(fam.name, labels, float(value) * (1.0 if dcgm else 1048576.0))
    out.extend(fam for fam, _ in fams if fam.samples)
    return out


def details_health(poller: DetailsPoller, labels: Mapping[str, str]) -> list[Metric]:
    """The details poller's health: whether its newest result is fresh, and when it was taken.

    Args:
        poller: the poller.
        labels: the constant labels.

    Returns:
        The families.
    """
    up = gauge(
        "smiquery_details_up",
        f"1 when nvidia-smi -q -x answered within the last {poller.stale_after:g} s (MIG series are served), else 0.",
    )
    up.add_sample(up.name, dict(labels), 1.0 if poller.fresh() is not None else 0.0)
    out = [up]
    _, _, wall = poller.latest()
    if wall is not None:
        when = gauge("smiquery_details_last_success_timestamp_seconds", "Unix time of the newest nvidia-smi -q -x.")
        when.add_sample(when.name, dict(labels), wall)
        out.append(when)
    return out
