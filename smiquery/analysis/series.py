"""A recording read for the report and the plot, one view per GPU of it, and the helpers both draw on.

Each GPU runs along its own timeline (a step back of the clock counts 0); helpers give numbers, GPUs' rows, times, a
line's points, text measures and the scene a plot draws.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from itertools import pairwise
from typing import TYPE_CHECKING, Any, cast

from smiquery.clock import REPORTED_STEP_BACK, timeline, to_zone
from smiquery.errors import InvalidFieldError, InvalidTimeZoneError, RecordingError, ReportError
from smiquery.fields import CATALOGUE, Field

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = [
    "ALERT_SHADE",
    "GPU_COLOURS",
    "GRID",
    "STALL_SHADE",
    "THRESHOLD_COLOUR",
    "GpuSeries",
    "Scene",
    "as_float",
    "axis_clock",
    "catalogue_field",
    "draw_notes",
    "gpu_rows",
    "line_points",
    "load_recording",
    "merged",
    "split_gpus",
    "stack_labels",
    "text_size",
    "threshold_notes",
]

_BY_ATTR: dict[str, Field] = {f.attr: f for f in CATALOGUE}

#: Eight colours with no look-alike pair (tab10 without its grey and olive), the ``k``-th GPU drawn the ``k % 8``-th.
GPU_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
STALL_SHADE = "#9e9e9e"
ALERT_SHADE = "#f4a582"
THRESHOLD_COLOUR = "#000000"
GRID = "#dddddd"


@dataclass
class Scene:
    """What every plot layout draws: per GPU (in index order) its times and each field's values; what to shade.

    ``xs``: per GPU its times on the axis's clock (:func:`axis_clock`); ``values``: per field name, per GPU its values
    (NaN where missing); ``thresholds``: per field name its rules' thresholds as (value, label); ``stalls``: (start,
    end, GPU index) on the axis's clock, ``alerts`` the same per field of a firing rule; spans closer than ``slack``
    are drawn (and labelled) as one; ``names``: a fleet frame's :class:`~smiquery.analysis.model.GpuName` by index;
    ``max_points``: the most points of a line (a heatmap: the most columns of cells).
    """

    flds: Sequence[Field]
    gpus: list[int]
    xs: list[np.ndarray]
    values: dict[str, list[np.ndarray]]
    thresholds: dict[str, list[tuple[float, str]]]
    stalls: list[tuple[Any, Any, int]]
    alerts: dict[str, list[tuple[Any, Any, int]]]
    x_range: tuple[Any, Any]
    zone: Any
    gap_limit: float
    slack: Any
    names: dict[int, Any]
    max_points: int


def merged(spans: Iterable[tuple[Any, Any, int]], slack: Any) -> list[tuple[Any, Any, list[int]]]:
    """(start, end, gpu) spans that overlap, or lie within ``slack`` of each other, merged into (start, end, gpus)."""
    out: list[tuple[Any, Any, list[int]]] = []
    for start, end, gpu in sorted(spans, key=lambda s: s[0]):
        if out and start <= out[-1][1] + slack:
            s0, e0, gs = out[-1]
            out[-1] = (s0, max(e0, end), sorted({*gs, gpu}))
        else:
            out.append((start, end, [gpu]))
    return out


def catalogue_field(name: str) -> Field | None:
    """The catalogue's field for a column (``memory_used``) or an nvidia-smi name (``memory.used``); None if unknown."""
    return _BY_ATTR.get(name.replace(".", "_"))


def as_float(series: pd.Series) -> np.ndarray:
    """A column as float64, NaN where missing (booleans as 0.0 and 1.0)."""
    import numpy as np

    if series.dtype.kind == "b" or str(series.dtype) == "boolean":
        series = series.astype("Float64")
    try:
        return np.asarray(series.to_numpy(dtype="float64", na_value=np.nan), dtype="float64")
    except (TypeError, ValueError):
        return np.asarray(series.astype("Float64").to_numpy(dtype="float64", na_value=np.nan), dtype="float64")


def gpu_rows(index: np.ndarray) -> list[tuple[int, Any]]:
    """(GPU index, its row positions) per GPU in index order: slices when the frame holds each GPU's rows together."""
    import numpy as np

    if len(index) > 1 and not bool((index[1:] >= index[:-1]).all()):
        order = np.argsort(index, kind="stable")  # file order within each GPU
        parts = np.split(order, np.flatnonzero(np.diff(index[order])) + 1)
        return [(int(index[p[0]]), p) for p in parts]
    edges = [0, *(np.flatnonzero(np.diff(index)) + 1).tolist(), len(index)]
    return [(int(index[a]), slice(a, b)) for a, b in pairwise(edges)]


def axis_clock(stamps: pd.Series) -> np.ndarray:
    """Timestamps as a plot's time axis holds them, naive datetime64[ns]: the recorded wall clock, or UTC in a zone.

    In a zone the instants never repeat (a fall-back's second 02:30 comes after the first).
    """
    import numpy as np

    if getattr(stamps.dt, "tz", None) is not None:
        stamps = stamps.dt.tz_convert("UTC").dt.tz_localize(None)
    return np.asarray(stamps.to_numpy(dtype="datetime64[ns]"))


def line_points(
    x: np.ndarray, y: np.ndarray, gap_limit: float, max_points: int, envelope: bool = False, band: bool = False
) -> tuple[np.ndarray, ...]:
    """(x, y): x (naive datetime64) and y (float, NaN where missing or across a gap in time) for one GPU's line.

    Past ``max_points`` samples, each bucket of samples (about a pixel wide) becomes its mean, or with ``envelope``
    its lowest and highest value at their own times (two points a bucket), so that a one-sample spike still shows.
    With ``band``, a line of means comes as (x, y, lows, highs): each bucket's lowest and highest value, drawn as a
    band around it so that what the mean hides (a memory drop to 1 MiB every ten minutes of a 34-hour run) shows.
    """
    import numpy as np

    extremes: list[np.ndarray] = []
    if len(x) > max_points:
        # Means by default: in a panel of several GPUs a noisy line (or its envelope) covers the others, so the overlay
        # draws each bucket's extremes as a band; a panel of its own (small multiples) the envelope.
        step = math.ceil((2 if envelope else 1) * len(x) / max_points)
        n = (len(x) // step) * step
        blocks = y[:n].reshape(-1, step)
        present = ~np.isnan(blocks)
        if envelope:
            lows = np.where(present, blocks, np.inf).argmin(axis=1)
            highs = np.where(present, blocks, -np.inf).argmax(axis=1)
            # each bucket's two extremes in time order: positions into the samples, then their values
            picks = (np.sort(np.stack((lows, highs), axis=1), axis=1) + np.arange(0, n, step)[:, None]).ravel()
            values = y[picks]
            values[np.repeat(~present.any(axis=1), 2)] = np.nan
            x, y = np.concatenate((x[picks], x[n:])), np.concatenate((values, y[n:]))
        else:
            counts = present.sum(axis=1)
            means = np.full(len(counts), np.nan)
            np.divide(np.where(present, blocks, 0.0).sum(axis=1), counts, out=means, where=counts > 0)
            if band:  # NaN where all are missing
                extremes = [np.concatenate((f.reduce(blocks, axis=1), y[n:])) for f in (np.fmin, np.fmax)]
            x, y = np.concatenate((x[:n:step], x[n:])), np.concatenate((means, y[n:]))
        # points now stand up to two buckets apart: only a longer pause in time is a gap
        gap_limit *= step
    x, (y, *extremes) = _broken(x, [y, *extremes], gap_limit)
    return x, y, *extremes


def _broken(x: np.ndarray, ys: list[np.ndarray], gap_limit: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """A NaN point inside each gap in time and at each step back of the clock, so a line breaks there."""
    import numpy as np

    if len(x) > 1:
        secs = np.diff(x).astype("timedelta64[ns]").astype("float64") / 1e9
        # a step back of the recorded clock (a DST fall-back, an NTP step) breaks the line too: never drawn backwards
        back = secs < -REPORTED_STEP_BACK
        gaps = np.nonzero((secs > gap_limit) | back)[0]
        if len(gaps):
            # at a step back, the break sits on its first side
            mids = np.where(back[gaps], x[gaps], x[gaps] + (x[gaps + 1] - x[gaps]) // 2)
            x = np.insert(x, gaps + 1, mids)
            ys = [np.insert(y, gaps + 1, np.nan) for y in ys]
    return x, ys


#: A label's box for :func:`stack_labels`; a note: its text, font size and the rest of its style (:func:`draw_notes`).
Box = tuple[float, float, float, Sequence[float]]
Note = tuple[str, float, dict[str, Any]]


def text_size(text: str, fontsize: float) -> tuple[float, float]:
    """(width, height) in points of one line of ``text`` in matplotlib's default font (height: its line height)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    width, _, _ = text_to_path.get_text_width_height_descent(text, FontProperties(size=fontsize), ismath=False)
    return float(width), 1.2 * fontsize


def stack_labels(boxes: Sequence[Box], area: tuple[float, float, float, float]) -> list[tuple[float, float] | None]:
    """Where each label goes, (left, top), so that no two overlap and each stays inside ``area``; None if none fits.

    ``boxes``: per label, in the order of priority, (left, width, height, the tops it would rather have, best first);
    ``area``: (left, bottom, right, top); all in points, y upwards. Failing its wishes, a label takes the highest top
    below its first that fits; one that would run past the right edge is moved left.
    """
    x_lo, y_lo, x_hi, y_hi = area
    placed: list[tuple[float, float, float, float]] = []  # (x0, y0, x1, y1)
    out: list[tuple[float, float] | None] = []

    def clear(x0: float, x1: float, top: float, height: float) -> bool:
        if top > y_hi + 1e-6 or top - height < y_lo - 1e-6:
            return False
        return all(x1 <= a0 or x0 >= a1 or top - height >= b1 or top <= b0 for a0, b0, a1, b1 in placed)

    for left, width, height, wanted in boxes:
        x0 = max(x_lo, min(left, x_hi - width))  # moved in from the right edge, never past the left one
        x1 = x0 + width
        tops = [min(t, y_hi) for t in wanted]
        # then under each label in the way of the first wish, highest first
        tops += sorted((b0 for a0, b0, a1, _ in placed if not (x1 <= a0 or x0 >= a1) and b0 <= tops[0]), reverse=True)
        top = next((t for t in tops if clear(x0, x1, t, height)), None)
        if top is not None:
            placed.append((x0, top - height, x1, top))
        out.append(None if top is None else (x0, top))
    return out


_PLACED = {"textcoords": "offset points", "ha": "left", "va": "top"}
_NOTE_BOX = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}


def threshold_notes(
    marks: Sequence[tuple[float, str]],
    size: float,
    y_of: Callable[[float], float],
    room: float = math.inf,
    **style: Any,
) -> tuple[list[Note], list[Box]]:
    """Threshold lines' labels and their boxes for :func:`stack_labels`, at the panel's left edge under the line.

    ``y_of(value)``: the line's height in points up the panel; a label wider than ``room`` points is cut short.
    """
    notes: list[Note] = []
    boxes: list[Box] = []
    for value, text in marks:
        width, height = text_size(text, size)
        while width > room and len(text) > 1:
            text = text[: max(1, int(len(text) * room / width) - 1)].rstrip() + "…"
            width, height = text_size(text, size)
        y = y_of(value)
        notes.append((text, size, {"color": THRESHOLD_COLOUR, "bbox": _NOTE_BOX, "zorder": 4, **style}))
        boxes.append((4.0, width + 2, height + 2, [y - 2, y + 2 + height + 2]))
    return notes, boxes


def draw_notes(ax: Any, notes: Sequence[Note], boxes: Sequence[Box], area: Any, **at: Any) -> list[Any]:
    """The notes annotated where :func:`stack_labels` finds them room, in points from ``at``'s ``xy``; none else."""
    out = []
    for (text, size, style), to in zip(notes, stack_labels(boxes, area), strict=True):
        if to is not None:
            out.append(ax.annotate(text, xytext=(to[0] + 1, to[1] - 1), fontsize=size, **_PLACED, **at, **style))
    return out


def load_recording(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | pd.DataFrame,
    *,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """A recording as a DataFrame with the columns of :func:`smiquery.frames.to_dataframe`, one row per sample.

    ``source``: a path (``.csv``, ``.jsonl``, ``.parquet`` file or dataset folder; other names are sniffed), several
    paths or a glob (``"run*.csv"``: a rotated set, read as one recording in time order), or a DataFrame. Files are
    read by :func:`smiquery.recordings.read_recording` (unreadable lines skipped and described in
    ``attrs["skipped"]``; a log without ``index`` is GPU 0); rows without a timestamp or GPU index are dropped.
    ``fields``: the columns of a headerless CSV log, in order (of another recording, each must be one of its
    columns). ``tz``: the zone the recording was made in (e.g. ``"Europe/Berlin"``): naive timestamps are localized
    to it, aware ones converted; default: as recorded (naive for nvidia-smi's CSV, never assumed to be UTC).

    Raises ReportError when the file is missing, unreadable, holds no readable row, has no ``timestamp`` or its
    columns do not agree with ``fields``; InvalidTimeZoneError for an unknown zone in ``tz``.
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
    median = float(np.median(intervals)) if intervals else 1.0
    interval = median if median > 0 else 1.0  # never 0 or NaN
    gap_limit = max(3 * interval, 5.0)
    gpus = []
    for idx, rows, times in parts:
        nxt = np.diff(times, append=times[-1] + interval) if len(times) else np.array([])
        # a sample stands for the time to the next one, except across a gap (the stream was stopped)
        dur = np.where(nxt > gap_limit, interval, nxt)
        gpus.append(GpuSeries(idx, df, floats, rows, times, stamps[rows], zone, dur, gap_limit))
    return gpus, interval
