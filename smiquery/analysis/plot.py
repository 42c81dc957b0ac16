"""A recorded run as a picture: one panel per field, one line per GPU, alert thresholds, gaps where data is missing.

Many GPUs get :mod:`smiquery.analysis.multiples` or heatmaps: a row per GPU, each cell the mean of its samples in a
column of pixels, stalls and firing alerts outlined (so short events that a mean would blur still show). Needs
matplotlib (``pip install 'smiquery[plot]'``); built with the object API, nothing here touches pyplot's state.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from smiquery.alerts import Rule
from smiquery.analysis.analyze import DEFAULT_RULES, stalls_and_alerts
from smiquery.analysis.multiples import cell_points, multiples_figure
from smiquery.analysis.render import gpu_name
from smiquery.analysis.series import (
    ALERT_SHADE,
    GPU_COLOURS,
    GRID,
    STALL_SHADE,
    THRESHOLD_COLOUR,
    Scene,
    as_float,
    axis_clock,
    draw_notes,
    gpu_rows,
    line_points,
    load_recording,
    merged,
    text_size,
    threshold_notes,
)
from smiquery.errors import ReportError
from smiquery.fields import Field, Kind, get_field, resolve_fields
from smiquery.printable import printable

if TYPE_CHECKING:
    from datetime import tzinfo

    import numpy as np
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_PLOT_FIELDS",
    "LAYOUTS",
    "MULTIPLES_MAX_GPUS",
    "OVERLAY_MAX_GPUS",
    "Layout",
    "plot_png",
    "plot_recording",
    "save_plot",
]

#: The panels drawn when no fields are given (those the recording has).
DEFAULT_PLOT_FIELDS: tuple[str, ...] = ("utilization.gpu", "temperature.gpu", "memory.used", "power.draw")

# Past eight GPUs the colours repeat with another dash pattern, so 32 GPUs stay apart.
_DASHES = ("-", "--", ":", "-.")

#: How GPUs share panels: ``overlay`` (one panel per field, every GPU a line in it), ``multiples`` (one small panel
#: per GPU per field, the panels of a field sharing their scales), ``heatmap`` (one panel per field, a row per GPU)
#: or ``auto``.
Layout = Literal["auto", "overlay", "multiples", "heatmap"]
LAYOUTS: tuple[str, ...] = ("auto", "overlay", "multiples", "heatmap")
#: ``layout="auto"`` overlays up to this many GPUs (the palette's distinct colours) and draws small multiples past it.
OVERLAY_MAX_GPUS = len(GPU_COLOURS)
#: ``layout="auto"`` draws small multiples up to this many GPUs and heatmaps past it.
MULTIPLES_MAX_GPUS = 16
# The kinds of field a panel can draw (booleans as 0 and 1).
_DRAWABLE = (Kind.INT, Kind.FLOAT, Kind.ENABLED, Kind.YES_NO, Kind.ACTIVE)


def _selected(df: pd.DataFrame, gpus: Sequence[int | str] | str) -> pd.Series:
    """Rows of the chosen GPUs, by index, UUID or PCI bus id (UUIDs and bus ids when the recording has them)."""
    from smiquery.streams.argv import normalize_gpus

    ids = normalize_gpus(gpus)
    keep = df["index"].astype("string").isin(list(ids))
    for column in ("uuid", "pci_bus_id"):
        if column in df.columns:
            keep |= df[column].astype("string").str.lower().isin([i.lower() for i in ids])
    return keep.fillna(False).astype(bool)


def _gpu_names(gpus: Sequence[int], total: int, names: dict[int, Any]) -> str:
    if len(gpus) == total and total > 1:
        return "all GPUs"
    if len(gpus) == 1 or names:
        return ", ".join(gpu_name(g, names) for g in gpus)
    return "GPUs " + ",".join(str(g) for g in gpus)


def _naive(ts: Any) -> Any:
    """A datetime as the plot's x axis holds it: the recorded wall clock, or UTC (instants) in a zone."""
    return ts if ts.tzinfo is None else ts.astimezone(timezone.utc).replace(tzinfo=None)


def _resolve(fields: str | Sequence[str] | None, df: pd.DataFrame) -> list[Field]:
    if fields is None:
        chosen = [get_field(n) for n in DEFAULT_PLOT_FIELDS]
        present = [f for f in chosen if f.attr in df.columns]
        if present:
            return present
        raise ReportError(
            "the recording has none of the default plot fields "
            f"({', '.join(DEFAULT_PLOT_FIELDS)}); name the fields to draw"
        )
    names = [n.strip() for n in fields.split(",")] if isinstance(fields, str) else list(fields)
    out: list[Field] = []
    for name in names:
        if not name:
            continue
        fld = get_field(name)
        if fld.name in ("timestamp", "index"):
            continue  # the x axis and the lines, not panels (a headerless log's column list names them)
        if fld.attr not in df.columns:
            raise ReportError(f"the recording has no {fld.name}; it holds {', '.join(map(str, df.columns))}")
        if fld.kind not in _DRAWABLE:
            raise ReportError(f"{fld.name} is {fld.kind.value}, not a number; it cannot be plotted")
        if all(f.name != fld.name for f in out):
            out.append(fld)
    if not out:
        raise ReportError("no field to plot")
    return out


def _thresholds(rules: Sequence[Rule], fld: Field) -> list[tuple[float, str]]:
    out: dict[float, list[str]] = {}
    for rule in rules:
        value = rule.threshold
        if rule.field.name == fld.name and isinstance(value, (int, float)) and not isinstance(value, bool):
            out.setdefault(float(value), []).append(str(rule).removeprefix(rule.field.name).strip())
    return sorted((value, "; ".join(labels)) for value, labels in out.items())


def _physical_scale(fld: Field, df: pd.DataFrame) -> tuple[float, float, str] | None:
    """A field's physical range for a heatmap's colours: 0 to 100 %, 0 to 100 C, 0 to its recorded limit; or None."""
    import numpy as np

    if fld.unit == "%":
        return 0.0, 100.0, ""
    if fld.name in ("temperature.gpu", "temperature.memory"):
        return 0.0, 100.0, "fixed 0 to 100"
    head, _, what = fld.name.rpartition(".")
    module = "module." if head.startswith("module.") else ""
    limits = [f"{head}.total"] if what in ("used", "free", "reserved") else []
    if fld.name.startswith(f"{module}power.draw"):
        limits = [f"{module}power.limit", f"{module}enforced.power.limit"]
    for name in limits:
        limit = get_field(name)
        if limit.attr in df.columns:
            values = as_float(df[limit.attr])
            if np.isfinite(values).any():
                return 0.0, float(np.nanmax(values)), f"0 to {name}"
    return None


def _layout_of(layout: str, gpus: int) -> str:
    """The layout drawn: the one asked for, or for ``auto`` the one that reads for this many GPUs."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout != "auto":
        return layout
    return "overlay" if gpus <= OVERLAY_MAX_GPUS else "multiples" if gpus <= MULTIPLES_MAX_GPUS else "heatmap"


def _overlay(
    figure: type[Figure], n: int, gpus: int, width: float, height: float, dpi: int
) -> tuple[Figure, list[Any]]:
    """One panel per field holding every GPU, on one time axis, by fixed margins in inches (as heatmaps are)."""
    # the legend: a GPU's line each, and the two kinds of shading
    rows = math.ceil((gpus + 2) / _legend_columns(gpus + 2, width))
    top, head, left, right = 0.45, 0.35, 0.9, 0.25  # the title; a panel's title; values and unit; the last tick
    bottom = 0.8 + 0.2 * rows  # times, the zone, the legend's rows
    panel = max((height * n + 1.1 - top - bottom - head * n) / n, 0.6)  # the figure is ``height`` a panel + 1.1 in
    total = top + bottom + n * (head + panel)
    fig = figure(figsize=(width, total), dpi=dpi)
    grid = {"left": left / width, "right": 1 - right / width, "top": 1 - (top + head) / total,
            "bottom": bottom / total, "hspace": head / panel}  # fmt: skip
    return fig, list(fig.subplots(n, 1, sharex=True, squeeze=False, gridspec_kw=grid)[:, 0])


def _legend_columns(entries: int, width: float) -> int:
    """How many legend entries go in a row: up to 10, as many as the figure's width holds (about an inch each)."""
    return max(1, min(entries, 10, int((width - 0.4) / 1.1)))


def plot_recording(
    source: str | os.PathLike[str] | pd.DataFrame,
    fields: str | Sequence[str] | None = None,
    *,
    rules: Iterable[Rule | str] | None = None,
    gpus: Sequence[int | str] | str | None = None,
    title: str | None = None,
    width: float = 12.0,
    panel_height: float = 2.4,
    dpi: int = 100,
    max_points: int | None = None,
    tz: tzinfo | str | None = None,
    shade: bool = True,
    name: str | None = None,
    layout: Layout = "auto",
) -> Figure:
    """Draw a recording: one panel per field (shared time axis), one line per GPU, rule thresholds as dashed lines.

    ``source`` and ``tz`` are as :func:`~smiquery.analysis.load_recording` takes them. ``fields`` are the panels, as
    names or a comma list (default :data:`DEFAULT_PLOT_FIELDS`, those present; for a headerless CSV log its columns
    in order, of which the numeric ones are drawn). The ``rules``' thresholds are drawn and their alerts shaded
    (default :data:`~smiquery.analysis.DEFAULT_RULES`); ``gpus`` picks GPUs by index, UUID or PCI bus id (as
    ``stream --id``). The ``title`` defaults to ``name`` (default: the file name) and the time span; ``width`` and
    ``panel_height`` are in inches. A line has at most ``max_points`` (default: one per pixel): a longer one is drawn
    as the mean of each stretch of samples in a band of their lowest and highest (in small multiples as its lowest
    and highest value). ``layout`` ``auto`` overlays up to :data:`OVERLAY_MAX_GPUS` GPUs, draws small multiples up
    to :data:`MULTIPLES_MAX_GPUS` and heatmaps past that.

    GPUs are named ``GPU <index>``; a fleet frame's by node, as its report names them. Missing values, gaps in time
    and a step back of a clock without a zone break the lines (in a zone the axis runs on instants, its ticks in
    local time). With ``shade``, stalls are shaded grey on every panel, a rule's firing alerts orange on its field's
    panel. A field with no value says so; the x axis names the time zone (or says there is none).

    The figure's artists carry gids: ``gpu-<index>`` (a GPU's line), ``band-<index>``, ``threshold``, ``stall``,
    ``alert``, ``no-data``, ``heatmap-<field>`` (its outlines one ``stall`` and one ``alert`` collection a panel)
    and ``multiples-<field>`` (a panel of cells, see :mod:`smiquery.analysis.multiples`).

    Raises ImportError without matplotlib, ReportError when the recording cannot be read or lacks a requested field,
    ValueError for a ``layout`` not in :data:`LAYOUTS`, InvalidFieldError for an unknown field and InvalidRuleError
    for a rule that cannot be parsed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'smiquery[plot]'") from exc
    with _collector_paused():
        import numpy as np
        from matplotlib.figure import Figure

        _layout_of(layout, 0)  # a bad layout fails before the recording is read
        df, flds = _prepare(source, fields, gpus, tz)
        parsed = list(map(Rule.of, DEFAULT_RULES if rules is None else rules))
        groups = gpu_rows(df["index"].to_numpy(dtype="int64"))
        chosen = _layout_of(layout, len(groups))
        start, end = df["timestamp"].min(), df["timestamp"].max()
        x_start, x_end = _naive(start), _naive(end)
        if x_end == x_start:
            x_end = x_start + (end - start) + np.timedelta64(1, "s")
        if not max_points:  # about a point a pixel across (a heatmap: a column a pixel of its panel)
            pixels = round(width * dpi * (0.85 if chosen == "heatmap" else 1.0))
            max_points = cell_points(width, dpi, len(groups)) if chosen == "multiples" else max(200, pixels)
        scene = _scene(df, flds, groups, parsed, max_points, shade, (x_start, x_end))
        handles: list[Any] = []
        if chosen == "heatmap":
            scales = {f.name: sc for f in flds if (sc := _physical_scale(f, df)) is not None}
            fig, axes = _heatmap_figure(Figure, scene, (width, panel_height, dpi), scales)
        elif chosen == "multiples":
            fig, axes = multiples_figure(Figure, scene, width, panel_height, dpi)
        else:
            fig, axes = _overlay(Figure, len(flds), len(groups), width, panel_height, dpi)
            for ax, fld in zip(axes, flds, strict=True):
                lines = _draw_panel(scene, ax, fld, first=ax is axes[0])
                if fld is flds[0]:
                    handles += lines
        _time_axis(fig, axes, chosen, scene)
        if title is None:
            if name is None:
                name = os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "recording"
            n = len(groups)
            until = f"{end:%Y-%m-%d %H:%M:%S}" if end.date() != start.date() else f"{end:%H:%M:%S}"
            title = f"{name}: {n} GPU{'s' if n != 1 else ''}, {start:%Y-%m-%d %H:%M:%S} to {until}"
        _title_and_legend(fig, title, axes, handles, chosen)
        return fig


# zlib level 3, not PIL's 6: about half the time to encode a heatmap's noisy cells, for a file 4 % larger
_PNG: dict[str, Any] = {"pil_kwargs": {"compress_level": 3}}


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a figure is built and drawn (unless paused already).

    A figure's tens of thousands of small objects trip the collector again and again, and each time it walks every
    object of the process (a third of the time of 64 small panels); the figure's cycles are collected later.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _prepare(
    source: str | os.PathLike[str] | pd.DataFrame,
    fields: str | Sequence[str] | None,
    gpus: Sequence[int | str] | str | None,
    tz: tzinfo | str | None,
) -> tuple[pd.DataFrame, list[Field]]:
    """The rows of the chosen GPUs, and the fields to draw: for a headerless log the fields name its columns too."""
    df = load_recording(source, fields=fields, tz=tz)
    if fields is not None and df.attrs.get("headerless"):
        names = [f.name for f in resolve_fields(fields)]
        drawn = [n for n in names if n not in ("timestamp", "index") and get_field(n).kind in _DRAWABLE]
        fields = drawn or None
    if gpus is not None:
        df = df[_selected(df, gpus)].reset_index(drop=True)
    if df.empty:
        raise ReportError("the recording holds no samples" + (" for those GPUs" if gpus is not None else ""))
    return df, _resolve(fields, df)


def _scene(
    df: pd.DataFrame,
    flds: Sequence[Field],
    groups: Sequence[tuple[int, Any]],
    rules: Sequence[Rule],
    max_points: int,
    shade: bool,
    x_range: tuple[Any, Any],
) -> Scene:
    """What every layout draws: each GPU's times and values, the thresholds, the stalls and alerts to shade."""
    import numpy as np

    x_all = axis_clock(df["timestamp"])
    xs = [x_all[rows] for _, rows in groups]
    diffs = sorted(float(np.median(np.diff(x).astype("int64"))) / 1e9 for x in xs if len(x) > 1)
    interval = diffs[len(diffs) // 2] if diffs else 0.0
    stalls: list[tuple[Any, Any, int]] = []
    alerts: dict[str, list[tuple[Any, Any, int]]] = {}  # by field
    if shade:
        found = stalls_and_alerts(df, rules=rules)
        stalls = [(_naive(s.start), _naive(s.end), s.gpu) for s in found.stalls]
        for a in found.alerts:
            rule = next(r for r in rules if str(r) == a.rule)
            alerts.setdefault(rule.field.name, []).append((_naive(a.fired), _naive(a.end), a.gpu))
    columns = {f.name: as_float(df[f.attr]) for f in flds}  # each column converted once, not once a panel
    names = df.attrs.get("gpu_names")  # a fleet frame's GpuName by GPU; none for a recording
    return Scene(
        flds=flds,
        gpus=[idx for idx, _ in groups],
        xs=xs,
        values={name: [column[rows] for _, rows in groups] for name, column in columns.items()},
        thresholds={f.name: _thresholds(rules, f) for f in flds},
        stalls=stalls,
        alerts=alerts,
        x_range=x_range,
        zone=getattr(df["timestamp"].dt, "tz", None),
        gap_limit=max(5.0, 3 * interval),  # 5.0 first: a NaN or negative interval gives 5 s
        slack=(df["timestamp"].max() - df["timestamp"].min()) / 200,  # half a percent of the run
        names=names if isinstance(names, dict) else {},
        max_points=max_points,
    )


def _draw_panel(scene: Scene, ax: Any, fld: Field, first: bool) -> list[Any]:
    """One overlaid panel: the GPUs' lines (returned, for the legend), shading, thresholds, title and scale.

    A line per GPU lies in a band from its lowest to highest values (a note when no GPU has a value). Stalls are
    shaded grey (labelled on the ``first`` panel), a rule's firing alerts orange on its field's panel.
    """
    import numpy as np

    lines: list[Any] = []
    for pos, (idx, xs, ys) in enumerate(zip(scene.gpus, scene.xs, scene.values[fld.name], strict=True)):
        x, y, *band = line_points(xs, ys, scene.gap_limit, scene.max_points, band=True)
        colour = GPU_COLOURS[pos % len(GPU_COLOURS)]
        dash = _DASHES[(pos // len(GPU_COLOURS)) % len(_DASHES)]
        lines += ax.plot(x, y, color=colour, linestyle=dash, linewidth=1.1, label=gpu_name(idx, scene.names),
                         gid=f"gpu-{idx}", zorder=2)  # fmt: skip
        if band:  # the mean hides a pixel's extremes: a band from its lowest to highest value shows them
            ax.fill_between(x, *band, color=colour, alpha=0.22, linewidth=0.5, gid=f"band-{idx}", zorder=1.5)
    has_values = any(bool(np.isfinite(v).any()) for v in scene.values[fld.name])
    if not has_values:
        _no_values_note(ax, fld.name)
        ax.set_yticks([])
    spans: list[tuple[Any, str]] = []
    for s0, e0, who in merged(scene.stalls, scene.slack):
        ax.axvspan(s0, e0, color=STALL_SHADE, alpha=0.22, linewidth=0, gid="stall", zorder=0)
        if first:
            spans.append((s0, f"stall: {_gpu_names(who, len(scene.gpus), scene.names)}"))
    for s0, e0, who in merged(scene.alerts.get(fld.name, []), scene.slack):
        ax.axvspan(s0, e0, color=ALERT_SHADE, alpha=0.35, linewidth=0, gid="alert", zorder=0)
        spans.append((s0, f"alert: {_gpu_names(who, len(scene.gpus), scene.names)}"))
    marks = scene.thresholds[fld.name] if has_values else []
    for value, _ in marks:  # dashed across the panel; _place_notes labels them
        ax.axhline(value, color=THRESHOLD_COLOUR, linestyle="--", linewidth=0.9, gid="threshold", zorder=3)
    _label_panel(ax, fld, has_values)
    _place_notes(ax, marks, spans, scene.x_range)
    return lines


def _place_notes(
    ax: Any, marks: Sequence[tuple[float, str]], spans: Sequence[tuple[Any, str]], x_range: tuple[Any, Any]
) -> None:
    """Label the thresholds and spans: all inside the panel, none over another (:func:`stack_labels`).

    Threshold labels go at the panel's left edge (under their line, else over it), then each span's label in its
    top left corner (moved down under a label in its way). A label with no room left is not drawn.
    """
    import matplotlib.dates as mdates

    if not marks and not spans:
        return
    pos, (fig_w, fig_h) = ax.get_position(), ax.get_figure().get_size_inches()
    width, height = pos.width * fig_w * 72, pos.height * fig_h * 72  # the panel in points
    y_lo, y_hi = ax.get_ylim()  # the panel's scale (autoscaled now, from its lines and thresholds)
    x_lo, x_hi = (float(v) for v in mdates.date2num(list(x_range)))  # type: ignore[no-untyped-call]
    notes, boxes = threshold_notes(marks, 8, lambda v: (v - y_lo) / (y_hi - y_lo) * height)
    for start, text in spans:
        w, h = text_size(text, 7.5)
        x = (float(mdates.date2num(start)) - x_lo) / (x_hi - x_lo) * width  # type: ignore[no-untyped-call]
        boxes.append((x + 3, w, h, [height - 3]))
        notes.append((text, 7.5, {"color": "#333333", "zorder": 5}))
    for note in draw_notes(ax, notes, boxes, (0, 0, width, height), xy=(0, 0), xycoords="axes fraction"):
        note.set_in_layout(False)  # it lies inside the panel: no margin for it
        note.set_clip_on(False)


def _label_panel(ax: Any, fld: Field, has_values: bool) -> None:
    """The panel's title, unit, y range and grid."""
    unit = fld.unit
    # a fixed place: placed around the ticks, a title is measured again on every draw
    ax.set_title(f"{fld.name} [{unit}]" if unit else fld.name, loc="left", fontsize=10, y=1.0, pad=4)
    if unit:
        ax.set_ylabel(unit)
    if unit == "%" and has_values:
        ax.set_ylim(-2, 105)
    elif fld.kind.is_bool and has_values:
        ax.set_ylim(-0.1, 1.1)
        ax.set_yticks([0, 1], ["no", "yes"])
    ax.grid(True, color=GRID, linewidth=0.6)


def _time_axis(fig: Figure, panels: Sequence[Any], layout: str, scene: Scene) -> None:
    """The time axis under the bottom panel, labelled with the zone (small multiples: the zone under the figure)."""
    import matplotlib.dates as mdates

    zone = scene.zone
    label = f"time ({zone})" if zone else "time (the recording's local clock; no zone recorded, pass --tz to name it)"
    if layout == "multiples":
        fig.supxlabel(label, y=0.45 / fig.get_size_inches()[1], va="center", fontsize=9)
        return
    last = panels[-1]
    last.set_xlim(*scene.x_range)
    locator = mdates.AutoDateLocator(tz=zone)  # type: ignore[no-untyped-call]
    last.xaxis.set_major_locator(locator)
    last.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=zone))  # type: ignore[no-untyped-call]
    last.set_xlabel(label, fontsize=9)


def _title_and_legend(fig: Figure, title: str, panels: Sequence[Any], handles: list[Any], layout: str) -> None:
    """The title above, and below a legend of the GPUs' lines (overlaid panels only) and the kinds of shading drawn."""
    from matplotlib.patches import Patch

    fig.suptitle(title, x=0.01, y=1 - 0.22 / fig.get_size_inches()[1], ha="left", va="center", fontsize=11)
    heat = layout == "heatmap"  # outlines (collections) there, shaded spans (patches) elsewhere
    for gid, text, edge, shade, alpha in (
        ("stall", "stall", _STALL_EDGE, STALL_SHADE, 0.4),
        ("alert", "alert firing", _ALERT_EDGE, ALERT_SHADE, 0.6),
    ):
        if any(a.get_gid() == gid for ax in panels for a in (ax.collections if heat else ax.patches)):
            style = {"facecolor": "none", "edgecolor": edge} if heat else {"color": shade, "alpha": alpha}
            handles.append(Patch(label=text, **style))
    if handles:
        columns = len(handles) if heat else _legend_columns(len(handles), fig.get_size_inches()[0])
        fig.legend(handles=handles, loc="lower center", ncols=columns, fontsize=8, frameon=False)


def save_plot(
    source: str | os.PathLike[str] | pd.DataFrame,
    output: str | os.PathLike[str],
    fields: str | Sequence[str] | None = None,
    **options: Any,
) -> Path:
    """Draw a recording (:func:`plot_recording`, which takes ``options``) and write it to ``output``: the path.

    The format follows the suffix (png, svg, pdf); raises what :func:`plot_recording` raises, and OSError.
    """
    path = Path(output)
    with _collector_paused():  # once for drawing and writing: resumed in between, it would walk the figure
        fig = plot_recording(source, fields, **options)
        fig.savefig(path, dpi=fig.dpi, **(_PNG if path.suffix.lower() == ".png" else {}))
    return path


def plot_png(
    source: str | os.PathLike[str] | pd.DataFrame, fields: str | Sequence[str] | None = None, **options: Any
) -> bytes:
    """Draw a recording (:func:`plot_recording`, which takes ``options``) as PNG bytes, e.g. for a report's page."""
    import io

    buf = io.BytesIO()
    with _collector_paused():
        fig = plot_recording(source, fields, **options)
        fig.savefig(buf, format="png", dpi=fig.dpi, **_PNG)
    return buf.getvalue()


#: A field's physical colour range: (lowest, highest, where it comes from, e.g. ``"0 to memory.total"``).
_Scale = tuple[float, float, str]

#: The outline of a stall on a GPU's row, and of a firing alert.
_STALL_EDGE = "#000000"
_ALERT_EDGE = "#e6550d"
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


def _heatmap_figure(
    figure: type[Figure], scene: Scene, size: tuple[float, float, int], scales: dict[str, _Scale]
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
        _outline(ax, scene.stalls, row_of, _STALL_EDGE, "stall", 0.9)
        _outline(ax, scene.alerts.get(fld.name, []), row_of, _ALERT_EDGE, "alert", 1.3)
        # a fixed place: placed around the ticks, a title is measured again on every draw
        name = f"{fld.name} [{fld.unit}]" if fld.unit else fld.name
        ax.set_title(f"{name}, colour: {source}" if source else name, loc="left", fontsize=10, y=1.0, pad=4)
        ax.set_yticks(shown, [printable(nodes[r] or "") if names else str(gpus[r]) for r in shown], fontsize=7)
        ax.set_ylabel("node" if names else "GPU")
        if names and len(starts) > 1:
            ax.hlines([r - 0.5 for r in starts[1:]], lo, hi, colors="#ffffff", linewidths=1.0, gid="node-boundary")
        if not np.isfinite(cells).any():
            _no_values_note(ax, fld.name)
    return fig, axes


def _no_values_note(ax: Any, name: str) -> None:
    """The note across a panel (``gid="no-data"``) whose field ``name`` has no value in any sample."""
    note = f"no values: {name} was missing ([N/A] or not supported) in every sample"
    ax.text(
        0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#555555", gid="no-data"
    )


def _colour_range(fld: Field, cells: np.ndarray, scale: _Scale | None) -> tuple[float, float, str]:
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
    # one artist for all: a patch each costs milliseconds to add and to draw
    verts = [[(s0, a - 0.5), (e0, a - 0.5), (e0, b + 0.5), (s0, b + 0.5)] for s0, e0, a, b in boxes]
    ax.add_collection(PolyCollection(verts, facecolors="none", edgecolors=edge, linewidths=lw, gid=gid, zorder=3),
                      autolim=False)  # fmt: skip
