"""What a run feeds besides its logs (a recording, Xid alerts), and :func:`run_monitor`, which builds them."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from smiquery._log import get_logger
from smiquery.alerts import AlertEvent, Notifier, Rule
from smiquery.errors import KernelLogError
from smiquery.fields import get_field
from smiquery.sources.xid import XidEvent, XidInfo, XidWatcher, describe, gpu_for
from smiquery.training.metrics import JobMetrics
from smiquery.training.monitor import Output, RunMonitor, TrainingAlert

if TYPE_CHECKING:
    from smiquery.recordings import SampleWriter
    from smiquery.sample import GpuSample

__all__ = ["METRICS_KEYWORDS", "KernelLog", "Recording", "XidAlert", "run_monitor"]

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


@dataclass(frozen=True)
class XidAlert(AlertEvent):
    """An Xid error on a GPU, as an alert event (always ``firing``: an Xid never clears).

    Its ``rule`` reads ``Xid 79``; ``value`` is the GPU's PCI address as the kernel printed it; ``info`` the code's
    catalogue entry (None for a code it lacks); ``xid_event`` the kernel log's event (driver text, pid, process).
    """

    xid: int = 0
    info: XidInfo | None = None
    xid_event: XidEvent | None = None

    def message(self) -> str:
        """One line for people: ``ALERT firing GPU 1: Xid 79 on GPU 1 (...): GPU has fallen off the bus; ...``."""
        gpu = f"GPU {self.gpu}" if self.gpu is not None else f"GPU {self.uuid or '?'}"
        text = describe(self.xid_event, self.gpu, self.uuid) if self.xid_event is not None else f"Xid {self.xid}"
        return f"ALERT {self.state} {gpu}: {text}"

    def to_dict(self) -> dict[str, object]:
        """The event's dict with ``xid``, ``meaning``, ``action``, ``advice`` and the driver's ``driver_message``."""
        ev = self.xid_event
        return {
            **super().to_dict(),
            "xid": self.xid,
            **{key: getattr(self.info, key, None) for key in ("meaning", "action", "advice")},
            "driver_message": ev.message if ev is not None else None,
            "pid": ev.pid if ev is not None else None,
        }


class KernelLog:
    """The kernel log at ``path`` (``/dev/kmsg``, ``/var/log/kern.log``) followed from its end while a run goes on.

    Each Xid on a watched GPU becomes an :class:`XidAlert` stamped with the training position, kept in
    ``monitor.alerts`` and handed to the handlers like a fired rule, on the watcher's thread (Xids are rare, and a
    GPU that fell off the bus may have stopped the sample thread). An Xid on another GPU is said once at INFO; an
    unreadable log is said once and the run goes on.
    """

    #: the PCI address names the GPU of an Xid
    fields: tuple[str, ...] = ("pci.bus_id",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._watcher: XidWatcher | None = None

    def open(self, monitor: RunMonitor) -> None:
        """Follow the log from its end."""

        def failed(exc: BaseException, _opened: bool) -> None:
            monitor.say(f"reading the kernel log stopped ({exc}): Xid errors are no longer reported to this run")

        on_event = functools.partial(_alert, monitor, Notifier((), monitor.handlers))
        try:
            self._watcher = XidWatcher(self.path, on_event=on_event, on_error=failed, from_start=False).start()
        except KernelLogError as exc:
            monitor.say(f"{exc}: Xid errors are not reported to this run")

    def take(self, samples: Sequence[GpuSample]) -> None:
        """Nothing: the watcher reads the run's newest samples when an Xid comes."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop following."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.close(timeout)


def _alert(monitor: RunMonitor, notifier: Notifier, event: XidEvent) -> None:
    """Alert ``monitor``'s run of ``event`` when it is on a GPU the run watches; else say it once per address."""
    found = gpu_for(event, monitor.latest().values())
    if found is None:
        monitor.say(
            f"{describe(event)} (not a GPU this run watches)", logging.INFO, key=f"xid-other-{event.pci_bus_id}"
        )
        return
    rule = Rule(get_field("pci.bus_id"), "==", event.pci_bus_id, text=f"Xid {event.xid}")
    at = datetime.now().astimezone()
    alert = XidAlert(
        rule, found.index, found.uuid, event.pci_bus_id, "firing", at, at, 0.0, event.xid, event.info, event
    )
    training = TrainingAlert.at(alert, monitor.position, monitor.context_extra)
    monitor.alerts.append(training)
    notifier.dispatch(alert, training.context())


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

    ``record``: a :class:`Recording` of every sample to this file; ``kernel_log``: follow this kernel log
    (``/dev/kmsg``...) for Xids on the watched GPUs (a :class:`KernelLog`); ``**options``: :data:`METRICS_KEYWORDS`
    (the job's :class:`~smiquery.training.metrics.JobMetrics`, served and/or pushed) and the other arguments of
    :class:`~smiquery.training.monitor.RunMonitor`. Raises ValueError, WebConfigError, InvalidFieldError or
    InvalidRuleError for an invalid argument, web-config file, field name or alert expression.
    """
    outputs: list[Output] = [] if record is None else [Recording(record)]
    # made even when unused: a bad web-config file is a mistake to fix before training, not a warning after it
    metrics = JobMetrics(**{k: options.pop(k) for k in METRICS_KEYWORDS if k in options})
    if metrics.metrics_port is not None or metrics.pushgateway is not None:
        outputs.append(metrics)
    if kernel_log:
        outputs.append(KernelLog(kernel_log))
    return RunMonitor(fields, interval, outputs=outputs, **options)
