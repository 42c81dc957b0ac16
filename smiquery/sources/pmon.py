"""Which process keeps a GPU busy, from ``nvidia-smi pmon``: the parser, its argv, instants and summaries.

The parser reads the columns (they depend on the driver and options) from each header; the supervised stream is
:func:`smiquery.streams.pmon.stream`.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from smiquery.errors import NotSupportedError, NvidiaSmiFailedError, ParseError
from smiquery.source import StreamEvent, StreamStats

__all__ = [
    "PMON_COLUMNS",
    "UNSUPPORTED_TEXT",
    "InstantGrouper",
    "PmonParser",
    "PmonRow",
    "PmonRows",
    "ProcessShare",
    "build_pmon_argv",
    "parse_pmon",
    "pmon_unsupported",
    "proc_stat",
    "process_share",
    "process_user",
    "sort_rows",
    "top_processes",
]


class PmonRow(NamedTuple):
    """One line of ``nvidia-smi pmon``: one process on one GPU at one instant (``pid`` None: an idle GPU).

    A value is None when pmon printed ``-`` or does not print that column. ``type`` is ``C``, ``G``, ``C+G`` (or
    ``M...`` on newer drivers); ``sm``, ``mem``, ``enc``, ``dec``, ``jpg``, ``ofa`` are utilisation %; ``fb`` and
    ``ccpm`` MB (``-s m``); ``command`` is the name as truncated by nvidia-smi; ``date``/``time`` come with ``-o DT``.
    """

    gpu: int | None
    pid: int | None = None
    type: str | None = None
    sm: int | None = None
    mem: int | None = None
    enc: int | None = None
    dec: int | None = None
    jpg: int | None = None
    ofa: int | None = None
    fb: int | None = None
    ccpm: int | None = None
    command: str | None = None
    date: str | None = None
    time: str | None = None

    @property
    def idle(self) -> bool:
        """True for the line pmon prints for a GPU without processes."""
        return self.pid is None

    @property
    def timestamp(self) -> datetime | None:
        """Local date and time of the line when pmon printed both (``-o DT``), else None."""
        if self.date is None or self.time is None:
            return None
        try:
            return datetime.strptime(self.date + self.time, "%Y%m%d%H:%M:%S")
        except ValueError:
            return None


#: The columns :class:`PmonRow` knows, by their pmon header names.
PMON_COLUMNS: tuple[str, ...] = PmonRow._fields
_INT_COLUMNS = frozenset({"gpu", "pid", "sm", "mem", "enc", "dec", "jpg", "ofa", "fb", "ccpm"})
_EMPTY = "-"
# Cells of number columns seen often enough to be worth a dict lookup instead of int(): `-`, 0..100, and pids
# as they come (bounded, so a long stream's memory stays flat).
_SEED_CELLS: dict[str, int | None] = {_EMPTY: None, **{str(i): i for i in range(101)}}
_CACHE_MAX = 4096
_new_row = tuple.__new__  # PmonRow._make without its length check: the itemgetter always gives 14 cells


class PmonParser:
    """Turns ``nvidia-smi pmon`` lines into :class:`PmonRow` records, one line at a time.

    The columns come from each header line (pass ``columns`` for output without one); unknown columns are read
    past, and ``command`` takes the rest of the line. A line that does not fit raises :class:`ParseError` when
    ``strict``, else it is counted in :attr:`dropped` (the error in :attr:`last_error`); driver messages are kept
    in :attr:`notices`.
    """

    def __init__(self, columns: Sequence[str] | None = None, *, strict: bool = True) -> None:
        self.strict = strict
        self.dropped = 0
        self.lineno = 0
        self.last_error: ParseError | None = None
        self.notices: list[str] = []
        self.columns: tuple[str, ...] = ()
        self._take: Callable[[list[object]], tuple[object, ...]] = operator.itemgetter(0)
        self._int_pos: tuple[int, ...] = ()
        self._int_cells: Callable[[list[object]], tuple[object, ...]] = operator.itemgetter(0, 0)
        self._cells: dict[str, int | None] = dict(_SEED_CELLS)
        self._n = 0
        if columns is not None:
            self._set_columns([c.lower() for c in columns])

    def _set_columns(self, names: list[str]) -> None:
        if names[-1] != "command":
            raise ValueError("pmon columns must end with 'command'")
        self.columns = tuple(names)
        self._n = len(names)
        where = {name: pos for pos, name in enumerate(names[:-1])}
        absent = len(names)  # the index of the None appended to each row's cells
        # per PmonRow field, the cell it comes from; itemgetter builds the record in one C call
        self._take = operator.itemgetter(
            *[where.get(f, absent) for f in PMON_COLUMNS[:-3]],
            absent - 1,
            where.get("date", absent),
            where.get("time", absent),
        )
        self._int_pos = tuple(pos for pos, name in enumerate(names[:-1]) if name in _INT_COLUMNS)
        self._int_cells = operator.itemgetter(*self._int_pos, absent)  # a tuple even for one column

    def feed(self, line: str) -> PmonRow | None:
        """The line's row; None for a header, unit, blank, notice or dropped line (strict: ParseError instead)."""
        self.lineno += 1
        if not line or line[0] == "#":
            names = line.lstrip("#").lower().split()  # the name header: "# gpu pid ... command", "#Date Time gpu ..."
            if "gpu" in names and "pid" in names and names[-1] == "command" and names != list(self.columns):
                self._set_columns(names)
            return None
        n = self._n
        parts = line.split(None, n - 1) if n else line.split()
        if not parts:
            return None
        if not n:
            msg = "a pmon row before any header line; pass columns= for headerless output"
            return self._notice_or_reject(line, msg)
        if len(parts) != n:
            return self._notice_or_reject(line, f"expected {n} columns, got {len(parts)}")
        cells = self._cells
        # cache hits (`-` and small numbers, pids seen before) come back converted, misses as their own text
        values: list[object] = list(map(cells.get, parts, parts))
        values.append(None)  # the cell of every column this layout lacks
        if str in map(type, self._int_cells(values)):  # a miss: convert in Python (rare once pids are known)
            bad = self._convert(values)
            if bad is not None:
                return self._notice_or_reject(line, f"{bad!r} is not a number")
        command = parts[-1].rstrip()
        values[-2] = None if command == _EMPTY else command
        return _new_row(PmonRow, self._take(values))

    def _convert(self, values: list[object]) -> str | None:
        """Turn the number columns' unconverted cells into ints (caching them); returns the first bad cell."""
        cells = self._cells
        for pos in self._int_pos:
            text = values[pos]
            if isinstance(text, str):
                try:
                    number = int(text)
                except ValueError:
                    return text
                if len(cells) < _CACHE_MAX:
                    cells[text] = number
                values[pos] = number
        return None

    def _notice_or_reject(self, line: str, message: str) -> PmonRow | None:
        if not line[:1].isspace() and not line[:1].isdigit():
            self.notices.append(line.strip())  # a driver message, not a damaged row
            return None
        err = ParseError(message, lineno=self.lineno, line=line)
        if self.strict:
            raise err
        self.dropped += 1
        self.last_error = err
        return None

    def parse(self, lines: Iterable[str]) -> Iterator[PmonRow]:
        """Parse every line, yielding the rows."""
        return (row for row in map(self.feed, lines) if row is not None)


def parse_pmon(text: str | Iterable[str], *, strict: bool = True) -> list[PmonRow]:
    """Parse a whole pmon capture (a string or lines) into its rows, idle GPUs' lines included (strict: ParseError)."""
    lines = text.splitlines() if isinstance(text, str) else text
    return list(PmonParser(strict=strict).parse(lines))


class InstantGrouper:
    """Cuts a row stream into instants: a (gpu, pid) seen again, or a new timestamp, starts the next one.

    :meth:`feed` returns the instant a row completes (the one before it), :meth:`flush` the last one.
    """

    def __init__(self) -> None:
        self._rows: list[PmonRow] = []
        self._seen: set[tuple[int | None, int | None]] = set()
        self._stamp: tuple[str | None, str | None] = (None, None)

    def feed(self, row: PmonRow) -> tuple[PmonRow, ...] | None:
        """Take one row; returns the instant it completes, if any."""
        key = (row.gpu, row.pid)
        stamp = (row.date, row.time)
        done = None
        if key in self._seen or stamp not in (self._stamp, (None, None)):
            done = self.flush()
        self._rows.append(row)
        self._seen.add(key)
        self._stamp = stamp
        return done

    def discard(self) -> None:
        """Forget the instant under way (cut short by a restart)."""
        self.flush()
        self._stamp = (None, None)

    def flush(self) -> tuple[PmonRow, ...] | None:
        """The instant under way, if any rows came (at the end of the stream)."""
        done = tuple(self._rows) or None
        self._rows, self._seen = [], set()
        return done


def build_pmon_argv(
    binary: str,
    gpus: Sequence[str] = (),
    *,
    interval: int = 1,
    count: int | None = None,
    select: str = "um",
    options: str = "DT",
) -> list[str]:
    """The argument list for ``nvidia-smi pmon``; ValueError for an interval, count, select or options it rejects."""
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 10:
        raise ValueError("pmon interval must be a whole number of seconds from 1 to 10 (nvidia-smi pmon -d)")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError("pmon count must be a positive integer (nvidia-smi pmon -c)")
    if not select or set(select) - set("um"):
        raise ValueError("pmon select takes the letters u (utilisation) and m (memory), e.g. 'um'")
    if set(options) - set("DT"):
        raise ValueError("pmon options take the letters D (date) and T (time), e.g. 'DT'")
    argv = [binary, "pmon", "-s", select, "-d", str(interval)]
    if count is not None:
        argv += ["-c", str(count)]
    if options:
        argv += ["-o", options]
    if gpus:
        argv += ["-i", ",".join(gpus)]
    return argv


class PmonRows:
    """The engine's interpreter for ``pmon`` lines: rows, dropped lines (``dropped_row`` events) and notices."""

    what = "nvidia-smi pmon"

    def __init__(self, stats: StreamStats, emit: Callable[[StreamEvent], None]) -> None:
        self.stats = stats
        self._emit = emit
        self.parser = PmonParser(strict=False)

    def child_started(self) -> None:
        """A new child prints its header again."""
        self.parser = PmonParser(strict=False)

    def feed(self, lines: Sequence[str], now: float, idle: float | None, out: list[PmonRow]) -> int:
        """Parse lines; append the rows; return how many."""
        parser = self.parser
        known = self.stats.known_gpus
        rows = 0
        for line in lines:
            before = parser.dropped
            row = parser.feed(line)
            if parser.dropped != before:
                self.stats.dropped_rows += 1
                err = parser.last_error
                self._emit(StreamEvent("dropped_row", err, str(err) if err else "dropped line"))
            if row is None:
                continue
            if row.gpu is not None and row.gpu not in known:
                known[row.gpu] = None
            out.append(row)
            rows += 1
        return rows

    def cut(self, out: list[PmonRow], now: float) -> None:
        """Nothing to finish (a restart's cut instant is dropped by the stream)."""

    def last_message(self) -> str | None:
        """The newest notice pmon printed."""
        notices = self.parser.notices
        return notices[-1] if notices else None


_METRICS = ("sm", "mem", "enc", "dec", "jpg", "ofa", "fb", "ccpm")


def _sum(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def top_processes(rows: Iterable[PmonRow], n: int, *, by: str = "sm") -> dict[int, list[PmonRow]]:
    """Per GPU of one instant, the ``n`` busiest processes by ``by``, then one ``other`` row summing the rest.

    At most ``n + 1`` series per GPU (bounded cardinality for exporters). ``other`` (``pid`` None, ``command``
    ``"other"``) comes only when more than ``n`` processes ran; its metrics sum the known values (None when none).
    An idle GPU gets an empty list; processes without a ``by`` value sort last, ties keep pmon's order. Raises
    ValueError when ``n`` is negative or ``by`` is not a pmon metric.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if by not in _METRICS:
        raise ValueError(f"by must be one of {', '.join(_METRICS)}")
    per_gpu: dict[int, list[PmonRow]] = {}
    for row in rows:
        if row.gpu is None:
            continue
        bucket = per_gpu.setdefault(row.gpu, [])
        if not row.idle:
            bucket.append(row)
    out: dict[int, list[PmonRow]] = {}
    for gpu, procs in per_gpu.items():
        ranked = sorted(procs, key=lambda r: (getattr(r, by) is None, -(getattr(r, by) or 0)))
        kept, rest = ranked[:n], ranked[n:]
        if rest:
            sums: dict[str, Any] = {m: _sum(getattr(r, m) for r in rest) for m in _METRICS}
            kept.append(PmonRow(gpu=gpu, command="other", **sums))
        out[gpu] = kept
    return out


@dataclass(frozen=True)
class ProcessShare:
    """How much of one GPU a set of processes (e.g. a training run) uses, against everyone else.

    SM % and framebuffer MB are summed over "mine" and over the others (None when no value); ``share`` is
    ``mine_sm / (mine_sm + others_sm)``, None when neither side reported SM use.
    """

    gpu: int
    mine_sm: int | None
    others_sm: int | None
    share: float | None
    mine_fb: int | None
    others_fb: int | None
    other_pids: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """True when another process is on this GPU at all (busy or not)."""
        return bool(self.other_pids)


def process_share(rows: Iterable[PmonRow], pids: Collection[int], *, every: bool = False) -> dict[int, ProcessShare]:
    """Per GPU that one of ``pids`` runs on, the share of one instant's SM use that is theirs.

    ``every``: also the other GPUs of the instant, with share 0 when others keep them busy, None when idle.
    """
    mine_ids = set(pids)
    by_gpu: dict[int, tuple[list[PmonRow], list[PmonRow]]] = {}
    for row in rows:
        if row.gpu is None:
            continue
        mine, others = by_gpu.setdefault(row.gpu, ([], []))
        if row.pid is not None:
            (mine if row.pid in mine_ids else others).append(row)
    out: dict[int, ProcessShare] = {}
    for gpu, (mine, others) in by_gpu.items():
        if not (mine or every):
            continue
        m_sm, o_sm = _sum(r.sm for r in mine), _sum(r.sm for r in others)
        m_fb, o_fb = _sum(r.fb for r in mine), _sum(r.fb for r in others)
        total = (m_sm or 0) + (o_sm or 0)
        other_pids = tuple(dict.fromkeys(r.pid for r in others if r.pid is not None))
        out[gpu] = ProcessShare(gpu, m_sm, o_sm, (m_sm or 0) / total if total else None, m_fb, o_fb, other_pids)
    return out


def sort_rows(rows: Iterable[PmonRow], by: str = "sm", *, descending: bool = True) -> list[PmonRow]:
    """Rows ordered by a :class:`PmonRow` field (ValueError for another), largest first by default; None sorts last."""
    if by not in PMON_COLUMNS:
        raise ValueError(f"by must be one of {', '.join(PMON_COLUMNS)}")
    items = list(rows)
    present = sorted((r for r in items if getattr(r, by) is not None), key=operator.attrgetter(by), reverse=descending)
    return present + [r for r in items if getattr(r, by) is None]


#: What pmon prints on GPUs and drivers without it (GeForce, R415), whatever its exit status.
UNSUPPORTED_TEXT = "not supported on the device"


def pmon_unsupported(exc: BaseException | None) -> bool:
    """Whether ``exc`` (a pmon stream's error) says pmon is not supported on this GPU or driver."""
    if isinstance(exc, NotSupportedError):
        return True
    return isinstance(exc, NvidiaSmiFailedError) and UNSUPPORTED_TEXT in exc.output.lower()


def proc_stat(pid: int, root: str = "/proc") -> list[str]:
    """The fields of ``ROOT/PID/stat`` after the command name (state, ppid, ...), empty when it cannot be read."""
    try:
        with open(f"{root}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return []
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    return text[text.rfind(b")") + 1 :].decode("ascii", "replace").split()


def process_user(pid: int) -> str | None:
    """The user (or uid as text) owning ``pid`` on this host, from ``/proc``; None when not visible (containers)."""
    try:
        uid = os.stat(f"/proc/{int(pid)}").st_uid
    except (OSError, ValueError):
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)
