"""The stream supervisor: one long-lived nvidia-smi in loop mode, watched, restarted and parsed into sweeps.

At most one child at any moment, reaped on every path (on Linux also when this process is killed); the engine
(:mod:`.engine`) says when a child is hung and how to retry. The guarantees are listed in docs/streams.md.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from datetime import tzinfo
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from smiquery._log import get_logger
from smiquery.errors import SmiqueryError, StreamEndedError
from smiquery.fields import FieldsArg
from smiquery.retry import RetryPolicy
from smiquery.runner import TERM_GRACE, LineSource, Runner, default_runner, find_nvidia_smi
from smiquery.sample import GpuSample
from smiquery.source import BaseSource, StreamEvent, StreamStats, Sweep
from smiquery.streams.argv import GpusArg
from smiquery.streams.engine import Engine
from smiquery.streams.sweeps import CsvSource

if TYPE_CHECKING:
    import os

    import pandas as pd

__all__ = ["DEFAULT_HISTORY_SWEEPS", "DEFAULT_STARTUP_TIMEOUT", "Stream", "ThreadDriver", "stream"]

#: Seconds a fresh nvidia-smi may take to print its first row (cold starts take 15-30 s on large hosts).
DEFAULT_STARTUP_TIMEOUT = 45.0

#: Sweeps a stream keeps for :meth:`Stream.history`: an hour at 1 s (about 4 MB per GPU, default fields).
DEFAULT_HISTORY_SWEEPS = 3600

Item = TypeVar("Item")
Driver = TypeVar("Driver", bound="ThreadDriver[Any]")


class ThreadDriver(BaseSource, Generic[Item]):
    """The base of the CSV and pmon streams: the engine's children one at a time, read on the consuming thread.

    ``sleep`` (None: a wait that :meth:`close` cuts short) waits between attempts; ``finite``: the child ends by
    itself when done (``pmon -c N``), so exit 0 ends the stream.
    """

    stats: StreamStats
    _engine: Engine[Item]
    # Only a weak reference: an abandoned iterator must be collectable at once (no cycle), so that dropping it
    # closes the generator and reaps the child immediately.
    _gen_ref: weakref.ref[Generator[Item, None, None]] | None = None

    def __init__(self, runner: Runner, sleep: Callable[[float], None] | None, *, finite: bool = False) -> None:
        self._runner = runner
        self._sleep = sleep
        self._finite = finite
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.child: LineSource | None = None
        self._no_child = threading.Event()
        self._no_child.set()
        self._reader: int | None = None  # the thread reading a child now

    def _items(self) -> Generator[Item, None, None]:
        """Everything the engine makes, child after child, until closed, over, spent or given up (raises)."""
        engine = self._engine
        engine.begin(time.monotonic())
        self._reader = threading.get_ident()
        try:
            while not engine.done and engine.starting(time.monotonic()):
                try:
                    got = yield from self._child()
                finally:
                    self._emit(engine.take_events())
                if got is None:
                    return
                cut, delay = got
                for item in cut:
                    if engine.closed:
                        return
                    yield item
                if delay <= 0 or engine.done:
                    continue  # a fresh streak starts at once
                if self._sleep is not None:
                    self._sleep(delay)
                else:  # cut short by a close or the end of ``duration``
                    end = engine.deadline() if engine.duration is not None else None
                    self._wake.wait(delay if end is None else min(delay, max(end - time.monotonic(), 0.0)))
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                self.stats.state = "failed"
                self.error = exc
            raise
        finally:
            self._reader = None
            engine.finish()

    def _child(self) -> Generator[Item, None, tuple[list[Item], float] | None]:
        """Start one child and read it to its end; returns what :meth:`Engine.failed` says (None: the stream ends)."""
        engine = self._engine
        clock = time.monotonic
        timed = engine.duration is not None
        try:
            child = self._runner.lines(engine.argv)
        except SmiqueryError as exc:
            return engine.failed(exc, clock(), time.time())
        with self._lock:
            self.child = child
            self._no_child.clear()
        try:
            if engine.closed:
                child.terminate()
            engine.started(clock())
            while not engine.done:
                now = clock()
                if engine.stopped(now):
                    return None
                # At the deadline this still looks at the pipe once: after a pause (SIGSTOP, a debugger) the rows
                # the child printed meanwhile are read before anyone calls it hung.
                line = child.readline(max(engine.deadline() - now, 0.0))
                if line is None:
                    now = clock()
                    if now >= engine.deadline():
                        hung = engine.expired(now)
                        if hung is None:
                            return None
                        raise hung
                    continue
                items = engine.feed((line,), clock(), child.idle)
                self._emit(engine.take_events())
                for item in items:
                    if engine.stopped(clock() if timed else 0.0):
                        return None  # nothing is delivered after close()
                    yield item
        except SmiqueryError as exc:
            if isinstance(exc, StreamEndedError) and self._finite and exc.returncode == 0 and not engine.closed:
                return None  # a finite child finished its count
            return engine.failed(exc, clock(), time.time())
        finally:
            with self._lock:
                self.child = None
            child.close()
            self._no_child.set()
        return None

    @property
    def child_pid(self) -> int | None:
        """The pid of the nvidia-smi child running now, if any."""
        child = self.child
        return child.pid if child is not None else None

    def close(self, timeout: float = 5.0) -> None:
        """Stop within ``timeout`` seconds: nothing is delivered after it, the child is reaped. Any thread.

        From the stream's own thread (a callback) it returns at once; the child is reaped when the callback returns.
        """
        end = time.monotonic() + max(timeout, 0.0)
        if self.stats.state not in ("failed", "ended"):
            self.stats.state = "closed"
        self._engine.close()
        self._wake.set()
        with self._lock:
            child = self.child
        if child is not None:
            child.interrupt()
            child.terminate()
        if self._reader == threading.get_ident():
            return  # inside the reading thread (a callback): it stops at its next step and reaps the child
        thread = self._thread
        if thread is not None:
            thread.join(min(TERM_GRACE, max(end - time.monotonic(), 0)))
            if thread.is_alive() and child is not None:
                child.kill()
            thread.join(max(end - time.monotonic(), 0))
            return
        generator = self._gen_ref() if self._gen_ref is not None else None
        if generator is not None:
            try:
                generator.close()
                return
            except ValueError:
                pass  # running in another thread: it sees the close at its next step and reaps its child
        if child is not None and not self._no_child.wait(min(TERM_GRACE, max(end - time.monotonic(), 0))):
            child.kill()
            self._no_child.wait(max(end - time.monotonic(), 0))

    def __enter__(self: Driver) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream(CsvSource, ThreadDriver[GpuSample | Sweep]):
    """One long-lived nvidia-smi in loop mode (``-l`` for whole seconds, ``-lms`` below): a live ``SampleSource``.

    Example::

        with smiquery.stream("health", interval=0.5) as s:
            for sweep in s.sweeps(count=10):
                print(max(x.temperature_gpu or 0 for x in sweep))

    Iterate it for samples, or :meth:`sweeps` for whole instants; or :meth:`start` it in a background thread and
    read :meth:`latest` or :meth:`history` from any thread. Use it as a context manager (or :meth:`close` it).
    :attr:`stats` shows counters and the retry state; :meth:`subscribe` (or ``on_event``) hears every event.
    Nothing runs until it is iterated or started. ``smiquery.stream`` is this class.

    Args:
        fields: a preset, ``"a,b,c"`` or a sequence of names (``index`` is added when absent).
        interval: seconds between samples.
        gpus: indices, UUIDs or PCI bus ids; None for all.
        nvidia_smi: path of the binary.
        max_samples: stop after this many samples (rows).
        duration: stop after this many seconds (a deadline, whatever nvidia-smi does).
        startup_timeout: seconds a freshly started nvidia-smi may take to print its first row.
        stall_timeout: seconds without a data row, once rows flow, before the child counts as hung (default
            ``max(3 * interval, 10)``).
        retry: how to wait between starts and when to give up (default ``RetryPolicy()``: never give up;
            ``RetryPolicy(fail_fast=True)`` for interactive use).
        on_event: called with each :class:`~smiquery.source.StreamEvent` (see also :meth:`subscribe`).
        runner: how to run nvidia-smi (tests inject one).
        sleep: how to wait between attempts (tests inject one; default: a wait that ``close()`` cuts short).
        tz: time zone of the timestamps.
        history_sweeps: how many of the newest sweeps :meth:`history` keeps (0: none).

    Raises InvalidFieldError, InvalidGpuIdError or NvidiaSmiNotFoundError (no usable binary) before anything runs,
    and ValueError for a non-positive interval or timeout or a negative ``history_sweeps``.
    """

    def __init__(
        self,
        fields: FieldsArg = "default",
        *,
        interval: float = 1.0,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        max_samples: int | None = None,
        duration: float | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stall_timeout: float | None = None,
        retry: RetryPolicy | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        runner: Runner | None = None,
        sleep: Callable[[float], None] | None = None,
        tz: tzinfo | None = None,
        history_sweeps: int = DEFAULT_HISTORY_SWEEPS,
    ) -> None:
        if history_sweeps < 0:
            raise ValueError("history_sweeps must be 0 or more")
        runner = runner or default_runner()
        super().__init__(
            fields,
            interval=interval,
            gpus=gpus,
            binary=find_nvidia_smi(nvidia_smi, runner=runner),
            startup_timeout=startup_timeout,
            stall_timeout=stall_timeout,
            retry=retry,
            on_event=on_event,
            tz=tz,
            duration=duration,
            max_rows=max_samples,
        )
        ThreadDriver.__init__(self, runner, sleep)
        self._history: deque[Sweep] = deque(maxlen=history_sweeps)
        self._history_lock = threading.Lock()
        self._tz = tz

    def _items(self) -> Generator[GpuSample | Sweep, None, None]:
        for item in super()._items():
            if isinstance(item, Sweep):
                with self._history_lock:
                    self._history.append(item)
            yield item

    def _generator(self) -> Generator[GpuSample | Sweep, None, None]:
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("this stream runs in the background; read it with latest()")
        current = self._gen_ref() if self._gen_ref is not None else None
        if current is not None and inspect.getgeneratorstate(current) != inspect.GEN_CLOSED:
            return current
        if self._engine.closed:
            raise RuntimeError("this stream is closed")
        gen = self._items()
        self._gen_ref = weakref.ref(gen)
        return gen

    def __iter__(self) -> Iterator[GpuSample]:
        return (item for item in self._generator() if isinstance(item, GpuSample))

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield sweeps (at most ``count``), one instant each (see :class:`~smiquery.source.SweepGrouper`).

        A short one is flagged.
        """
        return islice((item for item in self._generator() if isinstance(item, Sweep)), count)

    def start(self) -> Stream:
        """Consume the stream in a background thread, so that :meth:`latest` stays fresh. Returns self."""
        if self._thread is not None:
            return self
        if self._gen_ref is not None and self._gen_ref() is not None:
            raise RuntimeError("this stream is already being iterated")
        ready = threading.Event()

        def run() -> None:
            try:
                gen = self._generator()
                ready.set()
                for _ in gen:
                    pass
            except BaseException as exc:  # kept for the owner; a background thread must not die silently
                self.error = exc
                if not self._engine.closed:
                    get_logger("smiquery").error("smiquery stream stopped: %s", exc)
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="smiquery-stream", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def history(self, n: int | None = None) -> pd.DataFrame:
        """The newest ``n`` (None: all kept) of the last ``history_sweeps`` sweeps read, as a DataFrame.

        One row per sample, oldest first, as :func:`smiquery.query_df` gives them (no rows before the first
        sweep). Any thread, without blocking the stream. Raises ValueError for a negative ``n``.
        """
        from smiquery.frames import empty_array, local_zone, make_frame, to_dataframe

        if n is not None and n < 0:
            raise ValueError("n must be 0 or more")
        with self._history_lock:
            kept = list(self._history)
        sweeps = kept[len(kept) - n :] if n is not None and n < len(kept) else kept
        samples = [sample for sweep in sweeps for sample in sweep]
        if samples:
            return to_dataframe(samples)
        return make_frame(self.fields, [empty_array(f, self._tz or local_zone()) for f in self.fields], {}, None)

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None and not engine.closed:
            with contextlib.suppress(Exception):
                self.close(timeout=1.0)


#: ``smiquery.stream(...)`` is ``Stream(...)``.
stream = Stream
