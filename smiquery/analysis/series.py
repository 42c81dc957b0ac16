"""Helpers shared by the report and the plot: numbers, GPUs' rows, times, a line's points, text measures, the scene."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from smiquery.clock import REPORTED_STEP_BACK
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
    "Scene",
    "as_float",
    "axis_clock",
    "catalogue_field",
    "gpu_rows",
    "line_band",
    "line_points",
    "merged",
    "stack_labels",
    "text_size",
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

    Attributes:
        xs: per GPU its times as the axis holds them (:func:`axis_clock`).
        values: per field name, per GPU its values (NaN where missing).
        thresholds: per field name its rules' thresholds as (value, label).
        stalls: (start, end, GPU index) on the axis's clock; ``alerts`` the same per field of a firing rule.
        slack: spans closer than this are drawn (and labelled) as one.
        names: a fleet frame's GPU names (:class:`~smiquery.analysis.model.GpuName`) by index; none for a recording.
        max_points: most points of a line (a heatmap: most columns of cells).
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
        ordered = index[order]
        bounds = np.flatnonzero(np.diff(ordered)) + 1
        parts = np.split(order, bounds)
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
    x: np.ndarray, y: np.ndarray, gap_limit: float, max_points: int, envelope: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """x (naive datetime64) and y (float, NaN where missing or across a gap in time) for one GPU's line.

    Past ``max_points`` samples, each bucket of samples (about a pixel wide) becomes its mean, or with ``envelope``
    its lowest and highest value at their own times (two points a bucket), so that a one-sample spike still shows.
    """
    import numpy as np

    if len(x) > max_points:
        # Means by default: in a panel of several GPUs a noisy line (or its envelope) covers the others, so the overlay
        # draws each bucket's extremes as a band (line_band); a panel of its own (small multiples) the envelope.
        step = math.ceil(len(x) / max_points) if not envelope else math.ceil(2 * len(x) / max_points)
        n = (len(x) // step) * step
        blocks = y[:n].reshape(-1, step)
        present = ~np.isnan(blocks)
        counts = present.sum(axis=1)
        if envelope:
            lows = np.where(present, blocks, np.inf).argmin(axis=1)
            highs = np.where(present, blocks, -np.inf).argmax(axis=1)
            # each bucket's two extremes in time order: positions into the samples, then their values
            base = np.arange(len(blocks)) * step
            picks = np.stack((np.minimum(lows, highs), np.maximum(lows, highs)), axis=1) + base[:, None]
            picks = picks.ravel()
            values = y[picks]
            values[np.repeat(counts == 0, 2)] = np.nan
            x = np.concatenate((x[picks], x[n:]))
            y = np.concatenate((values, y[n:]))
        else:
            sums = np.where(present, blocks, 0.0).sum(axis=1)
            means = np.full(len(counts), np.nan)
            np.divide(sums, counts, out=means, where=counts > 0)
            x = np.concatenate((x[:n:step], x[n:]))
            y = np.concatenate((means, y[n:]))
        # points now stand up to two buckets apart: only a longer pause in time is a gap
        gap_limit *= step
    x, (y,) = _broken(x, [y], gap_limit)
    return x, y


def line_band(
    x: np.ndarray, y: np.ndarray, gap_limit: float, max_points: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The lowest and highest value of each bucket :func:`line_points` averages: (x, lows, highs); None if it draws all.

    Drawn as a band around the mean line, so that what the mean hides (a memory drop to 1 MiB every ten minutes
    of a 34-hour run, a one-sample spike) still shows.
    """
    import numpy as np

    if len(x) <= max_points:
        return None
    step = math.ceil(len(x) / max_points)
    n = (len(x) // step) * step
    blocks = y[:n].reshape(-1, step)
    empty = np.isnan(blocks).all(axis=1)
    lows = np.where(np.isnan(blocks), np.inf, blocks).min(axis=1)
    highs = np.where(np.isnan(blocks), -np.inf, blocks).max(axis=1)
    lows[empty] = np.nan
    highs[empty] = np.nan
    xb, (lo, hi) = _broken(
        np.concatenate((x[:n:step], x[n:])),
        [np.concatenate((lows, y[n:])), np.concatenate((highs, y[n:]))],
        gap_limit * step,
    )
    return xb, lo, hi


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


def text_size(text: str, fontsize: float) -> tuple[float, float]:
    """(width, height) in points of one line of ``text`` in matplotlib's default font, measured without a renderer.

    The height is that of a text box (the font's line height).
    """
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    width, _, _ = text_to_path.get_text_width_height_descent(text, FontProperties(size=fontsize), ismath=False)
    return float(width), 1.2 * fontsize


def stack_labels(
    boxes: Sequence[tuple[float, float, float, Sequence[float]]], area: tuple[float, float, float, float]
) -> list[tuple[float, float] | None]:
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
