"""The exporter's per-process source: ``nvidia-smi pmon``'s newest instant, cut to the busiest processes per GPU."""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smiquery.errors import StreamEndedError
from smiquery.retry import RetryPolicy
from smiquery.sources import pmon
from smiquery.sources.latest import Latest
from smiquery.streams.pmon import PmonStream, stream

if TYPE_CHECKING:
    import os

    from smiquery.source import StreamEvent
    from smiquery.streams.argv import GpusArg

__all__ = ["TOP_PROCESSES_BY", "PmonWatcher", "ProcessInstant", "process_instant"]


@dataclass(frozen=True)
class ProcessInstant:
    """One pmon instant as the exporter serves it: at most ``top`` processes per GPU plus one ``other`` row.

    ``rows``: ``(row, user)`` pairs, busiest first per GPU, ``other`` (``pid`` None) last; ``user`` is None where
    this host cannot see the process. ``processes``: GPU index -> processes pmon listed. ``wall``: when it was
    complete (epoch). ``by="name"``: one row per name and GPU (the lowest pid, no user).
    """

    rows: tuple[tuple[pmon.PmonRow, str | None], ...]
    processes: dict[int, int]
    wall: float
    by: str = "pid"


#: How ``--top-processes`` labels its series: ``name`` (bounded: one series per process name) or ``pid``.
TOP_PROCESSES_BY: tuple[str, ...] = ("name", "pid")


def _by_name(rows: tuple[pmon.PmonRow, ...]) -> tuple[pmon.PmonRow, ...]:
    """One row per (GPU, process name): the known values summed (None when none is known), idle lines kept."""
    groups: dict[tuple[int | None, str], list[pmon.PmonRow]] = {}
    out = [row for row in rows if row.idle]
    for row in rows:
        if not row.idle:
            groups.setdefault((row.gpu, row.command or ""), []).append(row)
    cols = ("sm", "mem", "enc", "dec", "jpg", "ofa", "fb", "ccpm")
    for members in groups.values():
        known = {col: [v for r in members if (v := getattr(r, col)) is not None] for col in cols}
        totals = {col: sum(values) if values else None for col, values in known.items()}
        out.append(min(members, key=lambda r: r.pid or 0)._replace(**totals))
    return tuple(out)


def process_instant(
    rows: Iterable[pmon.PmonRow], top: int, *, user_of: Callable[[int], str | None] = pmon.process_user, by: str = "pid"
) -> ProcessInstant:
    """One pmon instant cut to what the exporter serves, stamped now: the ``top`` busiest (by SM) per GPU, ``other``.

    ``by="name"`` sums the processes of one name on a GPU into one row first (so short-lived processes add no
    series) and keeps ``top`` names; ``user_of``: pid -> user name.
    """
    rows = tuple(rows)
    counts: dict[int, int] = {}
    for row in rows:
        if row.gpu is not None:
            counts[row.gpu] = counts.get(row.gpu, 0) + (0 if row.idle else 1)
    named = by == "name"
    kept = pmon.top_processes(_by_name(rows) if named else rows, top, by="sm")
    pairs = tuple(
        (row, None if row.pid is None or named else user_of(row.pid)) for gpu in sorted(kept) for row in kept[gpu]
    )
    return ProcessInstant(pairs, counts, time.time(), by)


class PmonWatcher:
    """Follows ``nvidia-smi pmon`` in a background ``Latest`` and keeps its newest instant, cut to the top processes.

    ``top`` processes per GPU are kept (at least 1), :func:`process_instant` cuts ``by`` name or pid; ``interval``
    is pmon's ``-d`` (1..10 s); pmon watches at most 4 ``gpus``; the newest instant is served until ``stale_after``
    seconds old (default ``max(4 * interval, 10)``). An error that needs a person (pmon or NVML unsupported) ends
    the stream: one warning, nothing served, a new stream tried every ``retry_after`` seconds. :meth:`close` reaps
    every child. ``user_of`` and ``make_stream`` are for tests. Raises ValueError (``top``, ``by``, ``interval``),
    NvidiaSmiNotFoundError and InvalidGpuIdError at once.
    """

    def __init__(
        self,
        top: int,
        *,
        interval: int = 1,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        stall_timeout: float | None = None,
        stale_after: float | None = None,
        retry_after: float = 300.0,
        user_of: Callable[[int], str | None] = pmon.process_user,
        make_stream: Callable[[], PmonStream] | None = None,
        by: str = "name",
    ) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError("the number of top processes must be a whole number >= 1")
        if by not in TOP_PROCESSES_BY:
            raise ValueError(f"top processes are labelled by {' or '.join(TOP_PROCESSES_BY)}, not {by!r}")
        self.top = top
        self.by = by
        self.interval = interval
        self.stale_after = float(stale_after) if stale_after is not None else max(4.0 * interval, 10.0)
        #: pmon's failures by error type: each restart's error, and each end of a stream
        self.errors: Counter[str] = Counter()
        self.last_error_type: str | None = None
        self._user_of = user_of
        self._lock = threading.Lock()
        self._closed = False
        self._make = make_stream or functools.partial(
            stream,
            gpus=gpus,
            interval=interval,
            select="um",
            options="DT",  # a new time stamp cuts an instant even when the set of processes changes
            nvidia_smi=nvidia_smi,
            stall_timeout=stall_timeout,
            # a permanent error is raised here, logged once and opened again every retry_after by the Latest
            retry=RetryPolicy(max_restarts=None, backoff_max=30.0, permanent_retry=None),
            on_event=self._on_event,
        )
        # made here, so that a bad interval, GPU id or binary fails the exporter's start, not a thread
        self._stream: PmonStream | None = self._make()
        self._made: PmonStream | None = self._stream
        self.poll: Latest[ProcessInstant] = Latest.following(
            self._instants, retry_after, name="nvidia-smi pmon", on_close=self._close_stream
        )

    def _on_event(self, event: StreamEvent) -> None:
        if event.kind == "error" and event.error is not None:
            self.errors[type(event.error).__name__] += 1
            self.last_error_type = type(event.error).__name__

    def _instants(self) -> Iterator[ProcessInstant]:
        """One stream's instants, cut to the top processes; its end is an error (pmon never ends by itself)."""
        with self._lock:
            made, self._made = self._made, None
        counted = self.errors.copy()
        new: PmonStream | None = None
        try:
            new = made if made is not None else self._make()
            with self._lock:
                if self._closed:
                    return  # never iterated: no child to reap
                self._stream = new
            for instant in new.samples():
                yield process_instant(instant, self.top, user_of=self._user_of, by=self.by)
        except Exception as exc:
            name = self.last_error_type = type(exc).__name__
            if self.errors[name] == counted[name]:
                self.errors[name] += 1  # raised without an error event (e.g. while starting the child)
            raise
        finally:
            if new is not None:
                new.close()
        if not self._closed:  # without -c pmon never ends by itself: the stream restarts it
            self.last_error_type = "StreamEndedError"
            raise StreamEndedError(list(new.argv), 0, "", "nvidia-smi pmon ended by itself")

    def _close_stream(self) -> None:
        with self._lock:
            self._closed = True
            current = self._stream
        if current is not None:
            current.close()

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``retrying`` (pmon restarts after an error), ``failed`` or ``closed``."""
        if self._closed:
            return "closed"
        snap = self.poll.get()
        if snap.error is not None:
            return "failed"
        s = self._stream
        st = str(s.stats.state) if s is not None else "starting"
        if st == "running" and snap.value is None:
            return "starting"
        return st if st in ("starting", "running", "retrying") else "failed"

    def fresh(self) -> ProcessInstant | None:
        """The newest instant when it is younger than ``stale_after`` and pmon still runs, else None."""
        got = self.poll.get().fresh(self.stale_after)
        return None if got is None or self.state in ("failed", "closed") else got

    def start(self) -> PmonWatcher:
        """Follow pmon in a background thread until :meth:`close`. Returns self."""
        self.poll.start()
        return self

    def close(self, timeout: float = 15.0) -> None:
        """Stop: the pmon child is reaped, the thread joined (up to ``timeout`` seconds). Idempotent; any thread."""
        self.poll.close(timeout)
