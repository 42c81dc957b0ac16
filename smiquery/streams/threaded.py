"""The thread driver of the engine (the CSV and pmon streams'): reads lines with deadlines, sleeps between starts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Generic, TypeVar

from smiquery.errors import SmiqueryError, StreamEndedError
from smiquery.runner import TERM_GRACE, LineSource, Runner
from smiquery.source import StreamEvent
from smiquery.streams.engine import Engine

__all__ = ["ThreadDriver"]

Item = TypeVar("Item")


class ThreadDriver(Generic[Item]):
    """Runs an engine's children one at a time on the calling thread.

    ``emit`` hands the engine's events to the listeners; ``sleep`` (None: a wait that :meth:`close` cuts short)
    waits between attempts; ``finite``: the child ends by itself when done (``pmon -c N``), so exit 0 ends the stream.
    """

    def __init__(
        self,
        engine: Engine[Item],
        runner: Runner,
        emit: Callable[[StreamEvent], None],
        *,
        sleep: Callable[[float], None] | None = None,
        finite: bool = False,
    ) -> None:
        self.engine = engine
        self._runner = runner
        self._emit = emit
        self._sleep = sleep
        self._finite = finite
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.child: LineSource | None = None
        self._no_child = threading.Event()
        self._no_child.set()
        self._reader: int | None = None  # the thread reading a child now

    def _tell(self) -> None:
        for event in self.engine.take_events():
            self._emit(event)

    def _pause(self, seconds: float) -> bool:
        """Wait between attempts, cut short by a close or the end of ``duration``; False when the stream stops."""
        engine = self.engine
        if seconds <= 0:
            pass  # a fresh streak starts at once
        elif self._sleep is not None:
            self._sleep(seconds)
        else:
            limit = seconds
            if engine.duration is not None:
                limit = min(seconds, max(engine.deadline() - time.monotonic(), 0.0))
            self._wake.wait(limit)
        return not engine.stopped(time.monotonic())

    def items(self) -> Generator[Item, None, None]:
        """Everything the engine makes, child after child, until closed, over, spent or given up (raises)."""
        engine = self.engine
        engine.begin(time.monotonic())
        self._reader = threading.get_ident()
        try:
            while not engine.done and engine.starting(time.monotonic()):
                try:
                    got = yield from self._child()
                finally:
                    self._tell()
                if got is None:
                    return
                cut, delay = got
                for item in cut:
                    if engine.closed:
                        return
                    yield item
                if not engine.done and not self._pause(delay):
                    return
        finally:
            self._reader = None
            engine.finish()

    def _child(self) -> Generator[Item, None, tuple[list[Item], float] | None]:
        """Start one child and read it to its end; returns what :meth:`Engine.failed` says (nothing: no failure)."""
        engine = self.engine
        try:
            child = self._runner.lines(engine.argv)
        except SmiqueryError as exc:
            return engine.failed(exc, time.monotonic(), time.time())
        with self._lock:
            self.child = child
            self._no_child.clear()
        try:
            if engine.closed:
                child.terminate()
            engine.started(time.monotonic())
            yield from self._read(child)
        except StreamEndedError as exc:
            if self._finite and exc.returncode == 0 and not engine.closed:
                return None  # a finite child finished its count
            return engine.failed(exc, time.monotonic(), time.time())
        except SmiqueryError as exc:
            return engine.failed(exc, time.monotonic(), time.time())
        finally:
            with self._lock:
                self.child = None
            child.close()
            self._no_child.set()
        return [], 0.0

    def _read(self, child: LineSource) -> Generator[Item, None, None]:
        """Read one child until it fails (raises), the stream stops or the budget is spent (returns)."""
        engine = self.engine
        clock = time.monotonic
        timed = engine.duration is not None
        while True:
            now = clock()
            if engine.stopped(now):
                return
            # At the deadline this still looks at the pipe once: after a pause (SIGSTOP, a debugger) the rows
            # the child printed meanwhile are read before anyone calls it hung.
            line = child.readline(max(engine.deadline() - now, 0.0))
            if line is None:
                now = clock()
                if now >= engine.deadline():
                    hung = engine.expired(now)
                    if hung is None:
                        return
                    raise hung
                continue
            items = engine.feed((line,), clock(), child.idle)
            self._tell()
            for item in items:
                if engine.stopped(clock() if timed else 0.0):
                    return  # nothing is delivered after close()
                yield item
            if engine.done:
                return

    @property
    def child_pid(self) -> int | None:
        """The pid of the child running now, if any."""
        child = self.child
        return child.pid if child is not None else None

    def close(
        self,
        timeout: float,
        thread: threading.Thread | None,
        generator: Generator[Item, None, None] | None,
    ) -> None:
        """Stop within ``timeout`` s (see ``Stream.close``): join the consuming ``thread``, close the ``generator``."""
        end = time.monotonic() + max(timeout, 0.0)
        self.engine.close()
        self._wake.set()
        with self._lock:
            child = self.child
        if child is not None:
            child.interrupt()
            child.terminate()
        if self._reader == threading.get_ident():
            return  # inside the reading thread (a callback): it stops at its next step and reaps the child
        if thread is not None:
            thread.join(min(TERM_GRACE, max(end - time.monotonic(), 0)))
            if thread.is_alive() and child is not None:
                child.kill()
            thread.join(max(end - time.monotonic(), 0))
            return
        if generator is not None:
            try:
                generator.close()
                return
            except ValueError:
                pass  # running in another thread: it sees the close at its next step and reaps its child
        if child is not None and not self._no_child.wait(min(TERM_GRACE, max(end - time.monotonic(), 0))):
            child.kill()
            self._no_child.wait(max(end - time.monotonic(), 0))
