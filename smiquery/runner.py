"""Finding and running nvidia-smi: the only module that imports ``subprocess``.

Every child runs from an argument list (never a shell), in its own process group, under a deadline. On every
path (normal end, exception, timeout, early stop, ``KeyboardInterrupt``, garbage collection) the whole group is
terminated, then killed, and the child is reaped: a helper process that inherited the pipes is killed with it.
On Linux a loop child also gets a parent-death signal, so it dies with this process however this process dies.
Only children started by the current process are ever touched: a forked copy of this process leaves them alone.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import os
import queue
import select
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from smiquery.errors import (
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    OutputTooLargeError,
    StreamEndedError,
    failure_from_exit,
)

__all__ = [
    "Completed",
    "LineSource",
    "LineStream",
    "Runner",
    "SubprocessRunner",
    "default_runner",
    "find_nvidia_smi",
    "live_children",
    "terminate_and_reap",
]

ENV_VAR = "SMIQUERY_NVIDIA_SMI"

#: Seconds between SIGTERM and SIGKILL, and how long to wait for a killed child before a reaper thread takes it.
TERM_GRACE = 0.5
#: Seconds an exited child's helpers may keep its pipes open before the group is killed and the output taken.
PIPE_GRACE = 0.2
_MAX_ERR_BYTES = 64 * 1024
#: The most a one-shot call reads before it gives up on the child (:class:`~smiquery.errors.OutputTooLargeError`).
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
#: A loop child's line longer than this is cut to its first :data:`_KEPT_OF_LONG_LINE` bytes (the parser rejects
#: it) and the rest is skipped until its end, so that endless output without a newline keeps memory flat.
MAX_LINE_BYTES = 64 * 1024
_KEPT_OF_LONG_LINE = 256


class _Flood(Exception):
    """Internal: a one-shot child's output passed :data:`MAX_OUTPUT_BYTES`."""


_LINUX = sys.platform.startswith("linux")


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


# The last PATH search that found nvidia-smi: (PATH value, path). Searched again when PATH changes or the file is
# no longer an executable file, so a remembered answer is never staler than one stat.
_which_memo: tuple[str | None, str] | None = None


def _which_cached() -> str | None:
    global _which_memo
    path_var = os.environ.get("PATH")
    memo = _which_memo
    if memo is not None and memo[0] == path_var and os.path.isfile(memo[1]) and os.access(memo[1], os.X_OK):
        return memo[1]
    found = shutil.which("nvidia-smi")
    _which_memo = (path_var, found) if found else None
    return found


def find_nvidia_smi(nvidia_smi: str | os.PathLike[str] | None = None, *, runner: Runner | None = None) -> str:
    r"""Locate the nvidia-smi binary.

    Order: the ``nvidia_smi`` argument, the ``SMIQUERY_NVIDIA_SMI`` environment variable, ``PATH``, then the
    usual places (``/usr/bin``, ``/usr/local/nvidia/bin`` used by container runtimes, WSL's ``/usr/lib/wsl/lib``,
    and on Windows ``%SystemRoot%\System32`` and ``%ProgramFiles%\NVIDIA Corporation\NVSMI``).
    A PATH hit is remembered while ``PATH`` keeps its value and the file stays executable.

    A runner that serves nvidia-smi without a file (one with a ``locate`` method, like
    :class:`smiquery.testing.InProcessRunner`) names the binary itself and nothing is looked up: the ``runner``
    argument, else the runner :func:`default_runner` returns.

    Args:
        nvidia_smi: an explicit path (or a bare command name looked up on PATH).
        runner: the runner that will run the binary (default: :func:`default_runner`).

    Returns:
        The path to run.

    Raises:
        NvidiaSmiNotFoundError: nothing usable was found; the message says what to do.
    """
    chosen = runner if runner is not None else _installed
    if chosen is not None and isinstance(chosen, _Locating):
        return chosen.locate(nvidia_smi)
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
    found = _which_cached()
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


class LineSource(Protocol):
    """The output of one running nvidia-smi, line by line: what :meth:`Runner.lines` returns.

    :class:`LineStream` reads a real child; :class:`smiquery.testing.InProcessRunner` serves one without a
    process. Nothing here decides that a child is hung: :meth:`readline` just reports that no line came in time,
    and the caller (the stream supervisor) decides what silence means.
    """

    argv: tuple[str, ...]

    @property
    def pid(self) -> int | None:
        """The child's process id (None without a process)."""
        ...

    @property
    def returncode(self) -> int | None:
        """The exit status, once the child is reaped."""
        ...

    @property
    def idle(self) -> float:
        """Seconds the last :meth:`readline` waited for its line's data (0.0 when it was already buffered)."""
        ...

    @property
    def stderr(self) -> str:
        """What the child wrote to stderr so far."""
        ...

    @property
    def closed(self) -> bool:
        """True once the child is reaped and everything is released."""
        ...

    def readline(self, timeout: float) -> str | None:
        """The next complete line, without its newline; blank lines are skipped.

        Returns:
            The line, or None when no complete line arrived within ``timeout`` seconds (or :meth:`interrupt` was
            called); the child keeps running either way.

        Raises:
            StreamEndedError: the output ended and the child exited 0.
            NvidiaSmiFailedError: the output ended and the child exited non-zero (its typed subclass).
        """
        ...

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now."""
        ...

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its group). Any thread; idempotent."""
        ...

    def kill(self) -> None:
        """Kill the child's group (SIGKILL). Any thread; idempotent."""
        ...

    def close(self) -> None:
        """Terminate, kill if needed, reap and release; idempotent, returns within about a second."""
        ...


class Runner(Protocol):
    """How smiquery runs nvidia-smi. :class:`SubprocessRunner` is the real one; tests may inject others.

    Every function that runs nvidia-smi takes ``runner=``; without one it uses :func:`default_runner`. A runner
    may also define ``locate(nvidia_smi) -> str``: then :func:`find_nvidia_smi` asks it for ``argv[0]`` instead
    of searching the file system (:class:`smiquery.testing.InProcessRunner` does, since it starts no binary).
    """

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run to completion within ``timeout`` seconds."""
        ...

    def lines(self, argv: Sequence[str]) -> LineSource:
        """Start a long-running child and return its output lines."""
        ...


@runtime_checkable
class _Locating(Protocol):
    """A runner that names ``argv[0]`` itself (it starts no file), so no PATH lookup is made for it."""

    def locate(self, nvidia_smi: str | os.PathLike[str] | None) -> str: ...


# The runner used where none is passed. Only smiquery.testing.use_runner() changes it, for the length of a
# `with` block in a test; no environment variable or configuration file can.
_installed: Runner | None = None


def default_runner() -> Runner:
    """The runner used wherever none is passed: a new :class:`SubprocessRunner`.

    Inside a :func:`smiquery.testing.use_runner` block (tests only) it is the runner given there instead, in
    every thread, so that the CLI, the exporter and the callbacks run against an in-process fake.

    Returns:
        The runner to use.
    """
    installed = _installed
    return installed if installed is not None else SubprocessRunner()


def install_default(runner: Runner | None) -> Runner | None:
    """Make ``runner`` the default (None: back to :class:`SubprocessRunner`); returns the previous one."""
    global _installed
    previous, _installed = _installed, runner
    return previous


# ------------------------------------------------------------------------------------------ child bookkeeping

# Children alive right now, with the pid of the process that started them: killed at interpreter exit so a loop
# child never outlives its parent. A forked copy of this process inherits the set but owns none of them.
_LIVE: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_OWNER_ATTR = "_smiquery_owner"


def _owned(proc: subprocess.Popen[bytes]) -> bool:
    return getattr(proc, _OWNER_ATTR, None) == os.getpid()


def live_children() -> list[int]:
    """PIDs of nvidia-smi children this process started and has not reaped yet."""
    with _LIVE_LOCK:
        return [p.pid for p in _LIVE if p.returncode is None and _owned(p)]


def _exec_error(path: str, exc: OSError) -> NvidiaSmiNotFoundError:
    """The one-line reason an existing path could not be executed, or that it does not exist."""
    code = exc.errno
    if code == errno.ENOENT and not os.path.exists(path):
        return NvidiaSmiNotFoundError(f"nvidia-smi not found: {path} does not exist")
    if code == errno.ENOENT:
        return NvidiaSmiNotFoundError(
            f"{path} exists but cannot start: its loader (ELF interpreter) is missing, so it was built for "
            "another system or architecture, or the driver install is broken; reinstall the NVIDIA driver"
        )
    if code == errno.ENOEXEC:
        return NvidiaSmiNotFoundError(
            f"{path} exists but cannot start: exec format error (built for another architecture, or a script "
            "without a #! line); use the nvidia-smi of this machine's driver"
        )
    if code in (errno.EACCES, errno.EPERM):
        return NvidiaSmiNotFoundError(f"{path} cannot be executed (permission denied); check chmod +x and mounts")
    return NvidiaSmiNotFoundError(f"{path} cannot be executed: {exc.strerror or exc}")


# A loop child gets PR_SET_PDEATHSIG = SIGKILL through this trampoline, which then execs nvidia-smi in place (same
# pid). Setting it in the child through preexec_fn is unsafe with threads; the trampoline is a fresh interpreter.
# The kernel sends the signal when the *thread* that forked dies, so every loop child is forked by one long-lived
# spawner thread. The exec outcome comes back through a close-on-exec pipe, like subprocess's own.
_TRAMPOLINE = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None).prctl(1,9,0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(1)\n"
    "fd=int(sys.argv[2]);os.set_inheritable(fd,False)\n"
    "try:os.execv(sys.argv[3],sys.argv[3:])\n"
    "except OSError as e:os.write(fd,str(e.errno).encode());os._exit(127)\n"
)


def _can_trampoline() -> bool:
    return _LINUX and bool(sys.executable) and not getattr(sys, "frozen", False)


# Every child leads a process group of its own, so that the whole group (helpers included) can be signalled. A new
# group, not a new session: on Linux setsid() also gives the child a scheduler autogroup of its own, which on a
# busy machine makes a short nvidia-smi run slower and far more variable (scripts/bench_compat.py --child sh).
_OWN_GROUP: dict[str, Any] = (
    {} if os.name == "nt" else {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


def _popen(argv: Sequence[str], env: Mapping[str, str] | None, pdeathsig: bool) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group with piped output; translate exec failures. Runs on any thread."""
    argv = list(argv)
    status_r = status_w = -1
    cmd = argv
    if pdeathsig:
        status_r, status_w = os.pipe()
        cmd = [sys.executable, "-S", "-E", "-s", "-c", _TRAMPOLINE, str(os.getpid()), str(status_w), *argv]
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            pass_fds=(status_w,) if pdeathsig else (),
            **_OWN_GROUP,
        )
    except OSError as exc:
        if pdeathsig:
            os.close(status_r)
            os.close(status_w)
        raise _exec_error(argv[0], exc) from exc
    setattr(proc, _OWNER_ATTR, os.getpid())
    with _LIVE_LOCK:
        _LIVE.add(proc)
    if pdeathsig:
        os.close(status_w)
        try:
            with os.fdopen(status_r, "rb") as status:
                report = status.read()  # EOF at the exec: empty on success
        except OSError:
            report = b""
        if report:
            terminate_and_reap(proc)
            try:
                code = int(report)
            except ValueError:
                code = errno.EIO
            raise _exec_error(argv[0], OSError(code, os.strerror(code)))
    return proc


#: Called on the spawner thread with the new child, or with the exception that kept it from starting. It must
#: not block; if it raises, the child is killed and reaped.
_SpawnDone = Callable[["subprocess.Popen[bytes] | BaseException"], None]


class _Spawner:
    """The one long-lived thread that forks loop children (a parent-death signal follows the forking thread)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Sequence[str], Mapping[str, str] | None, _SpawnDone]]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="smiquery-spawner", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            argv, env, done = self._jobs.get()
            result: subprocess.Popen[bytes] | BaseException
            try:
                result = _popen(argv, env, pdeathsig=True)
            except BaseException as exc:
                result = exc
            try:
                done(result)
            except BaseException:  # nobody took the child: it must not outlive the job, nor stop this thread
                if isinstance(result, subprocess.Popen):
                    terminate_and_reap(result, 0.0)

    def submit(self, argv: Sequence[str], env: Mapping[str, str] | None, done: _SpawnDone) -> None:
        """Fork ``argv`` on this thread; ``done`` gets the child or the exception, on this thread."""
        self._jobs.put((argv, env, done))

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
        out: list[subprocess.Popen[bytes] | BaseException] = []
        finished = threading.Event()

        def done(result: subprocess.Popen[bytes] | BaseException) -> None:
            out.append(result)
            finished.set()

        self.submit(argv, env, done)
        finished.wait()
        result = out[0]
        if isinstance(result, BaseException):
            raise result
        return result


_SPAWNER: _Spawner | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> _Spawner:
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = _Spawner()
        return _SPAWNER


def _spawn_loop_child(argv: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
    if not _can_trampoline():
        return _popen(argv, env, pdeathsig=False)
    return _spawner().spawn(argv, env)


def _submit_loop_child(argv: Sequence[str], env: Mapping[str, str] | None, done: _SpawnDone) -> None:
    """Start a loop child with a parent-death signal without waiting for it: ``done`` gets the outcome.

    The spawner thread forks it (so it dies with this process, not with the calling thread), reads the
    trampoline's exec report and then calls ``done`` there, with the child or the typed
    :class:`~smiquery.errors.NvidiaSmiNotFoundError`. Only where :func:`_can_trampoline` is true.
    """
    _spawner().submit(argv, env, done)


def _forget(proc: subprocess.Popen[bytes]) -> None:
    """Drop a reaped child from :func:`live_children` (for children reaped outside this module)."""
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def _after_fork_in_child() -> None:
    # The fork has no spawner thread and owns none of the parent's children (their owner pid says so too).
    global _SPAWNER, _LIVE_LOCK, _SPAWNER_LOCK
    _SPAWNER = None
    _SPAWNER_LOCK = threading.Lock()
    _LIVE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the child's whole group: the leader and any helper it started. Only our own, unreaped children.

    While the leader is unreaped (alive or a zombie) its pid, which is the group id, cannot be reused, so the
    group signalled is always the child's.
    """
    if proc.returncode is not None or not _owned(proc):
        return
    try:
        if os.name != "nt":
            os.killpg(proc.pid, sig)
        elif sig == signal.SIGTERM:
            proc.terminate()
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Has the leader exited? Does not reap it, so its group id stays reserved for signalling helpers."""
    if proc.returncode is not None:
        return True
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll() is not None
    return info is not None


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the leader to exit, without reaping it."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not _exited(proc):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)
    return True


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    # A child stuck in the kernel (D state) ignores even SIGKILL until its call returns. Nobody should block
    # on it: a daemon thread waits and reaps it whenever it finally dies.
    def wait() -> None:
        with contextlib.suppress(Exception):
            proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(proc)

    threading.Thread(target=wait, name=f"smiquery-reap-{proc.pid}", daemon=True).start()


def terminate_and_reap(proc: subprocess.Popen[bytes], grace: float = TERM_GRACE) -> None:
    """Stop the child's whole group and reap it; close its pipes. Never blocks much beyond ``2 * grace``.

    SIGTERM to the group, SIGKILL after ``grace`` if the leader is still there, then SIGKILL to the group once
    more (helpers that kept the pipes open), then reap. A child that is not this process's own is left alone.
    """
    try:
        if _owned(proc) and proc.returncode is None:
            if not _exited(proc):
                _signal_group(proc, signal.SIGTERM)
                if not _wait_exit(proc, grace):
                    _signal_group(proc, signal.SIGKILL)
                    _wait_exit(proc, grace)
            _signal_group(proc, signal.SIGKILL)  # the leader is gone or a zombie: this reaches its helpers
            if _exited(proc):
                with contextlib.suppress(Exception):
                    proc.wait(grace)
            if proc.returncode is None:
                _reap_later(proc)
                return
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
        procs = [p for p in _LIVE if _owned(p)]
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(0.2)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _message_of(lines: Sequence[str], err: bytes, rc: int) -> str:
    output = "\n".join(lines) + ("\n" + _decode(err) if err else "")
    if rc in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT) and not output.strip():
        output = f"killed by signal {-rc}"
    return output


class _PidWatch:
    """Readiness of the leader's exit for a selector: a pidfd where the kernel has them."""

    def __init__(self, pid: int) -> None:
        self.fd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.fd = os.pidfd_open(pid)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class LineStream:
    """The output lines of one long-running nvidia-smi child (``-l``/``-lms`` loop mode): a :class:`LineSource`.

    :meth:`readline` returns complete lines (undecodable bytes replaced) or None when none came in time; it never
    kills the child for being slow. When the output ends, or the leader exits (helpers holding the pipes are then
    killed after :data:`PIPE_GRACE`), the child is reaped and its status judged after the last line: 0 raises
    :class:`~smiquery.errors.StreamEndedError`, non-zero the matching typed
    :class:`~smiquery.errors.NvidiaSmiFailedError`. A trailing partial line is returned as it is (the parser
    rejects it).

    Use it as a context manager, or call :meth:`close`; it also closes itself when garbage-collected.
    :meth:`interrupt`, :meth:`terminate` and :meth:`kill` may be called from any thread.

    Args:
        argv: the command.
        env: environment for the child (default: inherit).
        pdeathsig: on Linux, kill the child when this process dies (default True).
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, pdeathsig: bool = True) -> None:
        self.argv = tuple(argv)
        self.started = time.monotonic()
        self._proc = _spawn_loop_child(self.argv, env) if pdeathsig else _popen(self.argv, env, pdeathsig=False)
        self._finalizer = weakref.finalize(self, terminate_and_reap, self._proc)
        self._lines: deque[tuple[str, float]] = deque()
        self._partial: list[bytes] = []  # the pieces of the line being read, joined once at its newline
        self._partial_len = 0
        self._skipping = False  # inside an over-long line: its rest is skipped
        self._err = bytearray()
        self._messages: deque[str] = deque(maxlen=20)  # recent non-CSV stdout lines, for error messages
        self._open_fds = 2
        self._eof = False
        self._ended: BaseException | None = None
        self._stopping = False
        self._idle = 0.0
        self._io = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pidwatch = _PidWatch(self._proc.pid)
        self._exit_seen: float | None = None
        self._sel = selectors.DefaultSelector()
        for pipe in (self._proc.stdout, self._proc.stderr):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            self._sel.register(pipe, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        if self._pidwatch.fd is not None:
            self._sel.register(self._pidwatch.fd, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status, once reaped."""
        return self._proc.returncode

    @property
    def idle(self) -> float:
        """Seconds the last :meth:`readline` waited for its line's data (0.0 when it was already buffered)."""
        return self._idle

    @property
    def stderr(self) -> str:
        """What the child has written to stderr so far (at most 64 KiB)."""
        return _decode(bytes(self._err))

    @property
    def closed(self) -> bool:
        """True once the child is reaped and the pipes are closed."""
        return not self._finalizer.alive

    def readline(self, timeout: float) -> str | None:
        """The next complete line; None if none within ``timeout`` s or on :meth:`interrupt` (see the class)."""
        with self._io:
            if self._lines:
                line, self._idle = self._lines.popleft()
                return line
            if self._ended is not None:
                raise self._ended
            if self.closed:
                raise StreamEndedError(self.argv, 0, "", "the nvidia-smi stream was closed")
            return self._fill(time.monotonic() + max(timeout, 0.0))

    def _fill(self, deadline: float) -> str | None:
        waited = 0.0
        looked = False  # a deadline already past still gets one look at the pipes
        while not self._lines:
            if self._eof:
                self._finish()
                break
            remaining = deadline - time.monotonic()
            if self._exit_seen is not None:
                # The leader is gone but something still holds its pipes: give the output a moment, then end it.
                remaining = min(remaining, self._exit_seen + PIPE_GRACE - time.monotonic())
                if remaining <= 0:
                    _signal_group(self._proc, signal.SIGKILL)
                    self._drain_now()
                    self._eof = True
                    continue
            elif self._pidwatch.fd is None:
                remaining = min(remaining, 0.5)  # no pidfd: look at the leader now and then
            if remaining <= 0:
                if looked:
                    self._idle = waited
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
            if not events:
                if self._pidwatch.fd is None and self._exit_seen is None and _exited(self._proc):
                    self._exit_seen = time.monotonic()
                continue
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 512):
                            pass
                    self._idle = waited
                    if not self._lines:
                        return None
                elif self._pidwatch.fd is not None and key.fileobj == self._pidwatch.fd:
                    self._sel.unregister(key.fileobj)
                    if self._exit_seen is None:
                        self._exit_seen = time.monotonic()
                else:
                    self._read(key)
        line, _ = self._lines.popleft()
        self._idle = waited
        return line

    def _read(self, key: selectors.SelectorKey) -> None:
        try:
            data = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(key.fileobj)
            self._open_fds -= 1
            if self._open_fds == 0:
                self._eof = True
            return
        if key.fileobj is self._proc.stdout:
            self._take(data)
        elif len(self._err) < _MAX_ERR_BYTES:
            self._err += data

    def _drain_now(self) -> None:
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is None or pipe.closed:
                continue
            while True:
                try:
                    data = os.read(pipe.fileno(), 65536)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                if pipe is self._proc.stdout:
                    self._take(data)
                elif len(self._err) < _MAX_ERR_BYTES:
                    self._err += data

    def _take(self, data: bytes) -> None:
        parts = data.split(b"\n")
        rest = parts.pop()
        if parts and (self._partial or self._skipping):
            head = b"".join(self._partial) + parts[0]
            parts[0] = b"" if self._skipping else head  # an over-long line's end is skipped
            self._partial = []
            self._partial_len = 0
            self._skipping = False
        for raw in parts:
            self._add_line(raw)
        if rest and not self._skipping:
            self._partial.append(rest)
            self._partial_len += len(rest)
            if self._partial_len > MAX_LINE_BYTES:
                # no newline in sight: keep the head for the parser to reject, skip the rest until the newline
                self._add_line(b"".join(self._partial)[:_KEPT_OF_LONG_LINE])
                self._partial = []
                self._partial_len = 0
                self._skipping = True

    def _add_line(self, raw: bytes) -> None:
        line = _decode(raw).rstrip("\r")
        if not line.strip():
            return
        self._lines.append((line, 0.0))
        if ", " not in line:
            self._messages.append(line)

    def _finish(self) -> None:
        # The output has ended: the child has exited (or closed its output). Reap it, then judge the exit code.
        stopping = self._stopping
        _wait_exit(self._proc, 5.0)  # a leader that closed its output but lingers is killed by _release
        self._release()
        rc = self._proc.returncode if self._proc.returncode is not None else -signal.SIGKILL
        tail = b"".join(self._partial)
        self._partial = []
        if tail.strip() and not self._skipping:
            self._add_line(tail)
        output = _message_of(list(self._messages), bytes(self._err), rc)
        if rc != 0 and not stopping:
            self._ended = failure_from_exit(self.argv, rc, output)
        else:
            self._ended = StreamEndedError(self.argv, rc, output)
        if not self._lines:
            raise self._ended

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now. Any thread."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its group). Any thread; iteration then ends without an error."""
        self._stopping = True
        _signal_group(self._proc, signal.SIGTERM)

    def kill(self) -> None:
        """Kill the child's group (SIGKILL). Any thread; idempotent."""
        self._stopping = True
        _signal_group(self._proc, signal.SIGKILL)

    def close(self) -> None:
        """Terminate, kill if needed, reap the child and close the pipes. Idempotent; any thread."""
        self._stopping = True
        self.interrupt()
        with self._io:
            self._release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self._sel.close()
        self._pidwatch.close()
        self._finalizer()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> LineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_to_end(proc: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, bytes, bool]:
    """Read a one-shot child's output to its end; returns (stdout, stderr, finished in time).

    The output ends when both pipes close and the leader has exited, or :data:`PIPE_GRACE` after the leader
    exited (helpers that still hold the pipes are then killed). Where the kernel has pidfds the leader's exit is
    one more readiness event beside the pipes, so nothing sleeps or polls; elsewhere the leader is looked at
    every 50 ms.
    """
    out, err = bytearray(), bytearray()
    pipes = {p.fileno(): buf for p, buf in ((proc.stdout, out), (proc.stderr, err)) if p is not None}
    for fd in pipes:
        os.set_blocking(fd, False)
    watch = _PidWatch(proc.pid)
    try:
        if watch.fd is None or not hasattr(select, "poll"):
            finished = _read_polling(proc, pipes, deadline)
        else:
            finished = _read_with_pidfd(proc, pipes, watch.fd, deadline)
    finally:
        watch.close()
    return bytes(out), bytes(err), finished


def _drain(pipes: dict[int, bytearray]) -> None:
    for fd, buf in pipes.items():
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 65536):
                buf += chunk
                if len(buf) > MAX_OUTPUT_BYTES:
                    raise _Flood


def _read_chunk(fd: int, pipes: dict[int, bytearray]) -> bool:
    """Read what ``fd`` has; at end of file drop it from ``pipes`` and return True."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    except OSError:
        chunk = b""
    if chunk:
        buf = pipes[fd]
        buf += chunk
        if len(buf) > MAX_OUTPUT_BYTES:
            raise _Flood
        return False
    del pipes[fd]
    return True


def _read_with_pidfd(proc: subprocess.Popen[bytes], pipes: dict[int, bytearray], pidfd: int, deadline: float) -> bool:
    """:func:`_run_to_end` where the leader's exit is readable on ``pidfd``: wake only on events.

    ``pipes`` maps each open output fd to its buffer; closed ones are removed.
    """
    poller = select.poll()
    for fd in pipes:
        poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    exit_seen: float | None = None
    while pipes or exit_seen is None:
        now = time.monotonic()
        wait = deadline - now
        if exit_seen is not None:  # only pipes left: a helper may hold them
            wait = min(wait, exit_seen + PIPE_GRACE - now)
            if wait <= 0:
                _signal_group(proc, signal.SIGKILL)
                _drain(pipes)
                return True
        if wait <= 0:
            return False
        for fd, _ in poller.poll(max(1, math.ceil(wait * 1000))):
            if fd == pidfd:
                poller.unregister(pidfd)
                exit_seen = time.monotonic()
            elif _read_chunk(fd, pipes):
                poller.unregister(fd)
    return True


def _read_polling(proc: subprocess.Popen[bytes], pipes: dict[int, bytearray], deadline: float) -> bool:
    """:func:`_run_to_end` without pidfds: select on the pipes, looking at the leader every 50 ms."""
    exit_seen: float | None = None
    while pipes:
        now = time.monotonic()
        if exit_seen is None and _exited(proc):
            exit_seen = now
        wait = deadline - now
        if exit_seen is not None:
            wait = min(wait, exit_seen + PIPE_GRACE - now)
            if wait <= 0:
                _signal_group(proc, signal.SIGKILL)
                _drain(pipes)
                return True
        elif wait <= 0:
            return False
        ready, _, _ = select.select(list(pipes), [], [], min(wait, 0.05 if exit_seen is None else wait))
        for fd in ready:
            _read_chunk(fd, pipes)
    return _wait_exit(proc, max(deadline - time.monotonic(), 0.0))


class SubprocessRunner:
    """Runs nvidia-smi as a real child process.

    Args:
        env: environment for the child (default: inherit).
        pdeathsig: give loop children a parent-death signal on Linux (default True).
    """

    def __init__(self, env: Mapping[str, str] | None = None, *, pdeathsig: bool = True) -> None:
        self.env = env
        self.pdeathsig = pdeathsig

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run ``argv`` to completion.

        The whole call, killing included, takes at most about ``timeout`` seconds: the child is terminated
        shortly before the deadline so that reaping fits inside it. A child that exited while a helper it
        started still holds its output pipe is complete: its output is returned and the helper killed.

        Raises:
            NvidiaSmiNotFoundError: the binary does not exist or cannot be executed.
            NvidiaSmiTimeoutError: it did not finish in time (it was killed).
        """
        start = time.monotonic()
        proc = _popen(argv, self.env, pdeathsig=False)
        grace = min(TERM_GRACE, timeout / 10)
        try:
            if os.name == "nt":  # pragma: no cover - no select() on pipes there
                try:
                    raw_out, raw_err = proc.communicate(timeout=max(timeout - 2 * grace, 0.001))
                    finished = True
                except subprocess.TimeoutExpired:
                    raw_out, raw_err, finished = b"", b"", False
            else:
                raw_out, raw_err, finished = _run_to_end(proc, start + max(timeout - 2 * grace, 0.001))
        except _Flood:
            raise OutputTooLargeError(argv, MAX_OUTPUT_BYTES) from None
        finally:
            terminate_and_reap(proc, grace)
        if not finished:
            raise NvidiaSmiTimeoutError(
                f"nvidia-smi did not answer within {timeout:g} s and was killed; the driver may be hung "
                "(check `dmesg` for Xid errors) or slow without persistence mode (`nvidia-smi -pm 1`)",
                argv=argv,
                timeout=timeout,
            )
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return Completed(tuple(argv), rc, _decode(raw_out), _decode(raw_err), time.monotonic() - start)

    def lines(self, argv: Sequence[str]) -> LineStream:
        """Start ``argv`` and return its output as a :class:`LineStream`."""
        return LineStream(argv, env=self.env, pdeathsig=self.pdeathsig)
