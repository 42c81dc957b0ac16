"""The children's life, from start to reaping; only those of the current process are ever touched."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from smiquery.errors import (
    NvidiaSmiNotFoundError,
    ResourceLimitError,
)

__all__ = [
    "MAX_ERR_BYTES",
    "PIPE_GRACE",
    "TERM_GRACE",
    "exit_pauses",
    "exited",
    "live_children",
    "popen",
    "read_some",
    "signal_group",
    "spawn_loop_child",
    "terminate_and_reap",
    "wait_exit",
]

#: Seconds between SIGTERM and SIGKILL, and how long to wait for a killed child before a reaper thread takes it.
TERM_GRACE = 0.5
#: Seconds an exited child's helpers may keep its pipes open before the group is killed and the output taken.
PIPE_GRACE = 0.2
#: The most of a child's stderr that is kept.
MAX_ERR_BYTES = 64 * 1024
_LINUX = sys.platform.startswith("linux")


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


#: errno values of a spawn that failed for want of a resource of this process.
_LIMITS = {
    errno.EMFILE: "this process has too many open files; raise its limit (`ulimit -n`, systemd LimitNOFILE=, "
    "or the container's nofile ulimit) or close what leaks descriptors",
    errno.ENFILE: "the system's open-file table is full; raise fs.file-max or find what holds the files",
    errno.EAGAIN: "too many processes for this user (or cgroup pids.max); raise the limit (`ulimit -u`, TasksMax=)",
    errno.ENOMEM: "out of memory for a new process; free memory or raise the cgroup's memory limit",
}


def exec_error(path: str, exc: OSError) -> NvidiaSmiNotFoundError | ResourceLimitError:
    """The one-line reason ``path`` could not be started: missing, not executable, or a limit of this process."""
    code = exc.errno
    if code in _LIMITS:
        return ResourceLimitError(f"cannot start {path}: {exc.strerror or os.strerror(code)}: {_LIMITS[code]}")
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


# Every child leads a process group of its own, so that the whole group (helpers included) can be signalled. A new
# group, not a new session: on Linux setsid() also gives the child a scheduler autogroup of its own, which on a
# busy machine makes a short nvidia-smi run slower and far more variable (scripts/bench_compat.py --child sh).
_OWN_GROUP: dict[str, Any] = (
    {} if os.name == "nt" else {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


def popen(argv: Sequence[str], *, pdeathsig: bool = False) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group with piped output; translate exec failures. Runs on any thread."""
    argv = list(argv)
    status_r = status_w = -1
    cmd = argv
    try:
        if pdeathsig:
            status_r, status_w = os.pipe()
            cmd = [sys.executable, "-S", "-E", "-s", "-c", _TRAMPOLINE, str(os.getpid()), str(status_w), *argv]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,) if pdeathsig else (),
            **_OWN_GROUP,
        )
    except OSError as exc:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        raise exec_error(argv[0], exc) from exc
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
            raise exec_error(argv[0], OSError(code, os.strerror(code)))
    return proc


# The one long-lived thread that forks loop children (a parent-death signal follows the forking thread), with the
# queue of its jobs: an argument list and where to put the child or the exception that kept it from starting.
_Done = queue.SimpleQueue["subprocess.Popen[bytes] | BaseException"]
_JOBS: queue.SimpleQueue[tuple[Sequence[str], _Done]] | None = None
_SPAWNER_LOCK = threading.Lock()


def _serve(jobs: queue.SimpleQueue[tuple[Sequence[str], _Done]]) -> None:
    while True:
        argv, done = jobs.get()
        try:
            done.put(popen(argv, pdeathsig=True))
        except BaseException as exc:
            done.put(exc)


def spawn_loop_child(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start a loop child that dies with this process (Linux, a real interpreter: forked by the spawner thread)."""
    global _JOBS
    if not _LINUX or not sys.executable or getattr(sys, "frozen", False):
        return popen(argv)
    done: _Done = queue.SimpleQueue()
    with _SPAWNER_LOCK:
        if _JOBS is None:
            _JOBS = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_JOBS,), name="smiquery-spawner", daemon=True).start()
        _JOBS.put((argv, done))
    result = done.get()
    if isinstance(result, BaseException):
        raise result
    return result


def _after_fork_in_child() -> None:
    # The fork has no spawner thread and owns none of the parent's children (their owner pid says so too).
    global _JOBS, _LIVE_LOCK, _SPAWNER_LOCK
    _JOBS = None
    _SPAWNER_LOCK = threading.Lock()
    _LIVE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
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


def exited(proc: subprocess.Popen[bytes]) -> bool:
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


def exit_pauses(proc: subprocess.Popen[bytes], timeout: float) -> Iterator[float]:
    """The pauses of a wait of up to ``timeout`` s for the leader's exit: from 1 ms, doubling up to 50 ms."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not exited(proc) and (left := deadline - time.monotonic()) > 0:
        yield min(delay, left)
        delay = min(delay * 2, 0.05)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the leader to exit, without reaping it."""
    for pause in exit_pauses(proc, timeout):
        time.sleep(pause)
    return exited(proc)


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
            if not exited(proc):
                signal_group(proc, signal.SIGTERM)
                if not wait_exit(proc, grace):
                    signal_group(proc, signal.SIGKILL)
                    wait_exit(proc, grace)
            signal_group(proc, signal.SIGKILL)  # the leader is gone or a zombie: this reaches its helpers
            if exited(proc):
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
        signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(0.2)


def read_some(fd: int) -> bytes | None:
    """What a non-blocking pipe holds now: its data, b"" at its end (or on an error), None when nothing is there."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
