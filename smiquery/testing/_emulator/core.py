"""The fake's ground floor: its settings and their overrides, its faults, where its engine writes, bad command lines."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, NoReturn, Protocol

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
HELP_HINT = "Please run 'nvidia-smi -h' for help."
# The bytes of garbage (with NUL) and flood output: no NUL, comma or line break (str.splitlines() knows eight)
NOISE = bytes(b for b in range(1, 256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")


class FakeUsageError(Exception):
    """The fake was set up wrongly (not a simulated nvidia-smi failure)."""


class FakeExit(Exception):
    """Ends the fake with an exit status (its one argument) from deep inside the output loop."""


def is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


class MemoryState(Protocol):
    """What keeps the ``reenumerate`` count instead of a file: an :class:`InProcessRunner`."""

    reloads: int  # read and set whole, never updated in place: no lock needed


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a written script bakes in or an in-process runner holds."""

    recording: str | None = None
    fault: str | None = None
    start_delay: float = 0.0
    apps: str | None = None
    log: str | None = None
    sweep: int = 0
    keep_time: bool = False
    state: str | MemoryState | None = None
    xml: str | None = None

    def with_env(self, env: Mapping[str, str]) -> Settings:
        """Apply the SMIQUERY_FAKE_* overrides (an empty RECORDING or START_DELAY is no override)."""
        var = {name.removeprefix("SMIQUERY_FAKE_").lower(): env[name] for name in ENV_VARS if name in env}
        changes: dict[str, object] = {k: v or None for k, v in var.items() if k in ("fault", "log", "state", "xml")}
        if var.get("recording"):
            changes["recording"] = var["recording"]
        if "apps" in var:
            changes["apps"] = var["apps"]
        if "keep_time" in var:
            changes["keep_time"] = var["keep_time"] == "1"
        try:
            if var.get("start_delay"):
                changes["start_delay"] = float(var["start_delay"])
        except ValueError:
            raise FakeUsageError("SMIQUERY_FAKE_START_DELAY must be a number of seconds") from None
        try:
            if "sweep" in var:
                changes["sweep"] = int(var["sweep"] or "0")
        except ValueError:
            raise FakeUsageError("SMIQUERY_FAKE_SWEEP must be an integer") from None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def read_bundled(name: str) -> str:
    try:  # the package's own folder: importlib.resources would cost more than the read
        return pathlib.Path(__file__).parents[2].joinpath("data", name).read_text(encoding="utf-8")
    except OSError:  # installed where data are no plain files (a zip)
        from importlib import resources

        return (resources.files("smiquery") / "data" / name).read_text(encoding="utf-8")


class Output:
    """Where the fake's engine writes and how it waits: the process's stdout and clock (in-process: a channel)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def line(self, text: str = "") -> None:
        self.raw(text.encode("utf-8") + b"\n")

    def table(self, rows: Mapping[str, str]) -> None:
        """Help text's two columns: each name, padded to the longest, then its text."""
        width = max(len(name) for name in rows) + 2
        for name, text in rows.items():
            self.line(f"  {name:<{width}}{text}")

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

    def begin(self, faults: Faults) -> None:
        """What ``grandchild`` and ``ignore-term`` do, before nvidia-smi's own work."""
        if faults.grandchild:  # a child that holds stdout and stderr open for an hour (in the fake's process group)
            import shutil

            sleeper = shutil.which("sleep")
            cmd = [sleeper, "3600"] if sleeper else [sys.executable, "-c", "import time; time.sleep(3600)"]
            # posix_spawn leaves no Popen object behind to complain that its child outlived it
            os.posix_spawn(cmd[0], cmd, os.environ)
        if faults.ignore_term and hasattr(signal, "SIGTERM"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def hang(out: Output) -> NoReturn:
    out.flush()
    while True:
        out.sleep(3600)


def usage_error(out: Output, hint: str = "") -> Callable[[str], NoReturn]:
    """What nvidia-smi does with a bad command line: ``ERROR: <message> <hint>`` on stdout, exit 255."""

    def fail(message: str) -> NoReturn:
        out.line(f"ERROR: {message} {hint}".rstrip())
        raise FakeExit(255)

    return fail


class ArgReader:
    """Options one by one, as ``(argument, name, inline value or None)``: ``--opt=VALUE`` or ``--opt VALUE``."""

    def __init__(self, argv: Sequence[str], fail: Callable[[str], NoReturn]) -> None:
        self.argv = list(argv)
        self.pos = 0
        self.fail = fail

    def __iter__(self) -> Iterator[tuple[str, str, str | None]]:
        while self.pos < len(self.argv):
            arg = self.argv[self.pos]
            self.pos += 1
            name, eq, inline = arg.partition("=")
            yield arg, name, inline if eq else None

    def value(self, option: str, inline: str | None) -> str:
        if inline is None and self.pos < len(self.argv):
            self.pos += 1
            return self.argv[self.pos - 1]
        if not inline:
            self.fail(f"Option {option} is missing its value.")
        return inline

    def optional_number(self) -> str | None:
        if self.pos < len(self.argv) and is_number(self.argv[self.pos]):
            self.pos += 1
            return self.argv[self.pos - 1]
        return None


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


INFOROM_WARNING = "WARNING: infoROM is corrupted at gpu 0000:0B:00.0"
HANDLE_ERROR = "Unable to determine the device handle for GPU {bus}: {reason}"
GPU_LOST_REASON = "GPU is lost. Reboot the system to recover this GPU"
# Exit codes and messages of NVIDIA-SMI.md section 5. `not-supported` has no recorded message; NVML's own error
# string for NVML_ERROR_NOT_SUPPORTED is used.
_NVML = "Failed to initialize NVML: "
_STARTUP_FAULTS: dict[str, tuple[int, str]] = {  # exit status, the lines printed
    "driver-not-loaded": (
        9,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.",
    ),
    "nvml-not-found": (
        12,
        "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA "
        "Display Driver is properly installed and present in your system.\n"
        "Please also try adding directory that contains libnvidia-ml.so to your system PATH.",
    ),
    "version-mismatch": (18, _NVML + "Driver/library version mismatch\nNVML library version: {nvml}"),
    "no-devices": (6, "No devices were found"),
    "no-supported-gpus": (255, _NVML + "No supported GPUs were found\nUnable to determine the number of GPUs"),
    "gpu-lost-start": (15, HANDLE_ERROR.format(bus="0000:02:00.0", reason=GPU_LOST_REASON)),
    "permission": (4, _NVML + "Insufficient Permissions"),
    "not-supported": (3, _NVML + "Not Supported"),
    "unknown-error": (255, _NVML + "Unknown Error"),
}
_COUNTED_FAULTS = ("hang-after", "crash-after", "garbage-after", "wrong-columns-after", "notices-after")
_FLAG_FAULTS = ("inforom", "hang", "garbage", "truncated", "ignore-term", "grandchild")
_RELOAD_MODES = ("swap", "remove", "add")


# what `notices-after` prints each interval once the rows stop
NOTICE_BATCH = (INFOROM_WARNING, HANDLE_ERROR.format(bus="0000:02:00.0", reason="Unknown Error"))


@dataclasses.dataclass(frozen=True)
class Faults:
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


def _check(ok: bool, spec: str, problem: str) -> None:
    if not ok:
        raise FakeUsageError(f"fault {spec!r}: {problem}")


def _nonneg(spec: str, text: str, default: int | None = None) -> int:
    if default is not None and not text:
        return default
    _check(is_number(text), spec, f"{text!r} is not a non-negative integer")
    return int(text)


def _exit_code(spec: str, text: str) -> int:
    code = _nonneg(spec, text)
    _check(code <= 255, spec, "exit codes go up to 255")
    return code


def _number(spec: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    _check(math.isfinite(value), spec, f"{text!r} is not a number")
    return value


def parse_faults(spec: str | None) -> Faults:
    """Parse a comma-separated fault list; unknown names raise :class:`FakeUsageError`."""
    values: dict[str, Any] = {"clock_steps": (), "reloads": ()}
    for item in filter(None, (raw.strip() for raw in (spec or "").split(","))):
        name, _, arg = item.partition(":")
        first, _, rest = arg.partition(":")  # the fields of `name:first:second:third`
        second, _, third = rest.partition(":")
        if name in _STARTUP_FAULTS and not arg:
            values.setdefault("startup", name)
        elif name == "exit" and arg:
            values.setdefault("exit_code", _exit_code(item, first))
            values.setdefault("exit_message", rest or None)
        elif name == "exit-after" and ":" in arg:
            values["exit_after"] = _nonneg(item, first)
            values["exit_after_code"] = _exit_code(item, second)
            values["exit_after_message"] = third or None
        elif name == "drop-gpu-after" and arg:
            _check(third in ("", "message"), item, "only the literal suffix ':message' may follow the index")
            values["drop_gpu_after"] = _nonneg(item, first)
            values["drop_gpu_index"] = _nonneg(item, second, 0)
            values["drop_gpu_message"] = third == "message"
        elif name == "start-delay" and arg:
            try:
                delay = float(arg)
            except ValueError:
                delay = -1.0
            _check(0 <= delay < math.inf, item, f"{arg!r} is not a non-negative number of seconds")
            values["start_delay"] = delay
        elif name in _FLAG_FAULTS and not arg:
            values[name.replace("-", "_")] = True
        elif name in _COUNTED_FAULTS and arg:
            values[name.replace("-", "_")] = _nonneg(item, arg)
        elif name == "gpu-lost-after" and arg:
            values["gpu_lost_after"] = _nonneg(item, first)
            values["gpu_lost_index"] = _nonneg(item, rest, 0)
        elif name == "clock-step" and ":" in arg:
            values["clock_steps"] += ((_nonneg(item, first), _number(item, rest)),)
        elif name == "dst-fallback":
            values["dst_before"] = _number(item, arg) if arg else 10.0
            _check(values["dst_before"] >= 0, item, "the seconds before the change must not be negative")
        elif name == "slow-row" and ":" in arg:
            values["slow_every"] = _nonneg(item, first)
            values["slow_fraction"] = _number(item, second)
            _check(values["slow_every"] >= 1, item, "N counts sweeps and starts at 1")
            _check(0 < values["slow_fraction"] < 1, item, "FRACTION is a share of the interval, between 0 and 1")
            values["slow_index"] = _nonneg(item, third, 3)
        elif name == "reenumerate" and arg:
            _check((rest or "swap") in _RELOAD_MODES, item, f"MODE is one of {', '.join(_RELOAD_MODES)}")
            values["reloads"] += ((_nonneg(item, first), rest or "swap"),)
        elif name == "flood":
            values["flood"] = True
            if arg:
                values["flood_bytes"] = _nonneg(item, arg)
                _check(values["flood_bytes"] >= 1, item, "BYTES must be at least 1 (leave it out for no end)")
        else:
            raise FakeUsageError(f"unknown fault {item!r}; known faults: {', '.join(FAULTS)}")
    return Faults(**values)


def startup(faults: Faults, driver_version: str, out: Output) -> None:
    """Where real nvidia-smi initialises NVML: the start-up failures, and `hang`."""
    if faults.hang:
        hang(out)
    if faults.startup is not None:
        code, text = _STARTUP_FAULTS[faults.startup]
        out.line(text.format(nvml=".".join(driver_version.split(".")[:2])))
        raise FakeExit(code)
    if faults.exit_code is not None:
        if faults.exit_message:
            out.line(faults.exit_message)
        raise FakeExit(faults.exit_code)


def check_settings(fault: str | None, start_delay: float) -> None:
    try:
        parse_faults(fault)
    except FakeUsageError as exc:
        raise ValueError(str(exc)) from None
    if start_delay < 0:
        raise ValueError("start_delay must not be negative")
