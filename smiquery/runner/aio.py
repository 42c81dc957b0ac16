"""Children on an asyncio event loop: one-shot runs and loop-mode lines, without blocking the loop.

Every child runs from an argument list (never a shell) in its own process group; it is terminated, killed if need
be, and reaped on every path, cancellation and ``asyncio.wait_for`` included. On Linux a loop child also dies with
this process however it dies: the runner's spawner thread forks it with a parent-death signal (see
:func:`start_loop_child`). Reading has a deadline, and past it the child is killed; what silence means is the
stream engine's business (:mod:`smiquery.streams.engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections import deque
from collections.abc import Sequence
from typing import IO, Protocol

from smiquery.errors import failure_from_exit
from smiquery.runner import MAX_LINE_BYTES, TERM_GRACE, Completed, no_answer, terminate_and_reap
from smiquery.runner.children import MAX_ERR_BYTES, OWN_GROUP, can_trampoline, exec_error, forget, submit_loop_child
from smiquery.runner.lines import decode, message_of

__all__ = ["AsyncLines", "live_children", "run", "start_loop_child"]

_STREAM_LIMIT = 2**16  # what a stream reader buffers before it stops reading the pipe (asyncio's default)


class _Proc(Protocol):
    """What this module needs of a child: :class:`asyncio.subprocess.Process`, or :class:`_ForkedChild`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> asyncio.StreamReader | None: ...

    @property
    def stderr(self) -> asyncio.StreamReader | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


_LIVE: set[_Proc] = set()


def live_children() -> list[int]:
    """PIDs of nvidia-smi children this module started and has not reaped yet."""
    return [p.pid for p in _LIVE if p.returncode is None]


async def _spawn(argv: Sequence[str]) -> asyncio.subprocess.Process:
    """Start a one-shot child in its own process group (no parent-death signal: its timeout bounds it)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            **OWN_GROUP,  # the whole group is signalled
        )
    except OSError as exc:
        raise exec_error(argv[0], exc) from exc
    _LIVE.add(proc)
    return proc


class _PipeFeed:
    """Feeds one of a child's pipes into a :class:`asyncio.StreamReader`; the reader pauses and resumes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes], reader: asyncio.StreamReader) -> None:
        self._loop = loop
        self._pipe = pipe
        self._fd = pipe.fileno()
        self._reader = reader
        self._reading = False
        os.set_blocking(self._fd, False)
        reader.set_transport(self)  # type: ignore[arg-type]  # it only calls pause_reading/resume_reading
        self.resume_reading()

    def _ready(self) -> None:
        try:
            data = os.read(self._fd, _STREAM_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._reader.feed_data(data)
        else:
            self.close()

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self._pipe.closed:
            self._reading = True
            self._loop.add_reader(self._fd, self._ready)

    def close(self) -> None:
        """Stop reading, close the pipe and end the reader's data. Idempotent."""
        self.pause_reading()
        if not self._pipe.closed:
            with contextlib.suppress(OSError):
                self._pipe.close()
            if not self._reader.at_eof():
                self._reader.feed_eof()


class _ForkedChild:
    """A loop child forked by the runner's spawner thread, read and awaited on this event loop.

    Pipes are read with :meth:`~asyncio.AbstractEventLoop.add_reader` (flow control included), the exit is
    awaited on a pidfd where the kernel has them (else looked at every 50 ms); nothing blocks the loop.
    """

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        assert popen.stdout is not None and popen.stderr is not None
        self._popen = popen
        self._loop = loop
        self.stdout = asyncio.StreamReader(_STREAM_LIMIT, loop=loop)
        self.stderr = asyncio.StreamReader(_STREAM_LIMIT, loop=loop)
        self._feeds = (_PipeFeed(loop, popen.stdout, self.stdout), _PipeFeed(loop, popen.stderr, self.stderr))
        self._exit: asyncio.Future[int] | None = None
        self._pidfd: int | None = None
        self._poller: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def send_signal(self, sig: int) -> None:
        if self._popen.returncode is None:
            self._popen.send_signal(sig)

    async def wait(self) -> int:
        """Wait for the child to exit and reap it; returns its exit status. Cancelling the wait leaves it be."""
        rc = self._popen.returncode
        if rc is not None:
            return rc
        if self._exit is None:
            self._exit = self._loop.create_future()
            try:
                self._pidfd = os.pidfd_open(self._popen.pid)
            except (AttributeError, OSError):  # no pidfds: look now and then
                self._poller = asyncio.ensure_future(self._poll_exit())
            else:
                self._loop.add_reader(self._pidfd, self._reap_now)
        return await asyncio.shield(self._exit)

    def _reap_now(self) -> None:
        if self._popen.poll() is None:
            return  # woken early: keep watching
        self._stop_watching()
        forget(self._popen)
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(self._popen.returncode if self._popen.returncode is not None else -9)

    async def _poll_exit(self) -> None:
        while self._popen.returncode is None:
            await asyncio.sleep(0.05)
            self._reap_now()

    def _stop_watching(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        if self._poller is not None:
            if self._poller is not asyncio.current_task(self._loop):
                self._poller.cancel()
            self._poller = None

    def end_stdout(self) -> None:
        """Stop reading stdout and end its reader's data now (the stall watchdog gave up on the child)."""
        self._feeds[0].close()

    def release(self) -> None:
        """Close the pipes and stop watching the exit. Idempotent.

        Normally called once the child is reaped. If reaping was abandoned (cancelled twice while the loop shuts
        down), the child's group is killed and a runner thread reaps it, so no zombie is left behind.
        """
        for feed in self._feeds:
            feed.close()
        if self._popen.returncode is None:
            terminate_and_reap(self._popen, 0.0)  # SIGKILL to the group; reaped now or by a daemon thread
        if self._popen.returncode is not None:
            self._stop_watching()


def _throw_away(result: subprocess.Popen[bytes] | BaseException) -> None:
    """A child nobody will read any more: kill its group now and reap it in the background."""
    if isinstance(result, subprocess.Popen):
        terminate_and_reap(result, 0.0)


async def _reap_when_started(started: asyncio.Future[subprocess.Popen[bytes]], loop: asyncio.AbstractEventLoop) -> None:
    """The caller was cancelled during a fork: wait for the child and reap it (see :func:`start_loop_child`)."""
    try:
        popen = await asyncio.shield(started)
    except asyncio.CancelledError:
        if not started.cancel() and started.exception() is None:  # it came just now: settle() has passed
            _throw_away(started.result())
        raise
    except Exception:
        return  # it never started
    child = _ForkedChild(popen, loop)
    _LIVE.add(child)
    try:
        await _reap(child)
    finally:
        child.release()


async def start_loop_child(argv: Sequence[str]) -> _Proc:
    """Start a loop-mode child that dies with this process (Linux), without blocking the event loop.

    The runner's spawner thread forks it through the parent-death trampoline and reads the exec report; this
    coroutine only awaits the outcome. The kernel sends the parent-death signal when the *forking thread* ends,
    and the spawner thread lasts as long as the process, so an event loop in a worker thread that ends does not
    kill the children of another loop's streams. Where there is no trampoline (not Linux, a frozen
    interpreter), the child starts as a one-shot one does, without the signal.

    Cancelled while the child is being forked, it waits for the fork (bounded by the trampoline's start-up),
    then reaps the child before passing the cancellation on; cancelled again meanwhile, the child is killed and
    reaped in the background as soon as it exists.
    """
    if not can_trampoline():
        return await _spawn(argv)
    loop = asyncio.get_running_loop()
    started: asyncio.Future[subprocess.Popen[bytes]] = loop.create_future()

    def settle(result: subprocess.Popen[bytes] | BaseException) -> None:  # on the loop
        if started.cancelled():
            _throw_away(result)
        elif isinstance(result, BaseException):
            started.set_exception(result)
        else:
            started.set_result(result)

    def done(result: subprocess.Popen[bytes] | BaseException) -> None:  # on the spawner thread
        loop.call_soon_threadsafe(settle, result)  # a closed loop raises: the spawner then kills the child

    submit_loop_child(argv, None, done)
    try:
        popen = await asyncio.shield(started)
    except asyncio.CancelledError:
        await _reap_when_started(started, loop)
        raise
    child = _ForkedChild(popen, loop)
    _LIVE.add(child)
    return child


def _signal(proc: _Proc, sig: int) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name != "nt":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


async def _terminate(proc: _Proc, grace: float) -> None:
    try:
        if proc.returncode is None:
            _signal(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except asyncio.TimeoutError:
                _signal(proc, getattr(signal, "SIGKILL", signal.SIGTERM))
                await proc.wait()
    except asyncio.CancelledError:
        # cancelled while reaping (the loop is shutting down): make sure it dies; the child watcher reaps it
        _signal(proc, getattr(signal, "SIGKILL", signal.SIGTERM))
        raise
    finally:
        if proc.returncode is not None:
            _LIVE.discard(proc)


async def _reap(proc: _Proc, grace: float = TERM_GRACE) -> None:
    """Terminate, kill if needed, and reap ``proc``, even when the caller is being cancelled."""
    if proc.returncode is not None:
        _LIVE.discard(proc)
        return
    _signal(proc, signal.SIGTERM)  # at once, before any await: the child stops even if we are cancelled again
    task = asyncio.ensure_future(_terminate(proc, grace))
    await asyncio.shield(task)


async def run(argv: Sequence[str], timeout: float) -> Completed:
    """Run a one-shot child to completion within ``timeout`` seconds, without blocking the event loop.

    Raises:
        NvidiaSmiNotFoundError: the binary does not exist or cannot be executed.
        NvidiaSmiTimeoutError: it did not finish in time (it was killed and reaped).
    """
    proc = await _spawn(argv)
    try:
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            raise no_answer(argv, timeout) from None
    finally:
        await _reap(proc)
    rc = proc.returncode if proc.returncode is not None else -9
    return Completed(tuple(argv), rc, decode(out), decode(err), 0.0)


class AsyncLines:
    """One running loop-mode child's lines, read on the event loop until a deadline; its exit judged at the end.

    The asyncio counterpart of :class:`~smiquery.runner.lines.LineStream`; stderr is drained meanwhile.
    """

    def __init__(self, proc: _Proc, argv: Sequence[str]) -> None:
        self.proc = proc
        self.argv = tuple(argv)
        self.messages: deque[str] = deque(maxlen=20)  # the last lines, for error messages (rows are skipped there)
        self.idle = 0.0  # seconds the last readlines() waited
        self.timed_out = False
        self._lines: list[str] = []
        self._partial: list[bytes] = []
        self._partial_len = 0
        self._skipping = False
        self._eof = False
        self._err = bytearray()
        self._drain = asyncio.ensure_future(self._drain_stderr())
        self._loop = asyncio.get_running_loop()
        # One watchdog per child instead of a timer per read: it only acts while a read is waiting, and at the
        # deadline kills the child and ends its output, so the waiting read returns at once.
        self._deadline = 0.0
        self._wake = 0.0  # when the watchdog looks next
        self._waiting = False
        self._watchdog: asyncio.Future[None] | None = None

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while True:
            data = await self.proc.stderr.read(65536)
            if not data:
                return
            if len(self._err) < MAX_ERR_BYTES:
                self._err += data

    async def readlines(self, deadline: float) -> list[str] | None:
        """Every complete line available now (at least one), without newlines; None at the end of the output.

        Output is read in chunks (a sweep usually arrives in one read), as the sync runner does. ``deadline``
        (monotonic, the loop's clock) bounds the wait: past it the child is killed, :attr:`timed_out` is set and
        None is returned. A deadline that passed while this process was paused still sees what the child
        printed meanwhile first.
        """
        lines = self._lines
        loop = self._loop
        self._deadline = deadline
        if deadline < self._wake and self._watchdog is not None:
            # the deadline came closer (the first row turned the start-up deadline into the stall deadline): a
            # watchdog asleep until the old one would see a hang only then
            self._watchdog.cancel()
            self._watchdog = None
        waited = 0.0
        while not lines:
            if self._eof:
                return None
            stdout = self.proc.stdout
            assert stdout is not None
            if loop.time() >= deadline:
                await asyncio.sleep(0)  # the pipe's pending readiness is handled before anyone calls this hung
                await asyncio.sleep(0)
                if not self._buffered():
                    self._expire()
            if self._watchdog is None:
                self._watchdog = asyncio.ensure_future(self._watch())
            t0 = loop.time()
            self._waiting = True
            try:
                data = await stdout.read(65536)
            finally:
                self._waiting = False
                waited += loop.time() - t0
            if not data:
                self._eof = True
                tail = b"".join(self._partial)
                self._partial = []
                if tail.strip() and not self._skipping and not self.timed_out:
                    last = tail.decode("utf-8", "replace")  # a trailing partial line, as it is (the parser rejects it)
                    lines.append(last)
                    self.messages.append(last)
                continue
            self._take(data)
        self.idle = waited
        self._lines = []
        return lines

    def _take(self, data: bytes) -> None:
        cut = data.rfind(b"\n")
        if cut < 0:
            if not self._skipping:
                self._partial.append(data)
                self._partial_len += len(data)
                if self._partial_len > MAX_LINE_BYTES:  # no newline in sight: keep a head for the parser to reject
                    self._add(b"".join(self._partial)[:256])
                    self._partial = []
                    self._partial_len = 0
                    self._skipping = True
            return
        head = data[:cut]
        if self._partial or self._skipping:
            nl = head.find(b"\n")
            first, rest = (head, b"") if nl < 0 else (head[:nl], head[nl + 1 :])
            if not self._skipping:
                self._add(b"".join(self._partial) + first)
            self._partial = []
            self._partial_len = 0
            self._skipping = False
            head = rest if nl >= 0 else b""
        if head:
            self._add(head)
        tail = data[cut + 1 :]
        if tail:
            self._partial.append(tail)
            self._partial_len = len(tail)

    def _add(self, chunk: bytes) -> None:
        # one decode per read, not per line (the parser strips the \r of Windows line ends)
        new = chunk.decode("utf-8", "replace").split("\n")
        self._lines.extend(new)
        self.messages.extend(new)

    async def _watch(self) -> None:
        loop = self._loop
        while True:
            left = self._deadline - loop.time()
            if left > 0 or not self._waiting:
                self._wake = loop.time() + max(left, 0.05)
                await asyncio.sleep(max(left, 0.05))
                continue
            # After a pause (SIGSTOP) the timer and the pipe's data are due together: let the loop look at the
            # pipe and feed the reader before calling the child hung.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if self._waiting and self._deadline <= loop.time() and not self._buffered():
                self._expire()
                return

    def _buffered(self) -> bool:
        """True when the reader holds data not read yet (asyncio's StreamReader offers no public way to ask)."""
        return bool(getattr(self.proc.stdout, "_buffer", b""))

    def _expire(self) -> None:
        """Past the deadline with nothing to read: kill the child and end its output."""
        self.timed_out = True
        _signal(self.proc, getattr(signal, "SIGKILL", signal.SIGTERM))
        if isinstance(self.proc, _ForkedChild):
            self.proc.end_stdout()  # wakes the waiting read with b"" (and nothing is fed after)
        elif self.proc.stdout is not None:
            self.proc.stdout.feed_eof()  # wakes the waiting read with b""

    async def finish(self, timeout: float) -> int:
        """After the end of output: reap, and raise the typed error of a non-zero exit."""
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            await self.close()
            rc = self.proc.returncode if self.proc.returncode is not None else -9
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._drain), 1.0)
        if rc != 0:
            raise failure_from_exit(self.argv, rc, message_of(list(self.messages), bytes(self._err), rc))
        return rc

    async def close(self) -> None:
        """Terminate, kill if needed and reap; stop draining stderr."""
        try:
            await _reap(self.proc)
        finally:
            if isinstance(self.proc, _ForkedChild):
                self.proc.release()
            self._drain.cancel()
            if self._watchdog is not None:
                self._watchdog.cancel()
