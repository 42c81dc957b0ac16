"""A loop child's output lines: :class:`LineStream`, and :class:`LineSplitter` (shared with :mod:`.aio`)."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence

from smiquery.errors import StreamEndedError, failure_from_exit
from smiquery.runner.children import (
    MAX_ERR_BYTES,
    PIPE_GRACE,
    PidWatch,
    exited,
    popen,
    signal_group,
    spawn_loop_child,
    terminate_and_reap,
    wait_exit,
)

__all__ = ["MAX_LINE_BYTES", "LineSplitter", "LineStream", "decode", "message_of"]

#: A line longer than this is cut to its first 256 bytes (the parser rejects it) and the rest is skipped until its
#: end, so that endless output without a newline keeps memory flat.
MAX_LINE_BYTES = 64 * 1024


def decode(data: bytes) -> str:
    """Bytes a child printed, as text (undecodable bytes replaced)."""
    return data.decode("utf-8", "replace")


def message_of(lines: Sequence[str], err: bytes, rc: int) -> str:
    """What a failed child said: its message lines and stderr, or the signal that killed it."""
    output = "\n".join(lines) + ("\n" + decode(err) if err else "")
    if rc in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT) and not output.strip():
        output = f"killed by signal {-rc}"
    return output


class LineSplitter:
    """Cuts a child's stdout into lines: blank lines skipped, a CR stripped, over-long lines cut.

    :attr:`lines` holds the complete lines not taken yet; :attr:`messages` the last 20 lines that are no CSV row,
    for error messages.
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

    def _add(self, raw: bytes) -> None:
        line = decode(raw).rstrip("\r")
        if line.strip():
            self.lines.append(line)
            if ", " not in line:
                self.messages.append(line)


class LineStream:
    """The output lines of one long-running nvidia-smi child (``-l``/``-lms`` loop mode): a ``LineSource``.

    It never kills the child for being slow. When the output ends, or the leader exits (helpers holding the
    pipes are killed after ``PIPE_GRACE``), the child is reaped and, after the last line, exit 0 raises
    :class:`~smiquery.errors.StreamEndedError`, another the typed :class:`~smiquery.errors.NvidiaSmiFailedError`.
    A context manager; it also closes itself when garbage-collected. ``pdeathsig``: on Linux the child dies with
    this process.
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, pdeathsig: bool = True) -> None:
        self.argv = tuple(argv)
        self._proc = spawn_loop_child(self.argv, env) if pdeathsig else popen(self.argv, env, pdeathsig=False)
        self._finalizer = weakref.finalize(self, terminate_and_reap, self._proc)
        self.pid = self._proc.pid
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
        self._pidwatch = PidWatch(self._proc.pid)
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
    def returncode(self) -> int | None:
        """The child's exit status, once reaped."""
        return self._proc.returncode

    @property
    def stderr(self) -> str:
        """What the child has written to stderr so far (at most 64 KiB)."""
        return decode(bytes(self._err))

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
            elif self._pidwatch.fd is None:
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
            if not events and self._pidwatch.fd is None and self._exit_seen is None and exited(self._proc):
                self._exit_seen = time.monotonic()
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 512):
                            pass
                    self.idle = waited
                    if not lines:
                        return None
                elif key.fileobj == self._pidwatch.fd:
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
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if self._proc.stdout is not None and fd == self._proc.stdout.fileno():
            self._split.feed(data)
        elif len(self._err) < MAX_ERR_BYTES:
            self._err += data
        return data

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
        output = message_of(list(self._split.messages), bytes(self._err), rc)
        if rc != 0 and not stopping:
            self._ended = failure_from_exit(self.argv, rc, output)
        else:
            self._ended = StreamEndedError(self.argv, rc, output)
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
