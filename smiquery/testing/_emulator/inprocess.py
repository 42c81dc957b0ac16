"""The fake on a thread: :class:`InProcessRunner`, its line source, and :func:`use_runner`."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from smiquery.errors import (
    NvidiaSmiFailedError,
    NvidiaSmiTimeoutError,
    OutputTooLargeError,
    StreamEndedError,
    failure_from_exit,
)
from smiquery.testing._emulator.engine import execute
from smiquery.testing._emulator.faults import check_settings
from smiquery.testing._emulator.output import Output, log_invocation
from smiquery.testing._emulator.settings import MemoryState, Settings

if TYPE_CHECKING:
    from smiquery.runner import Completed, Runner

_R = TypeVar("_R", bound="Runner")


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


class _ChannelOutput(Output):
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

    def begin(self, argv: Sequence[str], log: str | None, *, grandchild: bool, ignore_term: bool) -> None:
        # `grandchild` needs a process: in-process it does nothing
        with self.channel.cond:
            self.channel.ignore_term = ignore_term
        if log:
            log_invocation(log, argv)


def _engine_thread(argv: Sequence[str], settings: Settings, env: Mapping[str, str], channel: _Channel) -> None:
    out = _ChannelOutput(channel)
    try:
        code = execute(argv, settings, env, out)
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
    Output waits for the reader past 1 MiB unread, as a pipe does; :meth:`run` reads at most the real runner's cap
    (:data:`smiquery.runner.MAX_OUTPUT_BYTES`) and then fails as it does (``OutputTooLargeError``).

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
        self._serial = 0
        self._lock = threading.Lock()

    def _start(self, argv: Sequence[str]) -> _Channel:
        settings = Settings(
            recording=None if self.recording is None else os.fspath(self.recording),
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
        from smiquery.runner import MAX_OUTPUT_BYTES, Completed

        start = time.monotonic()
        deadline = start + max(timeout, 0.0)
        channel = self._start(argv)
        out = bytearray()
        with channel.cond:
            while not channel.done:
                if channel.out:  # read as it comes, as the pipe is read
                    out += channel.out
                    channel.out.clear()
                    channel.cond.notify_all()
                    if len(out) > MAX_OUTPUT_BYTES:  # the real runner's cap, with its error
                        break
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                channel.cond.wait(left)
            finished = channel.done
        if len(out) > MAX_OUTPUT_BYTES:
            _stop_channel(channel)
            raise OutputTooLargeError(argv, MAX_OUTPUT_BYTES)
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

    For tests of code that builds its own runner: the CLI, the exporter, ``GpuMonitor`` and the Keras and Lightning
    callbacks. With an :class:`InProcessRunner`, no binary is looked up (``--nvidia-smi`` may name any path, or none)
    and no process is started. On exit the previous default comes back (blocks nest); the runner is not closed. Code
    that passes its own ``runner=`` keeps it. :mod:`smiquery.aio` starts its children with asyncio, not through a
    runner, and is not covered. Nothing else (no environment variable, no setting) changes the default, so production
    code always runs the real nvidia-smi.

    Example::

        from smiquery import errors, query
        from smiquery.testing import InProcessRunner, use_runner

        def test_query_without_a_driver():
            with use_runner(InProcessRunner(fault="driver-not-loaded")), pytest.raises(errors.DriverNotLoadedError):
                query()  # no runner= given: the one of the block

    Args:
        runner: the runner to use (any :class:`~smiquery.runner.Runner`).

    Yields:
        ``runner``.
    """
    from smiquery.runner import install_default

    previous = install_default(runner)
    try:
        yield runner
    finally:
        install_default(previous)
