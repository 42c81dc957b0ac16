"""A recorded ``--format=csv`` file as the fake replays it: columns, units, the GPUs and their sweeps."""

from __future__ import annotations

import contextlib
import functools
import itertools
import pathlib
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from smiquery.errors import InvalidFieldError
from smiquery.fields import Field, Kind, get_field
from smiquery.kinds import missing_reason, strip_unit
from smiquery.testing._emulator.settings import FakeUsageError, read_bundled

_DEFAULT_DRIVER = "590.48.01"


def split_header_cell(cell: str) -> tuple[str, str]:
    cell = cell.strip()
    m = re.fullmatch(r"(.*?) \[([^\]]*)\]", cell)
    return (m.group(1), m.group(2)) if m else (cell, "")


def is_token(cell: str) -> bool:
    return missing_reason(cell) is not None


def norm_bus_id(text: str) -> str:
    """``0000:0b:00.0`` and ``00000000:0B:00.0`` compare equal after this."""
    m = re.fullmatch(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])", text.strip())
    if not m:
        return text.strip().upper()
    return f"{int(m.group(1), 16):08X}:{int(m.group(2), 16):02X}:{int(m.group(3), 16):02X}.{m.group(4)}"


def short_bus_id(bus_id: str) -> str:
    """The 4-digit-domain form nvidia-smi uses in its error messages."""
    norm = norm_bus_id(bus_id)
    return norm[4:] if re.fullmatch(r"0000[0-9A-F]{4}:.*", norm) else norm


class Sweeps:
    """A recording's sweeps, each a list of rows of cells, found and split only as far as they are replayed.

    The fake runs once per nvidia-smi call: a one-shot query of the bundled 600-sweep recording reads the 9 lines
    up to the end of its sweep, not 4800. ``len()`` reads them all. Threads of the in-process fake share it.
    """

    def __init__(self, lines: Iterator[str], ncols: int, key: int | None) -> None:
        self._lines = lines  # the body lines not read yet
        self._seps = ncols - 1
        self._key = key  # the column that tells GPUs apart: a key seen again starts the next sweep
        self._rows: list[str] = []  # data lines read so far
        self._starts: list[int] = []  # where each sweep found so far starts in _rows
        self._seen: set[str] = set()
        self._done = False
        self._split: dict[int, list[list[str]]] = {}
        self._lock = threading.Lock()

    def _read(self, n: int) -> None:
        """Read lines until sweep ``n`` is complete (the next one has started) or the lines end."""
        with self._lock:
            while not self._done and len(self._starts) <= n + 1:
                line = next(self._lines, None)
                if line is None:
                    self._done = True
                    break
                line = line.rstrip("\r")
                if not line.strip() or line.count(", ") != self._seps:
                    continue  # notice lines (WARNING: ...) and damaged rows are not replayed
                k = line.split(", ", self._key + 1)[self._key].strip() if self._key is not None else ""
                if not self._rows or self._key is None or k in self._seen:
                    self._starts.append(len(self._rows))
                    self._seen = set()
                self._rows.append(line)
                self._seen.add(k)

    def has(self, n: int) -> bool:
        """Whether the recording has a sweep ``n`` (reads no further than its end)."""
        self._read(n)
        return 0 <= n < len(self._starts)

    def __len__(self) -> int:
        self._read(sys.maxsize - 1)
        return len(self._starts)

    def __getitem__(self, n: int) -> list[list[str]]:
        if not self.has(n):
            raise IndexError(n)
        sweep = self._split.get(n)
        if sweep is None:  # a race between threads only splits it twice
            end = self._starts[n + 1] if n + 1 < len(self._starts) else len(self._rows)
            sweep = [line.split(", ") for line in self._rows[self._starts[n] : end]]
            self._split[n] = sweep
        return sweep


class Recording:
    """A full-field ``--format=csv`` recording: columns, unit-free cells and sweeps."""

    def __init__(self, text: str, *, sidecar: pathlib.Path | None = None, source: str = "recording") -> None:
        lines = text.splitlines()
        first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
        if first is None:
            raise FakeUsageError(f"{source} is empty")
        header = self._header(lines[first].rstrip("\r"))
        if header is not None:
            body = itertools.islice(lines, first + 1, None)
        elif sidecar is not None and sidecar.is_file():
            names = [n for n in re.split(r"[\s,]+", sidecar.read_text(encoding="utf-8")) if n]
            header = [(n, "") for n in names]
            body = itertools.islice(lines, first, None)
        else:
            raise FakeUsageError(f"{source} has no header line (and no .fields file beside it)")
        self.columns: list[Field] = []
        self.units: list[str] = []
        self.extra: dict[str, Field] = {}
        for name, unit in header:
            try:
                fld = get_field(name)
            except InvalidFieldError:
                # a newer driver's field smiquery does not know yet: served under its own name
                fld = Field(name, Kind.STR, unit=unit)
                self.extra[name] = fld
            self.columns.append(fld)
            self.units.append(unit or fld.header_unit or "")
        self.col: dict[str, int] = {}
        for i, fld in enumerate(self.columns):
            self.col.setdefault(fld.name, i)
        key = next((self.col[k] for k in ("index", "uuid", "pci.bus_id") if k in self.col), None)
        self.sweeps: Sweeps | MappedSweeps = Sweeps(body, len(self.columns), key)
        if not self.sweeps.has(0):
            raise FakeUsageError(f"{source} has no data rows")
        self.gpus = [self.identity(pos, row) for pos, row in enumerate(self.sweeps[0])]

    @staticmethod
    def _header(line: str) -> list[tuple[str, str]] | None:
        cells = [split_header_cell(c) for c in line.split(",")]
        if not all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", n) for n, _ in cells):
            return None
        known = 0
        for name, _ in cells:
            with contextlib.suppress(InvalidFieldError):
                get_field(name)
                known += 1
        # a header names fields; a data row of plain words (`Enabled, P0`) names none of them
        return cells if known or any(u for _, u in cells) else None

    def cell(self, row: Sequence[str], name: str) -> str | None:
        """The cell of ``name`` in ``row`` without its unit, or None when the recording lacks the column."""
        i = self.col.get(name)
        return strip_unit(row[i], self.units[i]) if i is not None else None

    def identity(self, pos: int, row: Sequence[str]) -> dict[str, str]:
        return {
            "index": self.cell(row, "index") or str(pos),
            "uuid": self.cell(row, "uuid") or f"GPU-00000000-0000-0000-0000-{pos:012x}",
            "pci.bus_id": self.cell(row, "pci.bus_id") or f"00000000:{pos + 1:02X}:00.0",
            "name": self.cell(row, "name") or "NVIDIA GPU",
            "serial": self.cell(row, "serial") or "[N/A]",
        }

    def key_of(self, row: Sequence[str], pos: int) -> str:
        """The GPU a row belongs to (its index, or its position in the sweep)."""
        return self.cell(row, "index") or str(pos)

    @property
    def driver_version(self) -> str:
        value = self.cell(self.sweeps[0][0], "driver_version")
        return value if value and not is_token(value) else _DEFAULT_DRIVER

    def resolve(self, name: str) -> Field:
        """The field for a queried name (catalogue names and aliases, plus unknown names the recording has)."""
        try:
            return get_field(name)
        except InvalidFieldError:
            if name in self.extra:
                return self.extra[name]
            raise


def load_recording(path: str | None) -> Recording:
    if not path:
        return _bundled_recording()
    p = pathlib.Path(path)
    try:
        st = p.stat()
        side = p.with_suffix(".fields")
        side_st = side.stat() if side.is_file() else None
    except OSError as exc:
        raise FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    stamp = (st.st_mtime_ns, st.st_size, side_st.st_mtime_ns if side_st else 0, side_st.st_size if side_st else 0)
    return _parsed_recording(str(p), stamp)


# Parsed recordings are kept (read-only) so that the in-process fake pays for a recording once, not every call.
@functools.cache
def _bundled_recording() -> Recording:
    return Recording(read_bundled("demo-8gpu.csv"), source="bundled demo-8gpu.csv")


@functools.lru_cache(maxsize=32)
def _parsed_recording(path: str, stamp: tuple[int, int, int, int]) -> Recording:
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    return Recording(text, sidecar=p.with_suffix(".fields"), source=path)


class MappedSweeps:
    """A recording's sweeps as ``change`` turns each of them (the GPU set after ``reenumerate`` reloads)."""

    def __init__(self, sweeps: Sweeps | MappedSweeps, change: Callable[[list[list[str]]], list[list[str]]]) -> None:
        self._sweeps = sweeps
        self._change = change

    def has(self, n: int) -> bool:
        return self._sweeps.has(n)

    def __len__(self) -> int:
        return len(self._sweeps)

    def __getitem__(self, n: int) -> list[list[str]]:
        return self._change(self._sweeps[n])
