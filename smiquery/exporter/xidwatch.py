"""The Xid watcher: the kernel log followed in its own thread, Xid events counted per GPU and code.

``smiquery_xid_errors_total{uuid, gpu, xid}`` is a counter: every event counts, repeats too, and it never needs a
reset. ``/dev/kmsg`` replays its ring buffer to every new reader; each record is counted once (its sequence
number), and the replay after an exporter restart gives the counter back the value it had (Prometheus sees no
increase), as long as the ring buffer still holds those records.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.errors import KernelLogError
from smiquery.exporter.families import counter, gauge
from smiquery.sample import BusKey, bus_key
from smiquery.xid import DEFAULT_KERNEL_LOG, XID_CATALOGUE, XidEvent, XidFollower, follow

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["XidWatcher"]

log = get_logger("smiquery.exporter")


class XidWatcher:
    """Follows a kernel log in a background thread and counts Xid events by PCI address and code.

    Without permission to read the log (``/dev/kmsg`` needs root or ``CAP_SYSLOG`` where
    ``kernel.dmesg_restrict=1``): one warning, :attr:`up` stays False (``smiquery_xid_source_up 0``), and the
    log is tried again every ``retry`` seconds without further warnings; everything else is unaffected.

    Args:
        path: ``/dev/kmsg`` or a plain file followed like ``tail -F``.
        retry: seconds between attempts to open a log that could not be opened.
        poll: seconds between checks for new data and for :meth:`close`.
        on_event: called with each new event (in the watcher's thread).
    """

    def __init__(
        self,
        path: str = DEFAULT_KERNEL_LOG,
        *,
        retry: float = 30.0,
        poll: float = 0.5,
        on_event: Callable[[XidEvent], None] | None = None,
    ) -> None:
        self.path = path
        self.retry = retry
        self.poll = poll
        self.on_event = on_event
        self.up = False
        self.last_error: str | None = None
        self.events = 0
        self.attempts = 0
        self._counts: dict[tuple[BusKey, int], int] = {}
        self._bus_text: dict[BusKey, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._follower: XidFollower | None = None
        self._thread: threading.Thread | None = None

    def counts(self) -> dict[tuple[BusKey, int], int]:
        """A copy of the counts: ``(bus key, xid) -> events``."""
        with self._lock:
            return dict(self._counts)

    def bus_text(self, key: BusKey) -> str:
        """The PCI address as the kernel printed it for ``key``."""
        return self._bus_text.get(key, "")

    def count(self, event: XidEvent) -> None:
        """Count one event (the watcher's thread does; tests may too)."""
        key = bus_key(event.pci_bus_id)
        if key is None:
            return
        with self._lock:
            self._counts[(key, event.xid)] = self._counts.get((key, event.xid), 0) + 1
            self._bus_text.setdefault(key, event.pci_bus_id)
            self.events += 1
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a listener's bug must not stop the counting
                log.exception("smiquery exporter: an Xid listener failed")

    def start(self) -> XidWatcher:
        """Follow the log in a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-xid", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        warned = False
        after_seq: int | None = None
        from_start = True
        while not self._stop.is_set():
            self.attempts += 1
            try:
                follower = follow(self.path, after_seq=after_seq, from_start=from_start, poll=self.poll)
            except KernelLogError as exc:
                self.up = False
                self.last_error = f"{exc.reason}"
                if not warned:
                    warned = True
                    log.warning(
                        "smiquery exporter: cannot read the kernel log (%s); smiquery_xid_source_up is 0 and Xid "
                        "errors are not counted until it can be read (tried again every %g s). Give the exporter "
                        "CAP_SYSLOG (or run it as root), point --kernel-log at a readable file, or turn it off "
                        "with --kernel-log ''",
                        exc,
                        self.retry,
                    )
                self._stop.wait(self.retry)
                continue
            self._follower = follower
            if self._stop.is_set():
                follower.close()
            self.up = True
            self.last_error = None
            try:
                with follower:
                    for event in follower:
                        self.count(event)
            except Exception as exc:  # a read error (or a bug): resume after what was counted, not from the start
                self.up = False
                self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("smiquery exporter: reading the kernel log failed: %s", self.last_error)
                self._stop.wait(self.retry)
            after_seq = follower.last_seq if follower.last_seq >= 0 else None
            from_start = False  # a plain file: what was read is not read again
        self.up = False

    def close(self, timeout: float = 5.0) -> None:
        """Stop following (the reading thread sees it within ``poll`` seconds)."""
        self._stop.set()
        follower = self._follower
        if follower is not None:
            follower.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def families(
        self,
        gpus: Callable[[BusKey], Mapping[str, str] | None],
        labels: Mapping[str, str],
        *,
        inventory_known: bool = True,
    ) -> list[Metric]:
        """``smiquery_xid_errors_total`` and ``smiquery_xid_source_up``.

        Args:
            gpus: PCI key -> ``{"gpu": ..., "uuid": ...}`` of the GPU at that address; None for an address no
                GPU has (the GPU fell off the bus before the exporter saw it): its events are counted with
                ``gpu`` and ``uuid`` empty.
            labels: the constant labels.
            inventory_known: whether the GPUs have been listed yet; until then an event at an address no GPU is
                known at is held back, so that its series does not change labels once the GPU is seen.

        Returns:
            The families (the counter only once an event was counted).
        """
        up = gauge(
            "smiquery_xid_source_up",
            f"1 while the kernel log ({self.path}) is read for Xid errors, else 0 (no permission, missing).",
        )
        up.add_sample(up.name, {**labels, "path": self.path}, 1.0 if self.up else 0.0)
        xid = counter(
            "smiquery_xid_errors",
            "Xid errors the NVIDIA driver logged in the kernel log, by GPU and code (every event counts).",
        )
        for (key, code), n in sorted(self.counts().items()):
            found = gpus(key)
            if found is None and not inventory_known:
                continue
            gpu = found or {}
            info = XID_CATALOGUE.get(code)
            xid.add_sample(
                xid.name + "_total",
                {
                    **labels,
                    "gpu": gpu.get("gpu", ""),
                    "uuid": gpu.get("uuid", ""),
                    "pci_bus_id": self.bus_text(key),
                    "xid": str(code),
                    "action": info.action if info is not None else "unknown",
                },
                float(n),
            )
        return [up, xid] if xid.samples else [up]
