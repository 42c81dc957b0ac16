"""Xid errors as alerts of a training run: the run learns why its GPU stopped, not only that it did.

``RunMonitor(kernel_log=PATH)`` follows the kernel log (from the moment the run starts) on its own thread; each
Xid on a GPU the run watches becomes an :class:`XidAlert` (an :class:`~smiquery.alerts.AlertEvent` that says the
code, its meaning and the action) stamped with the training position, kept in ``monitor.alerts`` and handed to
the monitor's handlers like a fired rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from smiquery.alerts import AlertEvent, Notifier, Rule
from smiquery.errors import KernelLogError
from smiquery.fields import get_field
from smiquery.sources.xid import XidEvent, XidInfo, XidWatcher, describe, gpu_for
from smiquery.training.events import TrainingAlert

if TYPE_CHECKING:
    import os

    from smiquery.training.monitor import RunMonitor

__all__ = ["XidAlert", "XidAlerts", "xid_alert"]


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
        info = self.info
        ev = self.xid_event
        return {
            **super().to_dict(),
            "xid": self.xid,
            "meaning": info.meaning if info is not None else None,
            "action": info.action if info is not None else None,
            "advice": info.advice if info is not None else None,
            "driver_message": ev.message if ev is not None else None,
            "pid": ev.pid if ev is not None else None,
        }


def xid_alert(event: XidEvent, gpu: int | None, uuid: str | None, at: datetime | float) -> XidAlert:
    """The alert event of one Xid on GPU ``gpu`` (``at``: when it was read)."""
    rule = Rule(get_field("pci.bus_id"), "==", event.pci_bus_id, text=f"Xid {event.xid}")
    return XidAlert(
        rule, gpu, uuid, event.pci_bus_id, "firing", at, at, 0.0, xid=event.xid, info=event.info, xid_event=event
    )


class XidAlerts:
    """The kernel log of a :class:`~smiquery.training.monitor.RunMonitor`, followed while it runs.

    Events on a GPU the run does not watch (none of its samples has that PCI address) are said once per address
    at INFO and not alerted. Handlers are called on the follower's thread (Xids are rare, and a GPU that fell off
    the bus may have stopped the sample thread).

    Args:
        path: ``/dev/kmsg`` or a plain file.
        monitor: the monitor whose samples name the GPUs and whose handlers get the alerts.
    """

    def __init__(self, path: str | os.PathLike[str], monitor: RunMonitor) -> None:
        self.path = path
        self.monitor = monitor
        self._notifier = Notifier((), monitor.handlers)
        self._watcher: XidWatcher | None = None

    def start(self) -> XidAlerts:
        """Follow the log from its end; an unreadable one is said once and the run goes on. Returns self."""
        try:
            self._watcher = XidWatcher(self.path, on_event=self._event, on_error=self._failed, from_start=False).start()
        except KernelLogError as exc:
            self.monitor.say(f"{exc}: Xid errors are not reported to this run")
        return self

    def _failed(self, exc: BaseException, _opened: bool) -> None:
        self.monitor.say(f"reading the kernel log stopped ({exc}): Xid errors are no longer reported to this run")

    def _event(self, event: XidEvent) -> None:
        found = gpu_for(event, self.monitor.latest().values())
        if found is None:
            self.monitor.say(
                f"{describe(event)} (not a GPU this run watches)", logging.INFO, key=f"xid-other-{event.pci_bus_id}"
            )
            return
        alert = xid_alert(event, found.index, found.uuid, datetime.now().astimezone())
        training = TrainingAlert.at(alert, self.monitor.position, self.monitor.context_extra)
        self.monitor.alerts.append(training)
        context: dict[str, Any] = training.context()
        self._notifier.dispatch(alert, context)

    def close(self, timeout: float = 5.0) -> None:
        """Stop following."""
        if self._watcher is not None:
            self._watcher.close(timeout)
            self._watcher = None
