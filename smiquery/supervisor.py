"""The stream supervisor: one long-lived nvidia-smi in loop mode, watched, restarted and parsed into sweeps."""

from __future__ import annotations

import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from datetime import tzinfo
from typing import TYPE_CHECKING, Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from smiquery.errors import NvidiaSmiFailedError, SmiqueryError
from smiquery.fields import resolve_fields
from smiquery.oneshot import FieldsArg, GpusArg, build_argv, normalize_gpus
from smiquery.parsing import CsvParser
from smiquery.records import GpuSample
from smiquery.runner import LineStream, Runner, SubprocessRunner, find_nvidia_smi
from smiquery.source import LatestSweep, StreamEvent, StreamStats, Sweep, SweepGrouper

if TYPE_CHECKING:
    import os

__all__ = ["Stream", "stream"]

log = logging.getLogger("smiquery")


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, SmiqueryError) and exc.retryable


class _ChildEndedError(NvidiaSmiFailedError):
    """The loop child exited 0, which a loop never does by itself."""


class Stream(LatestSweep):
    """One long-lived nvidia-smi in loop mode, parsed into samples and sweeps.

    Iterate it for samples (one per GPU per instant), or call :meth:`sweeps` for whole sweeps. Or call
    :meth:`start` to run it in a background thread and read :meth:`latest` from any thread without blocking.
    Use it as a context manager (or call :meth:`close`): the child is always reaped.

    Silence is failure: no complete row within ``stall_timeout`` means nvidia-smi hung; it is killed and
    restarted. A child that exits or errors is restarted with exponential backoff and jitter (starting at
    ``backoff_initial``; reset once a new child delivers rows). Binary-not-found, invalid field, bad GPU id
    and permission errors are never retried. Counters are in :attr:`stats`; ``on_event`` hears each restart,
    error, dropped row and lost GPU.

    See :func:`stream` for the arguments.
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
        stall_timeout: float | None = None,
        max_attempts: int = 6,
        max_restarts: int | None = None,
        backoff_initial: float = 0.1,
        backoff_max: float = 30.0,
        on_event: Callable[[StreamEvent], None] | None = None,
        runner: Runner | None = None,
        sleep: Callable[[float], None] = time.sleep,
        tz: tzinfo | None = None,
    ) -> None:
        flds = resolve_fields(fields)
        if not any(f.name == "index" for f in flds):
            flds = (*resolve_fields(["index"]), *flds)  # sweeps are grouped by GPU index
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.fields = flds
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self._binary = find_nvidia_smi(nvidia_smi)
        self.argv = tuple(build_argv(self._binary, flds, self.gpus, interval=self.interval))
        self.max_samples = max_samples
        self.duration = duration
        self.stall_timeout = stall_timeout if stall_timeout is not None else max(3 * self.interval, 10.0)
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.on_event = on_event
        self._runner: Runner = runner or SubprocessRunner()
        self._sleep = sleep
        self._tz = tz
        self.stats = StreamStats()
        self._child: LineStream | None = None
        self._lock = threading.Lock()
        self._latest: tuple[Sweep, float] | None = None
        self._closed = False
        self._iterating = False
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._expected = len(self.gpus) if self.gpus else 0
        # Only a weak reference: an abandoned iterator must be collectable at once (no cycle), so that
        # dropping it closes the generator and reaps the child immediately.
        self._gen_ref: weakref.ref[Generator[GpuSample, None, None]] | None = None

    # ----------------------------------------------------------------------------------- supervision

    def _emit(self, event: StreamEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a monitor's callback must never break the stream
                log.exception("smiquery stream on_event callback failed")

    def _record_error(self, exc: BaseException) -> None:
        self.stats.errors[type(exc).__name__] += 1
        self.stats.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._emit(StreamEvent("error", exc, self.stats.last_error))

    def _open(self) -> tuple[LineStream, CsvParser, GpuSample]:
        """Start a child and read up to its first good row (what tenacity retries)."""
        if self._closed:
            raise _Stopped
        parser = CsvParser(self.fields, strict=False, tz=self._tz)
        child = self._runner.lines(self.argv, self.stall_timeout)
        self.stats.starts += 1
        with self._lock:
            self._child = child
        try:
            for line in child:
                sample = self._feed(parser, line)
                if sample is not None:
                    return child, parser, sample
            if self._closed:
                raise _Stopped
            if parser.dropped:
                raise _ChildEndedError(
                    self.argv,
                    0,
                    "",
                    f"nvidia-smi printed no valid row ({parser.dropped} dropped; last: {parser.last_error})",
                )
            raise _ChildEndedError(self.argv, 0, "", "nvidia-smi ended its loop without printing a row")
        except BaseException as exc:
            child.close()
            if not isinstance(exc, _Stopped) and not self._closed:
                self._record_error(exc)
            raise

    def _feed(self, parser: CsvParser, line: str) -> GpuSample | None:
        before = parser.dropped
        sample = parser.feed(line)
        if parser.dropped != before:
            self.stats.dropped_rows += 1
            err = parser.last_error
            self._emit(StreamEvent("dropped_row", err, str(err) if err else "dropped row"))
        return sample

    def _before_sleep(self, state: Any) -> None:
        self.stats.restarts += 1
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        self._emit(StreamEvent("restart", exc, f"restarting nvidia-smi in {wait:.2f} s after: {exc}"))
        log.warning("smiquery: restarting nvidia-smi in %.2f s after: %s", wait, exc)

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_attempt(self.max_attempts),
            # exponential from backoff_initial, plus up to backoff_initial of jitter (spreads a fleet's restarts)
            wait=wait_exponential(multiplier=self.backoff_initial, max=self.backoff_max)
            + wait_random(0, self.backoff_initial),
            retry=retry_if_exception(_retryable),
            reraise=True,
            sleep=self._sleep,
            before_sleep=self._before_sleep,
        )

    def _samples(self) -> Generator[GpuSample, None, None]:
        deadline = None if self.duration is None else time.monotonic() + self.duration
        budget = self.max_samples
        first_run = True
        try:
            while not self._closed:
                if not first_run:
                    if self.max_restarts is not None and self.stats.restarts >= self.max_restarts:
                        raise NvidiaSmiFailedError(
                            self.argv, -1, "", f"nvidia-smi failed {self.stats.restarts} times; giving up"
                        )
                    self.stats.restarts += 1
                    self._emit(StreamEvent("restart", None, "restarting nvidia-smi after a mid-stream failure"))
                    self._sleep(self.backoff_initial)
                first_run = False
                try:
                    child, parser, sample = self._retrying()(self._open)
                except _Stopped:
                    return
                try:
                    pending: GpuSample | None = sample
                    lines = iter(child)
                    while True:
                        if pending is None:
                            line = next(lines, None)
                            if line is None:
                                break
                            pending = self._feed(parser, line)
                            if pending is None:
                                continue
                        self._track_loss(pending)
                        self.stats.rows += 1
                        yield pending
                        pending = None
                        if budget is not None:
                            budget -= 1
                            if budget <= 0:
                                return
                        if deadline is not None and time.monotonic() >= deadline:
                            return
                    if self._closed:
                        return
                    raise _ChildEndedError(self.argv, 0, "", "nvidia-smi ended its loop; restarting")
                except SmiqueryError as exc:
                    if self._closed:
                        return
                    self._record_error(exc)
                    if not _retryable(exc):
                        raise
                    log.warning("smiquery: nvidia-smi failed mid-stream: %s", exc)
                finally:
                    child.close()
                    with self._lock:
                        self._child = None
        finally:
            with self._lock:
                child_left = self._child
                self._child = None
            if child_left is not None:
                child_left.close()

    def _track_loss(self, s: GpuSample) -> None:
        idx = s.index
        if idx is None:
            return
        lost = self.stats.lost_gpus
        if s.gpu_lost and idx not in lost:
            lost.add(idx)
            self._emit(StreamEvent("gpu_lost", None, f"GPU {idx} is lost (fell off the bus)", idx))
        elif not s.gpu_lost and idx in lost:
            lost.discard(idx)
            self._emit(StreamEvent("gpu_back", None, f"GPU {idx} reports values again", idx))

    # ----------------------------------------------------------------------------------- consumption

    def __iter__(self) -> Iterator[GpuSample]:
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("this stream runs in the background; read it with latest()")
        current = self._gen_ref() if self._gen_ref is not None else None
        if current is not None and inspect.getgeneratorstate(current) != inspect.GEN_CLOSED:
            return current
        gen = self._samples()
        self._gen_ref = weakref.ref(gen)
        return gen

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield whole sweeps (one sample per GPU for one instant).

        A sweep is complete when it holds as many GPUs as the first complete sweep did, or when a GPU index
        repeats (nvidia-smi marks no boundary between iterations).

        Args:
            count: stop after this many sweeps.
        """
        grouper = SweepGrouper(self._expected)
        try:
            yield from self._group(self, grouper, count, flush=False)
        finally:
            self._expected = grouper.expected  # later sweeps() calls complete their first sweep at once

    def start(self) -> Stream:
        """Consume the stream in a background thread, so that :meth:`latest` stays fresh. Returns self."""
        if self._thread is not None:
            return self
        if self._gen_ref is not None and self._gen_ref() is not None:
            raise RuntimeError("this stream is already being iterated")

        def run() -> None:
            try:
                for _ in self.sweeps():
                    if self._closed:
                        break
            except BaseException as exc:  # kept for the owner; a background thread must not die silently
                self._thread_error = exc
                if not self._closed:
                    log.error("smiquery stream stopped: %s", exc)

        self._thread = threading.Thread(target=run, name="smiquery-stream", daemon=True)
        self._thread.start()
        return self

    @property
    def error(self) -> BaseException | None:
        """The error that ended a background stream, if any."""
        return self._thread_error

    @property
    def running(self) -> bool:
        """True while a background stream's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop: kill and reap the child, end the background thread. Idempotent, safe from any thread."""
        self._closed = True
        with self._lock:
            child = self._child
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            if child is not None:
                child.terminate()
            thread.join(timeout)
            return
        gen = self._gen_ref() if self._gen_ref is not None else None
        if gen is not None:
            try:
                gen.close()
                return
            except ValueError:
                pass  # the generator is running in another thread: stop its child instead
        if child is not None:
            child.terminate()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close(timeout=1.0)
            except Exception:
                pass


class _Stopped(Exception):
    """Internal: the stream was closed while starting a child."""


def stream(
    fields: FieldsArg = "default",
    *,
    interval: float = 1.0,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    max_samples: int | None = None,
    duration: float | None = None,
    stall_timeout: float | None = None,
    max_attempts: int = 6,
    max_restarts: int | None = None,
    backoff_initial: float = 0.1,
    backoff_max: float = 30.0,
    on_event: Callable[[StreamEvent], None] | None = None,
    runner: Runner | None = None,
    sleep: Callable[[float], None] = time.sleep,
    tz: tzinfo | None = None,
) -> Stream:
    """Sample continuously from ONE nvidia-smi child in loop mode (``-l`` for whole seconds, ``-lms`` below).

    Example::

        with smiquery.stream("health", interval=0.5) as s:
            for sweep in s.sweeps(count=10):
                print(max(x.temperature_gpu or 0 for x in sweep))

    Args:
        fields: a preset, ``"a,b,c"`` or a sequence of names (``index`` is added when absent).
        interval: seconds between samples.
        gpus: indices, UUIDs or PCI bus ids; None for all.
        nvidia_smi: path of the binary.
        max_samples: stop after this many samples (rows).
        duration: stop after this many seconds.
        stall_timeout: seconds without a complete row before the child counts as hung (default
            ``max(3 * interval, 10)``).
        max_attempts: start attempts per failure streak before giving up.
        max_restarts: restarts after mid-stream failures before giving up (None: never give up).
        backoff_initial: first restart delay in seconds; doubles per failed attempt, with jitter.
        backoff_max: longest restart delay.
        on_event: called with each :class:`StreamEvent` (restart, error, dropped_row, gpu_lost, gpu_back).
        runner: how to run nvidia-smi (tests inject one).
        sleep: how to wait between restarts (tests inject one).
        tz: time zone of the timestamps.

    Returns:
        A :class:`Stream` (not started until iterated or :meth:`Stream.start` is called).

    Raises:
        InvalidFieldError: an unknown field, before anything runs.
        InvalidGpuIdError: a malformed GPU id, before anything runs.
        NvidiaSmiNotFoundError: no usable binary.
    """
    return Stream(
        fields,
        interval=interval,
        gpus=gpus,
        nvidia_smi=nvidia_smi,
        max_samples=max_samples,
        duration=duration,
        stall_timeout=stall_timeout,
        max_attempts=max_attempts,
        max_restarts=max_restarts,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
        on_event=on_event,
        runner=runner,
        sleep=sleep,
        tz=tz,
    )
