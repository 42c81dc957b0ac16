"""Rendering samples for people: aligned tables and the live in-place table.

The recording writers (CSV, JSONL, Parquet) are :mod:`smiquery.recordings`'s; this module only draws for a reader.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any, Literal

from smiquery.cli.keys import Viewport
from smiquery.fields import Field, Kind, get_field
from smiquery.printable import printable
from smiquery.recordings import json_value, sample_to_json
from smiquery.sample import GpuSample, Value
from smiquery.sources.query_gpu import format_row, header_line

if TYPE_CHECKING:
    from smiquery.alerts import AlertEvaluator, AlertEvent

__all__ = [
    "MISSING_MARKS",
    "UNKNOWN_USER",
    "Column",
    "LiveTable",
    "clip",
    "display_value",
    "fit_samples",
    "hidden_note",
    "render",
    "render_table",
    "sample_table",
    "terminal_size",
    "terminal_width",
    "use_color",
    "wrap_last_column",
]

#: How a missing value shows in a table, by reason (anything else shows as ``n/a``). Never blank, never 0.
MISSING_MARKS: dict[str, str] = {
    "not_available": "n/a",
    "not_supported": "n/s",
    "gpu_lost": "LOST",
    "gpu_requires_reset": "RESET",
    "insufficient_permissions": "denied",
    "unknown_error": "error",
}
MISSING_LEGEND = "n/a = not available, n/s = not supported"
#: A process whose user is not known (another PID namespace, gone): the same mark in ``stream`` and ``ps``.
UNKNOWN_USER = "?"

_RESET = "\x1b[0m"
_STYLES = {
    "firing": "\x1b[1;31m",
    "pending": "\x1b[33m",
    "missing": "\x1b[2m",
    "header": "\x1b[1m",
    "dim": "\x1b[2m",
    "error": "\x1b[1;97;41m",  # a lost or broken GPU: white on red, unlike a merely absent value
}
# Missing-value reasons that mean the GPU is in trouble: drawn as an error, not dimmed like n/a.
_ERROR_REASONS = frozenset({"gpu_lost", "gpu_requires_reset", "unknown_error"})
# Control characters a cell shows as ``?`` (as ps does): a newline or tab in a command line would break the table.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CellState = Literal["firing", "pending", "ok"]
# Wide identity columns the live table leaves out, in this order, when the terminal is too narrow.
_DROP_FIRST = ("uuid", "pci.bus_id", "serial", "vbios_version", "driver_version", "name")


def use_color(stream: IO[str]) -> bool:
    """Whether to colour output on ``stream``: a terminal, ``NO_COLOR`` unset and ``TERM`` not ``dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# ------------------------------------------------------------------------------------------------- values


def display_value(fld: Field, value: Value, reason: str | None = None) -> str:
    """A value as a table shows it: nvidia-smi's spelling without units; missing as ``n/a`` (or its reason).

    Decimals are rounded to the unit's precision (watts: two, as nvidia-smi prints them).
    """
    return fld.display(value, missing=MISSING_MARKS.get(reason or "not_available", "n/a"))


def _right_aligned(fld: Field) -> bool:
    return fld.kind.is_numeric


def _title(fld: Field) -> str:
    return f"{fld.name} [{fld.unit}]" if fld.unit else fld.name


def _visible_len(text: str) -> int:
    return len(_ANSI_RE.sub("", text))


def clip(line: str, width: int) -> str:
    """Cut a line to ``width`` visible characters, keeping (and closing) its colour codes."""
    if width <= 0 or _visible_len(line) <= width:
        return line
    out: list[str] = []
    shown = 0
    i = 0
    coloured = False
    while i < len(line) and shown < width - 1:
        m = _ANSI_RE.match(line, i)
        if m:
            out.append(m.group(0))
            coloured = True
            i = m.end()
            continue
        out.append(line[i])
        shown += 1
        i += 1
    out.append("…")
    if coloured:
        out.append(_RESET)
    return "".join(out)


def render_table(
    rows: Sequence[Sequence[str]],
    titles: Sequence[str],
    *,
    right: Sequence[bool] | None = None,
    styles: Sequence[Sequence[str | None]] | None = None,
    color: bool = False,
) -> list[str]:
    """Align text cells under titles (two spaces between columns).

    Args:
        rows: the cells, row by row.
        titles: the column titles.
        right: which columns to right-align (numbers); default none.
        styles: per-cell style names (``"firing"``, ``"pending"``, ``"missing"``) or None, used when ``color``.
        color: emit ANSI colour codes.

    Returns:
        The lines, title line first, without newlines. Control characters in cells and titles are shown escaped
        (:func:`smiquery.printable.printable`).
    """
    rows = [[printable(cell) for cell in row] for row in rows]  # text from others never reaches the terminal raw
    titles = [printable(t) for t in titles]
    ncols = len(titles)
    widths = [len(t) for t in titles]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    align = list(right) if right is not None else [False] * ncols

    def fit(text: str, i: int) -> str:
        return text.rjust(widths[i]) if align[i] else text.ljust(widths[i])

    head = "  ".join(fit(t, i) for i, t in enumerate(titles)).rstrip()
    lines = [f"{_STYLES['header']}{head}{_RESET}" if color else head]
    for r, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            text = fit(cell, i)
            style = styles[r][i] if styles is not None else None
            if color and style:
                text = f"{_STYLES[style]}{text}{_RESET}"
            cells.append(text)
        lines.append("  ".join(cells).rstrip())
    return lines


def sample_rows(
    samples: Iterable[GpuSample],
    fields: Sequence[Field],
    *,
    cell_state: Callable[[GpuSample, str], CellState] | None = None,
) -> tuple[list[list[str]], list[list[str | None]]]:
    """The display cells of each sample for ``fields``, and each cell's style (alert state or missing)."""
    rows: list[list[str]] = []
    styles: list[list[str | None]] = []
    for s in samples:
        missing = s.missing
        row: list[str] = []
        style: list[str | None] = []
        for fld in fields:
            value = s.get(fld.name)
            row.append(display_value(fld, value, missing.get(fld.name)))
            st: str | None = None
            if value is None:
                st = "error" if missing.get(fld.name) in _ERROR_REASONS else "missing"
            if cell_state is not None and value is not None:
                state = cell_state(s, fld.name)
                if state != "ok":
                    st = state
            style.append(st)
        rows.append(row)
        styles.append(style)
    return rows, styles


def sample_table(
    samples: Sequence[GpuSample],
    fields: Sequence[Field] | None = None,
    *,
    color: bool = False,
    cell_state: Callable[[GpuSample, str], CellState] | None = None,
    width: int = 0,
) -> list[str]:
    """A static table of samples: one row per sample, units in the titles, missing values marked.

    With a ``width`` (a terminal's), it is fitted as the live table is (:func:`fit_samples`) and ends with a line
    naming the fields left out.
    """
    if fields is None:
        fields = tuple(get_field(n) for n in samples[0].fields) if samples else ()
    if width > 0:
        lines, hidden = fit_samples(samples, fields, width, color=color, cell_state=cell_state)
        return lines + hidden_note(hidden, width)
    rows, styles = sample_rows(samples, fields, cell_state=cell_state)
    return render_table(
        rows, [_title(f) for f in fields], right=[_right_aligned(f) for f in fields], styles=styles, color=color
    )


@dataclass(frozen=True)
class Column:
    """One column of plain records (not samples) for :func:`render`.

    Attributes:
        key: the record key.
        title: the column title.
        unit: the unit, shown in titles (``[MiB]``) and after CSV values.
        right: right-align in tables (numbers).
        style: a cell's style name (``"firing"``, ``"missing"``, ...) from its value, for coloured tables.
        table_text: how a table shows a present value (default ``str``).
        missing: how a table shows a missing value.
    """

    key: str
    title: str = ""
    unit: str = ""
    right: bool = False
    style: Callable[[object], str | None] | None = None
    table_text: Callable[[object], str] | None = None
    missing: str = "n/a"

    @property
    def heading(self) -> str:
        """The title with its unit."""
        title = self.title or self.key
        return f"{title} [{self.unit}]" if self.unit else title


def _plain_json(record: Mapping[str, object]) -> dict[str, object]:
    return {k: json_value(v) if not isinstance(v, (list, dict)) else v for k, v in record.items()}  # type: ignore[arg-type]


def _csv_cell(value: object, unit: str) -> str:
    if value is None:
        return "[N/A]"
    if isinstance(value, bool):
        return "Yes" if value else "No"
    if isinstance(value, (list, tuple)):
        value = " ".join(str(v) for v in value)
    text = str(value).replace(",", ";").replace("\n", " ")
    return f"{text} {unit}" if unit else text


def render(
    records: Sequence[GpuSample] | Sequence[Mapping[str, Any]],
    fmt: str,
    *,
    fields: Sequence[Field] | None = None,
    columns: Sequence[Column] | None = None,
    color: bool = False,
    empty: str = "",
    width: int = 0,
) -> str:
    """Records as text in one of the output formats: ``table``, ``csv``, ``jsonl`` or ``json``.

    Samples (:class:`GpuSample`, with ``fields``) render as nvidia-smi's CSV (read back by ``read_csv``), JSON
    keyed by field name (ISO times, null for missing, reasons under ``"_missing"``) or an aligned table with
    units in the titles. Plain records render by ``columns``.

    Args:
        records: samples, or plain mappings.
        fmt: the format.
        fields: the sample fields (default: the first sample's); ignored when ``columns`` is given.
        columns: the columns of plain records.
        color: colour the table (missing values dim, lost GPUs as errors).
        empty: what a table shows when there are no records (default: just the titles).
        width: a table's most columns (a terminal's width; 0: any): samples are fitted as the live table is,
            plain records wrap their last column.

    Returns:
        The text, each line ending in a newline.

    Raises:
        ValueError: an unknown format.
    """
    if fmt not in ("table", "csv", "jsonl", "json"):
        raise ValueError(f"unknown format {fmt!r}; use table, csv, jsonl or json")
    if columns is None:
        samples: list[GpuSample] = list(records)  # type: ignore[arg-type]
        if fields is None:
            fields = tuple(get_field(n) for n in samples[0].fields) if samples else ()
        if fmt == "json":
            return json.dumps([sample_to_json(s) for s in samples], indent=2) + "\n"
        if fmt == "jsonl":
            return "".join(json.dumps(sample_to_json(s), separators=(", ", ": ")) + "\n" for s in samples)
        if fmt == "csv":
            return "".join([header_line(fields) + "\n", *(format_row(s, fields, units=True) + "\n" for s in samples)])
        if not samples and empty:
            return empty + "\n"
        return "".join(line + "\n" for line in sample_table(samples, fields, color=color, width=width))
    plain: Sequence[Mapping[str, Any]] = records
    if fmt == "json":
        return json.dumps([_plain_json(r) for r in plain], indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(_plain_json(r)) + "\n" for r in plain)
    if fmt == "csv":
        lines = [", ".join(c.heading for c in columns)]
        lines += [", ".join(_csv_cell(r.get(c.key), c.unit) for c in columns) for r in plain]
        return "".join(line + "\n" for line in lines)
    if not plain and empty:
        return empty + "\n"
    rows: list[list[str]] = []
    styles: list[list[str | None]] = []
    for r in plain:
        row: list[str] = []
        style: list[str | None] = []
        for c in columns:
            value = r.get(c.key)
            if value is None:
                row.append(c.missing)
                style.append("missing")
                continue
            text = c.table_text(value) if c.table_text is not None else str(value)
            row.append(_CONTROL_RE.sub("?", text))  # a newline in a command line must not break the table
            style.append(c.style(value) if c.style is not None else None)
        rows.append(row)
        styles.append(style)
    titles, right = [c.heading for c in columns], [c.right for c in columns]
    lines = render_table(rows, titles, right=right, styles=styles, color=color)
    if width > 0 and any(_visible_len(x) > width for x in lines):  # wrapped as plain text: no colour then
        lines = wrap_last_column(render_table(rows, titles, right=right), width)
    return "".join(line + "\n" for line in lines)


# ------------------------------------------------------------------------------------------------ live table


def fit_samples(
    samples: Sequence[GpuSample],
    fields: Sequence[Field],
    cols: int,
    *,
    color: bool = False,
    cell_state: Callable[[GpuSample, str], CellState] | None = None,
    marks: Sequence[str] | None = None,
) -> tuple[list[str], list[str]]:
    """A table of samples that fits ``cols`` columns (0: any width), and the names of the fields left out.

    Full titles first; then short titles (``temp C``); then fields are left out, identity first (UUID, bus id,
    name), measurements last, and index, utilization, memory, power and temperature the very last.

    Args:
        samples: one row each.
        fields: the columns.
        cols: the terminal's width.
        color: emit ANSI colours.
        cell_state: alert state of a cell, for its colour.
        marks: a state text per row (``LOST``, ``stale 3s``): a first column, shown when any row has one; a stale
            row is dimmed.

    Returns:
        The lines (titles first), and the fields left out in the order they were.
    """
    if not samples:
        return [], []
    fields = list(fields)
    rows, styles = sample_rows(samples, fields, cell_state=cell_state)
    marks = marks or [""] * len(rows)
    for style, mark in zip(styles, marks):
        if mark.startswith("stale"):  # old numbers: dimmed, whatever they were
            style[:] = ["dim"] * len(style)
    offset = 1 if any(marks) else 0
    if offset:
        for row, style, mark in zip(rows, styles, marks):
            row.insert(0, mark)
            style.insert(0, "error" if mark in ("LOST", "RESET") else ("pending" if mark else None))

    def table(keep: Sequence[int], short: bool) -> list[str]:
        cells = [*range(offset), *(i + offset for i in keep)]
        titles = [_short_title(fields[i]) if short else _title(fields[i]) for i in keep]
        return render_table(
            [[r[i] for i in cells] for r in rows],
            ["state"] * offset + titles,
            right=[False] * offset + [_right_aligned(fields[i]) for i in keep],
            styles=[[st[i] for i in cells] for st in styles],
            color=color,
        )

    keep = list(range(len(fields)))
    lines = table(keep, False)

    def fits(lines: Sequence[str]) -> bool:
        return max(_visible_len(x) for x in lines) <= cols

    if cols <= 0 or fits(lines):
        return lines, []
    lines = table(keep, True)
    hidden: list[str] = []
    for i in _drop_order(fields):
        if fits(lines) or len(keep) <= 1:
            break
        keep.remove(i)
        hidden.append(fields[i].name)
        lines = table(keep, True)
    return lines, hidden


def hidden_note(hidden: Sequence[str], cols: int) -> list[str]:
    """``hidden (terminal too narrow): uuid, name``, wrapped to ``cols``; nothing when nothing is hidden."""
    if not hidden:
        return []
    words = ["hidden", "(terminal", "too", "narrow):", *(f"{h}," for h in hidden[:-1]), hidden[-1]]
    return _wrap(words, cols, sep=" ")


def wrap_last_column(lines: Sequence[str], cols: int) -> list[str]:
    """Table lines with the text of their last column wrapped so that none is wider than ``cols``.

    The text wraps under its own column; when that column would be narrower than 30, it goes on the lines below
    its row instead, indented. The last column starts where its title does on the first line (plain text only).
    """
    if cols <= 0 or not lines or all(len(x) <= cols for x in lines):
        return list(lines)
    head = lines[0]
    start = len(head) - len(head.rsplit("  ", 1)[-1]) if "  " in head else 0
    below = cols - start < 30
    indent = 4 if below else start
    room = max(10, cols - indent)
    out: list[str] = []
    for i, line in enumerate(lines):
        lead, text = line[:start].rstrip(), line[start:]
        if below:
            out.append(clip(lead, cols))
            if i > 0 and text.strip():
                out += [" " * indent + c for c in textwrap.wrap(text, room)]
            continue
        if len(line) <= cols:
            out.append(line)
            continue
        chunks = textwrap.wrap(text, room) or [""]
        out.append(line[:start] + chunks[0])
        out += [" " * indent + c for c in chunks[1:]]
    return out


class LiveTable:
    """The newest sample of each GPU, one line each, redrawn in place on a terminal (ANSI, no curses).

    Each frame moves the cursor home and rewrites every line, clearing what is left of the old frame, in one
    write: a title, a summary line (GPUs, busy, idle, lost, mean utilization, the hottest), the GPU lines
    (:func:`~smiquery.cli.gpuview.gpu_lines`), then the footer (which GPUs are shown of how many, sample age,
    counters, alerts). The footer is always drawn: when the terminal is too short, the processes under the GPUs
    go first, then GPU rows scroll (:meth:`key`: arrows, PgUp/PgDn, Home/End; sort keys; ``/`` filters), and GPUs
    in trouble (lost, stale, past a firing rule) are never the ones left out. A GPU that stopped reporting keeps
    its last numbers, dimmed and marked ``stale`` in its row; a lost one is marked ``LOST``.

    Args:
        out: the terminal.
        fields: the columns (``timestamp`` is left out: the footer shows the age instead).
        title: the first line (what is being watched).
        color: colour cells past alert thresholds (red firing, yellow pending) and dim missing values.
        evaluator: the ``--alert`` evaluator, for cell colours and the firing list.
        size: returns (columns, lines) of the terminal.
        health: an evaluator of health rules (the built-in ones) that colours cells too, fed by :meth:`update`.
        stale_after: seconds without a sample after which every row is marked stale (the source went quiet).
        processes: show the processes of each GPU, on its line or under it (where the terminal has room).
        uuid: show the UUID whatever the width (otherwise only on a terminal 200 columns wide or more).
    """

    def __init__(
        self,
        out: IO[str],
        fields: Sequence[Field],
        *,
        title: str = "",
        color: bool = True,
        evaluator: AlertEvaluator | None = None,
        size: Callable[[], tuple[int, int]] | None = None,
        health: AlertEvaluator | None = None,
        stale_after: float = 5.0,
        processes: bool = False,
        uuid: bool = False,
    ) -> None:
        self.out = out
        self.fields = tuple(f for f in fields if f.kind is not Kind.TIMESTAMP)
        self.title = title
        self.color = color
        self.evaluator = evaluator
        self.health = health
        self.stale_after = stale_after
        self.show_processes = processes
        self.uuid = uuid
        self.view = Viewport(SORT_KEYS, "index")
        self._size = size or terminal_size
        self._rows: dict[object, GpuSample] = {}
        self._seen: dict[object, tuple[int, float]] = {}  # key -> (sweep, monotonic time) it last came in
        self._sweeps = 0
        self._procs: dict[int, list[str]] = {}
        self._received: float | None = None
        self._last_ts: datetime | None = None
        self._events: list[str] = []
        self._started = False
        self.frames = 0

    def update(self, samples: Iterable[GpuSample], now: float | None = None) -> None:
        """Take one sweep: the newest sample of each GPU is shown; a GPU missing from two sweeps is stale.

        Args:
            samples: the sweep (one sample per GPU).
            now: when it arrived (``time.monotonic()``), live; None: now, and the health rules' holds go by the
                samples' timestamps (a recording).
        """
        arrived = time.monotonic() if now is None else now
        self._sweeps += 1
        for s in samples:
            key = s.index if "index" in s else (s.uuid if "uuid" in s else len(self._rows))
            self._rows[key] = s
            self._seen[key] = (self._sweeps, arrived)
            ts = s.timestamp if "timestamp" in s else None
            if ts is not None:
                self._last_ts = ts
            if self.health is not None:
                self.health.update(s, now)  # None: a recording's holds go by its timestamps
        self._received = arrived

    def set_processes(self, by_gpu: Mapping[int, Sequence[str]]) -> None:
        """The processes to list under each GPU index, already as text (``user/command(1234MiB)``)."""
        self._procs = {k: list(v) for k, v in by_gpu.items()}

    def note(self, event: AlertEvent | str) -> None:
        """Remember an alert or source event for the footer (the newest few are shown).

        Args:
            event: an alert event, or one line of text (a restart, a lost GPU).
        """
        self._events.append(event if isinstance(event, str) else event.message())
        del self._events[:-4]

    def _cell_state(self, sample: GpuSample, name: str) -> CellState:
        states = [ev.cell_state(sample, name) for ev in (self.evaluator, self.health) if ev is not None]
        return "firing" if "firing" in states else ("pending" if "pending" in states else "ok")

    def _mark(self, key: object, sample: GpuSample, lost: Collection[object], now: float) -> str:
        """What the row's state cell says: LOST, RESET, ``stale 12s`` or nothing."""
        reasons = set(sample.missing.values())
        if "gpu_lost" in reasons or key in lost:
            return "LOST"
        if "gpu_requires_reset" in reasons:
            return "RESET"
        sweep, at = self._seen.get(key, (self._sweeps, now))
        quiet = now - at
        if sweep < self._sweeps - 1 or quiet > self.stale_after:
            return f"stale {quiet:.0f}s"
        return ""

    def _footer(self, stats: Mapping[str, object] | None, cols: int, now: float) -> list[str]:
        """The footer lines after the table: age and counters, errors, firing alerts, recent events."""
        color = self.color
        age = now - self._received if self._received is not None else None
        parts = [f"sample age {age:.1f} s" if age is not None else "no sample yet"]
        if self._last_ts is not None:
            parts.append(f"sampled {self._last_ts.strftime('%H:%M:%S')}")
        for key in ("sweeps", "rows", "restarts", "dropped_rows"):
            if stats is not None and key in stats:
                parts.append(f"{key.replace('_', ' ')} {stats[key]}")
        retry_at = stats.get("next_retry_at") if stats is not None else None
        if stats is not None and stats.get("state") == "retrying" and isinstance(retry_at, (int, float)):
            parts.append(f"retrying in {max(0.0, retry_at - time.time()):.0f} s")
        lost = stats.get("lost_gpus") if stats is not None else None
        if lost:
            text = "LOST GPU " + ",".join(str(i) for i in sorted(lost))  # type: ignore[call-overload]
            parts.append(f"{_STYLES['error']}{text}{_RESET}" if color else text)
        lines = _wrap(parts, cols)
        last_error = stats.get("last_error") if stats is not None else None
        if last_error:
            lines.append(f"last error: {last_error}")
        firing = [pair for ev in (self.evaluator, self.health) if ev is not None for pair in ev.firing()]
        if firing:
            text = "; ".join(dict.fromkeys(f"GPU {g}: {r}" for r, g in firing))
            lines.append(f"{_STYLES['firing']}FIRING{_RESET} {text}" if color else f"FIRING {text}")
        for msg in self._events:
            lines.append(f"{_STYLES['dim']}{msg}{_RESET}" if color else msg)
        return lines

    def key(self, key: str) -> bool:
        """Take one key (scroll, sort, filter: :class:`~smiquery.cli.keys.Viewport`); True when a redraw is due."""
        return self.view.key(key)

    def _words(self, key: object) -> str:
        """What the filter looks in: the index, name, UUID and processes of a GPU."""
        s = self._rows[key]
        procs = self._procs.get(key, ()) if isinstance(key, int) else ()
        return (
            " ".join(str(s.get(n)) for n in ("index", "name", "uuid", "pci.bus_id") if n in s) + " " + " ".join(procs)
        )

    def _ordered(self, keys: Sequence[object]) -> list[object]:
        """``keys`` in the viewport's sort order: by index, or by a value, largest first (missing last)."""
        name = _SORT_FIELDS.get(self.view.sort)
        if name is None:
            return list(keys)

        def value(k: object) -> float:
            v = self._rows[k].get(name)
            return -float(v) if isinstance(v, (int, float)) else float("inf")

        return sorted(keys, key=value)

    def frame(self, stats: Mapping[str, object] | None = None, status: str = "") -> str:
        """The text of one frame, escape sequences included."""
        from smiquery.cli.gpuview import gpu_lines, summary_line

        cols, lines_avail = self._size()
        now = time.monotonic()
        lost: Collection[object] = stats.get("lost_gpus") or () if stats is not None else ()  # type: ignore[assignment]
        keys = sorted(self._rows, key=_sort_key)
        marks = {k: self._mark(k, self._rows[k], lost, now) for k in keys}
        footer = self._footer(stats, cols, now)
        head = [self._paint(self.title, "header")] if self.title else []
        if len(keys) > 1:
            head.append(summary_line([self._rows[k] for k in keys], [marks[k] for k in keys]))
        view = self.view
        matching = self._ordered([k for k in keys if view.matches(self._words(k))])
        samples = [self._rows[k] for k in matching]
        cells, styles = sample_rows(samples, self.fields, cell_state=self._cell_state)
        for style, k in zip(styles, matching):
            if marks[k].startswith("stale"):  # old numbers: dimmed, whatever they were
                style[:] = ["dim"] * len(style)
        procs = [self._procs.get(k, []) if isinstance(k, int) else [] for k in matching]
        fitted = gpu_lines(
            samples,
            self.fields,
            cells,
            styles,
            cols,
            marks=[marks[k] for k in matching],
            procs=procs if self.show_processes else None,
            uuid=self.uuid,
            paint=self._paint,
        )
        extra: list[str] = hidden_note(fitted.hidden, cols)
        keys_help = "keys ↑↓ PgUp PgDn Home End · sort u/m/t/p/i · / filter"
        extra += _wrap([MISSING_LEGEND, *([status] if status else []), keys_help, "Ctrl-C to stop"], cols)
        limit = lines_avail - 1 if lines_avail > 0 else 1 << 30
        # Room for the GPU lines: the title and summary, the column titles, a blank line, the position line,
        # the footer and the legend stay (the legend goes first on a very short terminal).
        fixed = len(head) + 1 + 1 + 1 + len(footer)
        extra = extra[: max(0, min(len(extra), limit - fixed - min(3, len(matching))))]
        room = max(1, limit - fixed - len(extra))
        rows = dict(zip(matching, fitted.rows))
        procs_cut = sum(len(r) for r in fitted.rows) > room and any(len(r) > 1 for r in fitted.rows)
        if procs_cut:
            rows = {k: r[:1] for k, r in rows.items()}
        shown = view.window(matching, room, lambda k: self._trouble(k, marks))
        top = list(head)
        if samples:
            top.append(fitted.header)
            for k in shown:
                top += rows[k]
        elif keys:
            top.append(f"no GPU matches the filter '{printable(view.filter)}'")
        else:
            top.append("waiting for the first sample...")
        where = view.status("GPUs", len(shown), len(matching), len(keys))
        if len(shown) < len(matching):
            where = where.replace(" GPUs shown", f" GPUs shown ({_ranges(shown)})", 1) + " · PgDn/↓ for more"
        if view.sort != "index":
            where = " · ".join(x for x in (where, f"sorted by {view.sort}") if x)
        if procs_cut:
            where = " · ".join(x for x in (where, "processes not shown: terminal too short") if x)
        bottom = ["", *([self._paint(where, "pending")] if where else []), *footer]
        extra = [self._paint(x, "dim") for x in extra]
        lines = top + bottom + extra
        if len(lines) > limit:  # a terminal too short even for that: the table's last lines go, the footer stays
            top = top[: max(1, limit - len(bottom) - len(extra))]
            lines = (top + bottom + extra)[: max(1, limit)]
        body = "".join(clip(line, cols) + "\x1b[K\n" for line in lines)
        start = "" if self._started else "\x1b[?25l\x1b[2J"
        return f"{start}\x1b[H{body}\x1b[J"

    def _paint(self, text: str, style: str | None) -> str:
        return f"{_STYLES[style]}{text}{_RESET}" if self.color and style and text else text

    def _trouble(self, key: object, marks: Mapping[object, str]) -> bool:
        """A GPU never hidden when rows must be cut: lost, stale, reset, or with a cell past a firing rule."""
        s = self._rows[key]
        return bool(marks[key]) or any(self._cell_state(s, name) == "firing" for name in s.fields)

    def redraw(self, stats: Mapping[str, object] | None = None, status: str = "") -> None:
        """Draw one frame now."""
        self.out.write(self.frame(stats, status))
        self.out.flush()
        self._started = True
        self.frames += 1

    def close(self) -> None:
        """Show the cursor again (the last frame stays on screen)."""
        if self._started:
            try:
                self.out.write("\x1b[?25h")
                self.out.flush()
            except (OSError, ValueError):
                pass


def _ranges(keys: Sequence[object]) -> str:
    """``0-3,7,9-12`` for GPU indices (other keys are listed as they are)."""
    ints = sorted(k for k in keys if isinstance(k, int))
    parts: list[str] = []
    i = 0
    while i < len(ints):
        j = i
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        parts.append(str(ints[i]) if i == j else f"{ints[i]}-{ints[j]}")
        i = j + 1
    parts += [str(k) for k in keys if not isinstance(k, int)]
    return "GPU " + ",".join(parts)


# The live table keeps these longest, most useful last: index, utilization, memory, power, temperature.
_KEEP_LONGEST = ("index", "utilization.gpu", "memory.used", "power.draw", "temperature.gpu", "memory.total")
# Short titles for a narrow terminal (the unit follows): "temp C", "used MiB".
_SHORT = {
    "index": "gpu",
    "temperature.gpu": "temp",
    "temperature.memory": "memtemp",
    "utilization.gpu": "util",
    "utilization.memory": "memutil",
    "memory.used": "used",
    "memory.total": "total",
    "memory.free": "free",
    "power.draw": "power",
    "power.limit": "plimit",
    "fan.speed": "fan",
    "clocks.current.sm": "sm",
    "clocks.current.memory": "memclk",
    "clocks.current.graphics": "gfxclk",
    "pci.bus_id": "bus",
}


def _short_title(fld: Field) -> str:
    name = _SHORT.get(fld.name) or fld.name.rsplit(".", 1)[-1][:10]
    return f"{name} {fld.unit}" if fld.unit else name


def _drop_order(fields: Sequence[Field]) -> list[int]:
    """Indices of ``fields`` in the order the live table leaves them out when narrow."""
    identity = [i for name in _DROP_FIRST for i, f in enumerate(fields) if f.name == name]
    rank = {name: r for r, name in enumerate(_KEEP_LONGEST)}
    rest = [i for i in range(len(fields)) if i not in identity and fields[i].name not in rank]
    kept = sorted((i for i, f in enumerate(fields) if f.name in rank), key=lambda i: -rank[fields[i].name])
    return [*identity, *reversed(rest), *kept]


def _wrap(parts: Sequence[str], cols: int, sep: str = " · ") -> list[str]:
    """Join footer parts with ``sep`` into lines of at most ``cols`` visible characters (0: one line)."""
    lines: list[str] = []
    current = ""
    for part in parts:
        joined = f"{current}{sep}{part}" if current else part
        if current and cols > 0 and _visible_len(joined) > cols:
            lines.append(current)
            current = part
        else:
            current = joined
    if current:
        lines.append(current)
    return lines


# The viewport's sort names and the field each orders by (largest first); "index" keeps the GPUs' order.
_SORT_FIELDS = {"util": "utilization.gpu", "mem": "memory.used", "temp": "temperature.gpu", "power": "power.draw"}
#: The sort keys of the live table.
SORT_KEYS = {"u": "util", "m": "mem", "t": "temp", "p": "power", "i": "index"}


def _sort_key(key: object) -> tuple[int, str]:
    return (0, f"{key:09d}") if isinstance(key, int) else (1, str(key))


def terminal_width(stream: IO[str]) -> int:
    """The width of the terminal ``stream`` writes to, or 0 (any width) when it is no terminal."""
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return 0
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def terminal_size() -> tuple[int, int]:
    """(columns, lines) of the terminal, or (0, 0) when there is none (0: do not clip)."""
    try:
        size = os.get_terminal_size()
        return size.columns, size.lines
    except OSError:
        return 0, 0
