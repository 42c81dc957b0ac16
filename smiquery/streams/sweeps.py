"""What the CSV rows of a ``--query-gpu`` loop mean: samples, sweeps (one instant each) and which GPUs are there.

:class:`CsvRows` is the engine's interpreter for the CSV stream (every driver uses it, so sync, asyncio and replay
group and track GPUs alike). :class:`Identity` follows the GPUs by UUID (by index when UUIDs are not queried):

* the known set follows the newest undamaged sweep; a GPU absent from one is lost (one ``gpu_lost`` event naming
  its UUID and the index it had) until it delivers again (``gpu_back``);
* after a restart the GPU set may have changed (a driver reload, a reboot, a GPU that fell off the bus): a GPU
  that comes back under another index is renumbered, not lost, and no event ever names a GPU that is delivering;
* ``[GPU is lost]`` cells, and nvidia-smi's "GPU is lost" message for a bus id, mark a GPU lost at once.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import tzinfo

from smiquery._log import get_logger
from smiquery.fields import Field, FieldsArg, resolve_fields
from smiquery.retry import RetryPolicy
from smiquery.sample import BusKey, GpuSample, bus_key
from smiquery.source import LatestSweep, StreamEvent, StreamStats, Sweep, SweepGrouper
from smiquery.sources.query_gpu import CsvParser, is_message
from smiquery.streams.argv import GpusArg, build_argv, normalize_gpus
from smiquery.streams.engine import Engine

__all__ = ["CsvRows", "CsvSource", "Identity"]

log = get_logger("smiquery")

_LOST_MESSAGE = re.compile(r"device handle for GPU ([0-9A-Fa-f:.]+): GPU is lost", re.IGNORECASE)


class Identity:
    """Which GPUs are there and which are lost, by UUID (see the module docstring); kept in ``stats``."""

    def __init__(self, stats: StreamStats, emit: Callable[[StreamEvent], None]) -> None:
        self.stats = stats
        self._emit = emit
        self.index_of: dict[str, int | None] = {}  # key -> index, from the newest undamaged sweep
        self.lost: dict[str, int | None] = {}  # key -> the index it had
        self._bus: dict[BusKey | None, str] = {}  # bus key -> key
        self._said_lost: set[BusKey | None] = set()  # bus keys nvidia-smi called lost since the last sweep

    def message(self, line: str) -> None:
        """A driver message: remember a "GPU is lost" for its bus id."""
        found = _LOST_MESSAGE.search(line)
        if found:
            self._said_lost.add(bus_key(found.group(1)))

    def _resolve(self, sample: GpuSample) -> str | None:
        """The GPU's identity: its UUID when queried and known, else ``#index``.

        A lost GPU's row (``[GPU is lost]`` even in its UUID cell) keeps the UUID its index had.
        """
        uuid = sample.uuid if "uuid" in sample else None
        if isinstance(uuid, str) and uuid:
            return uuid
        idx = sample.index if "index" in sample else None
        if idx is not None and "uuid" in sample:
            for known, i in self.index_of.items():
                if i == idx and known[0] != "#":
                    return known
        return None if idx is None else f"#{idx}"

    def row(self, sample: GpuSample) -> None:
        """A data row: ``[GPU is lost]`` cells mark it lost; values from a lost GPU mean it is back."""
        if not sample.gpu_lost and not self.lost:
            return  # the common case, once a row
        key = self._resolve(sample)
        if key is None:
            return
        idx = sample.index
        if sample.gpu_lost:
            if key not in self.lost:
                self._lose(key, idx, "fell off the bus")
            return
        if key not in self.lost:
            return
        old = self.lost.pop(key)
        if old is not None and old not in self.lost.values():
            self.stats.lost_gpus.discard(old)
        uuid = None if key[0] == "#" else key
        self.stats.lost_uuids.pop(key, None)  # held by UUID only
        self.index_of[key] = idx
        detail = f"GPU {idx} reports values again"
        self._emit(StreamEvent("gpu_back", None, detail, idx, uuid))
        log.warning("smiquery: %s", detail)

    def sweep(self, sweep: Sweep) -> None:
        """An undamaged sweep: the GPUs absent from it are lost; the known set follows it."""
        present: dict[str, int | None] = {}
        delivering: set[int] = set()
        for s in sweep:
            key = self._resolve(s)
            if key is not None:
                present[key] = s.index
                if not s.gpu_lost and s.index is not None:
                    delivering.add(s.index)
                bus = s.get("pci.bus_id")
                if isinstance(bus, str) and bus:
                    self._bus[bus_key(bus)] = key
        if present == self.index_of and not self.lost and not self._said_lost:
            return  # the same GPUs as last time: nothing to say or publish
        said = {self._bus[b] for b in self._said_lost if b in self._bus}
        self._said_lost.clear()
        for key, idx in self.index_of.items():
            if key not in present and key not in self.lost:
                why = "nvidia-smi says it is lost" if key in said else "its rows stopped appearing"
                self._lose(key, idx, why)
        for key, idx in present.items():
            old = self.index_of.get(key, idx)
            if old != idx and key[0] != "#":
                detail = f"GPU {key} is now index {idx} (was {old}): the driver renumbered the GPUs"
                log.warning("smiquery: %s", detail)
                self._emit(StreamEvent("gpu_renumbered", None, detail, idx, key))
        self.index_of = {**{k: i for k, i in self.lost.items() if i not in present.values()}, **present}
        stats = self.stats
        stats.lost_gpus = {i for i in self.lost.values() if i is not None and i not in delivering}
        stats.lost_uuids = {k: i for k, i in self.lost.items() if k[0] != "#"}
        known: dict[int, str | None] = {}
        for key, idx in self.index_of.items():
            if idx is not None and (idx not in known or key in present):
                known[idx] = None if key[0] == "#" else key
        stats.known_gpus = known

    def _lose(self, key: str, idx: int | None, why: str) -> None:
        self.lost[key] = idx
        stats = self.stats
        stats.gpu_lost_events += 1
        uuid = None if key[0] == "#" else key
        if idx is not None:
            stats.lost_gpus.add(idx)
        if uuid is not None:
            stats.lost_uuids[uuid] = idx
        name = f"GPU {idx}" if uuid is None else f"GPU {idx} ({uuid})"
        detail = f"{name} is lost ({why})"
        self._emit(StreamEvent("gpu_lost", None, detail, idx, uuid))
        log.warning("smiquery: %s", detail)


class CsvRows:
    """The engine's interpreter for CSV rows: parse, group into sweeps, follow GPU identity, publish.

    ``expected`` are the GPU indices asked for with ``-i`` when all are indices (else the set is learnt);
    ``interval`` is :class:`~smiquery.source.SweepGrouper`'s arrival-gap hint.
    """

    what = "nvidia-smi"

    def __init__(
        self,
        fields: Sequence[Field],
        stats: StreamStats,
        emit: Callable[[StreamEvent], None],
        *,
        expected: Sequence[int] = (),
        interval: float | None = None,
        tz: tzinfo | None = None,
    ) -> None:
        self.fields = tuple(fields)
        self.stats = stats
        self._emit = emit
        self._tz = tz
        self.grouper = SweepGrouper(expected, interval=interval)
        self.identity = Identity(stats, emit)
        self.parser = CsvParser(self.fields, strict=False, tz=tz)
        self.messages: deque[str] = deque(maxlen=20)
        #: The newest sweep and its monotonic arrival time (one reference, swapped whole: any thread may read it).
        self.newest: tuple[Sweep, float] | None = None

    def child_started(self) -> None:
        """A new child: a fresh parser; the GPU set is learnt anew (it may have changed)."""
        self.parser = CsvParser(self.fields, strict=False, tz=self._tz)
        self.grouper.restart()

    def last_message(self) -> str | None:
        """The newest driver message."""
        return self.messages[-1] if self.messages else None

    def feed(self, lines: Sequence[str], now: float, idle: float | None, out: list[GpuSample | Sweep]) -> int:
        """Parse lines; append samples and the sweeps they close; return how many rows were parsed."""
        parser = self.parser
        grouper = self.grouper
        rows = 0
        for line in lines:
            if is_message(line):
                self.messages.append(line)
                self.identity.message(line)
                continue
            before = parser.dropped
            sample = parser.feed(line)
            if parser.dropped != before:
                self.stats.dropped_rows += 1
                grouper.damage()
                err = parser.last_error
                self._emit(StreamEvent("dropped_row", err, str(err) if err else "dropped row"))
            if sample is None:
                continue
            closed = grouper.boundary(sample, idle)
            idle = 0.0  # the other lines of this read waited for nothing
            if closed is not None:
                out.append(self._close(closed, now))
            self.identity.row(sample)
            whole = grouper.add(sample)
            out.append(sample)
            rows += 1
            if whole is not None:
                out.append(self._close(whole, now))
        return rows

    def cut(self, out: list[GpuSample | Sweep], now: float) -> None:
        """The child failed: its unfinished sweep, flagged short."""
        cut = self.grouper.flush(cut=True, absent=self.stats.lost_gpus)
        if cut is not None:
            out.append(self._close(cut, now))

    def _close(self, sweep: Sweep, now: float) -> Sweep:
        """Account for a closed sweep, follow identity, publish it."""
        sweep.arrived = now
        stats = self.stats
        if not sweep.damaged:
            self.identity.sweep(sweep)
        stats.sweeps += 1
        if sweep.damaged or bool(sweep.missing - stats.lost_gpus):
            stats.short_sweeps += 1
            gone = ", ".join(str(i) for i in sorted(sweep.missing))
            why = f"without GPU {gone}" if gone else "cut short"
            if sweep.damaged:
                why += " (a row was dropped or nvidia-smi ended mid-sweep)"
            self._emit(StreamEvent("short_sweep", None, f"short sweep: {why}"))
        self.newest = (sweep, now)
        return sweep


class CsvSource(LatestSweep):
    """What the thread and asyncio CSV streams share: checked arguments, counters, the rows' meaning, the engine.

    The arguments and errors are :func:`smiquery.stream`'s (``binary``: the located nvidia-smi; ``max_rows``: its
    ``max_samples``).
    """

    def __init__(
        self,
        fields: FieldsArg,
        *,
        interval: float,
        gpus: GpusArg,
        binary: str,
        startup_timeout: float,
        stall_timeout: float | None,
        retry: RetryPolicy | None,
        on_event: Callable[[StreamEvent], None] | None,
        tz: tzinfo | None,
        duration: float | None = None,
        max_rows: int | None = None,
    ) -> None:
        flds = resolve_fields(fields)
        if not any(f.name == "index" for f in flds):
            flds = (*resolve_fields(["index"]), *flds)  # sweeps are grouped by GPU index
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self.fields = flds
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self.argv = tuple(build_argv(binary, flds, self.gpus, interval=self.interval))
        self.stall_timeout = stall_timeout if stall_timeout is not None else max(3 * self.interval, 10.0)
        #: The :class:`~smiquery.retry.RetryPolicy` this stream runs under.
        self.retry_policy = retry if retry is not None else RetryPolicy()
        self.on_event = on_event
        self.stats = StreamStats()
        expected = [int(g) for g in self.gpus if g.isdigit()]
        events: list[StreamEvent] = []
        self._rows = CsvRows(
            flds,
            self.stats,
            events.append,
            expected=expected if len(expected) == len(self.gpus) else (),
            interval=self.interval,
            tz=tz,
        )
        self._engine: Engine[GpuSample | Sweep] = Engine(
            self._rows,
            self.argv,
            self.retry_policy,
            startup_timeout=startup_timeout,
            stall_timeout=self.stall_timeout,
            duration=duration,
            max_rows=max_rows,
            stats=self.stats,
            events=events,
        )

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""
        got = self._rows.newest
        return (None, None) if got is None else (got[0], time.monotonic() - got[1])
