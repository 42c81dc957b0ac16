"""The fake on a thread: :class:`InProcessRunner`, its line source, and :func:`use_runner`."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from smiquery.errors import NvidiaSmiFailedError, OutputTooLargeError, StreamEndedError, failure_from_exit
from smiquery.testing._emulator.core import MemoryState, Output, Settings, log_invocation
from smiquery.testing._emulator.engine import execute
from smiquery.testing._emulator.faults import check_settings

if TYPE_CHECKING:
    from smiquery.runner import Completed, Runner

_R = TypeVar("_R", bound="Runner")

_PIPE_BUFFER = 1 << 20  # unread output at which the in-process engine's flush waits, as a writer on a full pipe


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class _Stopped(BaseException):
    """Unwinds the engine thread when its source is terminated or killed (what the signal does to a process)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Channel(Output):
    """One in-process run: the engine's output (buffered like stdio, visible at flush), its pipes and signals."""

    def __init__(self) -> None:  # no stream: raw() and flush() below replace it
        self.cond = threading.Condition()
        self.pending = bytearray()  # written by the engine, not flushed yet
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
            if self.done or self.stop_signal == signal.SIGKILL or (signum == signal.SIGTERM and self.ignore_term):
                return
            self.stop_signal = signum
            self.cond.notify_all()

    def join(self, timeout: float) -> bool:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stop(self) -> None:
        self.signal(signal.SIGKILL)
        self.join(2.0)

    # -- the engine's side: the Output it writes to
    def _check(self) -> None:
        if self.stop_signal is not None:
            raise _Stopped(self.stop_signal)

    def raw(self, data: bytes) -> None:
        self._check()
        self.pending += data

    def flush(self) -> None:
        self._check()
        if self.pending:
            with self.cond:
                # a full pipe blocks the writer until the reader takes some (a flood must not fill the memory)
                self.cond.wait_for(lambda: len(self.out) < _PIPE_BUFFER or self.stop_signal is not None)
                self._check()
                self.out += self.pending
                self.cond.notify_all()
            self.pending.clear()

    def sleep(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stop_signal is not None, seconds)
        self._check()

    def error(self, text: str) -> None:
        with self.cond:
            self.err += (text + "\n").encode("utf-8")
            self.cond.notify_all()

    def begin(self, argv: Sequence[str], log: str | None, *, grandchild: bool, ignore_term: bool) -> None:
        # `grandchild` needs a process: in-process it does nothing
        with self.cond:
            self.ignore_term = ignore_term
        if log:
            log_invocation(log, argv)


def _engine_thread(argv: Sequence[str], settings: Settings, env: Mapping[str, str], channel: _Channel) -> None:
    try:
        code = execute(argv, settings, env, channel)
    except _Stopped as stop:
        code = -stop.signum  # what the signal leaves; output not yet flushed is lost, as in a killed process
    except Exception as exc:  # a bug in the fake: reported like a crashed interpreter, never swallowed
        channel.error(f"smiquery-fake-nvidia-smi: internal error: {exc!r}")
        code = 1
    with channel.cond:
        channel.returncode = code
        channel.cond.notify_all()


class InProcessLines:
    """The output of one in-process fake run, line by line: a ``LineSource`` without a process.

    Returned by :meth:`InProcessRunner.lines`; it ends and fails like the real line reader
    (:class:`~smiquery.runner.LineStream`). Loop intervals, start delays and hangs wait on the stop signal,
    so :meth:`terminate` (unless the fault is ``ignore-term``), :meth:`kill` and :meth:`close` end the engine
    thread at once. ``argv`` is the command as given; ``pid`` is always None; ``idle`` the seconds the last
    :meth:`readline` waited; ``closed`` is True once the end was read, or after :meth:`close`.
    """

    pid: int | None = None

    def __init__(self, argv: Sequence[str], channel: _Channel) -> None:
        self.argv = tuple(argv)
        self._ch = channel
        self._buf = b""
        self._lines: deque[str] = deque()
        self._messages: deque[str] = deque(maxlen=20)  # recent non-CSV lines, for error messages
        self._ended: NvidiaSmiFailedError | None = None
        self._stopping = False
        self._interrupted = False
        self.closed = False
        self.idle = 0.0
        self._finalizer = weakref.finalize(self, channel.stop)

    @property
    def returncode(self) -> int | None:
        """The exit status once the engine has finished (negative: the signal that stopped it)."""
        return self._ch.returncode

    @property
    def stderr(self) -> str:
        """What the fake wrote to stderr so far."""
        return _decode(bytes(self._ch.err))

    def readline(self, timeout: float) -> str | None:
        """The next complete line; None if none came within ``timeout`` s or on :meth:`interrupt`.

        Raises:
            StreamEndedError: the output ended with exit 0, or after a stop was asked for.
            NvidiaSmiFailedError: the output ended with a non-zero exit (its typed subclass).
        """
        ch = self._ch
        deadline = time.monotonic() + max(timeout, 0.0)
        waited = 0.0
        with ch.cond:
            self._take()
            if not self._lines and self._ended is not None:
                raise self._ended
            if not self._lines and self.closed:
                raise StreamEndedError(self.argv, 0, "", "the nvidia-smi stream was closed")
            while not self._lines and not self._interrupted:
                if ch.done:
                    self._finish()
                    if not self._lines:
                        assert self._ended is not None
                        raise self._ended
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                t0 = time.monotonic()
                ch.cond.wait(remaining)
                waited += time.monotonic() - t0
                self._take()
            self.idle = waited
            if self._lines:
                return self._lines.popleft()
            self._interrupted = False
            return None

    def _take(self) -> None:
        if self._ch.out:
            *complete, self._buf = (self._buf + bytes(self._ch.out)).split(b"\n")
            self._ch.out.clear()
            self._ch.cond.notify_all()  # room in the pipe again
            for raw in complete:
                self._add(raw)

    def _add(self, raw: bytes) -> None:
        line = _decode(raw).rstrip("\r")
        if line.strip():
            self._lines.append(line)
            if ", " not in line:
                self._messages.append(line)

    def _finish(self) -> None:
        from smiquery.runner import message_of

        tail, self._buf = self._buf, b""
        self._add(tail)
        rc = self._ch.returncode
        assert rc is not None
        output = message_of(list(self._messages), bytes(self._ch.err), rc)
        ended = failure_from_exit if rc != 0 and not self._stopping else StreamEndedError
        self._ended = ended(self.argv, rc, output)
        self.closed = True
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
            self.closed = True
            self._ch.cond.notify_all()
        self._finalizer.detach()

    def __enter__(self) -> InProcessLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessRunner:
    """A runner that serves the fake ``nvidia-smi`` inside this process: the same engine, faults and recordings.

    ``run()`` and ``lines()`` execute what the executable written by :func:`fake_nvidia_smi` executes, on a worker
    thread instead of a child process, with the same output and exit statuses; hangs, start delays and loop
    intervals are real waits that ``terminate``, ``kill`` and ``close`` cut short. Keep the executable for tests of
    pipes, signals and reaping. ``argv[0]`` is ignored and no binary is looked up; ``grandchild`` does nothing
    here. For code that takes no ``runner=``, see :func:`use_runner`.

    ``recording``, ``fault``, ``start_delay``, ``apps`` and ``log`` mean what they mean to :func:`fake_nvidia_smi`;
    they are attributes and may change between calls (``fault = None`` simulates a fix). The process environment
    is not read: ``env`` holds ``SMIQUERY_FAKE_*`` overrides (see :data:`ENV_VARS`). :attr:`calls` holds the argv of
    every call; ``reenumerate`` reloads are counted in :attr:`reloads`, not in a state file. Output waits for the
    reader past 1 MiB unread, as a pipe does; :meth:`run` fails as the real runner does past
    :data:`smiquery.runner.MAX_OUTPUT_BYTES`.

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
        check_settings(fault, start_delay)
        self.recording = recording
        self.fault = fault
        self.start_delay = start_delay
        self.apps = apps
        self.log = log
        self.env: dict[str, str] = dict(env or {})
        self.calls: list[tuple[str, ...]] = []
        self._state = MemoryState()
        self._channels: weakref.WeakSet[_Channel] = weakref.WeakSet()
        self._serial = itertools.count(1)

    def _start(self, argv: Sequence[str]) -> _Channel:
        def path(value: str | os.PathLike[str] | None) -> str | None:
            return None if value is None else os.fspath(value)

        settings = Settings(
            recording=path(self.recording),
            fault=self.fault,
            start_delay=float(self.start_delay),
            apps=path(self.apps),
            log=path(self.log),
            state=self._state,
        )
        self.calls.append(tuple(argv))
        channel = _Channel()
        channel.thread = threading.Thread(
            target=_engine_thread,
            args=(tuple(argv[1:]), settings, dict(self.env), channel),
            name=f"smiquery-fake-{next(self._serial)}",
            daemon=True,
        )
        self._channels.add(channel)
        channel.thread.start()
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
        """Run the fake to completion within ``timeout`` seconds (``argv[0]`` is ignored).

        Raises:
            NvidiaSmiTimeoutError: it did not finish in time (its thread was stopped).
        """
        from smiquery.runner import MAX_OUTPUT_BYTES, Completed, no_answer

        start = time.monotonic()
        channel = self._start(argv)
        out = bytearray()
        with channel.cond:
            while True:
                out += channel.out  # read as it comes, as the pipe is read
                channel.out.clear()
                channel.cond.notify_all()
                left = start + max(timeout, 0.0) - time.monotonic()
                if channel.done or len(out) > MAX_OUTPUT_BYTES or left <= 0:
                    break
                channel.cond.wait(left)
        if len(out) > MAX_OUTPUT_BYTES:  # the real runner's cap, with its error
            channel.stop()
            raise OutputTooLargeError(argv, MAX_OUTPUT_BYTES)
        if not channel.done:
            channel.stop()
            raise no_answer(argv, timeout)
        channel.join(1.0)
        rc = channel.returncode
        assert rc is not None
        return Completed(tuple(argv), rc, _decode(bytes(out)), _decode(bytes(channel.err)), time.monotonic() - start)

    def lines(self, argv: Sequence[str]) -> InProcessLines:
        """Start the fake and return its output as it comes (for ``-l``/``-lms`` loops); close it when done."""
        return InProcessLines(argv, self._start(argv))

    def locate(self, nvidia_smi: str | os.PathLike[str] | None) -> str:
        """``argv[0]`` for this runner: ``nvidia_smi`` as given (it need not exist), or ``nvidia-smi``.

        :func:`smiquery.runner.find_nvidia_smi` calls it instead of searching PATH, since no binary is started.
        """
        return "nvidia-smi" if nvidia_smi is None else os.fspath(nvidia_smi)

    def running(self) -> int:
        """How many engine threads of this runner are still running (0 once every source is closed)."""
        return sum(1 for ch in list(self._channels) if ch.thread is not None and ch.thread.is_alive())

    def close(self) -> None:
        """Stop every engine thread this runner started and wait for them."""
        for channel in list(self._channels):
            channel.stop()

    def __enter__(self) -> InProcessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def use_runner(runner: _R) -> Iterator[_R]:
    """Run every nvidia-smi call that gets no ``runner=`` through ``runner``, in every thread, inside the block.

    For code that builds its own runner: the CLI, the exporter, ``GpuMonitor``, the Keras and Lightning callbacks.
    With an :class:`InProcessRunner`, no binary is looked up and no process is started. On exit the previous
    default comes back (blocks nest); the runner is not closed. Code that passes its own ``runner=`` keeps it;
    :mod:`smiquery.aio` starts its children with asyncio and is not covered. Nothing else changes the default, so
    production code always runs the real nvidia-smi.
    """
    from smiquery.runner import install_default

    previous = install_default(runner)
    try:
        yield runner
    finally:
        install_default(previous)
