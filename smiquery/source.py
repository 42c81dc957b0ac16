"""What every sample source shares: sweeps, the latest-sweep publisher, events and counters.

A live :class:`~smiquery.supervisor.Stream` and a :class:`~smiquery.playback.Replay` both implement
:class:`SampleSource`; consumers (CLI, exporter, training callbacks) only ever see that protocol.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from smiquery.records import GpuSample

if TYPE_CHECKING:
    from smiquery.fields import Field

__all__ = [
    "EventKind",
    "LatestSweep",
    "SampleSource",
    "SourceState",
    "StreamEvent",
    "StreamStats",
    "Sweep",
    "SweepGrouper",
]


class Sweep(tuple[GpuSample, ...]):
    """All GPUs' samples for one instant (one iteration of nvidia-smi's loop), in nvidia-smi's order.

    A sweep never mixes instants. It may be short: ``missing`` names the GPU indices the source knows of that
    have no row in it (a cut sweep, a dropped row, a GPU that dropped out), and ``complete`` is False then.

    Attributes:
        missing: indices of known GPUs absent from this sweep.
        damaged: True when a row inside this sweep was rejected by the parser or the child ended mid-sweep.
    """

    missing: frozenset[int]
    damaged: bool

    def __new__(  # noqa: D102
        cls, samples: Iterable[GpuSample] = (), *, missing: Iterable[int] = (), damaged: bool = False
    ) -> Sweep:
        self = super().__new__(cls, samples)
        self.missing = frozenset(missing)
        self.damaged = damaged
        return self

    @property
    def complete(self) -> bool:
        """True when every known GPU has its row and no row of this instant was dropped."""
        return not self.missing and not self.damaged

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


EventKind = Literal["restart", "error", "recovered", "dropped_row", "short_sweep", "gpu_lost", "gpu_back"]


@dataclass(frozen=True)
class StreamEvent:
    """Something that happened to a source.

    Kinds: ``restart`` (a child is about to be started again; ``detail`` says when and why), ``error`` (a
    failure, ``error`` holds it), ``recovered`` (data flows again after errors), ``dropped_row`` (a line the
    parser rejected), ``short_sweep`` (a sweep without all known GPUs), ``gpu_lost`` and ``gpu_back``.

    Attributes:
        kind: what happened.
        error: the error behind it, if any.
        detail: one line for people.
        gpu: the GPU index concerned, if any.
        uuid: that GPU's UUID, when known.
    """

    kind: str
    error: BaseException | None = None
    detail: str = ""
    gpu: int | None = None
    uuid: str | None = None


SourceState = Literal["starting", "running", "retrying", "ended", "closed", "failed"]


@dataclass
class StreamStats:
    """Counters and retry state of a source, for monitors and exporters (read from any thread).

    Attributes:
        rows: samples delivered.
        sweeps: sweeps published (complete or short).
        short_sweeps: sweeps published without all known GPUs, or with a dropped row inside.
        restarts: nvidia-smi children restarted after a failure.
        starts: nvidia-smi children started in all.
        dropped_rows: lines rejected by the parser (garbage, truncated, wrong column count).
        errors: failures by error class name.
        lost_gpus: indices currently lost: ``[GPU is lost]`` cells, nvidia-smi's "GPU is lost" message, or rows
            that stopped appearing.
        gpu_lost_events: how many times a GPU was found lost.
        known_gpus: every GPU index seen, with its UUID when ``uuid`` is queried.
        last_error: the newest failure, as one line.
        last_error_type: its exception class name.
        state: ``starting``, ``running``, ``retrying`` (waiting to start again), ``ended`` (a finite source is
            done), ``closed`` or ``failed`` (gave up; ``error`` on the source says why).
        attempt: failed starts in the current failure streak (0 while healthy).
        next_retry_at: wall-clock time (``time.time()``) of the next start while retrying, else None.
        permanent: True while the current failure is one that needs a person (driver mismatch, NVML missing...).
    """

    rows: int = 0
    sweeps: int = 0
    short_sweeps: int = 0
    restarts: int = 0
    starts: int = 0
    dropped_rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_gpus: set[int] = field(default_factory=set)
    gpu_lost_events: int = 0
    known_gpus: dict[int, str | None] = field(default_factory=dict)
    last_error: str | None = None
    last_error_type: str | None = None
    state: SourceState = "starting"
    attempt: int = 0
    next_retry_at: float | None = None
    permanent: bool = False


@runtime_checkable
class SampleSource(Protocol):
    """Anything that delivers samples over time; consumers (CLI, exporter, training monitors) use only this.

    Implemented by a live :class:`~smiquery.supervisor.Stream` and a :class:`~smiquery.playback.Replay`.

    Iterate it for samples (one per GPU per instant), call :meth:`sweeps` for whole instants, or :meth:`start`
    it in a background thread and read :meth:`latest` from any thread. ``stats`` is always readable;
    :meth:`subscribe` hears each :class:`StreamEvent`. Use it as a context manager (or call :meth:`close`).
    """

    fields: tuple[Field, ...]
    stats: StreamStats

    def __iter__(self) -> Iterator[GpuSample]: ...

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield sweeps (one instant each), stopping after ``count``."""
        ...

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""
        ...

    def start(self) -> SampleSource:
        """Consume in a background thread so :meth:`latest` stays fresh; returns self."""
        ...

    def subscribe(self, callback: Callable[[StreamEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every event (off the caller's thread, never raising into the source).

        Returns:
            A function that unsubscribes.
        """
        ...

    def close(self, timeout: float = 5.0) -> None:
        """Stop within ``timeout`` seconds: children reaped, background thread ended. Idempotent, any thread."""
        ...

    @property
    def running(self) -> bool:
        """True while a background consumer thread is alive."""
        ...

    @property
    def error(self) -> BaseException | None:
        """The error that ended the source, if any."""
        ...

    def __enter__(self) -> SampleSource: ...

    def __exit__(self, *exc: object) -> None: ...
