"""Rendering samples and records for people: aligned tables fitted to a terminal, and the pieces of live views.

The recording writers (CSV, JSONL, Parquet) are :mod:`smiquery.recordings`'s; this module only draws for a reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

from smiquery.cli._options import is_tty
from smiquery.fields import Field, get_field
from smiquery.printable import text_table
from smiquery.recordings import json_value, sample_to_json
from smiquery.sample import GpuSample, Value
from smiquery.sources.query_gpu import format_row, header_line

__all__ = [
    "MISSING_LEGEND",
    "UNKNOWN_USER",
    "Column",
    "clip",
    "display_value",
    "drop_order",
    "frame_text",
    "hidden_note",
    "paint",
    "render",
    "render_table",
    "sample_rows",
    "sample_table",
    "short_title",
    "show_cursor",
    "terminal_size",
    "use_color",
    "wrap_parts",
]

#: How a missing value shows in a table, by reason (anything else shows as ``n/a``). Never blank, never 0.
_MISSING_MARKS: dict[str, str] = {
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
    "ok": "\x1b[32m",
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
_TOKEN_RE = re.compile(f"{_ANSI_RE.pattern}|.", re.DOTALL)  # a colour code, or one character
CellState = Literal["firing", "pending", "ok"]
# Narrow tables leave out the identity columns first, in this order (then see drop_order).
_IDENTITY = ("uuid", "pci.bus_id", "serial", "vbios_version", "driver_version")


def use_color(stream: IO[str]) -> bool:
    """Whether to colour output on ``stream``: a terminal, ``NO_COLOR`` unset and ``TERM`` not ``dumb``."""
    return not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb" and is_tty(stream)


def paint(text: str, style: str | None, color: bool) -> str:
    """``text`` in a style's colours (ok, firing, pending, missing, header, dim, error) when ``color`` and ``style``."""
    return f"{_STYLES[style]}{text}{_RESET}" if color and style else text


def display_value(fld: Field, value: Value, reason: str | None = None) -> str:
    """A value as a table shows it (:meth:`Field.display`: no unit, rounded); missing as ``n/a`` (or its reason)."""
    return fld.display(value, missing=_MISSING_MARKS.get(reason or "not_available", "n/a"))


def _title(fld: Field) -> str:
    return f"{fld.name} [{fld.unit}]" if fld.unit else fld.name


def _visible_len(text: str) -> int:
    """The length of ``text`` on a terminal (colour codes take no room)."""
    return len(_ANSI_RE.sub("", text))


def clip(line: str, width: int) -> str:
    """Cut a line to ``width`` visible characters, keeping (and closing) its colour codes."""
    if width <= 0 or _visible_len(line) <= width:
        return line
    out: list[str] = []
    shown = 0
    for token in _TOKEN_RE.findall(line):
        if shown >= width - 1:
            break
        out.append(token)
        if len(token) == 1:
            shown += 1
    coloured = any(len(token) > 1 for token in out)
    return "".join(out) + "…" + (_RESET if coloured else "")


def render_table(
    rows: Sequence[Sequence[str]],
    titles: Sequence[str],
    *,
    right: Sequence[bool] | None = None,
    styles: Sequence[Sequence[str | None]] | None = None,
    color: bool = False,
) -> list[str]:
    """Align text cells under titles (two spaces between columns); title line first, no newlines.

    ``right`` right-aligns columns (numbers); ``styles`` names each cell's style (:func:`paint`), used when
    ``color``. Control characters in cells and titles are shown escaped (:func:`smiquery.printable.printable`).
    """
    lines = text_table(titles, rows, right, (lambda text, r, i: paint(text, styles[r][i], color)) if styles else None)
    return [paint(lines[0], "header", color), *lines[1:]]


def sample_rows(
    samples: Iterable[GpuSample],
    fields: Sequence[Field],
    *,
    cell_state: Callable[[GpuSample, str], CellState] | None = None,
) -> tuple[list[list[str]], list[list[str | None]]]:
    """The display cells of each sample for ``fields``, and each cell's style (alert state or missing)."""

    def cell(s: GpuSample, fld: Field) -> tuple[str, str | None]:
        value, reason = s.get(fld.name), s.missing.get(fld.name)
        if value is None:
            return display_value(fld, value, reason), "error" if reason in _ERROR_REASONS else "missing"
        state = cell_state(s, fld.name) if cell_state is not None else "ok"
        return display_value(fld, value), None if state == "ok" else state

    cells = [[cell(s, fld) for fld in fields] for s in samples]
    return [[text for text, _ in row] for row in cells], [[style for _, style in row] for row in cells]


def sample_table(
    samples: Sequence[GpuSample], fields: Sequence[Field], *, color: bool = False, width: int = 0
) -> list[str]:
    """A static table of samples: one row per sample, units in the titles, missing values marked.

    With a ``width`` (a terminal's) it is fitted: full titles, else short ones (``temp C``), else fields are left
    out (:func:`drop_order`) and a last line names them.
    """
    if width > 0 and not samples:
        return []
    rows, styles = sample_rows(samples, fields)

    def table(keep: Sequence[int], short: bool) -> list[str]:
        return render_table(
            [[r[i] for i in keep] for r in rows],
            [short_title(fields[i]) if short else _title(fields[i]) for i in keep],
            right=[fields[i].kind.is_numeric for i in keep],
            styles=[[st[i] for i in keep] for st in styles],
            color=color,
        )

    def fits(lines: Sequence[str]) -> bool:
        return max(_visible_len(x) for x in lines) <= width

    keep = list(range(len(fields)))
    lines = table(keep, False)
    if width <= 0 or fits(lines):
        return lines
    lines = table(keep, True)
    hidden: list[str] = []
    names = [f.name for f in fields]
    for name in drop_order(names, early=("name",)):
        if fits(lines) or len(keep) <= 1:
            break
        keep.remove(names.index(name))
        hidden.append(name)
        lines = table(keep, True)
    return lines + hidden_note(hidden, width)


@dataclass(frozen=True)
class Column:
    """One column of plain records (not samples) for :func:`render`.

    ``unit`` shows in titles and after CSV values; in tables, ``style`` names a cell's style from its value and
    ``table_text`` says how a present value shows (default ``str``).
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

    def cell(self, value: object) -> tuple[str, str | None]:
        """A table cell's text and style (a newline in a command line must not break the table)."""
        if value is None:
            return self.missing, "missing"
        text = self.table_text(value) if self.table_text is not None else str(value)
        return _CONTROL_RE.sub("?", text), self.style(value) if self.style is not None else None


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
    """Records as text, each line ending in a newline: ``table``, ``csv``, ``jsonl`` or ``json``.

    Samples (:class:`GpuSample`, with ``fields``, default the first sample's) render as nvidia-smi's CSV (read back
    by ``read_csv``), JSON keyed by field name (ISO times, null for missing, reasons under ``"_missing"``) or an
    aligned table with units in the titles. Plain records render by ``columns``. A table shows ``empty`` when
    there are no records (default: just the titles); with a ``width`` (a terminal's), samples are fitted and
    plain records wrap their last column.
    """
    if fmt == "table" and not records and empty:
        return empty + "\n"
    to_json: Callable[[Any], dict[str, object]] = sample_to_json if columns is None else _plain_json
    if fmt == "json":
        return json.dumps([to_json(r) for r in records], indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(to_json(r)) + "\n" for r in records)
    if columns is None:
        samples: list[GpuSample] = list(records)  # type: ignore[arg-type]
        if fields is None:
            fields = tuple(get_field(n) for n in samples[0].fields) if samples else ()
        if fmt == "csv":
            return "".join([header_line(fields) + "\n", *(format_row(s, fields, units=True) + "\n" for s in samples)])
        return "".join(line + "\n" for line in sample_table(samples, fields, color=color, width=width))
    plain: Sequence[Mapping[str, Any]] = records
    if fmt == "csv":
        lines = [", ".join(c.heading for c in columns)]
        lines += [", ".join(_csv_cell(r.get(c.key), c.unit) for c in columns) for r in plain]
        return "".join(line + "\n" for line in lines)
    cells = [[c.cell(r.get(c.key)) for c in columns] for r in plain]
    rows = [[text for text, _ in row] for row in cells]
    styles = [[style for _, style in row] for row in cells]
    titles, right = [c.heading for c in columns], [c.right for c in columns]
    lines = render_table(rows, titles, right=right, styles=styles, color=color)
    if width > 0 and any(_visible_len(x) > width for x in lines):  # wrapped as plain text: no colour then
        lines = _wrap_last_column(render_table(rows, titles, right=right), width)
    return "".join(line + "\n" for line in lines)


def hidden_note(hidden: Sequence[str], cols: int) -> list[str]:
    """``hidden (terminal too narrow): uuid, name``, wrapped to ``cols``; nothing when nothing is hidden."""
    return wrap_parts(f"hidden (terminal too narrow): {', '.join(hidden)}".split(" "), cols, sep=" ") if hidden else []


def _wrap_last_column(lines: Sequence[str], cols: int) -> list[str]:
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


# The live table keeps these longest, most useful last: index, utilization, memory, power, temperature.
_KEEP_LONGEST = ("index", "utilization.gpu", "memory.used", "power.draw", "temperature.gpu", "memory.total")
# Short titles, the unit following: a narrow table's ("temp C"), the live table's ("TEMP C"); else the name's last part.
_SHORT = {
    "index": ("gpu", "GPU"),
    "temperature.gpu": ("temp", "TEMP"),
    "temperature.memory": ("memtemp", "MTEMP"),
    "utilization.gpu": ("util", "UTIL"),
    "utilization.memory": ("memutil", "MUTIL"),
    "memory.used": ("used", "MEM"),
    "power.draw": ("power", "PWR"),
    "power.limit": ("plimit", "PLIM"),
    "fan.speed": ("fan", "FAN"),
    "clocks.current.memory": ("memclk", "MEMCLK"),
    "clocks.current.graphics": ("gfxclk", "GFXCLK"),
    "pci.bus_id": ("bus", "BUS"),
}


def short_title(fld: Field, live: bool = False) -> str:
    """A field's short title with its unit: ``temp C`` (``TEMP C`` for the ``live`` table)."""
    tail = fld.name.rsplit(".", 1)[-1][:10]
    name = _SHORT.get(fld.name, (tail, tail.upper()))[live]
    return f"{name} {fld.unit}" if fld.unit else name


def drop_order(names: Sequence[str], *, early: Sequence[str] = (), late: Sequence[str] = ()) -> list[str]:
    """``names`` in the order a narrow table leaves them out.

    Identity (then ``early``) first, the other fields from the last, then ``late``, then index, utilization,
    memory, power and temperature the very last.
    """
    rank = {name: r for r, name in enumerate(_KEEP_LONGEST)}
    first = [n for n in (*_IDENTITY, *early) if n in names]
    last = [n for n in late if n in names]
    rest = [n for n in names if n not in first and n not in last and n not in rank and n != "state"]
    kept = sorted((n for n in names if n in rank), key=lambda n: -rank[n])
    return [*first, *reversed(rest), *last, *kept]


def wrap_parts(parts: Sequence[str], cols: int, sep: str = " · ") -> list[str]:
    """Join parts with ``sep`` into lines of at most ``cols`` visible characters (0: one line)."""
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


def terminal_size(stream: IO[str] | None = None) -> tuple[int, int]:
    """(columns, lines) of the terminal ``stream`` (default: stdout) writes to, or (0, 0) when none (0: do not clip)."""
    try:
        size = os.get_terminal_size(stream.fileno() if stream is not None else 1)
        return size.columns, size.lines
    except (OSError, ValueError, AttributeError):
        return 0, 0


def frame_text(lines: Sequence[str], cols: int, *, first: bool) -> str:
    """A frame of a live view that replaces the last one in place (cursor home, lines rewritten, the rest cleared).

    Each line is clipped to ``cols``; the ``first`` frame also hides the cursor and clears the screen.
    """
    body = "".join(clip(line, cols) + "\x1b[K\n" for line in lines)
    return ("\x1b[?25l\x1b[2J" if first else "") + f"\x1b[H{body}\x1b[J"


def show_cursor(out: IO[str]) -> None:
    """Show the cursor again after a live view (the last frame stays on screen)."""
    with contextlib.suppress(OSError, ValueError):
        out.write("\x1b[?25h")
        out.flush()
