"""What the fake replays: a recorded ``--format=csv`` file, the compute apps, and the GPU set after reloads."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import pathlib
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from smiquery.errors import InvalidFieldError
from smiquery.fields import Field, Kind, get_field
from smiquery.kinds import missing_reason, split_header_cell, strip_unit
from smiquery.testing._emulator.core import FakeUsageError, MemoryState, is_number, read_bundled

_DEFAULT_DRIVER = "590.48.01"


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
        self._rest = self._split(lines, ncols, key)  # the sweeps not read yet
        self._sweeps: list[list[list[str]]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _split(lines: Iterator[str], ncols: int, key: int | None) -> Iterator[list[list[str]]]:
        """The complete sweeps: ``key`` is the column that tells GPUs apart (a key seen again starts the next)."""
        sweep: list[list[str]] = []
        seen: set[str] = set()
        for line in lines:
            cells = line.rstrip("\r").split(", ")
            if not line.strip() or len(cells) != ncols:
                continue  # notice lines (WARNING: ...) and damaged rows are not replayed
            k = cells[key].strip() if key is not None else ""
            if sweep and (key is None or k in seen):
                yield sweep
                sweep, seen = [], set()
            sweep.append(cells)
            seen.add(k)
        if sweep:
            yield sweep

    def has(self, n: int) -> bool:
        """Whether the recording has a sweep ``n`` (reads no further than its end)."""
        with self._lock:
            self._sweeps += itertools.islice(self._rest, max(n + 1 - len(self._sweeps), 0))
        return 0 <= n < len(self._sweeps)

    def __len__(self) -> int:
        self.has(sys.maxsize - 1)
        return len(self._sweeps)

    def __getitem__(self, n: int) -> list[list[str]]:
        if not self.has(n):
            raise IndexError(n)
        return self._sweeps[n]


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
        self.sweeps = Sweeps(body, len(self.columns), key)
        if not self.sweeps.has(0):
            raise FakeUsageError(f"{source} has no data rows")
        self.change: Callable[[list[list[str]]], list[list[str]]] | None = None  # the GPU set after reloads
        self.gpus = [self.identity(pos, row) for pos, row in enumerate(self.sweep(0))]

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

    def sweep(self, n: int) -> list[list[str]]:
        """Sweep ``n``'s rows of cells, as the ``reenumerate`` reloads struck so far left the GPU set."""
        return self.sweeps[n] if self.change is None else self.change(self.sweeps[n])

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
        value = self.cell(self.sweep(0)[0], "driver_version")
        return value if value and not is_token(value) else _DEFAULT_DRIVER

    @property
    def driver_branch(self) -> int:
        """The driver's branch (590 for 590.48.01; 590 when unknown)."""
        branch = self.driver_version.split(".")[0]
        return int(branch) if is_number(branch) else 590

    def resolve(self, name: str) -> Field:
        """The field for a queried name (catalogue names and aliases, plus unknown names the recording has)."""
        return self.extra[name] if name in self.extra else get_field(name)


def load_recording(path: str | None) -> Recording:
    """The recording at ``path`` (None: the bundled demo), parsed once while its files stay unchanged."""
    if not path:
        return _parsed_recording(None, ())
    p = pathlib.Path(path)
    side = p.with_suffix(".fields")
    try:
        stamp = tuple((st.st_mtime_ns, st.st_size) for st in [p.stat(), *([side.stat()] if side.is_file() else [])])
    except OSError as exc:
        raise FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    return _parsed_recording(path, stamp)


# Parsed recordings are kept (read-only) so that the in-process fake pays for a recording once, not every call.
@functools.lru_cache(maxsize=32)
def _parsed_recording(path: str | None, stamp: tuple[tuple[int, int], ...]) -> Recording:
    if path is None:
        return Recording(read_bundled("demo-8gpu.csv"), source="bundled demo-8gpu.csv")
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    return Recording(text, sidecar=p.with_suffix(".fields"), source=path)


# Compute apps: canonical names with their help, input aliases and header units (NVIDIA-SMI.md section 4).
APP_FIELDS = {
    "timestamp": 'The timestamp of when the query was made in format "YYYY/MM/DD HH:MM:SS.msec".',
    "gpu_name": "Product name of the GPU the process runs on.",
    "gpu_bus_id": 'PCI bus id of the GPU, as "domain:bus:device.function" in hex.',
    "gpu_serial": "Board serial number of the GPU.",
    "gpu_uuid": "Globally unique identifier of the GPU.",
    "pid": "Process ID of the compute application",
    "process_name": "Process name",
    "used_gpu_memory": "GPU memory used by the process's context.",
}
APP_ALIASES = {"name": "process_name", "used_memory": "used_gpu_memory"}
APP_UNITS = {"used_gpu_memory": "MiB"}


def load_apps(setting: str | None, rec: Recording) -> list[dict[str, str]]:
    if setting == "":
        return []
    if setting is None:
        text = read_bundled("demo-8gpu-apps.csv")
    else:
        try:
            text = pathlib.Path(setting).read_text(encoding="utf-8")
        except OSError as exc:
            raise FakeUsageError(f"cannot read compute-apps file {setting}: {exc}") from exc
    lines = [ln.rstrip("\r") for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = [split_header_cell(cell) for cell in lines[0].split(",")]
    names = [APP_ALIASES.get(name, name) for name, _ in header]
    units = [unit or APP_UNITS.get(name, "") for name, unit in header]
    by_uuid = {g["uuid"].lower(): g for g in rec.gpus}
    apps: list[dict[str, str]] = []
    for line in lines[1:]:
        cells = line.split(", ")
        if len(cells) > len(names) and "process_name" in names:
            # a process name containing ", " : the surplus cells belong to it
            at = names.index("process_name")
            extra = len(cells) - len(names)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        if len(cells) != len(names):
            continue
        app = {n: strip_unit(c, u) for n, c, u in zip(names, cells, units)}
        gpu = by_uuid.get(app.get("gpu_uuid", "").lower())
        if gpu is not None:
            app.setdefault("gpu_name", gpu["name"])
            app.setdefault("gpu_bus_id", gpu["pci.bus_id"])
            app.setdefault("gpu_serial", gpu["serial"])
        apps.append(app)
    return apps


#: The ``reenumerate`` reload due in this start: after so many rows, the call that records it.
Reload = tuple[int, Callable[[], None]]


def reloads_struck(state: str | MemoryState | None) -> int:
    if state is None:
        raise FakeUsageError("fault 'reenumerate' needs a state file: set SMIQUERY_FAKE_STATE")
    if not isinstance(state, str):
        return state.reloads
    try:
        text = pathlib.Path(state).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise FakeUsageError(f"cannot read state file {state}: {exc}") from exc
    if not is_number(text):
        raise FakeUsageError(f"state file {state} holds {text[:40]!r}, not a count of reloads: delete it")
    return int(text)


def record_reload(state: str | MemoryState | None, struck: int) -> None:
    assert state is not None
    if not isinstance(state, str):
        state.reloads = struck
        return
    tmp = f"{state}.{os.getpid()}.tmp"
    pathlib.Path(tmp).write_text(f"{struck}\n", encoding="utf-8")
    os.replace(tmp, state)  # a start that reads it at the same moment sees the old count or the new one


def relayout(rec: Recording, modes: Sequence[str]) -> Recording:
    """``rec`` with the GPU set that the ``reenumerate`` reloads in ``modes`` left behind, in order."""
    if not modes:
        return rec
    changed = copy.copy(rec)  # the parsed recording is shared read-only: only attributes are replaced
    changed.change = functools.partial(_reenumerated, rec, tuple(modes))
    changed.gpus = [changed.identity(pos, row) for pos, row in enumerate(changed.sweep(0))]
    return changed


def _reenumerated(rec: Recording, modes: tuple[str, ...], sweep: list[list[str]]) -> list[list[str]]:
    rows = [list(row) for row in sweep]
    for mode in modes:
        if mode == "swap" and len(rows) >= 2:
            rows[0], rows[1] = rows[1], rows[0]
        elif mode == "remove" and rows:
            del rows[1 if len(rows) > 1 else 0]
        elif mode == "add" and rows:
            rows.append(_added_gpu(rec, rows))
        # the driver numbers GPUs afresh at each load: positions are the new indices
        at = rec.col.get("index")
        if at is not None:
            for pos, row in enumerate(rows):
                row[at] = str(pos)
    return rows


def _added_gpu(rec: Recording, rows: list[list[str]]) -> list[str]:
    """A new GPU's row: the first GPU's values under a uuid, bus id and serial no other GPU has."""
    import uuid

    row = list(rows[0])
    if (at := rec.col.get("uuid")) is not None:
        row[at] = f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'smiquery-fake:{rows[0][at]}:{len(rows)}')}"
    if (at := rec.col.get("pci.bus_id")) is not None:
        buses = [int(m.group(1), 16) for r in rows if (m := re.search(r":([0-9A-Fa-f]{2}):", r[at]))]
        row[at] = f"00000000:{(max(buses, default=0) + 1) % 256:02X}:00.0"
    if (at := rec.col.get("serial")) is not None:
        serials = [int(r[at]) for r in rows if is_number(r[at])]
        if serials:
            row[at] = str(max(serials) + 1)
    return row
