"""The fake's ground floor: its settings and their overrides, where its engine writes, and bad command lines."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO, NoReturn

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


class FakeUsageError(Exception):
    """The fake was set up wrongly (not a simulated nvidia-smi failure)."""


class FakeExit(Exception):
    """Ends the fake with an exit status from deep inside the output loop."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


class MemoryState:
    """How many ``reenumerate`` reloads have struck, kept by an :class:`InProcessRunner` instead of a file."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()


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

    def begin(self, argv: Sequence[str], log: str | None, *, grandchild: bool, ignore_term: bool) -> None:
        """What happens once the faults are known, before nvidia-smi's own work: grandchild, signals, ``log``."""
        if grandchild:  # a child that holds stdout and stderr open for an hour (in the fake's process group)
            import shutil

            sleeper = shutil.which("sleep")
            cmd = [sleeper, "3600"] if sleeper else [sys.executable, "-c", "import time; time.sleep(3600)"]
            # posix_spawn leaves no Popen object behind to complain that its child outlived it
            os.posix_spawn(cmd[0], cmd, os.environ)
        if ignore_term and hasattr(signal, "SIGTERM"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # logged after SIGTERM is ignored: a test that sees the line may rely on it
        if log:
            log_invocation(log, argv)


def hang(out: Output) -> NoReturn:
    out.flush()
    while True:
        out.sleep(3600)


def log_invocation(path: str, argv: Sequence[str]) -> None:
    import json

    record = json.dumps({"pid": os.getpid(), "argv": list(argv), "time": time.time()}) + "\n"
    with open(path, "ab", buffering=0) as file:  # one write on an O_APPEND descriptor: lines never interleave
        file.write(record.encode("utf-8"))


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
