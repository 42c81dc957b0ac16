"""The process poller: compute processes listed on their own interval, in a background thread."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.errors import SmiqueryError
from smiquery.sources.apps import GpuProcess, processes
from smiquery.streams.argv import normalize_gpus

if TYPE_CHECKING:
    import os

    from smiquery.streams.argv import GpusArg

__all__ = ["ProcessPoller"]

log = get_logger("smiquery.exporter")


class ProcessPoller:
    """Samples the compute processes (:func:`smiquery.processes`) on its own interval, in a background thread.

    Each poll runs nvidia-smi twice (GPU list and compute apps); scrapes only read the newest result.

    Args:
        interval: seconds between polls.
        gpus: only these GPUs.
        nvidia_smi: path of the binary.
        timeout: seconds per nvidia-smi call.
    """

    def __init__(
        self,
        interval: float = 15.0,
        *,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        if interval <= 0:
            raise ValueError("the processes interval must be positive")
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self.nvidia_smi = nvidia_smi
        self.timeout = timeout
        self.errors: Counter[str] = Counter()
        self.polls = 0
        self.last_error: str | None = None
        self._latest: tuple[tuple[GpuProcess, ...], float, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Run one poll now (errors are counted, never raised)."""
        self.polls += 1
        try:
            got = processes(gpus=self.gpus or None, nvidia_smi=self.nvidia_smi, timeout=self.timeout)
        except SmiqueryError as exc:
            self.errors[type(exc).__name__] += 1
            self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("smiquery exporter: listing processes failed: %s", self.last_error)
            return
        self.last_error = None
        self._latest = (tuple(got), time.monotonic(), time.time())

    def latest(self) -> tuple[tuple[GpuProcess, ...] | None, float | None, float | None]:
        """The newest process list, its age in seconds and its wall-clock time; Nones before the first success."""
        got = self._latest
        if got is None:
            return None, None, None
        return got[0], time.monotonic() - got[1], got[2]

    def start(self) -> ProcessPoller:
        """Poll in a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-processes", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def close(self, timeout: float = 15.0) -> None:
        """Stop polling and wait for a poll in progress (each nvidia-smi call is bounded by ``timeout``)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
