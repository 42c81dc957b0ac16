"""A recording read for the report: one frame, then one view per GPU along its own timeline (steps back count 0)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from typing import TYPE_CHECKING, Any, cast

from smiquery.analysis.series import as_float, axis_clock, gpu_rows
from smiquery.clock import timeline, to_zone
from smiquery.errors import InvalidFieldError, InvalidTimeZoneError, RecordingError, ReportError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = ["GpuSeries", "load_recording", "split_gpus"]


def load_recording(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | pd.DataFrame,
    *,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """A recording as a DataFrame with the columns of :func:`smiquery.frames.to_dataframe`, one row per sample.

    Files are read by :func:`smiquery.recordings.read_recording` (unreadable lines skipped and described in
    ``attrs["skipped"]``; a log without ``index`` is GPU 0); rows without a timestamp or GPU index are dropped.

    Args:
        source: a path (``.csv``, ``.jsonl``, ``.parquet`` file or dataset folder; other names are sniffed), several
            paths or a glob (``"run*.csv"``: a rotated set, read as one recording in time order), or a DataFrame.
        fields: the columns of a headerless CSV log, in order; for a recording with a header (or JSONL, Parquet)
            each must be one of its columns.
        tz: the zone the recording was made in (e.g. ``"Europe/Berlin"``): naive timestamps are localized to it,
            aware ones converted. Default: as recorded (naive for nvidia-smi's CSV, never assumed to be UTC).

    Raises:
        ReportError: the file is missing, unreadable, holds no readable row, has no ``timestamp``, or its
            columns do not agree with ``fields``.
        InvalidTimeZoneError: an unknown zone name in ``tz``.
    """
    import numpy as np
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        df = source
        if "index" not in df.columns:
            df = df.assign(index=pd.Series(np.zeros(len(df), dtype=np.int64), index=df.index, dtype="Int64"))
        if tz is not None and "timestamp" in df.columns:
            from smiquery.frames import set_zone
            from smiquery.recordings import resolve_zone

            df = df.copy(deep=False)
            set_zone(df, resolve_zone(tz))  # naive times localized (a repeated hour by row order), aware converted
    else:
        from smiquery.recordings import read_recording

        try:
            df = read_recording(source, fields=fields, tz=tz)
        except RecordingError as exc:
            raise ReportError(str(exc)) from exc
        except (InvalidFieldError, InvalidTimeZoneError):
            raise
        except (OSError, ValueError, ImportError) as exc:
            name = (
                os.fspath(source) if isinstance(source, (str, os.PathLike)) else ", ".join(os.fspath(p) for p in source)
            )
            raise ReportError(f"cannot read recording {name}: {exc}") from exc
    if "timestamp" not in df.columns:
        raise ReportError("the recording has no timestamp column; record with fields that include timestamp")
    bad = df["index"].isna() | df["timestamp"].isna()
    if bad.any():
        df = df[~bad].reset_index(drop=True)
    return df


@dataclass(eq=False)
class GpuSeries:
    """One GPU's samples: their row positions in the frame, times (s from the run's start) and durations.

    The frame is not split or copied: columns are read through the row positions (``rows``: a slice when the frame
    holds the GPU's rows together). ``stamps`` are wall-clock (naive) or UTC (with ``zone``) datetime64; they
    become ``datetime`` objects only where a stretch starts or ends. ``dur``: the time each sample stands for.
    """

    index: int
    df: pd.DataFrame
    _floats: Callable[[str], np.ndarray]  # the whole frame's column as float64, converted once for every GPU
    rows: Any
    times: np.ndarray
    stamps: np.ndarray
    zone: Any
    dur: np.ndarray
    gap_limit: float

    @property
    def columns(self) -> pd.Index:
        """The frame's columns."""
        return self.df.columns

    def stamp(self, i: int) -> datetime:
        """The time of sample ``i`` as a ``datetime`` (aware when the recording names its zone)."""
        import pandas as pd

        ts = cast(datetime, pd.Timestamp(self.stamps[i]).to_pydatetime())
        # to_zone: a time of a fall-back's repeated hour keeps its instant when compared or subtracted
        return ts if self.zone is None else to_zone(ts.replace(tzinfo=timezone.utc), self.zone)

    def floats(self, column: str) -> np.ndarray:
        """A numeric column as float64, NaN where missing."""
        picked: np.ndarray = self._floats(column)[self.rows]
        return picked

    def values(self, column: str) -> pd.Series:
        """A column's values (for text comparisons)."""
        picked: pd.Series = self.df[column].iloc[self.rows]
        return picked

    def seconds(self, first: Any, last: Any) -> Any:
        """How long the stretches from samples ``first`` to ``last`` (positions or arrays of them) last."""
        return self.times[last] - self.times[first] + self.dur[last]


def split_gpus(df: pd.DataFrame) -> tuple[list[GpuSeries], float]:
    """The recording as one :class:`GpuSeries` per GPU (in index order), and the median sampling interval."""
    import numpy as np

    zone = getattr(df["timestamp"].dt, "tz", None)
    stamps = axis_clock(df["timestamp"])  # wall-clock (naive) or UTC
    seconds = (stamps - stamps.min()).astype("int64") / 1e9
    floats = functools.cache(lambda column: as_float(df[column]))
    parts = []
    intervals: list[float] = []
    for idx, rows in gpu_rows(df["index"].to_numpy(dtype="int64")):
        # along the GPU's rows in file order, a step back of the clock counts 0: no duration is ever negative
        own = stamps[rows]
        times = seconds[rows][0] + timeline(own) if len(own) else seconds[rows]
        if len(times) > 1:
            intervals.append(float(np.median(np.diff(times))))
        parts.append((idx, rows, times))
    interval = float(np.median(intervals)) if intervals else 1.0
    if not interval > 0:
        interval = 1.0
    gap_limit = max(3 * interval, 5.0)
    gpus = []
    for idx, rows, times in parts:
        nxt = np.diff(times, append=times[-1] + interval) if len(times) else np.array([])
        # a sample stands for the time to the next one, except across a gap (the stream was stopped)
        dur = np.where(nxt > gap_limit, interval, nxt)
        gpus.append(GpuSeries(idx, df, floats, rows, times, stamps[rows], zone, dur, gap_limit))
    return gpus, interval
