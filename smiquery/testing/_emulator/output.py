"""Where the fake's engine writes and how it waits: the process's stdout and clock, its log and its signals."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import BinaryIO, NoReturn

HELP_HINT = "Please run 'nvidia-smi -h' for help."


class FakeExit(Exception):
    """Ends the fake with an exit status from deep inside the output loop."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Output:
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

    def begin(self, argv: Sequence[str], log: str | None, *, grandchild: bool, ignore_term: bool) -> None:
        """What happens once the faults are known, before nvidia-smi's own work: grandchild, signals, ``log``."""
        if grandchild:
            start_grandchild()
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
    # one write on an O_APPEND descriptor, so concurrent fakes never interleave their lines
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, record.encode("utf-8"))
    finally:
        os.close(fd)


def start_grandchild() -> None:
    """A child of the fake that holds its stdout and stderr open for an hour (in the fake's process group)."""
    import shutil

    sleeper = shutil.which("sleep")
    argv = [sleeper, "3600"] if sleeper else [sys.executable, "-c", "import time; time.sleep(3600)"]
    # posix_spawn leaves no Popen object behind to complain that its child outlived it
    os.posix_spawn(argv[0], argv, os.environ)
