"""What a run feeds besides its logs, and :func:`run_monitor`: the one place the user's keywords become outputs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from smiquery._log import get_logger
from smiquery.training.metrics import JobMetrics
from smiquery.training.monitor import Output, RunMonitor
from smiquery.training.xid import KernelLog

if TYPE_CHECKING:
    from smiquery.recordings import SampleWriter
    from smiquery.sample import GpuSample

__all__ = ["METRICS_KEYWORDS", "Recording", "run_monitor"]

log = get_logger("smiquery.training.outputs")


class Recording:
    """Every sample of the watched GPUs written to ``path`` (``.csv``, ``.jsonl``, ``.parquet``) for each run.

    ``smiquery report`` and ``smiquery plot`` read it. A failure is said once and the run goes on unrecorded.
    """

    fields: tuple[str, ...] = ()

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._writer: SampleWriter | None = None
        self._monitor: RunMonitor | None = None

    def open(self, monitor: RunMonitor) -> None:
        """Open the file with the fields the run streams."""
        self._monitor = monitor
        try:
            from smiquery.fields import resolve_fields
            from smiquery.recordings import open_recorder

            self._writer = open_recorder(self.path, resolve_fields(monitor.stream_fields))
        except Exception as exc:
            monitor.say(f"cannot record to {os.fspath(self.path)!r} ({exc}): the run is not recorded")

    def take(self, samples: Sequence[GpuSample]) -> None:
        """Append one sweep's samples."""
        writer = self._writer
        if writer is None:
            return
        try:
            for s in samples:
                writer.write(s)
        except Exception as exc:
            self._writer = None
            if self._monitor is not None:
                self._monitor.say(f"recording stopped: {exc}")

    def close(self, timeout: float = 5.0) -> None:
        """Close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                log.exception("smiquery: closing the recording failed")


#: The keywords of :func:`run_monitor` that go to the job's :class:`~smiquery.training.metrics.JobMetrics`.
METRICS_KEYWORDS = ("metrics_port", "metrics_addr", "web_config", "pushgateway", "push_interval", "job", "run_id")


def run_monitor(
    fields: str | Sequence[str] | None = None,
    interval: float = 1.0,
    *,
    record: str | os.PathLike[str] | None = None,
    kernel_log: str | os.PathLike[str] | None = None,
    **options: Any,
) -> RunMonitor:
    """A :class:`~smiquery.training.monitor.RunMonitor` with the outputs these keywords ask for (not started).

    Args:
        fields: extra fields to summarise per epoch.
        interval: seconds between samples.
        record: a :class:`Recording` of every sample to this file.
        kernel_log: follow this kernel log (``/dev/kmsg``...): each Xid on a watched GPU becomes an alert
            (a :class:`~smiquery.training.xid.KernelLog`).
        **options: :data:`METRICS_KEYWORDS` (``metrics_port=``, ``pushgateway=``...: the job's
            :class:`~smiquery.training.metrics.JobMetrics`, served and/or pushed), and the monitor's own arguments
            (``alerts``, ``handlers``, ``log_every``, ``nvidia_smi``, ``gpus``, ``framework``, ``process_share``...).

    Raises:
        ValueError, WebConfigError, InvalidFieldError, InvalidRuleError: an argument, the web-config file, a field
            name or an alert expression is invalid.
    """
    outputs: list[Output] = [] if record is None else [Recording(record)]
    # made even when unused: a bad web-config file is a mistake to fix before training, not a warning after it
    metrics = JobMetrics(**{k: options.pop(k) for k in METRICS_KEYWORDS if k in options})
    if metrics.metrics_port is not None or metrics.pushgateway is not None:
        outputs.append(metrics)
    if kernel_log:
        outputs.append(KernelLog(kernel_log))
    return RunMonitor(fields, interval, outputs=outputs, **options)
