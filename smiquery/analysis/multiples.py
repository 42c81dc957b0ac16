"""Small multiples: per field one panel holding a cell per GPU, the cells of a field on one y scale, all on one time.

A field is one matplotlib ``Axes`` (``gid="multiples-<field>"``) whose data units are inches; each cell draws
through its own transform from (time, value) to its place (an ``Axes`` per cell costs milliseconds each to make and
draw). Each cell's artists carry the label ``GPU <index>`` and the gids ``gpu-<index>``, ``stall``, ``alert``,
``threshold``, ``title`` and ``no-data``; tick labels are texts with ``gid`` ``xtick`` and ``ytick``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from smiquery.analysis.render import gpu_name
from smiquery.analysis.series import (
    ALERT_SHADE,
    GPU_COLOURS,
    GRID,
    STALL_SHADE,
    THRESHOLD_COLOUR,
    draw_notes,
    line_points,
    merged,
    text_size,
    threshold_notes,
)

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

    from smiquery.analysis.series import Scene
    from smiquery.fields import Field

__all__ = ["CELL_INCHES", "cell_of", "multiples_figure"]

#: The least width of a cell, in inches (a 12-inch figure holds 8 across).
CELL_INCHES = 1.5
# A cell's height, as a share of ``panel_height``.
_CELL_HEIGHT = 0.6
# Margins and gaps, in inches: above a field's cells (its name, the cells' titles), between rows, below (times); the
# figure's top and bottom; left of the first column (the least: values and unit), right of the last; between columns.
_HEAD, _GAP, _BELOW, _TOP, _BOTTOM, _LEFT, _RIGHT, _BETWEEN = 0.45, 0.3, 0.35, 0.45, 0.8, 0.65, 0.15, 0.15
# A field's panel reaches this far past its cells on every side, so that lines along their outer edges are not clipped.
_PAD = 0.1
_POINT = 1 / 72  # inches
_FRAME = "#000000"


class _Grid:
    """Where the cells lie, in inches: ``n`` cells a field, ``left`` of them the values and the unit."""

    def __init__(self, n: int, n_fields: int, width: float, panel_height: float, left: float = _LEFT) -> None:
        self.cols, self.cell_width = _columns(n, width, left)
        self.rows = math.ceil(n / self.cols)
        self.cell_height = panel_height * _CELL_HEIGHT
        # one field's block: head, cells, time labels
        self.block = _HEAD + self.rows * self.cell_height + (self.rows - 1) * _GAP + _BELOW
        self.total = _TOP + self.block * n_fields + _BOTTOM  # the figure's height

    def origin(self, k: int) -> tuple[float, float]:
        """The lower left corner of cell ``k`` in its panel's units (inches from the panel's lower left)."""
        col, row = k % self.cols, k // self.cols
        return col * (self.cell_width + _BETWEEN), (self.rows - 1 - row) * (self.cell_height + _GAP)


def _columns(n: int, width: float, left: float = _LEFT) -> tuple[int, float]:
    """How many cells fit across, and their width in inches (``left`` of them the values and the unit)."""
    cols = min(n, max(1, int((width - left + _LEFT) // CELL_INCHES)))
    return cols, (width - left - _RIGHT - _BETWEEN * (cols - 1)) / cols


def cell_points(width: float, dpi: int, gpus: int) -> int:
    """The most points of a cell's line: two (lowest, highest) per pixel of the cell's width."""
    return max(200, round(_columns(gpus, width)[1] * dpi) * 2)


def _y_range(fld: Field, lines: Sequence[np.ndarray], marks: Sequence[tuple[float, str]]) -> tuple[float, float, bool]:
    """The field's value range, shared by its cells, and whether any GPU has a value."""
    import numpy as np

    finite = [v[np.isfinite(v)] for v in lines]
    present = [v for v in finite if len(v)]
    if not present:
        return 0.0, 1.0, False
    if fld.kind.is_bool:
        return -0.1, 1.1, True
    if fld.unit == "%":
        return -2.0, 105.0, True
    lo = min(float(v.min()) for v in present)
    hi = max(float(v.max()) for v in present)
    for value, _ in marks:  # a rule's threshold shows on the scale
        lo, hi = min(lo, value), max(hi, value)
    if hi == lo:
        pad = max(abs(lo) * 0.05, 1.0)
        return lo - pad, hi + pad, True
    pad = (hi - lo) * 0.09  # a little room above and below, as a panel's own margins would give
    return lo - pad, hi + pad, True


def _y_ticks(fld: Field, lo: float, hi: float) -> tuple[list[float], list[str]]:
    from matplotlib.ticker import MaxNLocator

    if fld.kind.is_bool:
        return [0.0, 1.0], ["no", "yes"]
    locs = [float(v) for v in MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi) if lo <= v <= hi]
    return locs, [f"{v:g}" for v in locs]


def _left(scales: Sequence[tuple[Field, list[str]]]) -> tuple[float, float]:
    """The margin left of the cells (room for the widest value label and the unit) and where the unit goes."""
    widest = max((text_size(t, 7)[0] for _, labels in scales for t in labels), default=0.0) / 72
    unit = (3 * _POINT + widest + 4 * _POINT + text_size("M", 8)[1] / 2 / 72) if widest else 0.42
    return max(_LEFT, unit + text_size("M", 8)[1] / 2 / 72 + 0.08), unit


def cell_of(artist: Any) -> int | None:
    """The GPU index a cell's artist belongs to (from its ``GPU <index>`` label), or None."""
    label = artist.get_label()
    if isinstance(label, str) and label.startswith("GPU "):
        return int(label[4:])
    return None


def multiples_figure(
    figure: type[Figure], scene: Scene, width: float, panel_height: float, dpi: int
) -> tuple[Figure, list[Any]]:
    """The figure (of class ``figure``): a titled panel of cells per field; returns it and the panels, top to bottom.

    A row of cells is 0.6 of ``panel_height``; a cell's line has at most ``scene.max_points`` (lowest and highest of
    each stretch of samples past it). Each GPU's stalls and alerts are merged; every cell labels the same few times.
    """
    scales = []
    for fld in scene.flds:
        lo, hi, has_values = _y_range(fld, scene.values[fld.name], scene.thresholds[fld.name])
        scales.append((lo, hi, has_values, *_y_ticks(fld, lo, hi)))
    left, unit_at = _left([(fld, sc[4]) for fld, sc in zip(scene.flds, scales, strict=True)])
    grid = _Grid(len(scene.gpus), len(scene.flds), width, panel_height, left)
    fig = figure(figsize=(width, grid.total), dpi=dpi)
    x_ticks = _x_ticks(scene.x_range, scene.zone)
    axes = []
    for b, fld in enumerate(scene.flds):
        y0 = _TOP + b * grid.block  # inches from the top
        fig.text(0.01, 1 - (y0 + 0.13) / grid.total, f"{fld.name} [{fld.unit}]" if fld.unit else fld.name, ha="left",
                 va="center", fontsize=10, gid=f"field-{fld.name}")  # fmt: skip
        top = y0 + _HEAD
        height = grid.block - _HEAD - _BELOW
        # the panel: the cells, and _PAD around them; its data units are inches from the first cell's corner
        ax = fig.add_axes(((left - _PAD) / width, 1 - (top + height + _PAD) / grid.total,
                           (width - left - _RIGHT + 2 * _PAD) / width, (height + 2 * _PAD) / grid.total),
                          gid=f"multiples-{fld.name}")  # fmt: skip
        ax.set_axis_off()
        ax.set_autoscale_on(False)
        ax.set_xlim(-_PAD, width - left - _RIGHT + _PAD)
        ax.set_ylim(-_PAD, height + _PAD)
        _draw_field(ax, fld, scene, grid, x_ticks, (b == len(scene.flds) - 1, scales[b], unit_at))
        axes.append(ax)
    return fig, axes


def _x_ticks(x_range: tuple[Any, Any], zone: Any) -> tuple[list[float], list[str]]:
    """The same few times for every cell: where they are (date numbers) and their labels."""
    import matplotlib.dates as mdates

    x_start, x_end = x_range
    locator = mdates.AutoDateLocator(minticks=3, maxticks=4, tz=zone)  # type: ignore[no-untyped-call]
    lo, hi = mdates.date2num([x_start, x_end])  # type: ignore[no-untyped-call]
    locs = [float(v) for v in locator.tick_values(x_start, x_end) if lo <= v <= hi]  # type: ignore[no-untyped-call]
    formatter = mdates.ConciseDateFormatter(locator, tz=zone, show_offset=False)  # type: ignore[no-untyped-call]
    return locs, list(formatter.format_ticks(locs))  # type: ignore[no-untyped-call]


def _draw_field(
    ax: Any,
    fld: Field,
    scene: Scene,
    grid: _Grid,
    ticks: tuple[list[float], list[str]],
    where: tuple[bool, tuple[float, float, bool, list[float], list[str]], float],
) -> None:
    """One field's cells: lines, shading, thresholds, titles, scales, grid and frames.

    ``where``: whether it is the last field (the times go under it), its scale (lowest, highest, whether any GPU has
    a value, the values labelled and their labels) and how far left of a cell its unit goes (inches).
    """
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib.collections import LineCollection
    from matplotlib.transforms import Affine2D

    last, (lo, hi, has_values, y_locs, y_labels), unit_at = where
    n = len(scene.gpus)
    lines = scene.values[fld.name]
    marks = scene.thresholds[fld.name] if has_values else []
    x_lo, x_hi = (float(v) for v in mdates.date2num(list(scene.x_range)))  # type: ignore[no-untyped-call]
    sx, sy = grid.cell_width / (x_hi - x_lo), grid.cell_height / (hi - lo)
    # the times labelled: those whose label stays over its own cell (none runs into the next cell's)
    x_ticks = [(v, t) for v, t in zip(*ticks, strict=True)
               if text_size(t, 7)[0] / 2 / 72 <= min(v - x_lo, x_hi - v) * sx + _BETWEEN / 2 - 0.01]  # fmt: skip
    x_locs = [v for v, _ in x_ticks]
    gridlines: list[list[tuple[float, float]]] = []
    frames: list[list[tuple[float, float]]] = []
    for k, idx in enumerate(scene.gpus):
        ox, oy = grid.origin(k)
        w, h = grid.cell_width, grid.cell_height
        place = Affine2D().translate(-x_lo, -lo).scale(sx, sy).translate(ox, oy) + ax.transData
        gridlines += [[(ox + (v - x_lo) * sx, oy), (ox + (v - x_lo) * sx, oy + h)] for v in x_locs]
        gridlines += [[(ox, oy + (v - lo) * sy), (ox + w, oy + (v - lo) * sy)] for v in y_locs]
        frames.append([(ox, oy), (ox + w, oy), (ox + w, oy + h), (ox, oy + h), (ox, oy)])
        label = f"GPU {idx}"
        x, y = line_points(scene.xs[k], lines[k], scene.gap_limit, scene.max_points, envelope=True)
        days = mdates.date2num(x)  # type: ignore[no-untyped-call]
        colour = GPU_COLOURS[k % len(GPU_COLOURS)]
        ax.plot(days, y, color=colour, linewidth=1.1, label=label, gid=f"gpu-{idx}", zorder=2, transform=place)
        if not has_values or not np.isfinite(lines[k]).any():
            ax.text(ox + w / 2, oy + h / 2, "no values", ha="center", va="center", fontsize=8, color="#555555",
                    gid="no-data", label=label)  # fmt: skip
        _cell_shading(ax, place, scene, fld, idx, (lo, hi), label)
        for value, _ in marks:
            ax.plot([x_lo, x_hi], [value, value], transform=place, color=THRESHOLD_COLOUR, linestyle="--",
                    linewidth=0.9, gid="threshold", label=label, zorder=3)  # fmt: skip
        first = k % grid.cols == 0
        if first:  # the thresholds labelled inside the cell, cut short to fit
            notes, boxes = threshold_notes(marks, 7, lambda v: (v - lo) * sy * 72, w * 72 - 8, label=label)
            draw_notes(ax, notes, boxes, (0, 0, w * 72, h * 72), xy=(ox, oy), xycoords="data")
        title = gpu_name(idx, scene.names)
        ax.text(ox, oy + h + 2 * _POINT, title, ha="left", va="bottom", fontsize=8, gid="title", label=label)
        if first:
            for v, text in zip(y_locs, y_labels, strict=True):
                ax.text(ox - 3 * _POINT, oy + (v - lo) * sy, text, ha="right", va="center", fontsize=7, gid="ytick")
            if fld.unit:
                ax.text(ox - unit_at, oy + h / 2, fld.unit, rotation=90, ha="center", va="center", fontsize=8,
                        gid="unit")  # fmt: skip
        if last and k + grid.cols >= n:  # the bottom row
            for v, text in x_ticks:
                ax.text(ox + (v - x_lo) * sx, oy - 3 * _POINT, text, ha="center", va="top", fontsize=7, gid="xtick")
    ax.add_collection(LineCollection(gridlines, colors=GRID, linewidths=0.6, zorder=0.5, gid="grid"))
    ax.add_collection(LineCollection(frames, colors=_FRAME, linewidths=0.8, zorder=2.5, gid="frame"))


def _cell_shading(
    ax: Any, place: Any, scene: Scene, fld: Field, gpu: int, y_range: tuple[float, float], label: str
) -> None:
    """The GPU's stalls grey, its alerts of this field's rules orange, across the cell's height."""
    import matplotlib.dates as mdates
    from matplotlib.patches import Rectangle

    lo, hi = y_range
    for spans, colour, alpha, gid in (
        (scene.stalls, STALL_SHADE, 0.22, "stall"),
        (scene.alerts.get(fld.name, []), ALERT_SHADE, 0.35, "alert"),
    ):
        for start, end, _ in merged((span for span in spans if span[2] == gpu), scene.slack):
            x0, x1 = (float(v) for v in mdates.date2num([start, end]))  # type: ignore[no-untyped-call]
            ax.add_patch(Rectangle((x0, lo), x1 - x0, hi - lo, transform=place, color=colour, alpha=alpha,
                                   linewidth=0, gid=gid, label=label, zorder=0))  # fmt: skip
