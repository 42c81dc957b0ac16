"""What every sample source shares: sweeps, the latest-sweep publisher, events and counters.

A live :class:`~smiquery.supervisor.Stream` and a :class:`~smiquery.playback.Replay` both implement
:class:`SampleSource`; consumers (CLI, exporter, training callbacks) only ever see that protocol.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from smiquery.records import GpuSample

__all__ = ["LatestSweep", "StreamEvent", "StreamStats", "Sweep", "SweepGrouper"]


class Sweep(tuple[GpuSample, ...]):
    """All GPUs' samples for one instant (one iteration of nvidia-smi's loop), in nvidia-smi's order."""

    __slots__ = ()

    @property
    def timestamp(self) -> datetime | None:
        """The first sample's timestamp (when queried)."""
        return self[0].timestamp if self else None

    def by_index(self) -> dict[int | None, GpuSample]:
        """The samples keyed by GPU index."""
        return {s.index: s for s in self}


class SweepGrouper:
    """Groups samples into sweeps (one sample per GPU for one instant), for streams and replays alike.

    A sweep is complete when it holds as many GPUs as the first complete sweep did (or ``expected``), or when a
    GPU index repeats.

    Args:
        expected: the number of GPUs per sweep, when known in advance.
    """

    def __init__(self, expected: int = 0) -> None:
        self.expected = expected
        self._current: list[GpuSample] = []
        self._seen: set[int | None] = set()

    def feed(self, sample: GpuSample) -> list[Sweep]:
        """Add one sample; returns the sweeps it completed (zero, one, or two for one-GPU sweeps)."""
        done: list[Sweep] = []
        idx = sample.index if "index" in sample else None
        if idx in self._seen:
            done.append(Sweep(self._current))
            self.expected = self.expected or len(self._current)
            self._current, self._seen = [], set()
        self._current.append(sample)
        self._seen.add(idx)
        if self.expected and len(self._current) >= self.expected:
            done.append(Sweep(self._current))
            self._current, self._seen = [], set()
        return done

    def flush(self) -> Sweep | None:
        """The unfinished sweep at the end of the input, if any."""
        if not self._current:
            return None
        sweep = Sweep(self._current)
        self._current, self._seen = [], set()
        return sweep

    @property
    def pending(self) -> int:
        """Samples waiting for their sweep to complete."""
        return len(self._current)


class LatestSweep:
    """The newest complete sweep, published by the reading thread and read from any thread without blocking."""

    _lock: threading.Lock
    _latest: tuple[Sweep, float] | None
    stats: StreamStats

    def _publish(self, sweep: Sweep) -> None:
        self.stats.sweeps += 1
        with self._lock:
            self._latest = (sweep, time.monotonic())

    def _group(
        self, samples: Iterable[GpuSample], grouper: SweepGrouper, count: int | None, *, flush: bool
    ) -> Iterator[Sweep]:
        """Group ``samples`` into sweeps, publishing each; stop after ``count``; ``flush`` yields a last partial one."""
        done = 0
        for sample in samples:
            for sweep in grouper.feed(sample):
                self._publish(sweep)
                yield sweep
                done += 1
                if count is not None and done >= count:
                    return
        last = grouper.flush() if flush else None
        if last is not None:
            self._publish(last)
            yield last

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest complete sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""
        with self._lock:
            got = self._latest
        if got is None:
            return None, None
        return got[0], time.monotonic() - got[1]


@dataclass(frozen=True)
class StreamEvent:
    """Something that happened to a stream: ``restart``, ``error``, ``dropped_row``, ``gpu_lost``, ``gpu_back``.

    Attributes:
        kind: what happened.
        error: the error behind it, if any.
        detail: one line for people.
        gpu: the GPU index concerned, if any.
    """

    kind: str
    error: BaseException | None = None
    detail: str = ""
    gpu: int | None = None


@dataclass
class StreamStats:
    """Counters of a stream, for monitors and exporters.

    Attributes:
        rows: samples delivered.
        sweeps: complete sweeps seen.
        restarts: nvidia-smi children restarted after a failure.
        starts: nvidia-smi children started in all.
        dropped_rows: rows rejected by the parser (garbage, truncated, wrong column count).
        errors: failures by error class name.
        lost_gpus: indices currently reported as ``[GPU is lost]``.
        last_error: the newest failure, as one line.
    """

    rows: int = 0
    sweeps: int = 0
    restarts: int = 0
    starts: int = 0
    dropped_rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_gpus: set[int] = field(default_factory=set)
    last_error: str | None = None
