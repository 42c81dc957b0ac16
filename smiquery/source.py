"""What every sample source shares: sweeps, the latest-sweep publisher, events and counters.

A live :class:`~smiquery.streams.sync.Stream` and a :class:`~smiquery.recordings.playback.Replay` both implement
:class:`SampleSource`; consumers (CLI, exporter, training callbacks) only ever see that protocol.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from smiquery._log import get_logger
from smiquery.sample import GpuSample

if TYPE_CHECKING:
    from smiquery.fields import Field

__all__ = [
    "BaseSource",
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

    ``missing``: indices of known GPUs absent from it (a cut sweep, a dropped row, a GPU that dropped out);
    ``damaged``: a row inside it was rejected or the child ended mid-sweep; ``arrived``: ``time.monotonic()`` when a
    live stream read its last row (None in a replay): hold alerts and ages on this, never on nvidia-smi's wall-clock
    timestamps, which jump (DST, NTP steps).
    """

    missing: frozenset[int]
    damaged: bool
    arrived: float | None

    def __new__(  # noqa: D102
        cls, samples: Iterable[GpuSample] = (), *, missing: Iterable[int] = (), damaged: bool = False
    ) -> Sweep:
        self = super().__new__(cls, samples)
        self.missing = frozenset(missing)
        self.damaged = damaged
        self.arrived = None
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
    """Groups samples into sweeps, one instant each, for streams and replays alike.

    nvidia-smi prints one row per GPU in index order per iteration, with no boundary, so a new instant starts when a
    GPU index does not increase. Arrival is only a hint: a row whose index increases starts a new instant only when
    the reader waited at least 90 % of the interval for it (``idle``) and its timestamp does not place it in the
    current instant, so a slow row or a wall-clock step never splits a sweep.

    The known GPU set is learnt from the rows anew after :meth:`restart`, unless ``expected`` gives the indices (for
    ``-i 0,1``) or how many GPUs a whole sweep has. Once one whole cycle has been seen, a sweep is published as soon
    as every known GPU has its row, else when the next begins. ``interval`` None (replays): index order alone.
    """

    def __init__(self, expected: int | Iterable[int] = 0, *, interval: float | None = None) -> None:
        self.interval = interval
        self._hint = interval is not None and interval >= 0.5
        self._count = expected if isinstance(expected, int) else 0
        self._expected: tuple[int, ...] = () if isinstance(expected, int) else tuple(expected)
        self.restart()

    def restart(self) -> None:
        """A new child: forget the unfinished sweep and learn the GPU set anew (unless it was given)."""
        self.known: dict[int, None] = dict.fromkeys(self._expected)
        self.established = bool(self.known)
        self._current: list[GpuSample] = []
        self._present: set[int] = set()
        self._last_index: int | None = None
        self._last_time: datetime | None = None
        self._damaged = False
        self._closed_early_at: int | None = None

    def boundary(self, sample: GpuSample, idle: float | None = None) -> Sweep | None:
        """The current sweep, closed, if ``sample`` (waited for ``idle`` s; None: unknown) begins a new instant."""
        if not self._current:
            return None
        idx = sample.index
        new = idx is None or idx in self._present or (self._last_index is not None and idx <= self._last_index)
        if not new and self._hint and idle is not None and self.interval is not None and idle >= 0.9 * self.interval:
            ts, last = sample.timestamp, self._last_time
            try:  # unless its timestamp places it in the current instant
                new = ts is None or last is None or abs((ts - last).total_seconds()) >= 0.5 * self.interval
            except TypeError:  # naive against aware: no hint
                new = True
        if not new:
            return None
        if not self._damaged:
            self.established = True  # a whole cycle seen, none of its rows dropped: the known set is trustworthy
        return self._close(cut=False)

    def add(self, sample: GpuSample) -> Sweep | None:
        """Add ``sample`` to the current sweep; returns the sweep if that made it whole."""
        idx, early = sample.index, self._closed_early_at
        if not self._current and idx is not None and early is not None and idx > early and idx not in self.known:
            # A GPU never seen before, right after a sweep that looked whole: it belonged to that instant, which
            # was published too early. Flag this remainder instead of passing it off as an instant of its own.
            self._damaged = True
        self._closed_early_at = None
        self._current.append(sample)
        if idx is not None:
            self._present.add(idx)
            self.known.setdefault(idx, None)
        self._last_index = idx
        if "timestamp" in sample:
            self._last_time = sample.timestamp
        if idx is None:
            return self._close(cut=False)
        if not self.established and self._count and len(self._present) >= self._count:
            self.established = True
        if self.established and self._present.issuperset(self.known):
            sweep = self._close(cut=False)
            self._closed_early_at = idx
            return sweep
        return None

    def feed(self, sample: GpuSample, idle: float | None = None) -> list[Sweep]:
        """Add one sample; returns the sweeps it closed (the previous instant, and this one if it is whole)."""
        return [s for s in (self.boundary(sample, idle), self.add(sample)) if s is not None]

    def damage(self) -> None:
        """Mark the current sweep damaged: a row of this instant was rejected."""
        self._damaged = True

    def flush(self, *, cut: bool = True, absent: Collection[int] = ()) -> Sweep | None:
        """The unfinished sweep at the end of the input, if any.

        Damaged when ``cut`` (a crash, a kill) short of a known GPU's row, except those ``absent`` (known to be lost).
        """
        if not self._current:
            self._damaged = False
            return None
        return self._close(cut=cut, absent=absent)

    def _close(self, *, cut: bool, absent: Collection[int] = ()) -> Sweep:
        missing = [k for k in self.known if k not in self._present]
        damaged = self._damaged or (cut and (not self.established or any(k not in absent for k in missing)))
        sweep = Sweep(self._current, missing=missing, damaged=damaged)
        self._current = []
        self._present = set()
        self._last_index = None
        self._damaged = False
        return sweep


class BaseSource:
    """What every source shares: the event listeners, the error that ended it and its background thread."""

    on_event: Callable[[StreamEvent], None] | None = None
    #: The error that ended the source (it gave up, or its background thread failed), if any.
    error: BaseException | None = None
    _listeners: tuple[Callable[[StreamEvent], None], ...] = ()
    _thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[StreamEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every :class:`StreamEvent` from now on; returns a function that unsubscribes it.

        Callbacks run on the reading thread, so they must be quick; an exception in one is logged, never raised.
        """
        self._listeners = (*self._listeners, callback)

        def unsubscribe() -> None:
            self._listeners = tuple(c for c in self._listeners if c is not callback)

        return unsubscribe

    def _emit(self, events: Iterable[StreamEvent]) -> None:
        for event in events:
            for callback in filter(None, (self.on_event, *self._listeners)):
                try:
                    callback(event)
                except Exception:  # a monitor's callback must never break the source
                    get_logger().exception("smiquery: an event callback failed")

    @property
    def running(self) -> bool:
        """True while a background consumer thread is alive."""
        return self._thread is not None and self._thread.is_alive()


class LatestSweep(BaseSource):
    """A source of sweeps: the newest one (one reference, swapped whole: any thread reads it)."""

    stats: StreamStats
    _newest: tuple[Sweep, float] | None = None  # the sweep and its monotonic arrival time

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""
        got = self._newest
        return (None, None) if got is None else (got[0], time.monotonic() - got[1])


@dataclass(frozen=True)
class StreamEvent:
    """Something that happened to a source (``kind``), the ``error`` behind it, and the ``gpu`` and ``uuid`` concerned.

    ``detail`` is one line for people. The kinds: ``restart`` (a child is about to be started again), ``error``,
    ``recovered``, ``dropped_row``, ``short_sweep`` (a sweep without all known GPUs), ``gpu_lost``, ``gpu_back`` and
    ``gpu_renumbered`` (after a restart a GPU delivers under another index).
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

    ``rows`` samples delivered, ``sweeps`` published (``short_sweeps`` of them without all known GPUs or with a
    dropped row inside), ``starts`` of nvidia-smi children (``restarts`` after a failure), ``dropped_rows`` rejected
    by the parser, ``errors`` by class name. ``lost_gpus``: indices currently lost (a ``[GPU is lost]`` cell,
    nvidia-smi's message, or rows that stopped; not an index another GPU took after a restart: see ``lost_uuids``,
    UUID -> the index it last had), found ``gpu_lost_events`` times; ``known_gpus``: the newest whole sweep's
    indices -> UUIDs (when queried). ``last_error`` (one line) and ``last_error_type`` say the newest failure;
    ``state`` is ``starting``, ``running``, ``retrying``, ``ended`` (a finite source is done), ``closed`` or
    ``failed`` (gave up: the source's ``error`` says why). While failing: ``attempt`` (failed starts in the streak),
    ``next_retry_at`` (the next start's ``time.time()``) and ``permanent`` (a failure that needs a person).
    """

    rows: int = 0
    sweeps: int = 0
    short_sweeps: int = 0
    restarts: int = 0
    starts: int = 0
    dropped_rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_gpus: set[int] = field(default_factory=set)
    lost_uuids: dict[str, int | None] = field(default_factory=dict)
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
    """Anything that delivers samples over time (a live stream, a replay); consumers use only this.

    Iterate it for samples, call :meth:`sweeps` for whole instants, or :meth:`start` it in a background thread and
    read :meth:`latest` from any thread. Use it as a context manager (or call :meth:`close`).
    """

    fields: tuple[Field, ...]
    stats: StreamStats

    def __iter__(self) -> Iterator[GpuSample]: ...

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield sweeps (one instant each), stopping after ``count``."""

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""

    def start(self) -> SampleSource:
        """Consume in a background thread so :meth:`latest` stays fresh; returns self."""

    def subscribe(self, callback: Callable[[StreamEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every event (on the reading thread: be quick); returns the unsubscribe function."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop within ``timeout`` seconds: children reaped, background thread ended. Idempotent, any thread."""

    @property
    def running(self) -> bool:
        """True while a background consumer thread is alive."""

    @property
    def error(self) -> BaseException | None:
        """The error that ended the source, if any."""

    def __enter__(self) -> SampleSource: ...

    def __exit__(self, *exc: object) -> None: ...
