"""The processes under each GPU in ``smiquery stream``'s live table, polled beside the stream.

One ``nvidia-smi --query-compute-apps`` every few seconds on a thread of its own (never in the stream's way);
each process is shown as gpustat does, ``user:command/pid(1234MiB)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence

from smiquery.cli.ps.proc import ProcCache
from smiquery.sources.apps import GpuProcess, processes

__all__ = ["ProcessPoller", "process_label"]


def process_label(proc: GpuProcess, user: str | None) -> str:
    """``user:command/pid(memory)`` as gpustat shows a process (``?`` for what is not known).

    A newline or tab in the name the driver recorded becomes a space: one process is one line.
    """
    name = " ".join(proc.process_name.split()) or "?"
    command = os.path.basename(name.split(" ", 1)[0]) or name
    memory = f"{proc.used_memory}MiB" if proc.used_memory is not None else "n/a"
    return f"{user or '?'}:{command}/{proc.pid}({memory})"


class ProcessPoller:
    """Polls the compute processes every ``every`` seconds and hands them, by GPU index, to ``deliver``.

    Args:
        deliver: called from the poller's thread with GPU index -> labels (:func:`process_label`).
        nvidia_smi: the binary (None: the usual search).
        gpus: only these GPUs.
        every: seconds between polls.
        timeout: seconds one poll may take.
        lookup: the processes (default :func:`smiquery.sources.apps.processes`).
    """

    def __init__(
        self,
        deliver: Callable[[Mapping[int, Sequence[str]]], None],
        *,
        nvidia_smi: str | None = None,
        gpus: Sequence[str] | None = None,
        every: float = 2.0,
        timeout: float = 10.0,
        lookup: Callable[..., list[GpuProcess]] = processes,
    ) -> None:
        self._deliver = deliver
        self._kwargs = {"nvidia_smi": nvidia_smi, "gpus": gpus or None, "timeout": timeout}
        self._every = every
        self._lookup = lookup
        self._users = ProcCache()  # /proc, checked to be the process nvidia-smi named (PID namespaces)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="smiquery-live-processes", daemon=True)
        #: the last poll's error (the table goes on without processes), or None
        self.error: BaseException | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called."""
        return self._thread.ident is not None

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop polling (a poll under way is not waited for past ``timeout``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = self._lookup(**self._kwargs)
            except Exception as exc:  # no processes is better than no table: the stream reports its own errors
                self.error = exc
            else:
                self.error = None
                by_gpu: dict[int, list[str]] = {}
                for p in procs:
                    if p.gpu_index is not None:
                        user, _ = self._users.lookup(p.pid, p.process_name)
                        by_gpu.setdefault(p.gpu_index, []).append(process_label(p, user))
                self._users.keep({(p.pid, p.process_name) for p in procs})
                if not self._stop.is_set():
                    self._deliver(by_gpu)
            self._stop.wait(self._every)
