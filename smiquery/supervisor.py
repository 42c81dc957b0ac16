"""The stream supervisor: one long-lived nvidia-smi in loop mode, watched, restarted and parsed into sweeps.

What it guarantees, whatever nvidia-smi does:

* At most one child at any moment, reaped on every path (end, error, ``close()`` from any thread, an abandoned
  iterator, interpreter exit; on Linux also when this process is killed, through a parent-death signal).
* Only a parsed data row proves the child alive. No row within ``startup_timeout`` of a start, or within
  ``stall_timeout`` of the last row, means it is hung: it is killed and started again.
* One retry policy (tenacity) for every failure: exponential backoff with jitter and a cap for transient faults,
  a slow fixed cadence (``permanent_retry``) for faults that need a person (driver/library mismatch, NVML
  missing, no devices, a rejected field, the binary gone), so a stream recovers by itself once the cause is
  fixed. The backoff resets only after ``healthy_after`` seconds of good data. ``stats`` shows the state.
* ``duration`` and ``close()`` are deadlines, not hints.
* A sweep is one instant (see :class:`~smiquery.source.SweepGrouper`); a short one says so. A GPU whose rows stop,
  or that nvidia-smi reports lost, is reported lost until it is back.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from datetime import tzinfo
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.errors import NvidiaSmiFailedError, NvidiaSmiTimeoutError, SmiqueryError
from smiquery.fields import resolve_fields
from smiquery.oneshot import FieldsArg, GpusArg, build_argv, normalize_gpus
from smiquery.parsing import CsvParser, is_message
from smiquery.records import GpuSample
from smiquery.retry import DEFAULT_PERMANENT_RETRY, FAIL_FAST_ATTEMPTS, RetryPolicy, Supervision
from smiquery.runner import TERM_GRACE, LineSource, Runner, default_runner, find_nvidia_smi
from smiquery.source import LatestSweep, StreamEvent, StreamStats, Sweep, SweepGrouper

if TYPE_CHECKING:
    import os

__all__ = ["DEFAULT_PERMANENT_RETRY", "DEFAULT_STARTUP_TIMEOUT", "FAIL_FAST_ATTEMPTS", "Stream", "stream"]

log = get_logger("smiquery")

#: Seconds a fresh nvidia-smi may take to print its first row: cold starts without persistence mode take 15-30 s
#: on large hosts and in containers with a huge open-file limit (NVIDIA-SMI.md section 6).
DEFAULT_STARTUP_TIMEOUT = 45.0

_LOST_MESSAGE = re.compile(r"device handle for GPU ([0-9A-Fa-f:.]+): GPU is lost", re.IGNORECASE)


class _Stopped(Exception):
    """Internal: the stream was closed, or its duration is over."""


def _bus_key(bus_id: str) -> str:
    # "00000000:02:00.0" and "0000:02:00.0" name the same GPU.
    return bus_id.strip().upper().split(":", 1)[-1] if bus_id.count(":") >= 2 else bus_id.strip().upper()


class Stream(LatestSweep):
    """One long-lived nvidia-smi in loop mode: a live :class:`~smiquery.source.SampleSource`.

    Iterate it for samples (one per GPU per instant), or call :meth:`sweeps` for whole instants. Or call
    :meth:`start` to run it in a background thread and read :meth:`latest` from any thread without blocking.
    Use it as a context manager (or call :meth:`close`): the child is always reaped. The module docstring says
    what it guarantees; :attr:`stats` shows counters and the retry state; :meth:`subscribe` (or ``on_event``)
    hears every restart, error, recovery, dropped row, short sweep and lost or returning GPU.

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
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stall_timeout: float | None = None,
        max_attempts: int | None = None,
        max_restarts: int | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        permanent_retry: float = DEFAULT_PERMANENT_RETRY,
        healthy_after: float | None = None,
        fail_fast: bool = False,
        on_event: Callable[[StreamEvent], None] | None = None,
        runner: Runner | None = None,
        sleep: Callable[[float], None] | None = None,
        tz: tzinfo | None = None,
    ) -> None:
        flds = resolve_fields(fields)
        if not any(f.name == "index" for f in flds):
            flds = (*resolve_fields(["index"]), *flds)  # sweeps are grouped by GPU index
        if interval <= 0:
            raise ValueError("interval must be positive")
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self.fields = flds
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self._runner: Runner = runner or default_runner()
        self._binary = find_nvidia_smi(nvidia_smi, runner=self._runner)
        self.argv = tuple(build_argv(self._binary, flds, self.gpus, interval=self.interval))
        self.max_samples = max_samples
        self.duration = duration
        self.startup_timeout = float(startup_timeout)
        self.stall_timeout = stall_timeout if stall_timeout is not None else max(3 * self.interval, 10.0)
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.permanent_retry = float(permanent_retry)
        self.healthy_after = healthy_after if healthy_after is not None else max(30.0, 10 * self.interval)
        self.fail_fast = fail_fast
        #: The :class:`~smiquery.retry.RetryPolicy` built from the arguments above.
        self.retry_policy = RetryPolicy(
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            healthy_after=self.healthy_after,
            permanent_retry=self.permanent_retry,
            max_attempts=max_attempts,
            max_restarts=max_restarts,
            fail_fast=fail_fast,
        )
        self.on_event = on_event
        self._sleep = sleep
        self._tz = tz
        self.stats = StreamStats()
        self._supervision = Supervision(self.retry_policy, self.stats, self._emit)
        self._lock = threading.Lock()
        self._latest: tuple[Sweep, float] | None = None
        self._closed = threading.Event()
        self._child: LineSource | None = None
        self._no_child = threading.Event()
        self._no_child.set()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._messages: deque[str] = deque(maxlen=20)
        expected = [int(g) for g in self.gpus if g.isdigit()]
        gap = self.interval / 2 if self.interval >= 0.5 else None
        self._grouper = SweepGrouper(expected if len(expected) == len(self.gpus) else (), gap=gap)
        self._absent_lost_by_message: set[str] = set()
        self._bus_of: dict[int, str] = {}
        # Only a weak reference: an abandoned iterator must be collectable at once (no cycle), so that dropping it
        # closes the generator and reaps the child immediately.
        self._gen_ref: weakref.ref[Generator[GpuSample | Sweep, None, None]] | None = None

    # ----------------------------------------------------------------------------------------- events & state

    def _pause(self, seconds: float) -> None:
        """Wait between attempts; a close or the end of ``duration`` cuts the wait short and ends the stream."""
        if self._sleep is not None:
            self._sleep(seconds)
        else:
            limit = seconds if self._deadline is None else min(seconds, max(self._deadline - time.monotonic(), 0))
            self._closed.wait(limit)
        if self._closed.is_set() or (self._deadline is not None and time.monotonic() >= self._deadline):
            raise _Stopped

    # ---------------------------------------------------------------------------------------------- grouping

    def _on_sweep(self, sweep: Sweep) -> Sweep:
        """Update GPU loss from a closed sweep, then publish it."""
        stats = self.stats
        if sweep.missing and not sweep.damaged:
            # Every GPU prints a row each sweep, even a lost one ("[GPU is lost]" cells): a known GPU without a row
            # in an undamaged sweep has dropped out.
            for idx in sorted(sweep.missing):
                if idx not in stats.lost_gpus:
                    bus = self._bus_of.get(idx)
                    said = bus is not None and _bus_key(bus) in self._absent_lost_by_message
                    why = "nvidia-smi says it is lost" if said else "its rows stopped appearing"
                    self._mark_lost(idx, f"GPU {idx} is lost: {why}")
        self._absent_lost_by_message.clear()
        short = sweep.damaged or bool(sweep.missing - stats.lost_gpus)
        stats.sweeps += 1
        if short:
            stats.short_sweeps += 1
            gone = ", ".join(str(i) for i in sorted(sweep.missing))
            why = f"without GPU {gone}" if gone else "cut short"
            if sweep.damaged:
                why += " (a row was dropped or nvidia-smi ended mid-sweep)"
            self._emit(StreamEvent("short_sweep", None, f"short sweep: {why}"))
        with self._lock:
            self._latest = (sweep, time.monotonic())
        return sweep

    def _mark_lost(self, idx: int, detail: str) -> None:
        stats = self.stats
        stats.lost_gpus.add(idx)
        stats.gpu_lost_events += 1
        self._emit(StreamEvent("gpu_lost", None, detail, idx, stats.known_gpus.get(idx)))
        log.warning("smiquery: %s", detail)

    def _track(self, s: GpuSample) -> None:
        idx = s.index
        if idx is None:
            return
        stats = self.stats
        if idx not in stats.known_gpus or (stats.known_gpus[idx] is None and "uuid" in s):
            stats.known_gpus[idx] = s.uuid if "uuid" in s else None
        if s.get("pci.bus_id"):
            self._bus_of[idx] = str(s["pci.bus_id"])
        lost = stats.lost_gpus
        if s.gpu_lost and idx not in lost:
            self._mark_lost(idx, f"GPU {idx} is lost (fell off the bus)")
        elif not s.gpu_lost and idx in lost:
            lost.discard(idx)
            self._emit(StreamEvent("gpu_back", None, f"GPU {idx} reports values again", idx, stats.known_gpus.get(idx)))
            log.warning("smiquery: GPU %s reports values again", idx)

    # -------------------------------------------------------------------------------------------- supervision

    _deadline: float | None = None

    def _items(self) -> Generator[GpuSample | Sweep, None, None]:
        """Samples, with each sweep after the sample that closed it (or before the one that opened the next)."""
        self._deadline = None if self.duration is None else time.monotonic() + self.duration
        budget = [self.max_samples]
        try:
            yield from self._supervision.run(lambda: self._session(budget), self._pause)
        except _Stopped:
            return
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                self.stats.state = "failed"
                self._thread_error = exc
            raise
        finally:
            self._supervision.finished(self._closed.is_set())

    def _check_stop(self) -> None:
        if self._closed.is_set() or (self._deadline is not None and time.monotonic() >= self._deadline):
            raise _Stopped

    def _session(self, budget: list[int | None]) -> Generator[GpuSample | Sweep, None, None]:
        """Run one child until it fails (raises), the stream ends (raises _Stopped) or the budget is spent."""
        self._check_stop()
        stats = self.stats
        self._supervision.started()
        parser = CsvParser(self.fields, strict=False, tz=self._tz)
        try:
            child = self._runner.lines(self.argv)
        except SmiqueryError as exc:
            self._supervision.failure(exc)
            raise
        with self._lock:
            self._child = child
            self._no_child.clear()
        if self._closed.is_set():
            child.terminate()
        grouper = self._grouper
        first = True
        row_deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                self._check_stop()
                now = time.monotonic()
                limit = row_deadline if self._deadline is None else min(row_deadline, self._deadline)
                if now >= limit:
                    self._check_stop()
                    raise self._hung(first)
                try:
                    line = child.readline(limit - now)
                except NvidiaSmiFailedError:
                    self._check_stop()
                    raise
                if line is None:
                    continue
                sample = self._classify(parser, line)
                if sample is None:
                    continue
                if first:
                    first = False
                    self._supervision.first_row()
                row_deadline = time.monotonic() + self.stall_timeout
                closed = grouper.boundary(sample, child.idle)
                if closed is not None:
                    self._check_stop()
                    yield self._on_sweep(closed)
                self._track(sample)
                whole = grouper.add(sample)
                self._check_stop()
                stats.rows += 1
                yield sample
                if whole is not None:
                    self._check_stop()
                    yield self._on_sweep(whole)
                if budget[0] is not None:
                    budget[0] -= 1
                    if budget[0] <= 0:
                        return
        except SmiqueryError as exc:
            cut = grouper.flush(cut=True, absent=stats.lost_gpus)
            if cut is not None and not self._closed.is_set():
                yield self._on_sweep(cut)
            self._supervision.failure(exc)  # raises _FreshStreak after a healthy period
            raise
        finally:
            with self._lock:
                self._child = None
            child.close()
            self._no_child.set()

    def _hung(self, first: bool) -> NvidiaSmiTimeoutError:
        if first:
            return NvidiaSmiTimeoutError(
                f"nvidia-smi printed no row within {self.startup_timeout:g} s of starting and was killed; "
                "a cold start without persistence mode can be this slow (`nvidia-smi -pm 1`), or the driver hangs "
                "(check `dmesg` for Xid errors)",
                argv=self.argv,
                timeout=self.startup_timeout,
            )
        said = f" (it printed: {self._messages[-1]})" if self._messages else ""
        return NvidiaSmiTimeoutError(
            f"nvidia-smi printed no data row for {self.stall_timeout:g} s{said} and was killed (hung driver?); "
            "check `dmesg` for Xid errors and whether plain `nvidia-smi` answers",
            argv=self.argv,
            timeout=self.stall_timeout,
        )

    def _classify(self, parser: CsvParser, line: str) -> GpuSample | None:
        """A data row becomes a sample; a message is kept; anything else is a dropped row that damages its sweep."""
        if is_message(line):
            self._messages.append(line)
            found = _LOST_MESSAGE.search(line)
            if found:
                self._absent_lost_by_message.add(_bus_key(found.group(1)))
            return None
        before = parser.dropped
        sample = parser.feed(line)
        if parser.dropped != before:
            self.stats.dropped_rows += 1
            self._grouper.damage()
            err = parser.last_error
            self._emit(StreamEvent("dropped_row", err, str(err) if err else "dropped row"))
        return sample

    # ------------------------------------------------------------------------------------------- consumption

    def _generator(self) -> Generator[GpuSample | Sweep, None, None]:
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("this stream runs in the background; read it with latest()")
        current = self._gen_ref() if self._gen_ref is not None else None
        if current is not None and inspect.getgeneratorstate(current) != inspect.GEN_CLOSED:
            return current
        if self._closed.is_set():
            raise RuntimeError("this stream is closed")
        gen = self._items()
        self._gen_ref = weakref.ref(gen)
        return gen

    def __iter__(self) -> Iterator[GpuSample]:
        return (item for item in self._generator() if isinstance(item, GpuSample))

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        """Yield sweeps, one instant each (see :class:`~smiquery.source.SweepGrouper`), flagged when short.

        Args:
            count: stop after this many sweeps.
        """
        done = 0
        for item in self._generator():
            if isinstance(item, Sweep):
                yield item
                done += 1
                if count is not None and done >= count:
                    return

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
                self._thread_error = exc
                if not self._closed.is_set():
                    log.error("smiquery stream stopped: %s", exc)
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="smiquery-stream", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    @property
    def error(self) -> BaseException | None:
        """The error that ended the stream (given up after ``max_attempts``/``max_restarts``), if any."""
        return self._thread_error

    @property
    def running(self) -> bool:
        """True while a background stream's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def child_pid(self) -> int | None:
        """The pid of the nvidia-smi child running now, if any."""
        child = self._child
        return child.pid if child is not None else None

    def close(self, timeout: float = 5.0) -> None:
        """Stop within ``timeout`` seconds. Idempotent, safe from any thread.

        No sample is delivered after this returns; the child is killed (SIGTERM, then SIGKILL) and reaped; a
        background thread ends.
        """
        end = time.monotonic() + max(timeout, 0.0)
        self._closed.set()
        if self.stats.state not in ("failed", "ended"):
            self.stats.state = "closed"
        with self._lock:
            child = self._child
        if child is not None:
            child.interrupt()
            child.terminate()
        me = threading.current_thread()
        thread = self._thread
        if thread is not None and thread is not me:
            thread.join(min(TERM_GRACE, max(end - time.monotonic(), 0)))
            if thread.is_alive() and child is not None:
                child.kill()
            thread.join(max(end - time.monotonic(), 0))
            return
        gen = self._gen_ref() if self._gen_ref is not None else None
        if gen is not None:
            try:
                gen.close()
                return
            except ValueError:
                pass  # running in another thread: it sees the close at its next step and reaps its child
        if child is not None and not self._no_child.wait(min(TERM_GRACE, max(end - time.monotonic(), 0))):
            child.kill()
            self._no_child.wait(max(end - time.monotonic(), 0))

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", None) or self._closed.is_set():
            return
        try:
            self.close(timeout=1.0)
        except Exception:
            pass


def stream(
    fields: FieldsArg = "default",
    *,
    interval: float = 1.0,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    max_samples: int | None = None,
    duration: float | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    stall_timeout: float | None = None,
    max_attempts: int | None = None,
    max_restarts: int | None = None,
    backoff_initial: float = 0.5,
    backoff_max: float = 30.0,
    permanent_retry: float = DEFAULT_PERMANENT_RETRY,
    healthy_after: float | None = None,
    fail_fast: bool = False,
    on_event: Callable[[StreamEvent], None] | None = None,
    runner: Runner | None = None,
    sleep: Callable[[float], None] | None = None,
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
        duration: stop after this many seconds (a deadline, whatever nvidia-smi does).
        startup_timeout: seconds a freshly started nvidia-smi may take to print its first row.
        stall_timeout: seconds without a data row, once rows flow, before the child counts as hung (default
            ``max(3 * interval, 10)``). Notices and error lines do not count as rows.
        max_attempts: failed starts in one failure streak before giving up (None: never give up).
        max_restarts: restarts in all before giving up (None: never).
        backoff_initial: first delay after a transient failure, in seconds; doubles per failure, with jitter.
        backoff_max: the longest delay after a transient failure.
        permanent_retry: seconds between attempts while the failure needs a person (driver/library mismatch,
            NVML missing, no devices, a field the driver rejects, the binary gone).
        healthy_after: seconds of good data after which the backoff starts over (default ``max(30, 10 *
            interval)``).
        fail_fast: for interactive use: until the first row arrives, give up on a fault that needs a person at
            once and on a transient one after :data:`FAIL_FAST_ATTEMPTS` starts, raising its typed error. Once
            rows have flowed, the stream retries as usual.
        on_event: called with each :class:`~smiquery.source.StreamEvent` (see also :meth:`Stream.subscribe`).
        runner: how to run nvidia-smi (tests inject one).
        sleep: how to wait between attempts (tests inject one; default: a wait that ``close()`` cuts short).
        tz: time zone of the timestamps.

    Returns:
        A :class:`Stream` (not started until iterated or :meth:`Stream.start` is called).

    Raises:
        InvalidFieldError: an unknown field, before anything runs.
        InvalidGpuIdError: a malformed GPU id, before anything runs.
        NvidiaSmiNotFoundError: no usable binary, before anything runs.
        ValueError: a non-positive interval or timeout.
    """
    return Stream(
        fields,
        interval=interval,
        gpus=gpus,
        nvidia_smi=nvidia_smi,
        max_samples=max_samples,
        duration=duration,
        startup_timeout=startup_timeout,
        stall_timeout=stall_timeout,
        max_attempts=max_attempts,
        max_restarts=max_restarts,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
        permanent_retry=permanent_retry,
        healthy_after=healthy_after,
        fail_fast=fail_fast,
        on_event=on_event,
        runner=runner,
        sleep=sleep,
        tz=tz,
    )
