"""Playback: a recording as a sample source, paced by its own timestamps like the original run.

:func:`replay` gives the samples one by one (:meth:`Replay.sweeps` groups them as a live stream does), so anything
that consumes a live stream can consume a recording. The format modules read the samples; this module selects,
projects and paces them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from datetime import datetime, timedelta, tzinfo
from itertools import chain, islice

from smiquery.clock import later, seconds_between
from smiquery.errors import ParseError, ReplayError
from smiquery.fields import Field, resolve_fields
from smiquery.frames import field_for
from smiquery.recordings.base import (
    RecordingFormat,
    Sources,
    check_file,
    detect_format,
    expand_sources,
    resolve_zone,
    time_order,
    with_gpu0,
    with_timestamp,
)
from smiquery.recordings.csvfile import read_csv_samples
from smiquery.recordings.jsonl import read_jsonl_samples
from smiquery.recordings.parquet import dataset_files, is_dataset, read_parquet_samples
from smiquery.recordings.recorder import recorded_zone
from smiquery.sample import GpuSample, Schema
from smiquery.source import LatestSweep, StreamStats, Sweep, SweepGrouper
from smiquery.streams.argv import GpusArg, normalize_gpus

__all__ = ["MAX_GAP_SECONDS", "Replay", "replay"]


#: The longest pause replay makes for one gap in a recording (a stream that was stopped and restarted).
MAX_GAP_SECONDS = 60.0


class Replay(LatestSweep):
    """Play a recording back as samples, paced by its recorded timestamps: a ``SampleSource`` like a live stream.

    ``for sweep in replay("run.csv", speed=0).sweeps(): ...``: iterate it for samples, or call :meth:`sweeps`, or
    :meth:`start` it in the background and read :meth:`latest`. ``replay`` is this class.

    Args:
        path: a CSV in nvidia-smi's ``--format=csv`` format (with its header), a JSONL file, a Parquet file or
            dataset folder as ``smiquery stream --output`` writes them; or several, or a glob (``"run*.csv"``): a
            rotated set plays as one recording, its files in the order of their first timestamps.
        speed: 2 plays twice as fast, 0 as fast as possible; gaps longer than :data:`MAX_GAP_SECONDS` (after
            scaling) are skipped.
        fields: only these fields (a preset, ``"a,b,c"`` or names); ``index`` is always kept. None: all.
        loop: start again at the end, shifting the timestamps so that time keeps moving forward.
        gpus: only these GPUs (indices, UUIDs or PCI bus ids).
        sleep: how to wait; default an interruptible wait that :meth:`close` ends.
        clock: monotonic seconds, for the pacing (tests inject one).
        columns: a headerless CSV log's columns, in order (a CSV with a header must then have exactly these).
        tz: the zone the recording was made in, as :func:`~smiquery.recordings.read_recording` takes it.

    Raises ReplayError when the file is missing, empty, not a recording (no header and no ``columns``), holds no
    readable row, or lacks a requested field (unreadable lines are skipped and counted in ``stats.dropped_rows``;
    :attr:`first_error` names the first); InvalidFieldError, InvalidGpuIdError, InvalidTimeZoneError for a bad
    ``fields``, ``gpus`` or ``tz``.
    """

    def __init__(
        self,
        path: Sources,
        *,
        speed: float = 1.0,
        fields: str | Sequence[str] | None = None,
        loop: bool = False,
        gpus: GpusArg = None,
        sleep: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        columns: str | Sequence[str] | None = None,
        tz: tzinfo | str | None = None,
    ) -> None:
        if speed < 0 or speed != speed:
            raise ValueError("speed must be 0 (as fast as possible) or more")
        self.paths = expand_sources(path, error=ReplayError)
        for p in self.paths:
            if not is_dataset(p):
                check_file(p, ReplayError)
        self.path = self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (+{len(self.paths) - 1} more)"
        self._columns = resolve_fields(columns) if columns is not None else None
        #: The zone timestamps are given in (``tz=``); None keeps them as recorded (naive when no zone was).
        self.tz: tzinfo | None = resolve_zone(tz)
        self.speed = float(speed)
        self.loop = loop
        self.format: RecordingFormat = "parquet" if is_dataset(self.paths[0]) else detect_format(self.paths[0])
        self.gpus = normalize_gpus(gpus)
        self._wanted = resolve_fields(fields) if fields is not None else None
        if self._wanted is not None and not any(f.name == "index" for f in self._wanted):
            self._wanted = (*resolve_fields(["index"]), *self._wanted)  # sweeps are grouped by GPU index
        self._schema = Schema(tuple(f.name for f in self._wanted or ()))
        self._stop = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop.wait
        self._clock = clock
        self.stats = StreamStats()
        #: The first line skipped as unreadable (a torn last line, garbage), with its line number.
        self.first_error: ParseError | None = None
        #: GPUs per sweep, from the first sweep of the recording (0 when it has no ``index`` column).
        self.gpu_count = 0
        if len(self.paths) > 1:  # a rotated set, in the order of its files' first timestamps, whatever their names
            firsts = [next(iter(self._one_file(p, None, lambda err: None)), None) for p in self.paths]
            self.paths = [self.paths[i] for i in time_order([s.timestamp if s is not None else None for s in firsts])]
        dropped: list[ParseError] = []
        first = self._peek(dropped.append)
        if first is None and self._columns is not None:
            columns = ",".join(f.name for f in self._columns)
            why = f" ({dropped[0]})" if dropped else ""
            raise ReplayError(
                f"recording {self.path}: no row fits the columns {columns}; give the log's columns, in order{why}"
            )
        if first is None:
            raise ReplayError(
                f"recording {self.path} holds no readable rows; is it a recording from `smiquery stream --output` "
                "or `nvidia-smi --query-gpu=... --format=csv`?"
            )
        self.recorded_fields: tuple[Field, ...] = tuple(field_for(n) for n in first.fields)
        self.fields: tuple[Field, ...] = self._wanted if self._wanted is not None else self.recorded_fields
        self._positions: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._projected(first)  # a recording that lacks a wanted field fails here
        self._gen = self._samples()

    def _on_drop(self, err: ParseError) -> None:
        if self.first_error is None:
            self.first_error = err
        self.stats.dropped_rows += 1
        self.stats.last_error = str(err)

    def _raw_samples(self, on_drop: Callable[[ParseError], None]) -> Generator[GpuSample, None, None]:
        fmt = self.format if len(self.paths) == 1 else None
        yield from with_gpu0(s for path in self.paths for s in self._one_file(path, fmt, on_drop))

    def _one_file(
        self, path: str, fmt: RecordingFormat | None, on_drop: Callable[[ParseError], None]
    ) -> Iterator[GpuSample]:
        zone = self.tz if self.tz is not None else recorded_zone(path)
        files: list[tuple[str, RecordingFormat]]
        if is_dataset(path):
            parts, journals = dataset_files(path)
            files = [(os.fspath(p), "parquet") for p in parts] + [(os.fspath(j), "jsonl") for j in journals]
        else:
            files = [(path, fmt or detect_format(path))]
        for name, kind in files:
            if kind == "parquet":
                yield from read_parquet_samples(name, zone)
                continue
            try:
                fh = open(name, encoding="utf-8", errors="replace", newline="")  # noqa: SIM115 - closed below
            except OSError as exc:
                raise ReplayError(f"cannot read recording {name}: {exc.strerror or exc}") from exc
            with fh:
                if kind == "jsonl":
                    yield from read_jsonl_samples(fh, on_drop, zone)
                else:
                    yield from read_csv_samples(fh, name, on_drop, self._columns, zone)

    def _peek(self, on_drop: Callable[[ParseError], None]) -> GpuSample | None:
        """The first sample, and the number of GPUs in the first sweep (into :attr:`gpu_count`)."""
        first: GpuSample | None = None
        seen: set[object] = set()
        with contextlib.closing(self._raw_samples(on_drop)) as samples:
            for sample in samples:
                if first is None:
                    first = sample
                if not self._select(sample):
                    continue
                idx = sample.index if "index" in sample else None
                if idx is None or idx in seen or len(seen) >= 4096:
                    break
                seen.add(idx)
        self.gpu_count = len(seen)
        return first

    def _select(self, sample: GpuSample) -> bool:
        if not self.gpus:
            return True
        keys = {str(sample.get(name)) for name in ("index", "uuid", "pci.bus_id") if name in sample}
        return any(g in keys for g in self.gpus)

    def _projected(self, sample: GpuSample) -> GpuSample:
        """The sample with the wanted fields only (its columns may change mid-file)."""
        if self._wanted is None:
            return sample
        schema = self._schema
        positions = self._positions.get(sample.fields)
        if positions is None:
            have = {n: i for i, n in enumerate(sample.fields)}
            lacking = [n for n in schema.names if n not in have]
            if lacking:
                raise ReplayError(
                    f"recording {self.path} has no {', '.join(lacking)}; it holds {', '.join(sample.fields)}"
                )
            positions = self._positions[sample.fields] = tuple(have[n] for n in schema.names)
        values = sample.values()
        raw = tuple(sample.raw.values())
        missing = {n: r for n, r in sample.missing.items() if n in schema.names}
        return GpuSample(
            schema,
            tuple(values[i] for i in positions),
            tuple(raw[i] for i in positions),
            missing or None,
            sample.gpu_lost,
        )

    def _samples(self) -> Generator[GpuSample, None, None]:
        shift = timedelta(0)
        anchor: tuple[float, datetime] | None = None
        while not self._stop.is_set():
            first_ts: datetime | None = None
            last_ts: datetime | None = None
            second_ts: datetime | None = None
            got = 0
            for sample in self._raw_samples(self._on_drop):
                if self._stop.is_set():
                    return
                if not self._select(sample):
                    continue
                sample = self._projected(sample)
                ts = sample.timestamp
                if ts is not None:
                    if first_ts is None:
                        first_ts = ts
                    elif second_ts is None and seconds_between(first_ts, ts) >= 0.05:
                        second_ts = ts
                    last_ts = ts
                    if shift:
                        ts = later(ts, shift)
                        sample = with_timestamp(sample, ts)
                    anchor = self._pace(anchor, ts)
                got += 1
                self.stats.rows += 1
                yield sample
            if not self.loop or got == 0:
                return
            if first_ts is not None and last_ts is not None:
                step = seconds_between(first_ts, second_ts) if second_ts is not None else 1.0
                shift += timedelta(seconds=seconds_between(first_ts, last_ts) + step)

    def _pace(self, anchor: tuple[float, datetime] | None, ts: datetime) -> tuple[float, datetime]:
        now = self._clock()
        if self.speed == 0 or anchor is None:
            return (now, ts)
        wall0, ts0 = anchor
        offset = seconds_between(ts0, ts) / self.speed
        delay = wall0 + offset - now
        if offset < 0 or delay > MAX_GAP_SECONDS:
            return (now, ts)  # time went backwards (start pacing afresh), or a long gap (skip it, not freeze)
        if delay > 0:
            self._sleep(delay)
        return anchor

    def __iter__(self) -> Iterator[GpuSample]:
        return self

    def __next__(self) -> GpuSample:
        return next(self._gen)

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield whole sweeps (one sample per GPU for one instant) as :meth:`Stream.sweeps` does; ``count`` at most."""
        grouper = SweepGrouper(self.gpu_count)
        whole = (sweep for sample in self for sweep in grouper.feed(sample))
        last = iter(lambda: grouper.flush(cut=False), None)  # the unfinished sweep at the end, if any
        for sweep in islice(chain(whole, last), count):
            self.stats.sweeps += 1
            if not sweep.complete:
                self.stats.short_sweeps += 1
            self._newest = (sweep, time.monotonic())
            yield sweep

    def close(self, timeout: float = 5.0) -> None:
        """Stop: wake a paced wait and end the iteration (a background thread within ``timeout`` s). Any thread."""
        self._stop.set()
        with contextlib.suppress(ValueError):  # running in another thread: it sees the stop flag next sample
            self._gen.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Replay:
        """Play in a background thread, so that :meth:`latest` follows the recording. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._play, name="smiquery-replay", daemon=True)
            self._thread.start()
        return self

    def _play(self) -> None:
        self.stats.state = "running"
        try:
            for _ in self.sweeps():
                if self._stop.is_set():
                    break
        except BaseException as exc:  # kept for the owner; a background thread must not die silently
            self.error = exc
            self.stats.state = "failed"
            return
        self.stats.state = "closed" if self._stop.is_set() else "ended"


#: ``replay(...)`` is ``Replay(...)``.
replay = Replay
