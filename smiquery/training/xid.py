"""Xid errors as alerts of a training run (``kernel_log=PATH``): the run learns why its GPU stopped."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from smiquery.alerts import AlertEvent, Notifier, Rule
from smiquery.errors import KernelLogError
from smiquery.fields import get_field
from smiquery.sources.xid import XidEvent, XidInfo, XidWatcher, describe, gpu_for
from smiquery.training.events import TrainingAlert

if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

    from smiquery.sample import GpuSample
    from smiquery.training.monitor import RunMonitor

__all__ = ["KernelLog", "XidAlert"]


@dataclass(frozen=True)
class XidAlert(AlertEvent):
    """An Xid error on a GPU, as an alert event (always ``firing``: an Xid never clears).

    Its ``rule`` reads ``Xid 79``; ``value`` is the GPU's PCI address as the kernel printed it.

    Attributes:
        xid: the code.
        info: its catalogue entry (meaning, action, advice), None for a code the catalogue lacks.
        xid_event: the kernel log's event (the driver's text, pid, process name).
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
