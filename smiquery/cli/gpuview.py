"""The GPU lines of the live table: one line per GPU, as compact as gpustat's, fitted to the terminal.

``GPU NAME TEMP UTIL MEM PWR`` with the units once in the titles, a utilization bar where there is room, memory as
``used/total``, and the GPU's processes (``user/name(MiB)``) on its line, or indented under it when they do not fit.
A summary line counts the GPUs (busy, idle, lost), their mean utilization and the hottest one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smiquery.fields import Field
from smiquery.printable import printable
from smiquery.sample import GpuSample

__all__ = ["GpuLines", "gpu_lines", "short_name", "summary_line"]

# Identity columns left out first when narrow, then the other measurements, then the bar, the name, the rest.
_IDENTITY = ("uuid", "pci.bus_id", "serial", "vbios_version", "driver_version")
_KEY = ("index", "utilization.gpu", "memory.used", "power.draw", "temperature.gpu", "memory.total")
_TITLES = {
    "index": "GPU",
    "name": "NAME",
    "uuid": "UUID",
    "pci.bus_id": "BUS",
    "temperature.gpu": "TEMP",
    "temperature.memory": "MTEMP",
    "utilization.gpu": "UTIL",
    "utilization.memory": "MUTIL",
    "memory.used": "MEM",
    "memory.total": "TOTAL",
    "memory.free": "FREE",
    "power.draw": "PWR",
    "power.limit": "PLIM",
    "fan.speed": "FAN",
    "clocks.current.sm": "SM",
    "clocks.current.memory": "MEMCLK",
    "clocks.current.graphics": "GFXCLK",
}
_BAR = 10
_MIN_PROCS = 16  # the narrowest processes column; narrower, they go under their GPU
_VENDOR = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}
_SUFFIX = re.compile(r"(HBM\w*|GDDR\w*|PCIE|SXM\d*|NVL|SXM)", re.IGNORECASE)
#: Utilization under this many percent counts a GPU as idle in the summary line (as ``smiquery top``).
IDLE_BELOW = 5


def short_name(name: str) -> str:
    """A GPU model without the vendor and memory words: ``H100 80GB`` from ``NVIDIA H100 80GB HBM3``."""
    words = [w for w in name.split() if w.upper() not in _VENDOR]
    while len(words) > 1 and _SUFFIX.fullmatch(words[-1]):
        words.pop()
    return " ".join(words) or name


def _bar(value: object) -> str:
    if not isinstance(value, (int, float)):
        return ""
    filled = round(max(0.0, min(100.0, float(value))) / 100 * _BAR)
    return "█" * filled + "░" * (_BAR - filled)


@dataclass
class _Col:
    name: str  # a field name, or "state" / "bar"
    title: str
    right: bool
    cells: list[str] = field(default_factory=list)
    styles: list[str | None] = field(default_factory=list)

    @property
    def width(self) -> int:
        return max(len(self.title), *(len(c) for c in self.cells)) if self.cells else len(self.title)


@dataclass
class GpuLines:
    """The fitted lines: the title line, each GPU's lines (its own first, then its processes), what was left out."""

    header: str
    rows: list[list[str]]
    hidden: list[str]


def _columns(
    samples: Sequence[GpuSample],
    fields: Sequence[Field],
    cells: Sequence[Sequence[str]],
    styles: Sequence[Sequence[str | None]],
    marks: Sequence[str],
) -> list[_Col]:
    names = [f.name for f in fields]
    merged = "memory.used" in names and "memory.total" in names
    cols: list[_Col] = []
    if any(marks):
        cols.append(_Col("state", "STATE", False, list(marks), [_mark_style(m) for m in marks]))
    for i, f in enumerate(fields):
        if merged and f.name == "memory.total":
            continue
        title = _TITLES.get(f.name) or f.name.rsplit(".", 1)[-1][:10].upper()
        col = _Col(f.name, f"{title} {f.unit}" if f.unit else title, f.kind.is_numeric)
        col.cells = [row[i] for row in cells]
        col.styles = [st[i] for st in styles]
        if f.name == "name":
            col.cells = [short_name(c) for c in col.cells]
        if merged and f.name == "memory.used":
            t = names.index("memory.total")
            col.cells = [f"{row[i]}/{row[t]}" for row in cells]
            col.styles = [st[i] or st[t] for st in styles]
        cols.append(col)
        if f.name == "utilization.gpu":
            cols.append(_Col("bar", "", False, [_bar(s.get(f.name)) for s in samples], list(col.styles)))
    return cols


def _mark_style(mark: str) -> str | None:
    return "error" if mark in ("LOST", "RESET") else ("pending" if mark else None)


def _drop_order(cols: Sequence[_Col]) -> list[str]:
    names = [c.name for c in cols]
    rank = {n: r for r, n in enumerate(_KEY)}
    identity = [n for n in _IDENTITY if n in names]
    rest = [n for n in names if n not in (*identity, "state", "bar", "name") and n not in rank]
    kept = sorted((n for n in names if n in rank), key=lambda n: -rank[n])
    return [*identity, *reversed(rest), *(["bar"] if "bar" in names else []), *(["name"] * ("name" in names)), *kept]


def gpu_lines(
    samples: Sequence[GpuSample],
    fields: Sequence[Field],
    cells: Sequence[Sequence[str]],
    styles: Sequence[Sequence[str | None]],
    cols: int,
    *,
    marks: Sequence[str],
    procs: Sequence[Sequence[str]] | None = None,
    uuid: bool = False,
    paint: Callable[[str, str | None], str] = lambda text, style: text,
) -> GpuLines:
    """One line per GPU fitted to ``cols`` (0: any), its processes after it or under it.

    Args:
        samples: one per GPU, in the order shown.
        fields: the fields of ``cells``.
        cells: each sample's display texts (missing values marked).
        styles: each cell's style name, or None.
        cols: the terminal's width.
        marks: a state per row (``LOST``, ``stale 3s``); a state column when any has one.
        procs: each GPU's processes (``user/name(MiB)``), or None for none shown.
        uuid: keep the UUID (asked for); otherwise it shows only on a terminal 200 columns wide or more.
        paint: colours a text by style name (identity: no colour).
    """
    columns = _columns(samples, fields, cells, styles, marks)
    if not (uuid or cols <= 0 or cols >= 200):
        columns = [c for c in columns if c.name != "uuid"]
    hidden: list[str] = []

    def width(cs: Sequence[_Col]) -> int:
        return sum(c.width for c in cs) + 2 * (len(cs) - 1)

    for name in _drop_order(columns):
        if cols <= 0 or width(columns) <= cols or len(columns) <= 1:
            break
        columns = [c for c in columns if c.name != name]
        if name != "bar":
            hidden += [f.name for f in fields if f.name == name or (name == "memory.used" and f.name == "memory.total")]
    widths = [c.width for c in columns]

    def line(texts: Sequence[str], styles: Sequence[str | None]) -> str:
        out = []
        for c, w, text, st in zip(columns, widths, texts, styles):
            text = printable(text)
            out.append(paint(text.rjust(w) if c.right else text.ljust(w), st))
        return "  ".join(out)

    titles = [c.title.rjust(w) if c.right else c.title.ljust(w) for c, w in zip(columns, widths)]
    header = paint("  ".join(titles).rstrip(), "header")
    start = width(columns) + 2
    inline = cols <= 0 or cols - start >= _MIN_PROCS
    if procs is not None and any(procs) and inline:
        header = f"{header}  {paint('PROCESSES', 'header')}"
    rows: list[list[str]] = []
    for r in range(len(samples)):
        first = line([c.cells[r] for c in columns], [c.styles[r] for c in columns])
        labels = [printable(p) for p in procs[r]] if procs is not None and r < len(procs) else []
        if not labels:
            rows.append([first.rstrip()])
            continue
        indent, room = (start, cols - start) if inline else (4, cols - 4)
        packed = _pack(labels, room if cols > 0 else 0)
        if inline:
            rows.append([f"{first}  {paint(packed[0], 'dim')}", *(" " * indent + paint(p, "dim") for p in packed[1:])])
        else:
            rows.append([first.rstrip(), *(" " * indent + paint(p, "dim") for p in packed)])
    return GpuLines(header, rows, hidden)


def _pack(labels: Sequence[str], room: int) -> list[str]:
    """Labels joined with spaces into lines of at most ``room`` characters (0: one line)."""
    lines: list[str] = []
    current = ""
    for label in labels:
        joined = f"{current} {label}" if current else label
        if current and room > 0 and len(joined) > room:
            lines.append(current)
            current = label
        else:
            current = joined
    lines.append(current)
    return lines


def summary_line(samples: Sequence[GpuSample], marks: Sequence[str]) -> str:
    """``64 GPUs · 40 busy · 20 idle · 4 lost · mean util 63 % · hottest GPU 5 at 89 C``."""
    lost = sum(1 for m in marks if m in ("LOST", "RESET"))
    stale = sum(1 for m in marks if m.startswith("stale"))
    parts = [f"{len(samples)} GPUs"]
    live = [s for s, m in zip(samples, marks) if not m]
    utils = [u for s in live if isinstance(u := s.get("utilization.gpu"), (int, float))]
    if any("utilization.gpu" in s for s in samples):
        busy = sum(1 for u in utils if u >= IDLE_BELOW)
        parts += [f"{busy} busy", f"{len(utils) - busy} idle"]
    parts.append(f"{lost} lost")
    if stale:
        parts.append(f"{stale} stale")
    if utils:
        parts.append(f"mean util {sum(utils) / len(utils):.0f} %")
    temps = [(t, s) for s in live if isinstance(t := s.get("temperature.gpu"), (int, float))]
    if temps:
        t, s = max(temps, key=lambda pair: pair[0])
        which = f"GPU {s.index}" if "index" in s else "GPU"
        parts.append(f"hottest {which} at {t:.0f} C")
    return " · ".join(parts)
