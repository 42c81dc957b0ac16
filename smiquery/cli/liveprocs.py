"""The processes under each GPU in ``smiquery stream``'s live table, polled beside the stream.

One ``nvidia-smi --query-compute-apps`` every few seconds in a :class:`~smiquery.sources.latest.Latest` (never in
the stream's way); each process is shown as gpustat does, ``user/command(1234MiB)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from smiquery.cli.display import UNKNOWN_USER
from smiquery.cli.ps.proc import ProcCache
from smiquery.sources.apps import GpuProcess, processes
from smiquery.sources.latest import Latest

__all__ = ["live_processes", "process_label"]


def process_label(proc: GpuProcess, user: str | None) -> str:
    """``user/command(memory)`` as gpustat shows a process (:data:`UNKNOWN_USER` for a user not known).

    A newline or tab in the name the driver recorded becomes a space: one process is one line.
    """
    name = " ".join(proc.process_name.split()) or "?"
    command = os.path.basename(name.split(" ", 1)[0]) or name
    memory = f"{proc.used_memory}MiB" if proc.used_memory is not None else "n/a"
    return f"{user or UNKNOWN_USER}/{command}({memory})"


def live_processes(
    deliver: Callable[[Mapping[int, Sequence[str]]], None],
    *,
    nvidia_smi: str | None = None,
    gpus: Sequence[str] | None = None,
    every: float = 2.0,
    timeout: float = 10.0,
) -> Latest[dict[int, list[str]]]:
    """Polls the compute processes every ``every`` seconds and hands them, by GPU index, to ``deliver``.

    A failed poll leaves the table without new processes (the stream reports its own errors).

    Args:
        deliver: called from the poller's thread with GPU index -> labels (:func:`process_label`).
        nvidia_smi: the binary (None: the usual search).
        gpus: only these GPUs.
        every: seconds between polls.
        timeout: seconds one poll may take.
    """
    users = ProcCache()  # /proc, checked to be the process nvidia-smi named (PID namespaces)

    def labels() -> dict[int, list[str]]:
        procs = processes(nvidia_smi=nvidia_smi, gpus=gpus or None, timeout=timeout)
        by_gpu: dict[int, list[str]] = {}
        for p in procs:
            if p.gpu_index is not None:
                user, _ = users.lookup(p.pid, p.process_name)
                by_gpu.setdefault(p.gpu_index, []).append(process_label(p, user))
        users.keep({(p.pid, p.process_name) for p in procs})
        return by_gpu

    return Latest(labels, every, name="listing the live table's processes", on_value=deliver)
