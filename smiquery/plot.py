"""A recorded run as a picture: one panel per field, one line per GPU, alert thresholds, gaps where data is missing.

Needs matplotlib (``pip install 'smiquery[plot]'``). Figures are built with the object API on the Agg canvas, so
nothing here touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from smiquery.alerts import Rule
from smiquery.fields import Field, Kind, get_field
from smiquery.report import DEFAULT_RULES, ReportError, load_recording

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["DEFAULT_PLOT_FIELDS", "plot_recording", "save_plot"]

#: The panels drawn when no fields are given (those the recording has).
DEFAULT_PLOT_FIELDS: tuple[str, ...] = ("utilization.gpu", "temperature.gpu", "memory.used", "power.draw")

# Colour-blind-safe categorical colours (Okabe-Ito, then the rest of tab10); thresholds are drawn in black.
_GPU_COLOURS = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#7f7f7f",
    "#8c564b",
    "#17becf",
    "#bcbd22",
    "#9467bd",
)
_THRESHOLD_COLOUR = "#000000"


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'smiquery[plot]'") from exc


def _colour(position: int) -> str:
    if position < len(_GPU_COLOURS):
        return _GPU_COLOURS[position]
    # more GPUs than distinct colours: spread the rest around the hue circle
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((position * 0.618034) % 1.0, 0.75, 0.8)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


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
        if fld.attr not in df.columns:
            raise ReportError(f"the recording has no {fld.name}; it holds {', '.join(map(str, df.columns))}")
        if fld.kind not in (Kind.INT, Kind.FLOAT, Kind.ENABLED, Kind.YES_NO, Kind.ACTIVE):
            raise ReportError(f"{fld.name} is {fld.kind.value}, not a number; it cannot be plotted")
        if all(f.name != fld.name for f in out):
            out.append(fld)
    if not out:
        raise ReportError("no field to plot")
    return out


def _series(frame: pd.DataFrame, column: str, gap_limit: float, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """x (naive local datetime64) and y (float, NaN where missing or across a gap in time) for one GPU."""
    import numpy as np

    ts = frame["timestamp"]
    if getattr(ts.dt, "tz", None) is not None:
        ts = ts.dt.tz_localize(None)  # wall-clock time of the recording, as nvidia-smi printed it
    x = ts.to_numpy(dtype="datetime64[ns]")
    y = np.asarray(frame[column].astype("Float64").to_numpy(dtype="float64", na_value=np.nan), dtype="float64")
    if len(x) > max_points:
        step = math.ceil(len(x) / max_points)
        n = (len(x) // step) * step
        x = x[:n:step]
        blocks = y[:n].reshape(-1, step)
        with np.errstate(all="ignore"):
            counts = (~np.isnan(blocks)).sum(axis=1)
            sums = np.nansum(blocks, axis=1)
            y = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    if len(x) > 1:
        secs = np.diff(x).astype("timedelta64[ns]").astype("float64") / 1e9
        limit = gap_limit * max(1, math.ceil(len(frame) / max_points))
        gaps = np.nonzero(secs > limit)[0]
        if len(gaps):
            # a NaN point inside each gap breaks the line there
            mids = x[gaps] + (x[gaps + 1] - x[gaps]) // 2
            x = np.insert(x, gaps + 1, mids)
            y = np.insert(y, gaps + 1, np.nan)
    return x, y


def _thresholds(rules: Sequence[Rule], fld: Field) -> list[tuple[float, str]]:
    out: dict[float, str] = {}
    for rule in rules:
        if rule.field.name != fld.name or isinstance(rule.threshold, bool):
            continue
        if isinstance(rule.threshold, (int, float)):
            text = str(rule)
            label = text[len(rule.field.name) :].strip() if text.startswith(rule.field.name) else text
            value = float(rule.threshold)
            out[value] = f"{out[value]}; {label}" if value in out else label
    return sorted(out.items())


def plot_recording(
    source: str | os.PathLike[str] | pd.DataFrame,
    fields: str | Sequence[str] | None = None,
    *,
    rules: Iterable[Rule | str] | None = None,
    gpus: Sequence[int] | None = None,
    title: str | None = None,
    width: float = 12.0,
    panel_height: float = 2.4,
    dpi: int = 100,
    max_points: int = 20_000,
) -> Figure:
    """Draw a recording: one panel per field (shared time axis), one line per GPU, rule thresholds as dashed lines.

    Missing values (``[N/A]``, a lost GPU) and gaps in time (the recording was stopped) show as breaks in the
    lines, never as zeros or straight joins. Lines longer than ``max_points`` are averaged into that many points.

    Args:
        source: a recording path (CSV, JSONL, Parquet) or a DataFrame shaped like :func:`smiquery.frames.read_csv`.
        fields: fields to draw, as names or a comma list; default :data:`DEFAULT_PLOT_FIELDS` (those present).
        rules: rules whose thresholds are drawn; default :data:`smiquery.report.DEFAULT_RULES`.
        gpus: only these GPU indices.
        title: the figure title (default: the file name and time span).
        width: figure width in inches.
        panel_height: height of one panel in inches.
        dpi: resolution in dots per inch.
        max_points: most points per line.

    Returns:
        A matplotlib ``Figure``; each GPU line has ``gid="gpu-<index>"``, each threshold line ``gid="threshold"``.

    Raises:
        ImportError: matplotlib is not installed.
        ReportError: the recording cannot be read or lacks a requested field.
        InvalidFieldError: an unknown field name.
        InvalidRuleError: a rule cannot be parsed.
    """
    _matplotlib()
    import matplotlib.dates as mdates
    from matplotlib.figure import Figure

    df = load_recording(source)
    if gpus is not None:
        df = df[df["index"].isin(list(gpus))]
    if df.empty:
        raise ReportError("the recording holds no samples" + (" for those GPUs" if gpus is not None else ""))
    flds = _resolve(fields, df)
    parsed = [r if isinstance(r, Rule) else Rule.parse(r) for r in (DEFAULT_RULES if rules is None else rules)]

    groups = [(int(cast(Any, idx)), frame) for idx, frame in df.groupby("index", sort=True)]
    diffs = [frame["timestamp"].diff().dt.total_seconds().median() for _, frame in groups if len(frame) > 1]
    interval = float(sorted(diffs)[len(diffs) // 2]) if diffs else 1.0
    if not interval > 0 or math.isnan(interval):
        interval = 1.0
    gap_limit = max(3 * interval, 5.0)

    fig = Figure(figsize=(width, panel_height * len(flds) + 0.9), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(flds), 1, sharex=True, squeeze=False)[:, 0]
    handles: list[Any] = []
    for ax, fld in zip(axes, flds):
        for pos, (idx, frame) in enumerate(groups):
            x, y = _series(frame, fld.attr, gap_limit, max_points)
            (line,) = ax.plot(x, y, color=_colour(pos), linewidth=1.1, label=f"GPU {idx}", gid=f"gpu-{idx}")
            if ax is axes[0]:
                handles.append(line)
        marks = _thresholds(parsed, fld)
        for n, (value, label) in enumerate(marks):
            ax.axhline(value, color=_THRESHOLD_COLOUR, linestyle="--", linewidth=0.9, gid="threshold", zorder=3)
            above = n == len(marks) - 1  # the highest label above its line, the others below theirs
            ax.annotate(
                label,
                xy=(0.0, value),
                xycoords=("axes fraction", "data"),
                xytext=(4, 2 if above else -2),
                textcoords="offset points",
                ha="left",
                va="bottom" if above else "top",
                fontsize=8,
                color=_THRESHOLD_COLOUR,
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
                zorder=4,
            )
        unit = fld.unit
        ax.set_title(f"{fld.name} [{unit}]" if unit else fld.name, loc="left", fontsize=10)
        if unit:
            ax.set_ylabel(unit)
        if unit == "%":
            ax.set_ylim(-2, 105)
        elif fld.kind.is_bool:
            ax.set_ylim(-0.1, 1.1)
            ax.set_yticks([0, 1], ["no", "yes"])
        ax.grid(True, color="#dddddd", linewidth=0.6)
        ax.margins(x=0.005)
    locator = mdates.AutoDateLocator()  # type: ignore[no-untyped-call]
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    start = df["timestamp"].min()
    end = df["timestamp"].max()
    if title is None:
        name = "recording" if not isinstance(source, (str, os.PathLike)) else os.path.basename(os.fspath(source))
        title = (
            f"{name}: {len(groups)} GPU{'s' if len(groups) != 1 else ''}, {start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S}"
        )
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.legend(
        handles=handles,
        loc="outside upper right",
        ncols=min(len(handles), 8),
        fontsize=8,
        frameon=False,
    )
    return fig


def save_plot(
    source: str | os.PathLike[str] | pd.DataFrame,
    output: str | os.PathLike[str],
    fields: str | Sequence[str] | None = None,
    **options: Any,
) -> Path:
    """Draw a recording (see :func:`plot_recording`) and write it; the format follows the suffix (png, svg, pdf).

    Args:
        source: the recording or DataFrame.
        output: the image file to write.
        fields: the fields to draw.
        **options: passed to :func:`plot_recording`.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
        ReportError: the recording cannot be read or lacks a requested field.
        OSError: the image cannot be written.
    """
    fig = plot_recording(source, fields, **options)
    path = Path(output)
    fig.savefig(path, dpi=fig.dpi)
    return path
