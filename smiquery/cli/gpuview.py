"""The live table of ``smiquery stream``: one compact line per GPU (as gpustat's), redrawn in place.

``GPU NAME TEMP UTIL MEM PWR`` with the units once in the titles, a utilization bar where there is room, memory as
``used/total``, and the GPU's processes (``user/name(MiB)``) on its line, or indented under it when they do not fit.
A summary line counts the GPUs (busy, idle, lost), their mean utilization and the hottest one.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, TYPE_CHECKING

from smiquery.cli._options import ranges
from smiquery.cli.display import (
    MISSING_LEGEND,
    UNKNOWN_USER,
    CellState,
    drop_order,
    frame_text,
    hidden_note,
    paint,
    sample_rows,
    short_title,
    show_cursor,
    terminal_size,
    wrap_parts,
)
from smiquery.cli.keys import Viewport
from smiquery.fields import Field, Kind
from smiquery.printable import printable
from smiquery.sample import GpuSample

if TYPE_CHECKING:
    from smiquery.alerts import AlertEvaluator, AlertEvent
    from smiquery.sources.apps import GpuProcess

__all__ = ["SORT_KEYS", "LiveTable", "process_label"]

_BAR = 10
_MIN_PROCS = 16  # the narrowest processes column; narrower, they go under their GPU
_VENDOR = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}
_SUFFIX = re.compile(r"(HBM\w*|GDDR\w*|PCIE|SXM\d*|NVL|SXM)", re.IGNORECASE)
# Utilization under this many percent counts a GPU as idle in the summary line (as ``smiquery top``).
_IDLE_BELOW = 5


def _short_name(name: str) -> str:
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
        return max([len(self.title), *map(len, self.cells)])


def _summary_line(samples: Sequence[GpuSample], marks: Sequence[str]) -> str:
    """``64 GPUs · 40 busy · 20 idle · 4 lost · mean util 63 % · hottest GPU 5 at 89 C``."""
    lost = sum(1 for m in marks if m in ("LOST", "RESET"))
    stale = sum(1 for m in marks if m.startswith("stale"))
    parts = [f"{len(samples)} GPUs"]
    live = [s for s, m in zip(samples, marks) if not m]
    utils = [u for s in live if isinstance(u := s.get("utilization.gpu"), (int, float))]
    if any("utilization.gpu" in s for s in samples):
        busy = sum(1 for u in utils if u >= _IDLE_BELOW)
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


class LiveTable:
    """The newest sample of each GPU, one line each, redrawn in place on a terminal (ANSI, no curses).

    Below the GPU lines a footer (GPUs shown of how many, sample age, counters, alerts) is always drawn: on a short
    terminal the processes go first, then GPU rows scroll (:attr:`view` takes the keys); GPUs in trouble (lost,
    stale, past a firing rule) are never left out. A GPU that stopped reporting keeps its last numbers, dimmed and
    marked ``stale`` after ``stale_after`` seconds. Cells past the ``evaluator``'s (``--alert``) and the ``health``
    rules' thresholds are coloured; ``size`` returns the terminal's (columns, lines). :attr:`show_processes` lists
    each GPU's processes, :attr:`uuid` shows the UUID at any width.
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
    ) -> None:
        self.out = out
        self.fields = tuple(f for f in fields if f.kind is not Kind.TIMESTAMP)
        self.title = title
        self.color = color
        self.evaluator = evaluator
        self.health = health
        self.stale_after = stale_after
        self.show_processes = False
        self.uuid = False
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

    def update(self, samples: Iterable[GpuSample], now: float | None = None) -> None:
        """Take one sweep (``now``: its monotonic arrival, live; None for a recording, timed by its timestamps)."""
        arrived = time.monotonic() if now is None else now
        self._sweeps += 1
        for s in samples:
            key = s.index if "index" in s else (s.uuid if "uuid" in s else len(self._rows))
            self._rows[key] = s
            self._seen[key] = (self._sweeps, arrived)
            if "timestamp" in s and s.timestamp is not None:
                self._last_ts = s.timestamp
            if self.health is not None:
                self.health.update(s, now)
        self._received = arrived

    def set_processes(self, by_gpu: Mapping[int, Sequence[str]]) -> None:
        """The processes to list under each GPU index, already as text (``user/command(1234MiB)``)."""
        self._procs = {k: list(v) for k, v in by_gpu.items()}

    def note(self, event: AlertEvent | str) -> None:
        """Remember an alert event or a line of text (a restart, a lost GPU) for the footer (the newest few show)."""
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
        color, stats = self.color, stats or {}
        age = now - self._received if self._received is not None else None
        parts = [f"sample age {age:.1f} s" if age is not None else "no sample yet"]
        if self._last_ts is not None:
            parts.append(f"sampled {self._last_ts.strftime('%H:%M:%S')}")
        counters = ("sweeps", "rows", "restarts", "dropped_rows")
        parts += [f"{key.replace('_', ' ')} {stats[key]}" for key in counters if key in stats]
        retry_at = stats.get("next_retry_at")
        if stats.get("state") == "retrying" and isinstance(retry_at, (int, float)):
            parts.append(f"retrying in {max(0.0, retry_at - time.time()):.0f} s")
        lost = stats.get("lost_gpus")
        if lost:
            text = "LOST GPU " + ",".join(str(i) for i in sorted(lost))  # type: ignore[call-overload]
            parts.append(paint(text, "error", color))
        lines = wrap_parts(parts, cols)
        last_error = stats.get("last_error")
        if last_error:
            lines.append(f"last error: {last_error}")
        firing = [pair for ev in (self.evaluator, self.health) if ev is not None for pair in ev.firing()]
        if firing:
            text = "; ".join(dict.fromkeys(f"GPU {g}: {r}" for r, g in firing))
            lines.append(f"{paint('FIRING', 'firing', color)} {text}")
        return lines + [paint(msg, "dim", color) for msg in self._events]

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

    def frame(self, stats: Mapping[str, object] | None = None) -> str:
        """The text of one frame, escape sequences included."""
        cols, lines_avail = self._size()
        now = time.monotonic()
        lost: Collection[object] = stats.get("lost_gpus") or () if stats is not None else ()  # type: ignore[assignment]
        keys = sorted(self._rows, key=lambda k: (0, f"{k:09d}") if isinstance(k, int) else (1, str(k)))
        marks = {k: self._mark(k, self._rows[k], lost, now) for k in keys}
        footer = self._footer(stats, cols, now)
        head = [self._paint(self.title, "header")] if self.title else []
        if len(keys) > 1:
            head.append(_summary_line([self._rows[k] for k in keys], [marks[k] for k in keys]))
        view = self.view
        matching = self._ordered([k for k in keys if view.matches(self._words(k))])
        header, gpu_rows, hidden = self._gpu_lines(matching, marks, cols)
        extra: list[str] = hidden_note(hidden, cols)
        keys_help = "keys ↑↓ PgUp PgDn Home End · sort u/m/t/p/i · / filter"
        extra += wrap_parts([MISSING_LEGEND, keys_help, "Ctrl-C to stop"], cols)
        limit = lines_avail - 1 if lines_avail > 0 else 1 << 30
        # Kept besides the GPU lines: title, summary, column titles, a blank, the position line, footer, legend.
        fixed = len(head) + 1 + 1 + 1 + len(footer)
        extra = extra[: max(0, min(len(extra), limit - fixed - min(3, len(matching))))]
        room = max(1, limit - fixed - len(extra))
        rows = dict(zip(matching, gpu_rows))
        procs_cut = sum(len(r) for r in gpu_rows) > room and any(len(r) > 1 for r in gpu_rows)
        if procs_cut:
            rows = {k: r[:1] for k, r in rows.items()}
        shown = view.window(matching, room, lambda k: self._trouble(k, marks))
        top = list(head)
        if matching:
            top.append(header)
            for k in shown:
                top += rows[k]
        elif keys:
            top.append(f"no GPU matches the filter '{printable(view.filter)}'")
        else:
            top.append("waiting for the first sample...")
        where = view.status("GPUs", len(shown), len(matching), len(keys))
        if len(shown) < len(matching):
            ints = [k for k in shown if isinstance(k, int)]  # GPU 0-3,7 (other keys as they are)
            named = ",".join([*([ranges(ints)] if ints else []), *(str(k) for k in shown if not isinstance(k, int))])
            where = where.replace(" GPUs shown", f" GPUs shown (GPU {named})", 1) + " · PgDn/↓ for more"
        sort = f"sorted by {view.sort}" if view.sort != "index" else ""
        cut = "processes not shown: terminal too short" if procs_cut else ""
        where = " · ".join(x for x in (where, sort, cut) if x)
        bottom = ["", *([self._paint(where, "pending")] if where else []), *footer]
        extra = [self._paint(x, "dim") for x in extra]
        lines = top + bottom + extra
        if len(lines) > limit:  # a terminal too short even for that: the table's last lines go, the footer stays
            top = top[: max(1, limit - len(bottom) - len(extra))]
            lines = (top + bottom + extra)[: max(1, limit)]
        return frame_text(lines, cols, first=not self._started)

    def _columns(self, keys: Sequence[object], marks: Mapping[object, str]) -> list[_Col]:
        """The columns of GPUs ``keys``: a state column when any has a mark, memory as used/total, a utilization bar."""
        fields = self.fields
        samples = [self._rows[k] for k in keys]
        cells, styles = sample_rows(samples, fields, cell_state=self._cell_state)
        for style, k in zip(styles, keys):
            if marks[k].startswith("stale"):  # old numbers: dimmed, whatever they were
                style[:] = ["dim"] * len(style)
        states = [marks[k] for k in keys]
        names = [f.name for f in fields]
        merged = "memory.used" in names and "memory.total" in names
        cols: list[_Col] = []
        if any(states):
            styles_of = [("error" if m in ("LOST", "RESET") else "pending" if m else None) for m in states]
            cols.append(_Col("state", "STATE", False, states, styles_of))
        for i, f in enumerate(fields):
            if merged and f.name == "memory.total":
                continue
            col = _Col(f.name, short_title(f, live=True), f.kind.is_numeric)
            col.cells = [row[i] for row in cells]
            col.styles = [st[i] for st in styles]
            if f.name == "name":
                col.cells = [_short_name(c) for c in col.cells]
            if merged and f.name == "memory.used":
                t = names.index("memory.total")
                col.cells = [f"{row[i]}/{row[t]}" for row in cells]
                col.styles = [st[i] or st[t] for st in styles]
            cols.append(col)
            if f.name == "utilization.gpu":
                cols.append(_Col("bar", "", False, [_bar(s.get(f.name)) for s in samples], list(col.styles)))
        return cols

    def _gpu_lines(
        self, keys: Sequence[object], marks: Mapping[object, str], cols: int
    ) -> tuple[str, list[list[str]], list[str]]:
        """The title line, each GPU's lines fitted to ``cols`` (0: any; processes after or under), the fields left out.

        A state column when any GPU has a mark; the UUID only at 200 columns or more, unless :attr:`uuid`.
        """
        fields, paint = self.fields, self._paint
        procs = [self._procs.get(k, []) if isinstance(k, int) else [] for k in keys] if self.show_processes else None
        columns = self._columns(keys, marks)
        if not (self.uuid or cols <= 0 or cols >= 200):
            columns = [c for c in columns if c.name != "uuid"]
        hidden: list[str] = []

        def width(cs: Sequence[_Col]) -> int:
            return sum(c.width for c in cs) + 2 * (len(cs) - 1)

        for name in drop_order([c.name for c in columns], late=("bar", "name")):
            if cols <= 0 or width(columns) <= cols or len(columns) <= 1:
                break
            columns = [c for c in columns if c.name != name]
            if name != "bar":
                hidden += [
                    f.name for f in fields if f.name == name or (name == "memory.used" and f.name == "memory.total")
                ]
        widths = [c.width for c in columns]

        def line(texts: Sequence[str], styles: Sequence[str | None]) -> str:
            out = []
            for c, w, text, st in zip(columns, widths, texts, styles):
                text = printable(text)
                out.append(paint(text.rjust(w) if c.right else text.ljust(w), st))
            return "  ".join(out)

        header = paint(line([c.title for c in columns], [None] * len(columns)).rstrip(), "header")
        start = width(columns) + 2
        inline = cols <= 0 or cols - start >= _MIN_PROCS
        if procs is not None and any(procs) and inline:
            header = f"{header}  {paint('PROCESSES', 'header')}"
        rows: list[list[str]] = []
        for r in range(len(keys)):
            first = line([c.cells[r] for c in columns], [c.styles[r] for c in columns])
            labels = [printable(p) for p in procs[r]] if procs is not None and r < len(procs) else []
            if not labels:
                rows.append([first.rstrip()])
                continue
            indent, room = (start, cols - start) if inline else (4, cols - 4)
            packed = [paint(p, "dim") for p in wrap_parts(labels, room if cols > 0 else 0, sep=" ") or [""]]
            lead, under = ([f"{first}  {packed[0]}"], packed[1:]) if inline else ([first.rstrip()], packed)
            rows.append([*lead, *(" " * indent + p for p in under)])
        return header, rows, hidden

    def _paint(self, text: str, style: str | None) -> str:
        return paint(text, style, self.color and bool(text))

    def _trouble(self, key: object, marks: Mapping[object, str]) -> bool:
        """A GPU never hidden when rows must be cut: lost, stale, reset, or with a cell past a firing rule."""
        s = self._rows[key]
        return bool(marks[key]) or any(self._cell_state(s, name) == "firing" for name in s.fields)

    def redraw(self, stats: Mapping[str, object] | None = None) -> None:
        """Draw one frame now."""
        self.out.write(self.frame(stats))
        self.out.flush()
        self._started = True

    def close(self) -> None:
        """Show the cursor again (the last frame stays on screen)."""
        if self._started:
            show_cursor(self.out)


# The viewport's sort names and the field each orders by (largest first); "index" keeps the GPUs' order.
_SORT_FIELDS = {"util": "utilization.gpu", "mem": "memory.used", "temp": "temperature.gpu", "power": "power.draw"}
#: The sort keys of the live table.
SORT_KEYS = {"u": "util", "m": "mem", "t": "temp", "p": "power", "i": "index"}


def process_label(proc: GpuProcess, user: str | None) -> str:
    """``user/command(memory)`` as gpustat shows a process, on one line (:data:`UNKNOWN_USER`: a user not known)."""
    name = " ".join(proc.process_name.split()) or "?"
    command = os.path.basename(name.split(" ", 1)[0]) or name
    memory = f"{proc.used_memory}MiB" if proc.used_memory is not None else "n/a"
    return f"{user or UNKNOWN_USER}/{command}({memory})"
