"""What /proc tells about the processes nvidia-smi lists: user, command line and CPU use."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcCache", "ProcInfo", "matches_process", "proc_info"]

_CPU_WINDOW = 0.1  # seconds between the two reads of a process's CPU time


@dataclass(frozen=True)
class ProcInfo:
    """What /proc tells about one process; None where it cannot (another PID namespace, no permission).

    Attributes:
        user: the owner's name (or uid).
        command: the command line.
        cpu_percent: CPU use over a short window, in percent of one core.
    """

    user: str | None = None
    command: str | None = None
    cpu_percent: float | None = None


def _cpu_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # the command name in brackets may hold spaces: the fields after it start at the last ')'
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (IndexError, ValueError):
        return None


def matches_process(name: str | None, proc: Path, argv: Sequence[str]) -> bool:
    """Whether /proc/PID is the process nvidia-smi named (in a container, PIDs are the host's)."""
    if not name:
        return True
    want = os.path.basename(name.split()[0]) if name.split() else name
    try:
        comm = (proc / "comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        comm = ""
    seen = {comm, *(os.path.basename(a) for a in argv[:2])}
    return any(want == s or (len(comm) == 15 and want.startswith(s)) for s in seen if s)


def _identity(pid: int, name: str | None) -> ProcInfo | None:
    """User and command line of ``pid``, or None when /proc cannot tell or it is another process than ``name``."""
    from smiquery.sources.pmon import process_user

    proc = Path(f"/proc/{pid}")
    try:
        raw = (proc / "cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    if not matches_process(name, proc, argv):
        return None  # another PID namespace: this pid is someone else here
    return ProcInfo(process_user(pid), " ".join(argv) or None)


def proc_info(processes: Mapping[int, str | None]) -> dict[int, ProcInfo]:
    """User, command line and CPU use of each pid (-> the name nvidia-smi gave it); all None where unreadable."""
    first: dict[int, int] = {}
    out: dict[int, ProcInfo] = {}
    start = time.monotonic()
    for pid, name in processes.items():
        info = _identity(pid, name)
        out[pid] = info or ProcInfo()
        ticks = _cpu_ticks(pid) if info is not None else None
        if ticks is not None:
            first[pid] = ticks
    if first:
        time.sleep(max(0.0, _CPU_WINDOW - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        hz = os.sysconf("SC_CLK_TCK")
        for pid, before in first.items():
            after = _cpu_ticks(pid)
            if after is not None and elapsed > 0:
                info = out[pid]
                out[pid] = ProcInfo(info.user, info.command, round(100.0 * (after - before) / hz / elapsed, 1))
    return out


class ProcCache:
    """User and full command line of each pid from /proc, read once per process (a pid seen again is cached)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str | None], ProcInfo | None] = {}

    def lookup(self, pid: int, name: str | None) -> tuple[str | None, str | None]:
        """(user, command line) of ``pid``; None for what /proc cannot tell or when it is another process."""
        key = (pid, name)
        if key not in self._known:
            self._known[key] = _identity(pid, name)
        info = self._known[key]
        return (info.user, info.command) if info is not None else (None, None)

    def keep(self, pids: set[tuple[int, str | None]]) -> None:
        """Forget processes no longer listed (their pids may be reused)."""
        for key in [k for k in self._known if k not in pids]:
            del self._known[key]
