"""A fake ``nvidia-smi`` for tests and demos: a real executable that replays a recorded CSV and fails on demand.

:func:`fake_nvidia_smi` writes the executable; :func:`main` is its entry point (also ``python -m smiquery.testing``
and the ``smiquery-fake-nvidia-smi`` console script). Real process, real pipes, real signals: no mocks.
:class:`InProcessRunner` runs the same engine on a thread, and :func:`use_runner` makes it the runner of everything
that runs nvidia-smi (CLI, exporter, monitor, callbacks) for the length of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import os
import pathlib
import re
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, BinaryIO, NoReturn, TypeVar, overload

from smiquery.errors import (
    InvalidFieldError,
    NvidiaSmiFailedError,
    NvidiaSmiTimeoutError,
    StreamEndedError,
    failure_from_exit,
)
from smiquery.fields import CATALOGUE, Field, Kind, get_field
from smiquery.kinds import FIELD_KINDS, strip_unit
from smiquery.parsing import missing_reason

if TYPE_CHECKING:
    import random

    from smiquery.runner import Completed, Runner

__all__ = [
    "ENV_VARS",
    "FAULTS",
    "FAULT_HELP",
    "InProcessLines",
    "InProcessRunner",
    "fake_nvidia_smi",
    "main",
    "use_runner",
]

#: Fault specs understood by the fake, and what each does (``N``, ``CODE`` and ``INDEX`` are integers, ``SECONDS``
#: a number; combine specs with commas, so a MESSAGE cannot hold one). Messages and exit codes follow
#: NVIDIA-SMI.md section 5. ``N`` counts data rows written, across the sweeps of a loop. The start-up faults print
#: nvidia-smi's message on stdout and exit with its status, no CSV; they strike where NVML would start: after the
#: arguments and field names are checked.
FAULT_HELP: Mapping[str, str] = {
    "driver-not-loaded": "start-up: the driver is not loaded or not reachable, exit 9",
    "nvml-not-found": "start-up: libnvidia-ml.so is missing (a container without `utility`), exit 12",
    "version-mismatch": "start-up: Driver/library version mismatch, exit 18",
    "no-devices": "start-up: No devices were found, exit 6",
    "no-supported-gpus": "start-up: No supported GPUs were found, exit 255",
    "gpu-lost-start": "start-up: GPU 0000:02:00.0 is lost, exit 15",
    "permission": "start-up: Insufficient Permissions, exit 4",
    "not-supported": "start-up: Not Supported, exit 3",
    "unknown-error": "start-up: Unknown Error, exit 255",
    "exit:CODE[:MESSAGE]": "start-up: print MESSAGE (if given) on stdout, exit CODE",
    "inforom": "normal rows, then the infoROM warning, exit 14 (in a loop: the warning once, and the loop goes on)",
    "hang": "print nothing, sleep forever",
    "hang-after:N": "N rows, then silence while the process keeps running",
    "crash-after:N": "N rows, then `Unable to determine the device handle for GPU ...: Unknown Error`, exit 255",
    "exit-after:N:CODE[:MESSAGE]": "N rows, then MESSAGE (if given) on stdout, exit CODE",
    "notices-after:N": "N rows, then only notice lines (infoROM warning, device-handle error), one batch per "
    "interval (one-shot: per second), forever",
    "gpu-lost-after:N[:INDEX]": "after N rows, GPU INDEX's (default 0) cells read [GPU is lost] except timestamp, "
    "index, uuid, pci.bus_id and name; the loop goes on",
    "drop-gpu-after:N[:INDEX[:message]]": "after N rows, GPU INDEX's (default 0) rows stop appearing; with "
    "`:message`, nvidia-smi's `GPU is lost` line for it is printed in their place each sweep",
    "garbage": "header, then lines of random bytes (invalid UTF-8, wrong cell counts), exit 0",
    "garbage-after:N": "N rows, one garbage line, then the normal rows",
    "truncated": "the last row of the (first) sweep cut in the middle, no newline, exit 0",
    "wrong-columns-after:N": "N rows, then one row missing its last cell, then the normal rows",
    "ignore-term": "SIGTERM is ignored: callers have to escalate to SIGKILL",
    "start-delay:SECONDS": "sleep SECONDS before any output (overrides the start_delay setting)",
    "grandchild": "first start a grandchild (same process group, same stdout and stderr) that sleeps an hour "
    "holding the pipes open; then run normally",
    "clock-step:N:SECONDS": "from row N on, the wall clock behind the timestamp cells is SECONDS later (negative: "
    "an NTP step back) and stays so; an N that is no multiple of the GPU count steps between two GPUs' rows of "
    "one sweep; repeat the spec for more steps (they add up)",
    "dst-fallback[:SECONDS]": "timestamps are Europe/Berlin local time, starting (at each start) SECONDS (default "
    "10) of real time before the fall-back of 2026-10-25 03:00 CEST: 02:59:5x, then 02:00:0x again",
    "slow-row:N:FRACTION[:INDEX]": "in every Nth sweep, GPU INDEX's (default 3) row comes FRACTION (0 < FRACTION < 1) "
    "of the interval (one-shot: of 1 s) late: the rows before it are flushed, then it and the rest of the sweep "
    "follow; its timestamp is on time, those after it are late too",
    "reenumerate:N[:MODE]": "a driver reload after N rows of a start: the sweep is cut, `Unable to determine the "
    "device handle for GPU ...: Unknown Error`, exit 255; every later start serves the changed GPU set: MODE "
    "`swap` (default) swaps GPUs 0 and 1 (uuid, bus id, values), `remove` drops GPU 1 and renumbers the rest "
    "down, `add` appends a GPU with a new uuid and bus id; repeat the spec to chain reloads (state: "
    "SMIQUERY_FAKE_STATE, in-process InProcessRunner.reloads)",
    "flood[:BYTES]": "a wrong binary on PATH: only garbage on stdout, no header: one-shot without any newline, in "
    "a loop 1 MiB lines back to back; endless, or BYTES in all and exit 0",
}

#: Fault specs understood by the fake (see :data:`FAULT_HELP` for what each does).
FAULTS: tuple[str, ...] = tuple(FAULT_HELP)

#: Environment variables read by the fake at run time, and what they do.
ENV_VARS: Mapping[str, str] = {
    "SMIQUERY_FAKE_RECORDING": "recording CSV to replay (overrides the baked-in one)",
    "SMIQUERY_FAKE_FAULT": "fault specs, comma separated (empty: no fault)",
    "SMIQUERY_FAKE_START_DELAY": "seconds to sleep before any output",
    "SMIQUERY_FAKE_APPS": "compute-apps CSV (empty: no processes)",
    "SMIQUERY_FAKE_LOG": "file to append one JSON line per invocation to (empty: no log)",
    "SMIQUERY_FAKE_SWEEP": "which sweep a one-shot query prints (modulo the sweep count); where a loop starts",
    "SMIQUERY_FAKE_KEEP_TIME": "1: print the recorded timestamps instead of the current time",
    "SMIQUERY_FAKE_STATE": "file holding how many `reenumerate` reloads have struck (default: the executable's "
    "path plus `.state`); delete it to start over",
    "SMIQUERY_FAKE_XML": "nvidia-smi -q -x capture that -q -x and -L answer from (empty: made from the recording)",
}

# Messages and exit codes of NVIDIA-SMI.md section 5. `not-supported` has no recorded message; NVML's own error
# string for NVML_ERROR_NOT_SUPPORTED is used.
_STARTUP_FAULTS: dict[str, tuple[tuple[str, ...], int]] = {
    "driver-not-loaded": (
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.",
        ),
        9,
    ),
    "nvml-not-found": (
        (
            "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA "
            "Display Driver is properly installed and present in your system.",
            "Please also try adding directory that contains libnvidia-ml.so to your system PATH.",
        ),
        12,
    ),
    "version-mismatch": (("Failed to initialize NVML: Driver/library version mismatch", "{nvml_line}"), 18),
    "no-devices": (("No devices were found",), 6),
    "no-supported-gpus": (
        ("Failed to initialize NVML: No supported GPUs were found", "Unable to determine the number of GPUs"),
        255,
    ),
    "gpu-lost-start": (
        (
            "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. "
            "Reboot the system to recover this GPU",
        ),
        15,
    ),
    "permission": (("Failed to initialize NVML: Insufficient Permissions",), 4),
    "not-supported": (("Failed to initialize NVML: Not Supported",), 3),
    "unknown-error": (("Failed to initialize NVML: Unknown Error",), 255),
}
_COUNTED_FAULTS = ("hang-after", "crash-after", "garbage-after", "wrong-columns-after", "notices-after")
_FLAG_FAULTS = ("inforom", "hang", "garbage", "truncated", "ignore-term", "grandchild")

_HELP_HINT = "Please run 'nvidia-smi -h' for help."
_INFOROM_WARNING = "WARNING: infoROM is corrupted at gpu 0000:0B:00.0"
_HANDLE_ERROR = "Unable to determine the device handle for GPU {bus}: {reason}"
_GPU_LOST_REASON = "GPU is lost. Reboot the system to recover this GPU"
# what `notices-after` prints each interval once the rows stop
_NOTICE_BATCH = (_INFOROM_WARNING, _HANDLE_ERROR.format(bus="0000:02:00.0", reason="Unknown Error"))
_DEFAULT_DRIVER = "590.48.01"
# CUDA version reported by `nvidia-smi --version`, by driver branch (the newest CUDA each branch supports).
_CUDA_BY_BRANCH = {470: "11.4", 535: "12.2", 550: "12.4", 560: "12.6", 570: "12.8", 580: "13.0", 590: "13.1"}
# On a lost GPU these cells keep their values (NVIDIA-SMI.md section 3); every other cell reads [GPU is lost].
_SURVIVES_LOSS = frozenset({"timestamp", "index", "uuid", "pci.bus_id", "name"})
_R = TypeVar("_R", bound="Runner")
_EX_SOFTWARE = 70  # misuse of the fake itself (bad fault spec, unreadable recording), never an nvidia-smi code


class _FakeUsageError(Exception):
    """The fake was set up wrongly (not a simulated nvidia-smi failure)."""


class _Exit(Exception):
    """Ends the fake with an exit status from deep inside the output loop."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class _Faults:
    startup: str | None = None
    exit_code: int | None = None
    exit_message: str | None = None
    inforom: bool = False
    hang: bool = False
    garbage: bool = False
    truncated: bool = False
    ignore_term: bool = False
    hang_after: int | None = None
    crash_after: int | None = None
    garbage_after: int | None = None
    wrong_columns_after: int | None = None
    gpu_lost_after: int | None = None
    gpu_lost_index: int = 0
    notices_after: int | None = None
    exit_after: int | None = None
    exit_after_code: int = 0
    exit_after_message: str | None = None
    drop_gpu_after: int | None = None
    drop_gpu_index: int = 0
    drop_gpu_message: bool = False
    start_delay: float | None = None
    grandchild: bool = False
    clock_steps: tuple[tuple[int, float], ...] = ()  # (rows, seconds), one per `clock-step`
    dst_before: float | None = None
    slow_every: int | None = None
    slow_fraction: float = 0.0
    slow_index: int = 3
    reloads: tuple[tuple[int, str], ...] = ()  # (rows, mode), one per `reenumerate`, in order
    flood: bool = False
    flood_bytes: int | None = None


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _nonneg(spec: str, text: str) -> int:
    if not _is_number(text):
        raise _FakeUsageError(f"fault {spec!r}: {text!r} is not a non-negative integer")
    return int(text)


def _exit_code(spec: str, text: str) -> int:
    code = _nonneg(spec, text)
    if code > 255:
        raise _FakeUsageError(f"fault {spec!r}: exit codes go up to 255")
    return code


def _number(spec: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise _FakeUsageError(f"fault {spec!r}: {text!r} is not a number")
    return value


_RELOAD_MODES = ("swap", "remove", "add")


def _parse_faults(spec: str | None) -> _Faults:
    """Parse a comma-separated fault list; unknown names raise :class:`_FakeUsageError`."""
    values: dict[str, object] = {}
    for raw in (spec or "").split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, arg = item.partition(":")
        if name in _STARTUP_FAULTS and not arg:
            values.setdefault("startup", name)
        elif name == "exit" and arg:
            code_text, _, message = arg.partition(":")
            values.setdefault("exit_code", _exit_code(item, code_text))
            values.setdefault("exit_message", message or None)
        elif name == "exit-after" and ":" in arg:
            count, _, rest = arg.partition(":")
            code_text, _, message = rest.partition(":")
            values["exit_after"] = _nonneg(item, count)
            values["exit_after_code"] = _exit_code(item, code_text)
            values["exit_after_message"] = message or None
        elif name == "drop-gpu-after" and arg:
            count, _, rest = arg.partition(":")
            index, _, suffix = rest.partition(":")
            if suffix not in ("", "message"):
                raise _FakeUsageError(f"fault {item!r}: only the literal suffix ':message' may follow the index")
            values["drop_gpu_after"] = _nonneg(item, count)
            values["drop_gpu_index"] = _nonneg(item, index) if index else 0
            values["drop_gpu_message"] = suffix == "message"
        elif name == "start-delay" and arg:
            try:
                delay = float(arg)
            except ValueError:
                delay = -1.0
            if not 0 <= delay < float("inf"):
                raise _FakeUsageError(f"fault {item!r}: {arg!r} is not a non-negative number of seconds")
            values["start_delay"] = delay
        elif name in _FLAG_FAULTS and not arg:
            values[name.replace("-", "_")] = True
        elif name in _COUNTED_FAULTS and arg:
            values[name.replace("-", "_")] = _nonneg(item, arg)
        elif name == "gpu-lost-after" and arg:
            count, _, index = arg.partition(":")
            values["gpu_lost_after"] = _nonneg(item, count)
            values["gpu_lost_index"] = _nonneg(item, index) if index else 0
        elif name == "clock-step" and ":" in arg:
            count, _, seconds = arg.partition(":")
            step = (_nonneg(item, count), _number(item, seconds))
            values["clock_steps"] = (*values.get("clock_steps", ()), step)  # type: ignore[misc]
        elif name == "dst-fallback":
            before = _number(item, arg) if arg else 10.0
            if before < 0:
                raise _FakeUsageError(f"fault {item!r}: the seconds before the change must not be negative")
            values["dst_before"] = before
        elif name == "slow-row" and ":" in arg:
            count, _, rest = arg.partition(":")
            fraction_text, _, index = rest.partition(":")
            every = _nonneg(item, count)
            fraction = _number(item, fraction_text)
            if every < 1:
                raise _FakeUsageError(f"fault {item!r}: N counts sweeps and starts at 1")
            if not 0 < fraction < 1:
                raise _FakeUsageError(f"fault {item!r}: FRACTION is a share of the interval, between 0 and 1")
            values["slow_every"] = every
            values["slow_fraction"] = fraction
            values["slow_index"] = _nonneg(item, index) if index else 3
        elif name == "reenumerate" and arg:
            count, _, mode = arg.partition(":")
            mode = mode or "swap"
            if mode not in _RELOAD_MODES:
                raise _FakeUsageError(f"fault {item!r}: MODE is one of {', '.join(_RELOAD_MODES)}")
            reload = (_nonneg(item, count), mode)
            values["reloads"] = (*values.get("reloads", ()), reload)  # type: ignore[misc]
        elif name == "flood":
            values["flood"] = True
            if arg:
                total = _nonneg(item, arg)
                if total < 1:
                    raise _FakeUsageError(f"fault {item!r}: BYTES must be at least 1 (leave it out for no end)")
                values["flood_bytes"] = total
        else:
            raise _FakeUsageError(f"unknown fault {item!r}; known faults: {', '.join(FAULTS)}")
    return _Faults(**values)  # type: ignore[arg-type]


class _MemoryState:
    """How many ``reenumerate`` reloads have struck, kept by an :class:`InProcessRunner` instead of a file."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()


def _reloads_struck(state: str | _MemoryState | None) -> int:
    if isinstance(state, _MemoryState):
        with state.lock:
            return state.value
    if state is None:
        raise _FakeUsageError("fault 'reenumerate' needs a state file: set SMIQUERY_FAKE_STATE")
    try:
        text = pathlib.Path(state).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise _FakeUsageError(f"cannot read state file {state}: {exc}") from exc
    if not _is_number(text):
        raise _FakeUsageError(f"state file {state} holds {text[:40]!r}, not a count of reloads: delete it")
    return int(text)


def _record_reload(state: str | _MemoryState | None, struck: int) -> None:
    if isinstance(state, _MemoryState):
        with state.lock:
            state.value = struck
        return
    assert state is not None
    tmp = f"{state}.{os.getpid()}.tmp"
    pathlib.Path(tmp).write_text(f"{struck}\n", encoding="utf-8")
    os.replace(tmp, state)  # a start that reads it at the same moment sees the old count or the new one


@dataclasses.dataclass(frozen=True)
class _Settings:
    recording: str | None = None
    fault: str | None = None
    start_delay: float = 0.0
    apps: str | None = None
    log: str | None = None
    sweep: int = 0
    keep_time: bool = False
    state: str | _MemoryState | None = None
    xml: str | None = None

    def with_env(self, env: Mapping[str, str]) -> _Settings:
        """Apply the SMIQUERY_FAKE_* overrides."""
        changes: dict[str, object] = {}
        if env.get("SMIQUERY_FAKE_RECORDING"):
            changes["recording"] = env["SMIQUERY_FAKE_RECORDING"]
        if "SMIQUERY_FAKE_FAULT" in env:
            changes["fault"] = env["SMIQUERY_FAKE_FAULT"] or None
        if env.get("SMIQUERY_FAKE_START_DELAY"):
            try:
                changes["start_delay"] = float(env["SMIQUERY_FAKE_START_DELAY"])
            except ValueError:
                raise _FakeUsageError("SMIQUERY_FAKE_START_DELAY must be a number of seconds") from None
        if "SMIQUERY_FAKE_APPS" in env:
            changes["apps"] = env["SMIQUERY_FAKE_APPS"]
        if "SMIQUERY_FAKE_LOG" in env:
            changes["log"] = env["SMIQUERY_FAKE_LOG"] or None
        if "SMIQUERY_FAKE_SWEEP" in env:
            try:
                changes["sweep"] = int(env["SMIQUERY_FAKE_SWEEP"] or "0")
            except ValueError:
                raise _FakeUsageError("SMIQUERY_FAKE_SWEEP must be an integer") from None
        if "SMIQUERY_FAKE_KEEP_TIME" in env:
            changes["keep_time"] = env["SMIQUERY_FAKE_KEEP_TIME"] == "1"
        if "SMIQUERY_FAKE_STATE" in env:
            changes["state"] = env["SMIQUERY_FAKE_STATE"] or None
        if "SMIQUERY_FAKE_XML" in env:
            changes["xml"] = env["SMIQUERY_FAKE_XML"] or None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------- recording


def _read_bundled(name: str) -> str:
    try:  # the package's own folder: importlib.resources would cost more than the read
        return pathlib.Path(__file__).parent.parent.joinpath("data", name).read_text(encoding="utf-8")
    except OSError:  # installed where data are no plain files (a zip)
        from importlib import resources

        return (resources.files("smiquery") / "data" / name).read_text(encoding="utf-8")


def _split_header_cell(cell: str) -> tuple[str, str]:
    cell = cell.strip()
    m = re.fullmatch(r"(.*?) \[([^\]]*)\]", cell)
    return (m.group(1), m.group(2)) if m else (cell, "")


def _strip_unit(cell: str, unit: str) -> str:
    return strip_unit(cell, unit)


def _is_token(cell: str) -> bool:
    return missing_reason(cell) is not None


def _norm_bus_id(text: str) -> str:
    """``0000:0b:00.0`` and ``00000000:0B:00.0`` compare equal after this."""
    m = re.fullmatch(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])", text.strip())
    if not m:
        return text.strip().upper()
    return f"{int(m.group(1), 16):08X}:{int(m.group(2), 16):02X}:{int(m.group(3), 16):02X}.{m.group(4)}"


def _short_bus_id(bus_id: str) -> str:
    """The 4-digit-domain form nvidia-smi uses in its error messages."""
    norm = _norm_bus_id(bus_id)
    return norm[4:] if re.fullmatch(r"0000[0-9A-F]{4}:.*", norm) else norm


class _Sweeps(Sequence[list[list[str]]]):
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

    @overload
    def __getitem__(self, n: int) -> list[list[str]]: ...
    @overload
    def __getitem__(self, n: slice) -> list[list[list[str]]]: ...
    def __getitem__(self, n: int | slice) -> list[list[str]] | list[list[list[str]]]:
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(len(self)))]
        if n < 0:
            n += len(self)
        if not self.has(n):
            raise IndexError(n)
        sweep = self._split.get(n)
        if sweep is None:  # a race between threads only splits it twice
            end = self._starts[n + 1] if n + 1 < len(self._starts) else len(self._rows)
            sweep = [line.split(", ") for line in self._rows[self._starts[n] : end]]
            self._split[n] = sweep
        return sweep


class _Recording:
    """A full-field ``--format=csv`` recording: columns, unit-free cells and sweeps."""

    def __init__(self, text: str, *, sidecar: pathlib.Path | None = None, source: str = "recording") -> None:
        lines = text.splitlines()
        first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
        if first is None:
            raise _FakeUsageError(f"{source} is empty")
        header = self._header(lines[first].rstrip("\r"))
        if header is not None:
            body = itertools.islice(lines, first + 1, None)
        elif sidecar is not None and sidecar.is_file():
            names = [n for n in re.split(r"[\s,]+", sidecar.read_text(encoding="utf-8")) if n]
            header = [(n, "") for n in names]
            body = itertools.islice(lines, first, None)
        else:
            raise _FakeUsageError(f"{source} has no header line (and no .fields file beside it)")
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
        self.sweeps: _Sweeps | _MappedSweeps = _Sweeps(body, len(self.columns), key)
        if not self.sweeps.has(0):
            raise _FakeUsageError(f"{source} has no data rows")
        self.gpus = [self._identity(pos, row) for pos, row in enumerate(self.sweeps[0])]

    @staticmethod
    def _header(line: str) -> list[tuple[str, str]] | None:
        cells = [_split_header_cell(c) for c in line.split(",")]
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
        return _strip_unit(row[i], self.units[i]) if i is not None else None

    def _identity(self, pos: int, row: Sequence[str]) -> dict[str, str]:
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
        return value if value and not _is_token(value) else _DEFAULT_DRIVER

    def resolve(self, name: str) -> Field:
        """The field for a queried name (catalogue names and aliases, plus unknown names the recording has)."""
        try:
            return get_field(name)
        except InvalidFieldError:
            if name in self.extra:
                return self.extra[name]
            raise


def _load_recording(path: str | None) -> _Recording:
    if not path:
        return _bundled_recording()
    p = pathlib.Path(path)
    try:
        st = p.stat()
        side = p.with_suffix(".fields")
        side_st = side.stat() if side.is_file() else None
    except OSError as exc:
        raise _FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    stamp = (st.st_mtime_ns, st.st_size, side_st.st_mtime_ns if side_st else 0, side_st.st_size if side_st else 0)
    return _parsed_recording(str(p), stamp)


# Parsed recordings are kept (read-only) so that the in-process fake pays for a recording once, not every call.
@functools.cache
def _bundled_recording() -> _Recording:
    return _Recording(_read_bundled("demo-8gpu.csv"), source="bundled demo-8gpu.csv")


@functools.lru_cache(maxsize=32)
def _parsed_recording(path: str, stamp: tuple[int, int, int, int]) -> _Recording:
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise _FakeUsageError(f"cannot read recording {path}: {exc}") from exc
    return _Recording(text, sidecar=p.with_suffix(".fields"), source=path)


class _MappedSweeps(Sequence[list[list[str]]]):
    """A recording's sweeps as ``change`` turns each of them (the GPU set after ``reenumerate`` reloads)."""

    def __init__(self, sweeps: _Sweeps | _MappedSweeps, change: Callable[[list[list[str]]], list[list[str]]]) -> None:
        self._sweeps = sweeps
        self._change = change

    def has(self, n: int) -> bool:
        return self._sweeps.has(n)

    def __len__(self) -> int:
        return len(self._sweeps)

    @overload
    def __getitem__(self, n: int) -> list[list[str]]: ...
    @overload
    def __getitem__(self, n: slice) -> list[list[list[str]]]: ...
    def __getitem__(self, n: int | slice) -> list[list[str]] | list[list[list[str]]]:
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(len(self)))]
        return self._change(self._sweeps[n])


def _relayout(rec: _Recording, modes: Sequence[str]) -> _Recording:
    """``rec`` with the GPU set that the ``reenumerate`` reloads in ``modes`` left behind, in order."""
    if not modes:
        return rec
    changed = copy.copy(rec)  # the parsed recording is shared read-only: only attributes are replaced
    changed.sweeps = _MappedSweeps(rec.sweeps, functools.partial(_reenumerated, rec, tuple(modes)))
    changed.gpus = [changed._identity(pos, row) for pos, row in enumerate(changed.sweeps[0])]
    return changed


def _reenumerated(rec: _Recording, modes: tuple[str, ...], sweep: list[list[str]]) -> list[list[str]]:
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


def _added_gpu(rec: _Recording, rows: list[list[str]]) -> list[str]:
    """A new GPU's row: the first GPU's values under a uuid, bus id and serial no other GPU has."""
    import uuid

    row = list(rows[0])
    if (at := rec.col.get("uuid")) is not None:
        row[at] = f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'smiquery-fake:{rows[0][at]}:{len(rows)}')}"
    if (at := rec.col.get("pci.bus_id")) is not None:
        buses = [int(m.group(1), 16) for r in rows if (m := re.search(r":([0-9A-Fa-f]{2}):", r[at]))]
        row[at] = f"00000000:{(max(buses, default=0) + 1) % 256:02X}:00.0"
    if (at := rec.col.get("serial")) is not None:
        serials = [int(r[at]) for r in rows if _is_number(r[at])]
        if serials:
            row[at] = str(max(serials) + 1)
    return row


# Compute apps: canonical names, input aliases and header units (NVIDIA-SMI.md section 4).
_APP_FIELDS: dict[str, str] = {
    "timestamp": "",
    "gpu_name": "",
    "gpu_bus_id": "",
    "gpu_serial": "",
    "gpu_uuid": "",
    "pid": "",
    "process_name": "",
    "used_gpu_memory": "MiB",
}
_APP_ALIASES = {"name": "process_name", "used_memory": "used_gpu_memory"}
_APP_HELP = {
    "timestamp": 'The timestamp of when the query was made in format "YYYY/MM/DD HH:MM:SS.msec".',
    "gpu_name": "Product name of the GPU the process runs on.",
    "gpu_bus_id": 'PCI bus id of the GPU, as "domain:bus:device.function" in hex.',
    "gpu_serial": "Board serial number of the GPU.",
    "gpu_uuid": "Globally unique identifier of the GPU.",
    "pid": "Process ID of the compute application",
    "process_name": "Process name",
    "used_gpu_memory": "GPU memory used by the process's context.",
}


def _load_apps(setting: str | None, rec: _Recording) -> list[dict[str, str]]:
    if setting == "":
        return []
    if setting is None:
        text = _read_bundled("demo-8gpu-apps.csv")
    else:
        try:
            text = pathlib.Path(setting).read_text(encoding="utf-8")
        except OSError as exc:
            raise _FakeUsageError(f"cannot read compute-apps file {setting}: {exc}") from exc
    lines = [ln.rstrip("\r") for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    names = []
    units = []
    for cell in lines[0].split(","):
        name, unit = _split_header_cell(cell)
        names.append(_APP_ALIASES.get(name, name))
        units.append(unit or _APP_FIELDS.get(name, ""))
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
        app = {n: _strip_unit(c, u) for n, c, u in zip(names, cells, units)}
        gpu = by_uuid.get(app.get("gpu_uuid", "").lower())
        if gpu is not None:
            app.setdefault("gpu_name", gpu["name"])
            app.setdefault("gpu_bus_id", gpu["pci.bus_id"])
            app.setdefault("gpu_serial", gpu["serial"])
        apps.append(app)
    return apps


# ------------------------------------------------------------------------------------------------ arguments


@dataclasses.dataclass
class _Options:
    query_gpu: str | None = None
    query_apps: str | None = None
    fmt: str | None = None
    ids: str | None = None
    interval: float | None = None
    action: str | None = None


class _Args:
    def __init__(self, argv: Sequence[str], out: _Output) -> None:
        self.argv = list(argv)
        self.pos = 0
        self.out = out

    def fail(self, message: str) -> NoReturn:
        self.out.line(f"ERROR: {message} {_HELP_HINT}")
        raise _Exit(255)

    def value(self, option: str, inline: str | None) -> str:
        if inline is not None:
            if not inline:
                self.fail(f"Option {option} is missing its value.")
            return inline
        if self.pos >= len(self.argv):
            self.fail(f"Option {option} is missing its value.")
        text = self.argv[self.pos]
        self.pos += 1
        return text

    def optional_number(self) -> str | None:
        if self.pos < len(self.argv) and _is_number(self.argv[self.pos]):
            self.pos += 1
            return self.argv[self.pos - 1]
        return None


def _parse_interval(args: _Args, option: str, text: str, scale: float) -> float:
    if not _is_number(text) or int(text) <= 0:
        args.fail(f"Invalid value {text!r} for option {option}.")
    return int(text) * scale


def _parse_args(argv: Sequence[str], out: _Output) -> _Options:
    opts = _Options()
    args = _Args(argv, out)
    actions = {
        "--help-query-gpu": "help-query-gpu",
        "--help-query-compute-apps": "help-query-compute-apps",
        "-L": "list",
        "--list-gpus": "list",
        "--version": "version",
        "-h": "help",
        "--help": "help",
        "--fake-help": "help",
    }
    while args.pos < len(args.argv):
        arg = args.argv[args.pos]
        args.pos += 1
        name, eq, inline_text = arg.partition("=")
        inline = inline_text if eq else None
        if arg in actions:
            opts.action = opts.action or actions[arg]
        elif name == "--query-gpu":
            opts.query_gpu = args.value(name, inline)
        elif name == "--query-compute-apps":
            opts.query_apps = args.value(name, inline)
        elif name == "--format":
            opts.fmt = args.value(name, inline)
        elif name in ("-i", "--id"):
            opts.ids = args.value(name, inline)
        elif name in ("-l", "--loop"):
            text = inline if inline is not None else args.optional_number()
            # `-l` without a value loops every 5 seconds (manual)
            opts.interval = _parse_interval(args, name, text, 1.0) if text is not None else 5.0
        elif name in ("-lms", "--loop-ms"):
            opts.interval = _parse_interval(args, name, args.value(name, inline), 0.001)
        else:
            args.fail(f"Option {name} is not recognized.")
    return opts


# --------------------------------------------------------------------------------------------------- output


class _Output:
    """Where the fake's engine writes and how it waits: the process's stdout and clock (in-process: a channel)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def line(self, text: str = "") -> None:
        self.raw(text.encode("utf-8") + b"\n")

    def raw(self, data: bytes) -> None:
        self.stream.write(data)

    def flush(self) -> None:
        """Make what was written visible to the reader (a C program's fflush)."""
        self.stream.flush()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``; the in-process output wakes up early to stop, as a signal would."""
        time.sleep(seconds)

    def error(self, text: str) -> None:
        """One line on stderr."""
        print(text, file=sys.stderr)

    def begin(self, argv: Sequence[str], settings: _Settings, faults: _Faults) -> None:
        """What happens once the faults are known, before nvidia-smi's own work: grandchild, signals, log."""
        if faults.grandchild:
            _start_grandchild()
        if faults.ignore_term and hasattr(signal, "SIGTERM"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # logged after SIGTERM is ignored: a test that sees the line may rely on it
        if settings.log:
            _log_invocation(settings.log, argv)


def _hang(out: _Output) -> NoReturn:
    out.flush()
    while True:
        out.sleep(3600)


def _now_text(now: datetime) -> str:
    return FIELD_KINDS[Kind.TIMESTAMP].format(now)


def _garbage_line(rng: random.Random, ncols: int) -> bytes:
    """A line that can never pass for a row of ``ncols`` cells: random bytes, invalid UTF-8, wrong cell count."""
    # no separators and nothing any reader could take for a line break (str.splitlines() knows eight of them)
    alphabet = bytes(b for b in range(256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    noise = bytes(rng.choice(alphabet) for _ in range(rng.randint(8, 60)))
    cells = ncols + 1 + rng.randint(0, 3)
    return b"\xff\xfe" + noise + b", \xc3(" * (cells - 1)


# The fall-back of `dst-fallback`: 2026-10-25 03:00 CEST (UTC+2) is 02:00 CET (UTC+1), at 01:00 UTC.
_DST_CHANGE_UTC = datetime(2026, 10, 25, 1, 0, 0)


class _Clock:
    """The wall clock behind the timestamp cells: the local time, or ``dst-fallback``'s, plus the clock steps."""

    def __init__(self, faults: _Faults, keep_time: bool) -> None:
        self.steps = faults.clock_steps
        self.dst_before = faults.dst_before
        self.keep_time = keep_time and self.dst_before is None
        self.start = time.monotonic()

    def now(self) -> datetime:
        """The instant a sweep starts: local time, or (``dst-fallback``) UTC, to be turned by :meth:`text`."""
        if self.dst_before is None:
            return datetime.now()
        return _DST_CHANGE_UTC + timedelta(seconds=time.monotonic() - self.start - self.dst_before)

    def text(self, instant: datetime, rows: int) -> str:
        """The timestamp cell of a row written after ``rows`` rows, at ``instant`` (from :meth:`now`)."""
        shift = sum(seconds for after, seconds in self.steps if rows >= after)
        if shift:
            instant += timedelta(seconds=shift)
        if self.dst_before is not None:  # Europe/Berlin: UTC+2 until the change, UTC+1 after it
            instant += timedelta(hours=2 if instant < _DST_CHANGE_UTC else 1)
        return _now_text(instant)

    def recorded(self, cell: str, rows: int) -> str:
        """A recorded timestamp cell (``SMIQUERY_FAKE_KEEP_TIME``), moved by the clock steps struck so far."""
        if not any(rows >= after for after, _ in self.steps):
            return cell
        try:
            instant = datetime.strptime(cell.strip(), "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            return cell
        return self.text(instant, rows)


@dataclasses.dataclass(frozen=True)
class _Reload:
    """The ``reenumerate`` reload due in this start: after ``after`` rows, the count in ``state`` goes up."""

    state: str | _MemoryState | None
    struck: int
    after: int


class _RowWriter:
    """Writes data rows and springs the row-counting faults (``hang-after``, ``crash-after``...)."""

    def __init__(
        self,
        out: _Output,
        faults: _Faults,
        ncols: int,
        interval: float | None = None,
        reload: _Reload | None = None,
    ) -> None:
        self.out = out
        self.faults = faults
        self.ncols = ncols
        self.interval = interval
        self.reload = reload
        self.rows = 0
        self._garbage_done = False
        self._wrong_done = False
        self._rng: random.Random | None = None  # made on the first garbage line: `random` is not imported per call

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            import random

            self._rng = random.Random(20240521)
        return self._rng

    def _due(self, limit: int | None) -> bool:
        return limit is not None and self.rows >= limit

    def check_stop(self, next_bus_id: str) -> None:
        """Hang, crash, exit or turn to notices when their row count is reached."""
        if self._due(self.faults.hang_after):
            _hang(self.out)
        if self._due(self.faults.crash_after):
            bus = _short_bus_id(next_bus_id) if next_bus_id else "0000:00:00.0"
            self.out.line(_HANDLE_ERROR.format(bus=bus, reason="Unknown Error"))
            self.out.flush()
            raise _Exit(255)
        if self._due(self.faults.exit_after):
            if self.faults.exit_after_message:
                self.out.line(self.faults.exit_after_message)
            self.out.flush()
            raise _Exit(self.faults.exit_after_code)
        if self._due(self.faults.notices_after):
            self._notices_forever()
        if self.reload is not None and self.rows >= self.reload.after:
            _record_reload(self.reload.state, self.reload.struck + 1)
            bus = _short_bus_id(next_bus_id) if next_bus_id else "0000:00:00.0"
            self.out.line(_HANDLE_ERROR.format(bus=bus, reason="Unknown Error"))
            self.out.flush()
            raise _Exit(255)

    def _notices_forever(self) -> NoReturn:
        while True:
            for text in _NOTICE_BATCH:
                self.out.line(text)
            self.out.flush()
            self.out.sleep(self.interval if self.interval is not None else 1.0)

    def row(self, cells: list[str], *, bus_id: str = "", truncate: bool = False) -> None:
        self.check_stop(bus_id)
        if not self._garbage_done and self._due(self.faults.garbage_after):
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")
            self._garbage_done = True
        if not self._wrong_done and self._due(self.faults.wrong_columns_after):
            cells = cells[:-1]
            self._wrong_done = True
        data = ", ".join(cells).encode("utf-8")
        if truncate:
            self.out.raw(data[: max(1, len(data) // 2)])
        else:
            self.out.raw(data + b"\n")
        self.rows += 1

    def garbage(self, lines: int = 12) -> None:
        for _ in range(lines):
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")


_FLOOD_LINE = 1 << 20  # a loop's flood: lines of 1 MiB, far past any sane row


@functools.cache
def _flood_block() -> bytes:
    """64 KiB of noise with no line break, comma or NUL: what a wrong binary could print."""
    import random

    alphabet = bytes(b for b in range(1, 256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    rng = random.Random(20261025)
    return bytes(rng.choice(alphabet) for _ in range(1 << 16))


def _flood(argv: Sequence[str], total: int | None, out: _Output) -> int:
    """``flood``: noise on stdout without end (or ``total`` bytes), in a loop as over-long lines."""
    loop = any(a.partition("=")[0] in ("-l", "--loop", "-lms", "--loop-ms") for a in argv) or tuple(argv[:1]) == (
        "pmon",
    )
    block = _flood_block()
    unit = block * (_FLOOD_LINE // len(block)) + b"\n" if loop else block
    left = total
    while left is None or left > 0:
        data = unit if left is None else unit[:left]
        out.raw(data)
        out.flush()
        if left is not None:
            left -= len(data)
    return 0


def _invalid_field(out: _Output, name: str) -> NoReturn:
    out.line(f'Field "{name}" is not a valid field to query.')
    out.line()
    raise _Exit(2)


def _format_flags(args_fmt: str | None, out: _Output) -> tuple[bool, bool]:
    """(header, units) from ``--format``."""
    tokens = [t.strip() for t in (args_fmt or "").split(",") if t.strip()]
    if "csv" not in tokens or any(t not in ("csv", "noheader", "nounits") for t in tokens):
        out.line(f"Invalid combination of input arguments. {_HELP_HINT}")
        raise _Exit(2)
    return "noheader" not in tokens, "nounits" not in tokens


def _select(rec: _Recording, ids: str | None, out: _Output) -> set[str]:
    """The keys (indices) of the GPUs that ``-i`` selects; exits 6 when an id matches nothing."""
    if ids is None:
        return {rec.key_of(row, pos) for pos, row in enumerate(rec.sweeps[0])}
    wanted = [i.strip() for i in ids.split(",") if i.strip()]
    chosen: set[str] = set()
    for ident in wanted:
        match = None
        for gpu in rec.gpus:
            if (
                (_is_number(ident) and _is_number(gpu["index"]) and int(ident) == int(gpu["index"]))
                or ident.lower() == gpu["uuid"].lower()
                or _norm_bus_id(ident) == _norm_bus_id(gpu["pci.bus_id"])
                or (gpu["serial"] not in ("[N/A]", "") and ident == gpu["serial"])
            ):
                match = gpu["index"]
                break
        if match is None:
            out.line("No devices were found")
            raise _Exit(6)
        chosen.add(match)
    if not chosen:
        out.line("No devices were found")
        raise _Exit(6)
    return chosen


def _sweep_order(first: int, sweeps: _Sweeps | _MappedSweeps, loop: bool) -> Iterator[int]:
    # modulo the sweep count, counted only when needed: counting reads the whole recording
    n = first if sweeps.has(first) else first % len(sweeps)
    if not loop:
        yield n
        return
    while True:
        yield n
        n = n + 1 if sweeps.has(n + 1) else 0


def _render(fld: Field, value: str | None, units: bool) -> str:
    if value is None:
        return fld.format(None)
    if units and fld.header_unit and not _is_token(value):
        return f"{value} {fld.header_unit}"
    return value


def _query_gpu(
    opts: _Options, rec: _Recording, settings: _Settings, faults: _Faults, out: _Output, reload: _Reload | None
) -> int:
    assert opts.query_gpu is not None
    fields: list[Field] = []
    for name in opts.query_gpu.split(","):
        try:
            fields.append(rec.resolve(name))
        except InvalidFieldError:
            _invalid_field(out, name)
    header, units = _format_flags(opts.fmt, out)
    _startup(faults, rec, out)
    selected = _select(rec, opts.ids, out)
    clock = _Clock(faults, settings.keep_time)
    keep_time = clock.keep_time and "timestamp" in rec.col
    loop = opts.interval is not None
    writer = _RowWriter(out, faults, len(fields), opts.interval, reload)
    if header:
        out.line(", ".join(f.header for f in fields))
    if faults.garbage:
        writer.garbage()
        out.flush()
        return 0
    warned = False
    for count, n in enumerate(_sweep_order(settings.sweep, rec.sweeps, loop), 1):
        rows = [(rec.key_of(r, pos), r) for pos, r in enumerate(rec.sweeps[n])]
        rows = [(key, r) for key, r in rows if key in selected]
        now = clock.now()
        slow = faults.slow_every is not None and count % faults.slow_every == 0
        late = 0.0  # how late this sweep's rows are, once its slow row has come
        for i, (key, row) in enumerate(rows):
            delay = 0.0
            if slow and key == str(faults.slow_index):
                delay = faults.slow_fraction * (opts.interval if opts.interval is not None else 1.0)
                out.flush()  # the rows before it reach the reader on time
                out.sleep(delay)
            if (
                faults.drop_gpu_after is not None
                and writer.rows >= faults.drop_gpu_after
                and key == str(faults.drop_gpu_index)
            ):
                if faults.drop_gpu_message:
                    ident = next((g for g in rec.gpus if g["index"] == key), rec.gpus[0])
                    bus = _short_bus_id(rec.cell(row, "pci.bus_id") or ident["pci.bus_id"])
                    out.line(_HANDLE_ERROR.format(bus=bus, reason=_GPU_LOST_REASON))
                continue
            lost = (
                faults.gpu_lost_after is not None
                and writer.rows >= faults.gpu_lost_after
                and key == str(faults.gpu_lost_index)
            )
            cells = []
            for fld in fields:
                if lost and fld.name not in _SURVIVES_LOSS:
                    cells.append("[GPU is lost]")
                elif fld.name == "timestamp" and not keep_time:
                    cells.append(clock.text(now + timedelta(seconds=late, milliseconds=i), writer.rows))
                elif fld.name == "timestamp":
                    cells.append(clock.recorded(_render(fld, rec.cell(row, fld.name), units), writer.rows))
                else:
                    cells.append(_render(fld, rec.cell(row, fld.name), units))
            late += delay  # the slow row's timestamp was taken before its slow answer; the rows after it are late
            truncate = faults.truncated and i == len(rows) - 1
            writer.row(cells, bus_id=rec.cell(row, "pci.bus_id") or "", truncate=truncate)
        out.flush()
        if faults.truncated:
            return 0
        if faults.inforom and not warned:
            if not loop:
                writer.check_stop("")
            out.line(_INFOROM_WARNING)
            out.flush()
            warned = True
            if not loop:
                return 14
        if loop:
            assert opts.interval is not None
            out.sleep(opts.interval)
    writer.check_stop("")
    return 0


def _query_apps(
    opts: _Options, rec: _Recording, settings: _Settings, faults: _Faults, out: _Output, reload: _Reload | None
) -> int:
    assert opts.query_apps is not None
    names: list[str] = []
    for name in opts.query_apps.split(","):
        canonical = _APP_ALIASES.get(name, name)
        if canonical not in _APP_FIELDS:
            _invalid_field(out, name)
        names.append(canonical)
    header, units = _format_flags(opts.fmt, out)
    _startup(faults, rec, out)
    selected = _select(rec, opts.ids, out)
    uuids = {g["uuid"].lower() for g in rec.gpus if g["index"] in selected}
    apps = [a for a in _load_apps(settings.apps, rec) if a.get("gpu_uuid", "").lower() in uuids or opts.ids is None]
    writer = _RowWriter(out, faults, len(names), opts.interval, reload)
    if header:
        out.line(", ".join(f"{n} [{_APP_FIELDS[n]}]" if _APP_FIELDS[n] else n for n in names))
    if faults.garbage:
        writer.garbage()
        out.flush()
        return 0
    clock = _Clock(faults, keep_time=False)
    while True:
        stamp = clock.text(clock.now(), writer.rows)
        for i, app in enumerate(apps):
            cells = []
            for n in names:
                value = stamp if n == "timestamp" else app.get(n)
                if value is None:
                    cells.append("[N/A]")
                elif units and _APP_FIELDS[n] and not _is_token(value):
                    cells.append(f"{value} {_APP_FIELDS[n]}")
                else:
                    cells.append(value)
            writer.row(cells, bus_id=app.get("gpu_bus_id", ""), truncate=faults.truncated and i == len(apps) - 1)
        out.flush()
        if faults.truncated or opts.interval is None:
            break
        out.sleep(opts.interval)
    writer.check_stop("")
    return 0


def _startup(faults: _Faults, rec: _Recording, out: _Output) -> None:
    """Where real nvidia-smi initialises NVML: the start-up failures, and `hang`."""
    if faults.hang:
        _hang(out)
    if faults.startup is not None:
        lines, code = _STARTUP_FAULTS[faults.startup]
        driver = rec.driver_version
        nvml = ".".join(driver.split(".")[:2])
        for text in lines:
            out.line(text.format(nvml_line=f"NVML library version: {nvml}"))
        raise _Exit(code)
    if faults.exit_code is not None:
        if faults.exit_message:
            out.line(faults.exit_message)
        raise _Exit(faults.exit_code)


def _help_query_gpu(rec: _Recording, out: _Output) -> int:
    out.line('List of valid properties to query for the switch "--query-gpu":')
    present = set(rec.col) | {"timestamp"}
    family = ""
    for fld in CATALOGUE:
        if fld.name not in present:
            continue
        group = fld.name.split(".")[0]
        if group in ("clocks_event_reasons", "ecc", "power", "clocks") and group != family:
            out.line()
            out.line(f"Section about {group} properties")
            out.line(f"Properties of the {group} group.")
        family = group
        out.line()
        out.line(" or ".join(f'"{n}"' for n in (fld.name, *fld.aliases)))
        out.line(fld.help or "No description.")
    for fld in rec.extra.values():
        out.line()
        out.line(f'"{fld.name}"')
        out.line("Listed by the driver this recording comes from.")
    out.line()
    return 0


def _help_query_apps(out: _Output) -> int:
    out.line('List of valid properties to query for the switch "--query-compute-apps":')
    out.line()
    out.line("Section about Active Compute Processes properties")
    out.line("List of processes having compute context on the device.")
    aliases = {v: k for k, v in _APP_ALIASES.items()}
    for name, text in _APP_HELP.items():
        out.line()
        out.line(f'"{name}"' + (f' or "{aliases[name]}"' if name in aliases else ""))
        out.line(text)
    out.line()
    return 0


def _cuda_version(driver: str) -> str:
    try:
        branch = int(driver.split(".")[0])
    except ValueError:
        return "13.1"
    best = max((b for b in _CUDA_BY_BRANCH if b <= branch), default=470)
    return _CUDA_BY_BRANCH[best]


def _version(rec: _Recording, out: _Output) -> int:
    driver = rec.driver_version
    out.line(f"NVIDIA-SMI version  : {driver}")
    out.line(f"NVML version        : {'.'.join(driver.split('.')[:2])}")
    out.line(f"DRIVER version      : {driver}")
    out.line(f"CUDA Version        : {_cuda_version(driver)}")
    out.line()
    return 0


def _list_gpus(rec: _Recording, selected: set[str], out: _Output) -> int:
    for gpu in rec.gpus:
        if gpu["index"] in selected:
            out.line(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
    return 0


def _table(rec: _Recording, selected: set[str], out: _Output) -> int:
    """A short version of the default human-readable table."""

    def get(row: Sequence[str], name: str, suffix: str = "") -> str:
        value = rec.cell(row, name)
        if value is None or _is_token(value):
            return "N/A"
        return value + suffix

    def watts(row: Sequence[str], name: str) -> str:
        value = get(row, name)
        return value if value == "N/A" else f"{float(value):.0f}W"

    driver = rec.driver_version
    rule = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
    out.line(time.asctime())
    out.line("+" + "-" * 89 + "+")
    title = f" NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}CUDA Version: {_cuda_version(driver):<9}"
    out.line(f"|{title:<89}|")
    out.line("|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    out.line("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.line("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.line("|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|")
    for pos, row in enumerate(rec.sweeps[0]):
        key = rec.key_of(row, pos)
        if key not in selected:
            continue
        pers = {"Enabled": "On", "Disabled": "Off"}.get(get(row, "persistence_mode"), "On")
        ecc = get(row, "ecc.errors.uncorrected.volatile.total")
        name = get(row, "name")
        out.line(f"| {key:>3}  {name:<30.30}{pers:>3}  |{get(row, 'pci.bus_id'):>19} Off |{ecc:>21} |")
        temp = get(row, "temperature.gpu", "C")
        power = f"{watts(row, 'power.draw')} / {watts(row, 'power.limit'):>5}"
        left = f" {get(row, 'fan.speed', '%'):>3} {temp:>5}    {get(row, 'pstate'):>2}{power:>24} "
        memory = f"{get(row, 'memory.used', 'MiB')} / {get(row, 'memory.total', 'MiB'):>9}"
        util = get(row, "utilization.gpu", "%")
        out.line(f"|{left:<41}|{memory:>23} |{util:>8}{'Default':>13} |")
        out.line(rule)
    return 0


def _usage(out: _Output) -> int:
    out.line("smiquery fake nvidia-smi: replays a recorded CSV like NVIDIA's System Management Interface.")
    out.line()
    out.line("    nvidia-smi [-i ID] --query-gpu=LIST --format=csv[,noheader][,nounits] [-l SEC | -lms MS]")
    out.line("    nvidia-smi [-i ID] --query-compute-apps=LIST --format=csv[,noheader][,nounits]")
    out.line("    nvidia-smi --help-query-gpu | --help-query-compute-apps | -L | --version | -h | --help")
    out.line()
    out.line("Faults (SMIQUERY_FAKE_FAULT or fault=; combine with commas; N counts data rows, across loop sweeps):")
    width = max(len(spec) for spec in FAULT_HELP) + 2
    for spec, text in FAULT_HELP.items():
        out.line(f"  {spec:<{width}}{text}")
    out.line()
    out.line("Environment variables (read at every start; they override the settings baked into the script):")
    width = max(len(name) for name in ENV_VARS) + 2
    for name, text in ENV_VARS.items():
        out.line(f"  {name:<{width}}{text}")
    return 0


# ----------------------------------------------------------------------------------------------- entry points


def _log_invocation(path: str, argv: Sequence[str]) -> None:
    import json

    record = json.dumps({"pid": os.getpid(), "argv": list(argv), "time": time.time()}) + "\n"
    # one write on an O_APPEND descriptor, so concurrent fakes never interleave their lines
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, record.encode("utf-8"))
    finally:
        os.close(fd)


def _dispatch(argv: Sequence[str], settings: _Settings, faults: _Faults, out: _Output) -> int:
    delay = faults.start_delay if faults.start_delay is not None else settings.start_delay
    if delay > 0:
        out.sleep(delay)
    if faults.flood:
        return _flood(argv, faults.flood_bytes, out)
    if {"-q", "--query", "-x", "--xml-format"} & set(argv) or (settings.xml and {"-L", "--list-gpus"} & set(argv)):
        from smiquery.testing._emulator.details import run_details  # -q -x, and -L from an XML capture

        return run_details(argv, settings, faults, out)
    if tuple(argv[:1]) == ("pmon",):  # a tuple from the in-process runner, a list from the executable
        from smiquery.testing._emulator.pmon import run_pmon

        return run_pmon(argv[1:], settings, faults, out)
    opts = _parse_args(argv, out)
    rec = _load_recording(settings.recording)
    reload = None
    if faults.reloads:
        struck = _reloads_struck(settings.state)
        rec = _relayout(rec, [mode for _, mode in faults.reloads[:struck]])
        if struck < len(faults.reloads):
            reload = _Reload(settings.state, struck, faults.reloads[struck][0])
    if opts.action == "help":
        return _usage(out)
    if opts.action == "help-query-gpu":
        return _help_query_gpu(rec, out)
    if opts.action == "help-query-compute-apps":
        return _help_query_apps(out)
    if opts.query_gpu is not None and opts.query_apps is not None:
        out.line(f"Invalid combination of input arguments. {_HELP_HINT}")
        return 2
    if opts.query_gpu is not None:
        return _query_gpu(opts, rec, settings, faults, out, reload)
    if opts.query_apps is not None:
        return _query_apps(opts, rec, settings, faults, out, reload)
    if opts.fmt is not None:
        out.line(f"Invalid combination of input arguments. {_HELP_HINT}")
        return 2
    _startup(faults, rec, out)
    if opts.action == "version":
        return _version(rec, out)
    selected = _select(rec, opts.ids, out)
    if opts.action == "list":
        return _list_gpus(rec, selected, out)
    return _table(rec, selected, out)


def _start_grandchild() -> None:
    """A child of the fake that holds its stdout and stderr open for an hour (in the fake's process group)."""
    import shutil

    sleeper = shutil.which("sleep")
    argv = [sleeper, "3600"] if sleeper else [sys.executable, "-c", "import time; time.sleep(3600)"]
    # posix_spawn leaves no Popen object behind to complain that its child outlived it
    os.posix_spawn(argv[0], argv, os.environ)


def _execute(argv: Sequence[str], settings: _Settings, env: Mapping[str, str], out: _Output) -> int:
    """The fake's engine, shared by the executable and :class:`InProcessRunner`: argv in, exit status out."""
    try:
        try:
            settings = settings.with_env(env)
            faults = _parse_faults(settings.fault)
            out.begin(argv, settings, faults)
            code = _dispatch(argv, settings, faults, out)
        except _Exit as exc:
            code = exc.code
        out.flush()
    except _FakeUsageError as exc:
        out.flush()
        out.error(f"smiquery-fake-nvidia-smi: {exc}")
        return _EX_SOFTWARE
    return code


def _run(argv: Sequence[str], settings: _Settings) -> int:
    """Run the fake with signal handling like a C program: quiet on SIGINT, SIGTERM and a closed pipe."""
    saved: dict[int, object] = {}
    for name in ("SIGINT", "SIGPIPE", "SIGTERM"):
        signum = getattr(signal, name, None)
        if signum is not None:
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                saved[signum] = signal.signal(signum, signal.SIG_DFL)
    stream: BinaryIO = getattr(sys.stdout, "buffer", None) or sys.stdout  # type: ignore[assignment]
    try:
        return _execute(argv, settings, os.environ, _Output(stream))
    except BrokenPipeError:
        # the reader went away: end quietly, and keep Python from complaining when it flushes at exit
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, handler)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Run the fake ``nvidia-smi`` with nvidia-smi's own command-line arguments.

    Settings come from the ``SMIQUERY_FAKE_*`` environment variables (see :data:`ENV_VARS`); without them it
    replays the bundled 8-GPU demo recording and fails in no way.

    Args:
        argv: the arguments after the program name; None means ``sys.argv[1:]``.

    Returns:
        The exit status nvidia-smi would return (70 when the fake itself is misconfigured).
    """
    return _run(sys.argv[1:] if argv is None else argv, _Settings())


def _main_with_settings(settings: Mapping[str, object], argv: list[str] | None = None) -> int:
    """Entry point of the scripts written by :func:`fake_nvidia_smi` (settings baked in)."""
    delay = settings.get("start_delay") or 0.0
    baked = _Settings(
        recording=_opt_str(settings.get("recording")),
        fault=_opt_str(settings.get("fault")),
        start_delay=float(delay) if isinstance(delay, (int, float, str)) else 0.0,
        apps=_opt_str(settings.get("apps")),
        log=_opt_str(settings.get("log")),
        state=_opt_str(settings.get("state")),
    )
    return _run(sys.argv[1:] if argv is None else argv, baked)


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _abs(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else str(pathlib.Path(path).absolute())


def _shebang(python: str) -> str:
    # The kernel splits a #! line at whitespace and truncates it (127 bytes on older kernels): such interpreters
    # are started through /bin/sh, with a first line that sh runs and Python reads as a string literal.
    import shlex

    if python.isascii() and not re.search(r"\s", python) and len(python) < 120:
        return f"#!{python}\n"
    return f"#!/bin/sh\n\"true\" '''\\'\nexec {shlex.quote(python)} \"$0\" \"$@\"\n'''\n"


def fake_nvidia_smi(
    directory: str | os.PathLike[str],
    *,
    recording: str | os.PathLike[str] | None = None,
    fault: str | None = None,
    start_delay: float = 0.0,
    apps: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    name: str = "nvidia-smi",
) -> pathlib.Path:
    """Write an executable fake ``nvidia-smi`` into ``directory``.

    The script runs this Python interpreter (``sys.executable``) and replays ``recording`` in nvidia-smi's exact
    CSV format, failing as ``fault`` says. The ``SMIQUERY_FAKE_*`` environment variables override these settings
    when it runs (see :data:`ENV_VARS`).

    Faults about time and identity, for stream engines (:data:`FAULT_HELP` has every fault):

    - ``clock-step:N:SECONDS``: from the Nth row on (0-based), the timestamp cells are SECONDS later (negative: an
      NTP step back). With 8 GPUs, ``clock-step:12:-3600`` steps back an hour between GPU 3 and GPU 4 of the second
      sweep, so that sweep straddles the step. Repeat the spec for more steps; with ``SMIQUERY_FAKE_KEEP_TIME=1``
      the recorded timestamps move by the same steps.
    - ``dst-fallback[:SECONDS]``: the timestamps are Europe/Berlin local time, starting SECONDS (default 10) of real
      time before 2026-10-25 03:00 CEST, when clocks go back to 02:00 CET: ``02:59:59.9xx`` is followed by
      ``02:00:00.0xx``. Each start begins SECONDS before the change again.
    - ``slow-row:N:FRACTION[:INDEX]``: in sweeps N, 2N, 3N... of a start, the rows before GPU INDEX's (default 3)
      are flushed, then that row and the rest of the sweep come FRACTION (0 < FRACTION < 1) of the interval late
      (one-shot: of 1 s). The slow row's timestamp is on time; the rows after it carry the delay. The next sweep
      starts one interval after this one ends, as nvidia-smi sleeps between sweeps.
    - ``reenumerate:N[:MODE]``: after N rows of a start, a driver reload: the sweep is cut, ``Unable to determine the
      device handle for GPU <bus id of the next row>: Unknown Error``, exit 255. The reload is counted in the state
      file (``<path>.state`` beside the executable; ``SMIQUERY_FAKE_STATE``), so every later start serves the changed
      GPU set, to every query (``-L``, ``-i``, compute apps too): ``swap`` (default) swaps GPUs 0 and 1 (uuid, bus
      id and values; the indices stay in order), ``remove`` drops GPU 1 and renumbers the ones after it down,
      ``add`` appends a GPU (GPU 0's values under a new uuid, bus id and serial). Repeated specs chain: the first
      start reloads after the first spec's N rows, the second start (with the first change) after the second's, and
      the last start runs on. Delete the state file to start over.
    - ``flood[:BYTES]``: a wrong binary on PATH: noise on stdout and nothing else, whatever the arguments; one-shot
      with no newline at all, in a loop (``-l``/``-lms``) as 1 MiB lines back to back; without end, or BYTES in
      all and exit 0.

    Args:
        directory: where to write it (created if missing).
        recording: a ``--format=csv`` recording with header; None for the bundled 8-GPU demo.
        fault: comma-separated fault specs from :data:`FAULTS`, e.g. ``"hang-after:8,ignore-term"``.
        start_delay: seconds to sleep before any output (nvidia-smi's start-up cost).
        apps: the compute-apps CSV; None for the bundled one, ``""`` for no processes.
        log: a file to which every invocation appends one JSON line (``pid``, ``argv``, ``time``).
        name: the file name.

    Returns:
        The path of the executable.

    Raises:
        ValueError: ``fault`` names an unknown fault or ``start_delay`` is negative.
    """
    _check_settings(fault, start_delay)
    folder = pathlib.Path(directory)
    path = folder / name
    settings = {
        "recording": _abs(recording),
        "fault": fault,
        "start_delay": float(start_delay),
        "apps": "" if apps == "" else _abs(apps),
        "log": _abs(log),
        "state": _abs(f"{path}.state"),
    }
    package_parent = str(pathlib.Path(__file__).resolve().parents[2])
    script = (
        _shebang(sys.executable)
        + '"""Fake nvidia-smi written by smiquery.testing.fake_nvidia_smi(): replays a recorded CSV."""\n'
        + "import sys\n\n"
        + f"SETTINGS = {settings!r}\n\n"
        + "try:\n"
        + "    from smiquery.testing import _main_with_settings\n"
        + "except ImportError:  # this interpreter has no smiquery installed: use the copy that wrote the script\n"
        + f"    sys.path.insert(0, {package_parent!r})\n"
        + "    from smiquery.testing import _main_with_settings\n\n"
        + "sys.exit(_main_with_settings(SETTINGS))\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------------------------- in-process fake


class _Stopped(BaseException):
    """Unwinds the engine thread when its source is terminated or killed (what the signal does to a process)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Channel:
    """What one in-process run shares between its engine thread and its reader: the pipes and the signals."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.out = bytearray()  # flushed stdout the reader has not taken yet
        self.err = bytearray()
        self.returncode: int | None = None
        self.ignore_term = False
        self.stop_signal: int | None = None
        self.thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.returncode is not None

    def signal(self, signum: int) -> None:
        """Deliver SIGTERM (ignored under ``ignore-term``) or SIGKILL to the engine."""
        with self.cond:
            if self.returncode is not None or self.stop_signal == signal.SIGKILL:
                return
            if signum == signal.SIGTERM and self.ignore_term:
                return
            self.stop_signal = signum
            self.cond.notify_all()

    def join(self, timeout: float) -> bool:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True


class _ChannelOutput(_Output):
    """The engine's output inside this process: buffered like stdio, visible at flush, stopped like a process."""

    def __init__(self, channel: _Channel) -> None:  # no stream: raw() and flush() below replace it
        self.channel = channel
        self.pending = bytearray()

    def _check(self) -> None:
        signum = self.channel.stop_signal
        if signum is not None:
            raise _Stopped(signum)

    def raw(self, data: bytes) -> None:
        self._check()
        self.pending += data

    def flush(self) -> None:
        self._check()
        if self.pending:
            ch = self.channel
            with ch.cond:
                # a full pipe blocks the writer until the reader takes some (a flood must not fill the memory)
                ch.cond.wait_for(lambda: len(ch.out) < _PIPE_BUFFER or ch.stop_signal is not None)
                self._check()
                ch.out += self.pending
                ch.cond.notify_all()
            self.pending.clear()

    def sleep(self, seconds: float) -> None:
        ch = self.channel
        with ch.cond:
            ch.cond.wait_for(lambda: ch.stop_signal is not None, seconds)
        self._check()

    def error(self, text: str) -> None:
        with self.channel.cond:
            self.channel.err += (text + "\n").encode("utf-8")
            self.channel.cond.notify_all()

    def begin(self, argv: Sequence[str], settings: _Settings, faults: _Faults) -> None:
        # `grandchild` needs a process: in-process it does nothing
        with self.channel.cond:
            self.channel.ignore_term = faults.ignore_term
        if settings.log:
            _log_invocation(settings.log, argv)


def _engine_thread(argv: Sequence[str], settings: _Settings, env: Mapping[str, str], channel: _Channel) -> None:
    out = _ChannelOutput(channel)
    try:
        code = _execute(argv, settings, env, out)
    except _Stopped as stop:
        code = -stop.signum  # what the signal leaves; output not yet flushed is lost, as in a killed process
    except Exception as exc:  # a bug in the fake: reported like a crashed interpreter, never swallowed
        out.error(f"smiquery-fake-nvidia-smi: internal error: {exc!r}")
        code = 1
    with channel.cond:
        channel.returncode = code
        channel.cond.notify_all()


def _stop_channel(channel: _Channel) -> None:
    channel.signal(signal.SIGKILL)
    channel.join(2.0)


_MESSAGE_LIMIT = 20  # recent non-CSV lines kept for error messages, as the real line reader keeps them
_PIPE_BUFFER = 1 << 20  # unread output at which the in-process engine's flush waits, as a writer on a full pipe
_RUN_OUTPUT_CAP = 64 << 20  # stdout InProcessRunner.run() keeps before it stops reading (then it times out)


class InProcessLines:
    """The output of one in-process fake run, line by line: a ``LineSource`` without a process.

    Returned by :meth:`InProcessRunner.lines`. It behaves like the real line reader: :meth:`readline` returns
    complete lines (blank ones skipped) or None when none came in time; when the output ends, a trailing partial
    line comes first, then exit 0 (or an end asked for by :meth:`terminate`, :meth:`kill` or :meth:`close`)
    raises ``StreamEndedError`` and a non-zero exit the typed :class:`~smiquery.errors.NvidiaSmiFailedError`
    from :func:`~smiquery.errors.failure_from_exit`. Loop intervals, start delays and hangs wait on the stop
    signal, so :meth:`terminate` (unless the fault is ``ignore-term``), :meth:`kill` and :meth:`close` end the
    engine thread at once.

    Attributes:
        argv: the command as given.
        pid: always None (no process).
    """

    pid: int | None = None

    def __init__(self, argv: Sequence[str], channel: _Channel) -> None:
        self.argv = tuple(argv)
        self._ch = channel
        self._buf = b""
        self._lines: deque[str] = deque()
        self._messages: list[str] = []
        self._ended: NvidiaSmiFailedError | None = None
        self._stopping = False
        self._interrupted = False
        self._closed = False
        self._idle = 0.0
        self._finalizer = weakref.finalize(self, _stop_channel, channel)

    @property
    def returncode(self) -> int | None:
        """The exit status once the engine has finished (negative: the signal that stopped it)."""
        return self._ch.returncode

    @property
    def idle(self) -> float:
        """Seconds the last :meth:`readline` waited for its line's data (0.0 when it was already buffered)."""
        return self._idle

    @property
    def stderr(self) -> str:
        """What the fake wrote to stderr so far."""
        return _decode(bytes(self._ch.err))

    @property
    def closed(self) -> bool:
        """True once the engine has finished and its end was read, or after :meth:`close`."""
        return self._closed

    def readline(self, timeout: float) -> str | None:
        """The next complete line; None if none came within ``timeout`` s or on :meth:`interrupt`.

        Args:
            timeout: seconds to wait for a line.

        Returns:
            The line without its newline, or None.

        Raises:
            StreamEndedError: the output ended with exit 0, or after a stop was asked for.
            NvidiaSmiFailedError: the output ended with a non-zero exit (its typed subclass).
        """
        ch = self._ch
        deadline = time.monotonic() + max(timeout, 0.0)
        waited = 0.0
        with ch.cond:
            self._take()
            if not self._lines:
                if self._ended is not None:
                    raise self._ended
                if self._closed:
                    raise StreamEndedError(self.argv, 0, "", "the nvidia-smi stream was closed")
            while not self._lines:
                if self._interrupted:
                    self._interrupted = False
                    self._idle = waited
                    return None
                if ch.done:
                    self._finish()
                    if not self._lines:
                        assert self._ended is not None
                        raise self._ended
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._interrupted = False
                    self._idle = waited
                    return None
                t0 = time.monotonic()
                ch.cond.wait(remaining)
                waited += time.monotonic() - t0
                self._take()
            self._idle = waited
            return self._lines.popleft()

    def _take(self) -> None:
        data = bytes(self._ch.out)
        if not data:
            return
        self._ch.out.clear()
        self._ch.cond.notify_all()  # room in the pipe again
        buf = self._buf + data
        *complete, self._buf = buf.split(b"\n")
        for raw in complete:
            self._add(raw)

    def _add(self, raw: bytes) -> None:
        line = _decode(raw).rstrip("\r")
        if not line.strip():
            return
        self._lines.append(line)
        if ", " not in line:
            self._messages = [*self._messages[-(_MESSAGE_LIMIT - 1) :], line]

    def _finish(self) -> None:
        tail, self._buf = self._buf, b""
        if tail.strip():
            self._add(tail)
        rc = self._ch.returncode
        assert rc is not None
        output = "\n".join(self._messages) + ("\n" + self.stderr if self._ch.err else "")
        if rc < 0 and not output.strip():
            output = f"killed by signal {-rc}"
        if rc != 0 and not self._stopping:
            self._ended = failure_from_exit(self.argv, rc, output)
        else:
            self._ended = StreamEndedError(self.argv, rc, output)
        self._closed = True
        self._finalizer.detach()

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now. Any thread."""
        with self._ch.cond:
            self._interrupted = True
            self._ch.cond.notify_all()

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM; ignored under ``ignore-term``). Any thread; idempotent."""
        self._stopping = True
        self._ch.signal(signal.SIGTERM)

    def kill(self) -> None:
        """Stop the engine (SIGKILL), whatever its faults. Any thread; idempotent."""
        self._stopping = True
        self._ch.signal(signal.SIGKILL)

    def close(self) -> None:
        """Stop the engine thread and wait for it (about a second at most); idempotent, any thread."""
        self._stopping = True
        self.interrupt()  # a readline blocked in another thread returns None, as the real one does
        self.terminate()
        if not self._ch.join(0.05):
            self.kill()
            self._ch.join(1.0)
        with self._ch.cond:
            self._closed = True
            self._ch.cond.notify_all()
        self._finalizer.detach()

    def __enter__(self) -> InProcessLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class InProcessRunner:
    """A runner that serves the fake ``nvidia-smi`` inside this process: the same engine, faults and recordings.

    ``run()`` and ``lines()`` execute exactly what the executable written by :func:`fake_nvidia_smi` executes, on a
    worker thread instead of a child process (no interpreter start-up per call), with the same output and exit
    statuses; hangs, start delays and loop intervals are real waits that :meth:`InProcessLines.terminate`,
    ``kill`` and ``close`` cut short. Use it wherever the subprocess boundary is not what a test is about; keep
    the executable for tests of pipes, signals and reaping. ``argv[0]`` (the binary) is ignored, so no binary is
    looked up for it (:meth:`locate`); ``grandchild`` needs a process and does nothing here. To run code that
    takes no ``runner=`` (the CLI, the exporter, the callbacks) against it, see :func:`use_runner`.

    Settings are plain attributes and may change between calls (set ``fault = None`` to simulate a fix). Unlike
    the executable, the process environment is not read: pass ``SMIQUERY_FAKE_*`` overrides in ``env``. The
    ``reenumerate`` reloads are counted on the runner (:attr:`reloads`), where the executable keeps a state file.
    Output waits for the reader past 1 MiB unread, as a pipe does; :meth:`run` keeps at most 64 MiB of stdout
    and then stops reading, so an endless ``flood`` ends in its timeout rather than filling the memory.

    Example::

        import pytest
        from smiquery import errors, query
        from smiquery.testing import InProcessRunner, fake_nvidia_smi

        def test_recovers_once_the_driver_is_back():
            runner = InProcessRunner(fault="driver-not-loaded")
            with pytest.raises(errors.DriverNotLoadedError):
                query(runner=runner)  # no binary is looked up: the runner starts none
            runner.fault = None  # the fix
            assert len(query(runner=runner)) == 8
            assert len(runner.calls) == 2
            # a loop: lines() returns a LineSource; readline(timeout) gives None while the fake is silent
            with runner.lines(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader", "-lms", "10"]) as src:
                assert src.readline(10) == "0"

    Args:
        recording: a ``--format=csv`` recording with header; None for the bundled 8-GPU demo.
        fault: comma-separated fault specs from :data:`FAULTS`.
        start_delay: seconds to wait before any output.
        apps: the compute-apps CSV; None for the bundled one, ``""`` for no processes.
        log: a file to which every call appends one JSON line, like the executable's.
        env: ``SMIQUERY_FAKE_*`` overrides, read at every call (see :data:`ENV_VARS`).

    Attributes:
        calls: the argv of every call, in order.

    Raises:
        ValueError: ``fault`` names an unknown fault or ``start_delay`` is negative.
    """

    def __init__(
        self,
        *,
        recording: str | os.PathLike[str] | None = None,
        fault: str | None = None,
        start_delay: float = 0.0,
        apps: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        _check_settings(fault, start_delay)
        self.recording = recording
        self.fault = fault
        self.start_delay = start_delay
        self.apps = apps
        self.log = log
        self.env: dict[str, str] = dict(env or {})
        self.calls: list[tuple[str, ...]] = []
        self._state = _MemoryState()
        self._channels: weakref.WeakSet[_Channel] = weakref.WeakSet()
        self._serial = 0
        self._lock = threading.Lock()

    def _start(self, argv: Sequence[str]) -> _Channel:
        settings = _Settings(
            recording=_opt_str(None if self.recording is None else os.fspath(self.recording)),
            fault=self.fault,
            start_delay=float(self.start_delay),
            apps=None if self.apps is None else os.fspath(self.apps),
            log=None if self.log is None else os.fspath(self.log),
            state=self._state,
        )
        channel = _Channel()
        with self._lock:
            self.calls.append(tuple(argv))
            self._serial += 1
            name = f"smiquery-fake-{self._serial}"
        thread = threading.Thread(
            target=_engine_thread, args=(tuple(argv[1:]), settings, dict(self.env), channel), name=name, daemon=True
        )
        channel.thread = thread
        self._channels.add(channel)
        thread.start()
        return channel

    @property
    def reloads(self) -> int:
        """How many ``reenumerate`` reloads have struck: later calls serve the GPU set they left (settable, 0: undo)."""
        with self._state.lock:
            return self._state.value

    @reloads.setter
    def reloads(self, value: int) -> None:
        with self._state.lock:
            self._state.value = value

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run the fake to completion within ``timeout`` seconds.

        Args:
            argv: the command (``argv[0]`` is ignored).
            timeout: seconds to wait for the end.

        Returns:
            What the executable would have returned.

        Raises:
            NvidiaSmiTimeoutError: it did not finish in time (its thread was stopped).
        """
        from smiquery.runner import Completed

        start = time.monotonic()
        deadline = start + max(timeout, 0.0)
        channel = self._start(argv)
        out = bytearray()
        with channel.cond:
            while not channel.done:
                if channel.out and len(out) < _RUN_OUTPUT_CAP:  # read as it comes, as the pipe is read
                    out += channel.out
                    channel.out.clear()
                    channel.cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                channel.cond.wait(left)
            finished = channel.done
        if not finished:
            _stop_channel(channel)
            raise NvidiaSmiTimeoutError(
                f"nvidia-smi did not answer within {timeout:g} s and was killed; the driver may be hung "
                "(check `dmesg` for Xid errors) or slow without persistence mode (`nvidia-smi -pm 1`)",
                argv=argv,
                timeout=timeout,
            )
        channel.join(1.0)
        rc = channel.returncode
        assert rc is not None
        with channel.cond:
            out += channel.out
        return Completed(tuple(argv), rc, _decode(bytes(out)), _decode(bytes(channel.err)), time.monotonic() - start)

    def lines(self, argv: Sequence[str]) -> InProcessLines:
        """Start the fake and return its output as it comes (for ``-l``/``-lms`` loops).

        Args:
            argv: the command (``argv[0]`` is ignored).

        Returns:
            The running output; close it when done.
        """
        return InProcessLines(argv, self._start(argv))

    def locate(self, nvidia_smi: str | os.PathLike[str] | None) -> str:
        """What ``argv[0]`` is for this runner: ``nvidia_smi`` as given, or ``nvidia-smi``; nothing is looked up.

        :func:`smiquery.runner.find_nvidia_smi` calls it instead of searching PATH, since no binary is started.

        Args:
            nvidia_smi: the path a caller asked for, if any (it need not exist).

        Returns:
            The name put in ``argv[0]`` (and shown in messages such as the doctor's).
        """
        return "nvidia-smi" if nvidia_smi is None else os.fspath(nvidia_smi)

    def running(self) -> int:
        """How many engine threads of this runner are still running (0 once every source is closed)."""
        return sum(1 for ch in list(self._channels) if ch.thread is not None and ch.thread.is_alive())

    def close(self) -> None:
        """Stop every engine thread this runner started and wait for them."""
        for channel in list(self._channels):
            _stop_channel(channel)

    def __enter__(self) -> InProcessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def use_runner(runner: _R) -> Iterator[_R]:
    """Run every nvidia-smi call that gets no ``runner=`` through ``runner``, in every thread, inside the block.

    For tests of code that builds its own runner: the CLI (``smiquery.cli.main``), the exporter, ``GpuMonitor``
    and the Keras and Lightning callbacks. With an :class:`InProcessRunner`, no binary is looked up (``--nvidia-smi``
    may name any path, or none) and no process is started. On exit the previous default comes back (blocks nest);
    the runner is not closed. Code that passes its own ``runner=`` keeps it. :mod:`smiquery.aio` starts its children
    with asyncio, not through a runner, and is not covered. Nothing else (no environment variable, no setting)
    changes the default, so production code always runs the real nvidia-smi.

    Example::

        from smiquery.cli import main
        from smiquery.testing import InProcessRunner, use_runner

        def test_query_exits_4_without_a_driver(capsys):
            with use_runner(InProcessRunner(fault="driver-not-loaded")), pytest.raises(SystemExit) as info:
                main(["query"])
            assert info.value.code == 4

    Args:
        runner: the runner to use (any :class:`~smiquery.runner.Runner`).

    Yields:
        ``runner``.
    """
    from smiquery.runner import _install_default

    previous = _install_default(runner)
    try:
        yield runner
    finally:
        _install_default(previous)


def _check_settings(fault: str | None, start_delay: float) -> None:
    try:
        _parse_faults(fault)
    except _FakeUsageError as exc:
        raise ValueError(str(exc)) from None
    if start_delay < 0:
        raise ValueError("start_delay must not be negative")

