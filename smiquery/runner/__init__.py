"""Finding and running nvidia-smi: one-shot runs (:class:`SubprocessRunner`), loop lines (:class:`LineStream`).

The only package that imports ``subprocess`` (:mod:`.aio`: on an event loop). Every child runs from an argument list
(never a shell), in its own process group, under a deadline. On every path (end, exception, timeout, early stop,
``KeyboardInterrupt``, garbage collection) the whole group, helpers that inherited the pipes included, is terminated,
then killed, and the child reaped; on Linux a loop child also dies with this process however it dies. A forked copy
of this process leaves the children alone.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from smiquery.errors import (
    NvidiaSmiFailedError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    OutputTooLargeError,
    StreamEndedError,
    failure_from_exit,
)
from smiquery.runner.children import (
    MAX_ERR_BYTES,
    PIPE_GRACE,
    TERM_GRACE,
    exited,
    live_children,
    popen,
    read_some,
    signal_group,
    spawn_loop_child,
    terminate_and_reap,
    wait_exit,
)

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_OUTPUT_BYTES",
    "TERM_GRACE",
    "Completed",
    "LineSource",
    "LineSplitter",
    "LineStream",
    "Runner",
    "SubprocessRunner",
    "decode",
    "default_runner",
    "find_nvidia_smi",
    "install_default",
    "live_children",
    "no_answer",
    "terminate_and_reap",
]

ENV_VAR = "SMIQUERY_NVIDIA_SMI"

#: The most stdout a one-shot call reads before it gives up (:class:`~smiquery.errors.OutputTooLargeError`).
MAX_OUTPUT_BYTES = 8 * 1024 * 1024


def usual_places() -> list[str]:
    """Where nvidia-smi is looked for after PATH: ``/usr/bin``, container runtimes' and WSL's places, Windows'."""
    places = ["/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi", "/usr/lib/wsl/lib/nvidia-smi"]
    if os.name == "nt":
        root = os.environ.get("SYSTEMROOT", r"C:\Windows")
        prog = os.environ.get("PROGRAMFILES", r"C:\Program Files")
        places = [
            str(Path(root) / "System32" / "nvidia-smi.exe"),
            str(Path(prog) / "NVIDIA Corporation" / "NVSMI" / "nvidia-smi.exe"),
        ]
    return places


def _check_executable(path: str, origin: str) -> str:
    p = Path(path)
    if not p.exists():
        raise NvidiaSmiNotFoundError(f"nvidia-smi not found at {path} ({origin}); fix the path or unset it")
    if p.is_dir() or not os.access(p, os.X_OK):
        raise NvidiaSmiNotFoundError(
            f"{path} ({origin}) is not an executable file; check its permissions (chmod +x) or the path"
        )
    return str(p)


# The last PATH search that found nvidia-smi: (PATH value, path), rechecked with one stat.
_which_memo: tuple[str | None, str] | None = None


def _runnable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_nvidia_smi(nvidia_smi: str | os.PathLike[str] | None = None, *, runner: Runner | None = None) -> str:
    """The path of the nvidia-smi binary to run; raises NvidiaSmiNotFoundError (saying what to do) if none is usable.

    Order: ``nvidia_smi`` (a path, or a bare name looked up on PATH), ``$SMIQUERY_NVIDIA_SMI``, ``PATH`` (a hit
    is remembered while ``PATH`` keeps its value and the file stays executable), then :func:`usual_places`. A
    runner with a ``locate`` method (``runner``, else the default runner) names the binary itself.
    """
    global _which_memo
    locate = getattr(runner if runner is not None else _installed, "locate", None)
    if locate is not None:
        return str(locate(nvidia_smi))
    if nvidia_smi is not None:
        text = os.fspath(nvidia_smi)
        if os.sep not in text and "/" not in text:
            found = shutil.which(text)
            if found:
                return found
        return _check_executable(text, "nvidia_smi argument")
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_executable(env, f"${ENV_VAR}")
    path_var, memo = os.environ.get("PATH"), _which_memo
    if memo is not None and memo[0] == path_var and _runnable(memo[1]):
        return memo[1]
    found = shutil.which("nvidia-smi")
    _which_memo = (path_var, found) if found else None
    searched = usual_places()
    found = found or next(filter(_runnable, searched), None)
    if found:
        return found
    raise NvidiaSmiNotFoundError(searched=["PATH", *searched])


def no_answer(argv: Sequence[str], timeout: float) -> NvidiaSmiTimeoutError:
    """The error of a one-shot child that did not finish within ``timeout`` seconds (it was killed)."""
    return NvidiaSmiTimeoutError(
        f"nvidia-smi did not answer within {timeout:g} s and was killed; the driver may be hung "
        "(check `dmesg` for Xid errors) or slow without persistence mode (`nvidia-smi -pm 1`)",
        argv=argv,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Completed:
    """A finished nvidia-smi run: its command, exit status, decoded output and wall time in seconds."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        """stdout and stderr together, for error messages (nvidia-smi prints its errors on stdout)."""
        return self.stdout + (("\n" + self.stderr) if self.stderr else "")


class LineSource(Protocol):
    """The output of one running nvidia-smi, line by line: what :meth:`Runner.lines` returns.

    :class:`LineStream` reads a real child; :class:`smiquery.testing.InProcessRunner` serves one without a
    process. :meth:`readline` only reports that no line came in time: the caller decides what silence means.
    """

    argv: tuple[str, ...]
    pid: int | None  #: the child's process id (None without a process)
    idle: float  #: seconds the last :meth:`readline` waited for its line's data

    def readline(self, timeout: float) -> str | None:
        """The next complete line, without its newline (blank lines skipped); None when none came in time.

        Once the output has ended, raises StreamEndedError (exit 0) or the exit's typed NvidiaSmiFailedError.
        """

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now."""

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its group). Any thread; idempotent."""

    def kill(self) -> None:
        """Kill the child's group (SIGKILL). Any thread; idempotent."""

    def close(self) -> None:
        """Terminate, kill if needed, reap and release; idempotent, returns within about a second."""


class Runner(Protocol):
    """How smiquery runs nvidia-smi: :class:`SubprocessRunner`, or one a test injects (``runner=``).

    A runner may also define ``locate(nvidia_smi) -> str``: :func:`find_nvidia_smi` then asks it for ``argv[0]``
    instead of searching the file system (:class:`smiquery.testing.InProcessRunner` starts no binary).
    """

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run to completion within ``timeout`` seconds."""

    def lines(self, argv: Sequence[str]) -> LineSource:
        """Start a long-running child and return its output lines."""


# The runner used where none is passed: only smiquery.testing.use_runner() changes it (no variable or file can).
_installed: Runner | None = None


def default_runner() -> Runner:
    """The runner used wherever none is passed: a :class:`SubprocessRunner`, or the one ``use_runner`` installed."""
    installed = _installed
    return installed if installed is not None else SubprocessRunner()


def install_default(runner: Runner | None) -> Runner | None:
    """Make ``runner`` the default (None: back to :class:`SubprocessRunner`); returns the previous one."""
    global _installed
    previous, _installed = _installed, runner
    return previous


#: A line longer than this is cut to its first 256 bytes (the parser rejects it) and the rest is skipped until its
#: end, so that endless output without a newline keeps memory flat.
MAX_LINE_BYTES = 64 * 1024


def decode(data: bytes) -> str:
    """Bytes a child printed, as text (undecodable bytes replaced)."""
    return data.decode("utf-8", "replace")


class LineSplitter:
    """Cuts a child's stdout into :attr:`lines` (blank lines skipped, a CR stripped, over-long lines cut).

    :attr:`messages` keeps the last 20 lines that are no CSV row, for error messages.
    """

    def __init__(self) -> None:
        self.lines: deque[str] = deque()
        self.messages: deque[str] = deque(maxlen=20)
        self._partial: list[bytes] = []  # the pieces of the line being read, joined once at its newline
        self._partial_len = 0
        self._skipping = False  # inside an over-long line: its rest is skipped

    def feed(self, data: bytes) -> None:
        """Take a chunk of output."""
        parts = data.split(b"\n")
        rest = parts.pop()
        if parts and (self._partial or self._skipping):
            parts[0] = b"" if self._skipping else b"".join(self._partial) + parts[0]
            self._partial, self._partial_len, self._skipping = [], 0, False
        for raw in parts:
            self._add(raw)
        if rest and not self._skipping:
            self._partial.append(rest)
            self._partial_len += len(rest)
            if self._partial_len > MAX_LINE_BYTES:  # no newline in sight: keep a head, skip to the newline
                self._add(b"".join(self._partial)[:256])
                self._partial, self._partial_len, self._skipping = [], 0, True

    def end(self) -> None:
        """The output ended: a trailing partial line counts as it is (the parser rejects it)."""
        if not self._skipping:
            self._add(b"".join(self._partial))
        self._partial, self._partial_len = [], 0

    def ended(self, argv: Sequence[str], rc: int, err: bytes, *, stopping: bool = False) -> NvidiaSmiFailedError:
        """After :meth:`end`: a non-zero exit's typed error, else (or ``stopping``) a ``StreamEndedError``."""
        output = "\n".join(self.messages) + ("\n" + decode(err) if err else "")
        if rc in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT) and not output.strip():
            output = f"killed by signal {-rc}"
        return (failure_from_exit if rc and not stopping else StreamEndedError)(argv, rc, output)

    def _add(self, raw: bytes) -> None:
        line = decode(raw).rstrip("\r")
        if line.strip():
            self.lines.append(line)
            if ", " not in line:
                self.messages.append(line)


class LineStream:
    """The output lines of one long-running nvidia-smi child (``-l``/``-lms`` loop mode): a ``LineSource``.

    It never kills the child for being slow. When the output ends, or the leader exits (helpers holding the pipes
    are killed after ``PIPE_GRACE``), the child is reaped and after the last line its exit raises as ``readline``
    says. A context manager, closed when garbage-collected too. ``pdeathsig``: on Linux the child dies with us.
    """

    def __init__(self, argv: Sequence[str], *, pdeathsig: bool = True) -> None:
        self.argv = tuple(argv)
        self._proc = spawn_loop_child(self.argv) if pdeathsig else popen(self.argv)
        self._finalizer = weakref.finalize(self, terminate_and_reap, self._proc)
        self.pid: int | None = self._proc.pid
        self.idle = 0.0  #: seconds the last :meth:`readline` waited for its line's data
        self._split = LineSplitter()
        self._err = bytearray()
        self._open_fds = 2
        self._eof = False
        self._ended: BaseException | None = None
        self._stopping = False
        self._io = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pidfd = -1  # readiness of the leader's exit, where the kernel has pidfds
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)
        self._exit_seen: float | None = None
        self._sel = selectors.DefaultSelector()
        for pipe in (self._proc.stdout, self._proc.stderr):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            self._sel.register(pipe, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        if self._pidfd >= 0:
            self._sel.register(self._pidfd, selectors.EVENT_READ)

    @property
    def closed(self) -> bool:
        """True once the child is reaped and the pipes are closed."""
        return not self._finalizer.alive

    def readline(self, timeout: float) -> str | None:
        """The next complete line; None if none within ``timeout`` s or on :meth:`interrupt` (see the class)."""
        with self._io:
            if self._split.lines:
                return self._split.lines.popleft()
            if self._ended is not None:
                raise self._ended
            if self.closed:
                raise StreamEndedError(self.argv, 0, "", "the nvidia-smi stream was closed")
            return self._fill(time.monotonic() + max(timeout, 0.0))

    def _fill(self, deadline: float) -> str | None:
        waited = 0.0
        looked = False  # a deadline already past still gets one look at the pipes
        lines = self._split.lines
        while not lines:
            if self._eof:
                self._finish()
                break
            remaining = deadline - time.monotonic()
            if self._exit_seen is not None:
                # The leader is gone but something still holds its pipes: give the output a moment, then end it.
                remaining = min(remaining, self._exit_seen + PIPE_GRACE - time.monotonic())
                if remaining <= 0:
                    signal_group(self._proc, signal.SIGKILL)
                    self._drain_now()
                    self._eof = True
                    continue
            elif self._pidfd < 0:
                remaining = min(remaining, 0.5)  # no pidfd: look at the leader now and then
            if remaining <= 0:
                if looked:
                    self.idle = waited
                    return None
                remaining = 0.0
            looked = True
            t0 = time.monotonic()
            events = self._sel.select(remaining)
            waited += time.monotonic() - t0
            if not events and remaining > 0 and time.monotonic() >= deadline:
                # Stopped past the deadline (SIGSTOP, a debugger), the wait returns empty-handed without looking
                # again (PEP 475): look once more, so the rows printed meanwhile are read.
                events = self._sel.select(0)
            if not events and self._pidfd < 0 and self._exit_seen is None and exited(self._proc):
                self._exit_seen = time.monotonic()
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 512):
                            pass
                    self.idle = waited
                    if not lines:
                        return None
                elif key.fileobj == self._pidfd:
                    self._sel.unregister(key.fileobj)
                    self._exit_seen = self._exit_seen or time.monotonic()
                elif self._read(key.fd) == b"":
                    self._sel.unregister(key.fileobj)
                    self._open_fds -= 1
                    self._eof = self._open_fds == 0
        self.idle = waited
        return lines.popleft()

    def _read(self, fd: int) -> bytes | None:
        """Take what ``fd`` has: the data (b"" at its end), None when nothing is there now."""
        data = read_some(fd)
        if data is None:
            return None
        if self._proc.stdout is not None and fd == self._proc.stdout.fileno():
            self._stdout(data)
        elif len(self._err) < MAX_ERR_BYTES:
            self._err += data
        return data

    def _stdout(self, data: bytes) -> None:
        self._split.feed(data)

    def _drain_now(self) -> None:
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is not None and not pipe.closed:
                while self._read(pipe.fileno()):
                    pass

    def _finish(self) -> None:
        # The output has ended: the child has exited (or closed its output). Reap it, then judge the exit code.
        stopping = self._stopping
        wait_exit(self._proc, 5.0)  # a leader that closed its output but lingers is killed by _release
        self._release()
        rc = self._proc.returncode if self._proc.returncode is not None else -signal.SIGKILL
        self._split.end()
        self._ended = self._split.ended(self.argv, rc, bytes(self._err), stopping=stopping)
        if not self._split.lines:
            raise self._ended

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now. Any thread."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its group). Any thread; iteration then ends without an error."""
        self._stopping = True
        signal_group(self._proc, signal.SIGTERM)

    def kill(self) -> None:
        """Kill the child's group (SIGKILL). Any thread; idempotent."""
        self._stopping = True
        signal_group(self._proc, signal.SIGKILL)

    def close(self) -> None:
        """Terminate, kill if needed, reap the child and close the pipes. Idempotent; any thread."""
        self._stopping = True
        self.interrupt()
        with self._io:
            self._release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self._sel.close()
        self._finalizer()
        for fd in (self._wake_r, self._wake_w, self._pidfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = self._pidfd = -1

    def __enter__(self) -> LineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WholeOutput(LineStream):
    """A one-shot child read by :class:`LineStream`'s loop, its stdout kept whole (up to :data:`MAX_OUTPUT_BYTES`)."""

    def __init__(self, argv: Sequence[str], deadline: float) -> None:
        super().__init__(argv, pdeathsig=False)
        self.deadline = deadline
        self.out = bytearray()
        self.finished = False

    def _stdout(self, data: bytes) -> None:
        self.out += data
        if len(self.out) > MAX_OUTPUT_BYTES:
            raise OutputTooLargeError(self.argv, MAX_OUTPUT_BYTES)

    def _finish(self) -> None:
        self.finished = wait_exit(self._proc, max(self.deadline - time.monotonic(), 0.0))
        raise StreamEndedError(self.argv, 0, "")

    def read_to_end(self) -> bool:
        """Read until the output ends and the leader exits (True), or the deadline passes (False)."""
        with contextlib.suppress(StreamEndedError):
            self.readline(self.deadline - time.monotonic())  # no line ever comes: None only at the deadline
        return self.finished


class SubprocessRunner:
    """Runs nvidia-smi as a real child process (loop children die with this process on Linux)."""

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run ``argv`` to completion within about ``timeout`` seconds, killing and reaping included.

        A child that exited while a helper it started still holds its output pipe is complete: its output is
        returned and the helper killed. Raises NvidiaSmiNotFoundError (the binary cannot be executed) or
        NvidiaSmiTimeoutError (no answer in time; it was killed).
        """
        start = time.monotonic()
        grace = min(TERM_GRACE, timeout / 10)
        deadline = start + max(timeout - 2 * grace, 0.001)
        if os.name == "nt":  # pragma: no cover - no select() on pipes there
            proc = popen(argv)
            try:
                raw_out, raw_err = proc.communicate(timeout=deadline - start)
            except subprocess.TimeoutExpired:
                raise no_answer(argv, timeout) from None
            finally:
                terminate_and_reap(proc, grace)
            stdout, stderr = decode(raw_out), decode(raw_err)
        else:
            child = _WholeOutput(argv, deadline)
            proc = child._proc
            try:
                finished = child.read_to_end()
            finally:
                terminate_and_reap(proc, grace)
                child.close()
            if not finished:
                raise no_answer(argv, timeout)
            stdout, stderr = decode(bytes(child.out)), decode(bytes(child._err))
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return Completed(tuple(argv), rc, stdout, stderr, time.monotonic() - start)

    def lines(self, argv: Sequence[str]) -> LineStream:
        """Start ``argv`` and return its output as a :class:`LineStream`."""
        return LineStream(argv)
