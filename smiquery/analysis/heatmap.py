"""Many GPUs as heatmaps: one panel per field, a row per GPU, time across, stalls and alerts outlined.

Each cell is the mean of one GPU's samples in one column of pixels; stalls and firing alerts are outlined, so short
events that a mean would blur still show. A field's colours span its physical range where it has one (0 to 100 %,
0 to ``memory.total`` or ``power.limit``, 0 to 100 C), widened to any value past it, else the data's range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from smiquery.analysis.series import text_size
from smiquery.printable import printable

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

    from smiquery.analysis.series import Scene
    from smiquery.fields import Field

__all__ = ["ALERT_EDGE", "STALL_EDGE", "Scale", "cell_means", "heatmap_figure", "no_values_note"]

#: A field's physical colour range: (lowest, highest, where it comes from, e.g. ``"0 to memory.total"``).
Scale = tuple[float, float, str]

#: The outline of a stall on a GPU's row, and of a firing alert.
STALL_EDGE = "#000000"
ALERT_EDGE = "#e6550d"
_MISSING = "#e8e8e8"
_BAR_FONT = 8  # the colour bars' ticks and labels
# Height of one GPU's row (inches) and the least height of a panel.
_ROW_INCHES = 0.055
_MIN_PANEL = 1.6


def cell_means(
    xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], x_range: tuple[Any, Any], columns: int
) -> np.ndarray:
    """A (GPUs, columns) array: per GPU the mean of its values in each of ``columns`` equal spans of time, NaN if none.

    ``xs`` and ``ys``: per GPU its times (on the plot's axis) and values (NaN where missing).
    """
    import numpy as np

    lo, hi = (int(np.asarray(v, dtype="datetime64[ns]").astype("int64")) for v in x_range)
    span = max(int(hi - lo), 1)
    at_cells: list[np.ndarray] = [np.zeros(0, dtype="int64")]
    weights: list[np.ndarray] = [np.zeros(0)]
    for row, (x, y) in enumerate(zip(xs, ys, strict=True)):
        ok = ~np.isnan(y)
        at = (x[ok].astype("datetime64[ns]").astype("int64") - lo) * columns // span
        at_cells.append(row * columns + np.clip(at, 0, columns - 1))
        weights.append(y[ok])
    # one count over all GPUs: a count per GPU would sweep every GPU's cells each time
    cells = np.concatenate(at_cells)
    sums = np.bincount(cells, weights=np.concatenate(weights), minlength=len(xs) * columns)
    counts = np.bincount(cells, minlength=len(xs) * columns)
    means = np.full(len(sums), np.nan)
    np.divide(sums, counts, out=means, where=counts > 0)
    return means.reshape(len(xs), columns)


def heatmap_figure(
    figure: type[Figure], scene: Scene, size: tuple[float, float, int], scales: dict[str, Scale]
) -> tuple[Figure, list[Any]]:
    """One heatmap panel per field, a row per GPU, sharing the time axis; returns the figure and its panels.

    ``size`` is (width, panel height, dpi); ``scene.max_points`` the most columns of cells. A field without a
    ``scales`` range is coloured on the range of its values. A fleet's rows are labelled by node, with white lines
    (``gid="node-boundary"``) between the nodes.
    """
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib import colormaps

    width, panel_height, dpi = size
    flds, gpus, names, x_range = scene.flds, scene.gpus, scene.names, scene.x_range
    # no more columns than about half a GPU's samples: each cell then holds one sample or more, none is left empty
    columns = max(1, min(scene.max_points, max(len(x) for x in scene.xs) // 2))
    panels = []
    for fld in flds:
        cells = cell_means(scene.xs, scene.values[fld.name], x_range, columns)
        vmin, vmax, source = _colour_range(fld, cells, scales.get(fld.name))
        panels.append((fld, cells, vmin, vmax, source, _bar_ticks(vmin, vmax)))
    # Placed by fixed margins in inches (constrained layout measures every tick of every colour bar). Right of the
    # panels: a gap, the colour bar, its ticks, their widest label and the bar's label.
    height = max(panel_height, _MIN_PANEL, len(gpus) * _ROW_INCHES + 0.6)
    widest = max(text_size(t, _BAR_FONT)[0] for *_, (_, labels) in panels for t in labels)
    top, head, gap, bottom, left, bar_width = 0.45, 0.3, 0.3, 0.95, 0.75, 0.15
    right = 0.1 + bar_width + (7 + widest + 5 + text_size("0", _BAR_FONT)[1]) / 72 + 0.12
    total = top + len(flds) * (head + height) + (len(flds) - 1) * gap + bottom
    fig = figure(figsize=(width, total), dpi=dpi)
    axes: list[Any] = []
    for k in range(len(flds)):
        y = total - top - head - height - k * (head + height + gap)  # the panel's foot, inches from the bottom
        box = (left / width, y / total, (width - left - right) / width, height / total)
        axes.append(fig.add_axes(box, sharex=axes[0] if axes else None))
        if k < len(flds) - 1:
            axes[-1].tick_params(labelbottom=False)
    lo, hi = (float(v) for v in mdates.date2num(list(x_range)))  # type: ignore[no-untyped-call]
    row_of = {g: r for r, g in enumerate(gpus)}
    cmap = colormaps["viridis"].with_extremes(bad=_MISSING)
    nodes = [names[g].node if names and g in names else None for g in gpus]
    starts = [r for r in range(len(gpus)) if r == 0 or nodes[r] != nodes[r - 1]]
    # at most about 16 labels: of GPUs, or of the nodes (at their first row) in a fleet
    rows = starts if names else range(len(gpus))
    shown = rows[:: max(1, len(rows) // 16)]
    for ax, (fld, cells, vmin, vmax, source, (locs, labels)) in zip(axes, panels, strict=True):
        image = ax.imshow(
            np.ma.masked_invalid(cells),
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            extent=(lo, hi, len(gpus) - 0.5, -0.5),
            gid=f"heatmap-{fld.name}",
        )
        pos = ax.get_position()
        bar = fig.colorbar(image, cax=fig.add_axes((pos.x1 + 0.1 / width, pos.y0, bar_width / width, pos.height)))
        # plain numbers, fixed: a scalar formatter would write 40,000 to 40,001 as "+4e4" and offsets
        bar.set_ticks(locs, labels=labels, fontsize=_BAR_FONT)
        scale = f"{_number(vmin)} to {_number(vmax)} {fld.unit}".rstrip()
        bar_inches = pos.height * total
        fits = text_size(scale, _BAR_FONT)[0] / 72 <= bar_inches - 0.1
        bar.set_label(scale if fits else fld.unit, fontsize=_BAR_FONT, labelpad=4)
        for value, _ in scene.thresholds[fld.name]:
            if vmin <= value <= vmax:  # a white line under a dashed black one shows on any colour
                bar.ax.axhline(value, color="#ffffff", linewidth=2.0)
                bar.ax.axhline(value, color="#000000", linewidth=1.0, linestyle="--", gid="threshold")
        _outline(ax, scene.stalls, row_of, STALL_EDGE, "stall", 0.9)
        _outline(ax, scene.alerts.get(fld.name, []), row_of, ALERT_EDGE, "alert", 1.3)
        # a fixed place: placed around the ticks, a title is measured again on every draw
        name = f"{fld.name} [{fld.unit}]" if fld.unit else fld.name
        ax.set_title(f"{name}, colour: {source}" if source else name, loc="left", fontsize=10, y=1.0, pad=4)
        ax.set_yticks(shown, [printable(nodes[r] or "") if names else str(gpus[r]) for r in shown], fontsize=7)
        ax.set_ylabel("node" if names else "GPU")
        if names and len(starts) > 1:
            ax.hlines([r - 0.5 for r in starts[1:]], lo, hi, colors="#ffffff", linewidths=1.0, gid="node-boundary")
        if not np.isfinite(cells).any():
            no_values_note(ax, fld.name)
    return fig, axes


def no_values_note(ax: Any, name: str) -> None:
    """The note across a panel (``gid="no-data"``) whose field ``name`` has no value in any sample."""
    note = f"no values: {name} was missing ([N/A] or not supported) in every sample"
    ax.text(
        0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#555555", gid="no-data"
    )


def _colour_range(fld: Field, cells: np.ndarray, scale: Scale | None) -> tuple[float, float, str]:
    """The field's colour range, widened to the values, and where it comes from (for the panel's title, or "")."""
    import numpy as np

    finite = cells[np.isfinite(cells)]
    if fld.kind.is_bool:
        return 0.0, 1.0, ""
    if not len(finite):
        return scale or (0.0, 1.0, "")
    low, high = float(finite.min()), float(finite.max())
    if scale is not None:
        vmin, vmax, source = scale
        if low < vmin or high > vmax:
            source = f"{source}, widened to the values" if source else "widened to the values"
        return min(vmin, low), max(vmax, high), source
    if high == low:
        pad = max(abs(low) * 0.05, 1.0)
        return low - pad, high + pad, "around the one value"
    return low, high, "the values' range"


def _number(value: float) -> str:
    """A plain number for a colour bar: 81,559, 0.5, -20; never an offset or a power of ten."""
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    digits = max(0, 3 - math.floor(math.log10(abs(value)))) if value else 0
    return f"{value:,.{digits}f}".rstrip("0").rstrip(".")


def _bar_ticks(vmin: float, vmax: float) -> tuple[list[float], list[str]]:
    """About five round values inside the colour range, and their labels."""
    from matplotlib.ticker import MaxNLocator

    locs = [float(v) for v in MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin, vmax)]
    locs = [v for v in locs if vmin - 1e-9 * abs(vmax - vmin) <= v <= vmax + 1e-9 * abs(vmax - vmin)]
    return locs, [_number(0.0 if abs(v) < 1e-12 * max(abs(vmin), abs(vmax), 1) else v) for v in locs]


def _outline(
    ax: Any, spans: Sequence[tuple[Any, Any, int]], row_of: dict[int, int], edge: str, gid: str, lw: float
) -> None:
    """Each (start, end, gpu) span as an outline around its stretch of the GPU's row.

    Spans of neighbouring rows within a hundredth of the run of each other share one outline (64 GPUs stalling at
    once are one box).
    """
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib.collections import PolyCollection

    lo, hi = ax.get_xlim()
    slack = (hi - lo) / 100
    kept = [(start, end, row_of[gpu]) for start, end, gpu in spans if gpu in row_of]
    if not kept:
        return
    # the times of all spans converted at once: a conversion per span costs more than the rest of the outline
    times = np.array([t for start, end, _ in kept for t in (start, end)], dtype="datetime64[ns]")
    nums = mdates.date2num(times).reshape(-1, 2)  # type: ignore[no-untyped-call]
    placed = [(float(s0), float(e0), row) for (s0, e0), (_, _, row) in zip(nums, kept, strict=True)]
    boxes: list[list[float]] = []  # [start, end, first row, last row]
    ending: dict[int, list[list[float]]] = {}  # the boxes whose last row is the key
    for s0, e0, row in sorted(placed, key=lambda p: (p[2], p[0])):
        above = ending.get(row - 1, [])
        near = next((b for b in above if abs(b[0] - s0) <= slack and abs(b[1] - e0) <= slack), None)
        if near is None:
            near = [s0, e0, row, row]
            boxes.append(near)
        else:
            above.remove(near)
            near[0], near[1], near[3] = min(near[0], s0), max(near[1], e0), row
        ending.setdefault(row, []).append(near)
    if boxes:  # one artist for all: a patch each costs milliseconds to add and to draw
        verts = [[(s0, a - 0.5), (e0, a - 0.5), (e0, b + 0.5), (s0, b + 0.5)] for s0, e0, a, b in boxes]
        ax.add_collection(PolyCollection(verts, facecolors="none", edgecolors=edge, linewidths=lw, gid=gid, zorder=3),
                          autolim=False)  # fmt: skip
