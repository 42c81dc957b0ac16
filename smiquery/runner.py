"""Finding and running nvidia-smi: the only module that imports ``subprocess``.

Every child runs from an argument list (never a shell), in its own process group, under a timeout. On every
path (normal end, exception, timeout, early stop, ``KeyboardInterrupt``, garbage collection) the child is
terminated, then killed, then reaped, and its pipes are closed.
"""

from __future__ import annotations

import atexit
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from smiquery.errors import NvidiaSmiNotFoundError, NvidiaSmiTimeoutError, failure_from_exit

__all__ = [
    "Completed",
    "LineStream",
    "Runner",
    "SubprocessRunner",
    "find_nvidia_smi",
    "live_children",
]

ENV_VAR = "SMIQUERY_NVIDIA_SMI"

#: Seconds between SIGTERM and SIGKILL, and how long to wait for a killed child before a reaper thread takes it.
TERM_GRACE = 0.5
_MAX_ERR_BYTES = 64 * 1024


def _usual_places() -> list[str]:
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


def find_nvidia_smi(nvidia_smi: str | os.PathLike[str] | None = None) -> str:
    r"""Locate the nvidia-smi binary.

    Order: the ``nvidia_smi`` argument, the ``SMIQUERY_NVIDIA_SMI`` environment variable, ``PATH``, then the
    usual places (``/usr/bin``, ``/usr/local/nvidia/bin`` used by container runtimes, WSL's ``/usr/lib/wsl/lib``,
    and on Windows ``%SystemRoot%\System32`` and ``%ProgramFiles%\NVIDIA Corporation\NVSMI``).

    Args:
        nvidia_smi: an explicit path (or a bare command name looked up on PATH).

    Returns:
        The path to run.

    Raises:
        NvidiaSmiNotFoundError: nothing usable was found; the message says what to do.
    """
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
    found = shutil.which("nvidia-smi")
    if found:
        return found
    searched = _usual_places()
    for place in searched:
        if os.path.isfile(place) and os.access(place, os.X_OK):
            return place
    raise NvidiaSmiNotFoundError(searched=["PATH", *searched])


@dataclass(frozen=True)
class Completed:
    """A finished nvidia-smi run.

    Attributes:
        argv: the command that ran.
        returncode: its exit status.
        stdout: standard output, decoded (undecodable bytes replaced).
        stderr: standard error, decoded.
        seconds: wall time of the run.
    """

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        """stdout and stderr together, for error messages (nvidia-smi prints its errors on stdout)."""
        return self.stdout + (("\n" + self.stderr) if self.stderr else "")


class Runner(Protocol):
    """How smiquery runs nvidia-smi. :class:`SubprocessRunner` is the real one; tests may inject others."""

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run to completion within ``timeout`` seconds."""
        ...

    def lines(self, argv: Sequence[str], line_timeout: float) -> LineStream:
        """Start a long-running child and return its output lines."""
        ...


# Children alive right now; killed at interpreter exit so a loop child never outlives its parent.
_LIVE: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def live_children() -> list[int]:
    """PIDs of nvidia-smi children smiquery started and has not reaped yet."""
    with _LIVE_LOCK:
        return [p.pid for p in _LIVE if p.returncode is None]


def _spawn(argv: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=os.name != "nt",  # own process group: the whole group is signalled
            env=dict(env) if env is not None else None,
        )
    except FileNotFoundError as exc:
        raise NvidiaSmiNotFoundError(f"nvidia-smi not found: {argv[0]} does not exist") from exc
    except PermissionError as exc:
        raise NvidiaSmiNotFoundError(f"{argv[0]} cannot be executed (permission denied); check chmod +x") from exc
    except OSError as exc:
        raise NvidiaSmiNotFoundError(f"{argv[0]} cannot be executed: {exc.strerror or exc}") from exc
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.returncode is not None:
        return
    try:
        if os.name != "nt":
            os.killpg(proc.pid, sig)
        elif sig == signal.SIGTERM:
            proc.terminate()
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    # A child stuck in the kernel (D state) ignores even SIGKILL until its call returns. Nobody should block
    # on it: a daemon thread waits and reaps it whenever it finally dies.
    def wait() -> None:
        with contextlib.suppress(Exception):
            proc.wait()

    threading.Thread(target=wait, name=f"smiquery-reap-{proc.pid}", daemon=True).start()


def terminate_and_reap(proc: subprocess.Popen[bytes], grace: float = TERM_GRACE) -> None:
    """SIGTERM the child's group, then SIGKILL, then reap; close its pipes. Never blocks much beyond ``2*grace``."""
    try:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    _reap_later(proc)
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with _LIVE_LOCK:
            _LIVE.discard(proc)


@atexit.register
def _kill_all_at_exit() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(0.2)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class LineStream:
    """The output lines of one long-running nvidia-smi child (``-l``/``-lms`` loop mode).

    Iterating yields complete lines (without the newline), decoded with undecodable bytes replaced. A line
    that does not arrive within ``line_timeout`` seconds means the child is hung: it is killed and
    :class:`NvidiaSmiTimeoutError` is raised. When the child exits, its status is checked after the last
    line: non-zero raises the matching :class:`~smiquery.errors.NvidiaSmiFailedError`. A trailing partial line
    is yielded as it is (the parser rejects it).

    Use it as a context manager, or call :meth:`close`; it also closes itself when garbage-collected.
    :meth:`terminate` may be called from another thread to stop a reader blocked in iteration.
    """

    def __init__(self, argv: Sequence[str], line_timeout: float, *, env: Mapping[str, str] | None = None) -> None:
        self.argv = tuple(argv)
        self.line_timeout = line_timeout
        self.started = time.monotonic()
        self._proc = _spawn(self.argv, env)
        self._finalizer = weakref.finalize(self, terminate_and_reap, self._proc)
        self._lines: deque[str] = deque()
        self._buf = b""
        self._err = bytearray()
        self._messages: deque[str] = deque(maxlen=20)  # recent non-CSV stdout lines, for error messages
        self._open_fds = 2
        self._done = False
        self._stopping = False
        self._sel = selectors.DefaultSelector()
        for pipe in (self._proc.stdout, self._proc.stderr):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            self._sel.register(pipe, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status, once reaped."""
        return self._proc.returncode

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        lines = self._lines
        while not lines:
            if self._done:
                raise StopIteration
            self._fill()
        return lines.popleft()

    def _fill(self) -> None:
        deadline = time.monotonic() + self.line_timeout
        while not self._lines and not self._done:
            if self._open_fds == 0:
                self._finish()
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopping = self._stopping
                self._release()
                self._done = True
                if stopping:
                    return
                raise NvidiaSmiTimeoutError(
                    f"nvidia-smi printed no complete line for {self.line_timeout:g} s and was killed (hung driver?); "
                    "check `dmesg` for Xid errors and whether plain `nvidia-smi` answers",
                    argv=self.argv,
                    timeout=self.line_timeout,
                )
            for key, _ in self._sel.select(remaining):
                pipe = key.fileobj
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    self._sel.unregister(pipe)
                    self._open_fds -= 1
                    continue
                if pipe is self._proc.stdout:
                    self._take(data)
                elif len(self._err) < _MAX_ERR_BYTES:
                    self._err += data

    def _take(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        if b"\n" not in buf:
            self._buf = buf
            return
        *complete, self._buf = buf.split(b"\n")
        for raw in complete:
            line = _decode(raw)
            self._lines.append(line)
            if ", " not in line:
                self._messages.append(line)

    def _finish(self) -> None:
        # Both pipes are at EOF: the child has exited (or closed its output). Reap it, then judge the exit code.
        stopping = self._stopping
        try:
            rc = self._proc.wait(self.line_timeout)
        except subprocess.TimeoutExpired:
            self._release()
            rc = self._proc.returncode if self._proc.returncode is not None else -9
        self._done = True
        tail = self._buf
        self._buf = b""
        self._release()
        if tail.strip():
            self._lines.append(_decode(tail))
            if b", " not in tail:
                self._messages.append(_decode(tail))
        if rc != 0 and not stopping:
            output = "\n".join(self._messages) + "\n" + _decode(bytes(self._err))
            self._lines.clear()
            if rc in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT) and not output.strip():
                output = f"killed by signal {-rc}"
            raise failure_from_exit(self.argv, rc, output)

    @property
    def stderr(self) -> str:
        """What the child has written to stderr so far (at most 64 KiB)."""
        return _decode(bytes(self._err))

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its group); safe from any thread. Iteration then ends quietly."""
        self._stopping = True
        _signal_group(self._proc, signal.SIGTERM)

    def close(self) -> None:
        """Terminate, kill if needed, reap the child and close the pipes. Idempotent."""
        self._stopping = True
        self._release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self._sel.close()
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once the child is reaped and the pipes are closed."""
        return not self._finalizer.alive

    def __enter__(self) -> LineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SubprocessRunner:
    """Runs nvidia-smi as a real child process.

    Args:
        env: environment for the child (default: inherit).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run ``argv`` to completion.

        The whole call, killing included, takes at most about ``timeout`` seconds: the child is terminated
        shortly before the deadline so that reaping fits inside it.

        Raises:
            NvidiaSmiNotFoundError: the binary cannot be executed.
            NvidiaSmiTimeoutError: it did not finish in time (it was killed).
        """
        start = time.monotonic()
        proc = _spawn(argv, self.env)
        grace = min(TERM_GRACE, timeout / 10)
        try:
            out, err = proc.communicate(timeout=max(timeout - 2 * grace, 0.001))
        except subprocess.TimeoutExpired as exc:
            terminate_and_reap(proc, grace)
            raise NvidiaSmiTimeoutError(
                f"nvidia-smi did not answer within {timeout:g} s and was killed; the driver may be hung "
                "(check `dmesg` for Xid errors) or slow without persistence mode (`nvidia-smi -pm 1`)",
                argv=argv,
                timeout=timeout,
            ) from exc
        finally:
            terminate_and_reap(proc, grace)
        return Completed(tuple(argv), proc.returncode, _decode(out), _decode(err), time.monotonic() - start)

    def lines(self, argv: Sequence[str], line_timeout: float) -> LineStream:
        """Start ``argv`` and return its output as a :class:`LineStream`."""
        return LineStream(argv, line_timeout, env=self.env)
