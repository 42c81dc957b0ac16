"""``smiquery stream --kernel-log PATH``: the driver's Xid errors, one line each, beside the live samples.

nvidia-smi never reports Xids (a GPU that fell off the bus just stops answering); the kernel log says why. The
follower runs on its own thread and names the GPU from the stream's own samples (their ``pci.bus_id``), so a GPU
that fell off the bus is still named by the last sample it gave. Lines that look like an Xid but that the kernel did
not write (``logger 'NVRM: Xid ...'``) are not shown as Xids: a note says so, at most once a minute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smiquery.errors import KernelLogError, UsageError

if TYPE_CHECKING:
    from smiquery.recordings import SampleWriter
    from smiquery.sample import GpuSample
    from smiquery.sources.xid import XidEvent, XidWatcher

__all__ = ["XID_FIELDS", "KernelLogOpt", "XidNotes", "start_xid_notes", "xid_fields"]

KernelLogOpt = Annotated[
    str | None,
    typer.Option(
        "--kernel-log",
        metavar="PATH",
        help="Also follow the kernel log (/dev/kmsg, needs root or CAP_SYSLOG; or a file such as "
        "/var/log/kern.log) and print each NVIDIA Xid error logged from now on: the GPU, the code, what it means "
        "and what to do; only lines the kernel wrote count. Adds pci.bus_id to the queried fields.",
        show_default=False,
    ),
]

#: What names a GPU in an Xid line: the kernel log gives only the PCI address.
XID_FIELDS = ("index", "uuid", "pci.bus_id")


def xid_fields(replay: Path | None) -> tuple[str, ...]:
    """The fields ``--kernel-log`` needs queried.

    Raises:
        UsageError: with ``--replay`` (the kernel log is this machine's now, the recording is the past).
    """
    if replay is not None:
        raise UsageError("--kernel-log goes with a live stream, not --replay: the kernel log is this machine's now")
    return XID_FIELDS


class XidNotes:
    """A sample writer that keeps each GPU's newest sample, and the watcher that turns Xid events into lines.

    It sits among the stream's writers: every sample updates the GPUs it names; closing it stops the watcher.
    ``note`` takes each line (stderr, or the live table's footer).
    """

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note
        self._gpus: dict[str, GpuSample] = {}  # PCI address -> the newest sample from there
        self._watcher: XidWatcher | None = None
        self._lock = threading.Lock()

    def write(self, sample: GpuSample) -> None:
        """Remember the GPU at the sample's PCI address."""
        bus = sample.get("pci.bus_id")
        if isinstance(bus, str):
            with self._lock:
                self._gpus[bus] = sample

    def _event(self, event: XidEvent) -> None:
        from smiquery.sources.xid import describe, gpu_for

        with self._lock:
            gpu = gpu_for(event, self._gpus.values())
        self.note(f"smiquery: {describe(event, gpu.index, gpu.uuid) if gpu is not None else describe(event)}")

    def _failed(self, exc: BaseException, _opened: bool) -> None:
        self.note(f"smiquery: reading the kernel log stopped ({exc}); the stream goes on without Xid errors")

    def start(self, path: str) -> None:
        """Follow ``path`` from its end.

        Raises:
            KernelLogError: it cannot be opened.
        """
        from smiquery.sources.xid import XidWatcher

        self._watcher = XidWatcher(
            path,
            on_event=self._event,
            on_error=self._failed,
            from_start=False,
            on_refused=lambda text: self.note(f"smiquery: {text}"),
        ).start()

    def close(self) -> None:
        """Stop following."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None


def start_xid_notes(path: str, writers: list[SampleWriter], note: Callable[[str], None]) -> None:
    """Follow ``path`` for the stream: its notes join ``writers`` (closed with them); unreadable, one warning."""
    notes = XidNotes(note)
    try:
        notes.start(path)
    except KernelLogError as exc:
        note(f"smiquery: {exc}; the stream goes on without Xid errors")
        return
    writers.append(notes)
