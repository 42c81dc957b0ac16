"""What users call: ``query()``, ``stream()``, ``processes()`` and ``get_gpu_status()``.

Builds validated argument lists, runs them through a :class:`~smiquery.runner.Runner`, parses the output, and
supervises long-running streams (stall detection, restarts with backoff, counters).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import TYPE_CHECKING, Any, cast

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from smiquery.errors import (
    InvalidGpuIdError,
    NvidiaSmiFailedError,
    ParseError,
    SmiqueryError,
    failure_from_exit,
)
from smiquery.fields import Field, resolve_fields
from smiquery.parsing import CsvParser, missing_reason
from smiquery.records import GpuSample
from smiquery.runner import LineStream, Runner, SubprocessRunner, find_nvidia_smi

if TYPE_CHECKING:
    import os

    import pandas as pd

__all__ = [
    "GpuProcess",
    "InfoRomWarning",
    "LatestSweep",
    "Stream",
    "StreamEvent",
    "StreamStats",
    "Sweep",
    "SweepGrouper",
    "build_argv",
    "get_gpu_status",
    "normalize_gpus",
    "processes",
    "processes_df",
    "query",
    "query_df",
    "stream",
]

log = logging.getLogger("smiquery")

FieldsArg = str | Sequence[str] | None
GpusArg = int | str | Sequence[int | str] | None

_UUID_RE = re.compile(r"(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_BUS_RE = re.compile(r"([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


class InfoRomWarning(UserWarning):
    """nvidia-smi exited 14 (infoROM corrupted) but printed valid rows; the rows were returned."""


def normalize_gpus(gpus: GpusArg) -> tuple[str, ...]:
    """Validate GPU ids (indices, UUIDs or PCI bus ids) before anything runs.

    Args:
        gpus: one id, a comma list, or a sequence of ids; None for all GPUs.

    Returns:
        The ids as strings for ``-i``.

    Raises:
        InvalidGpuIdError: an id is none of the three forms.
    """
    if gpus is None:
        return ()
    if isinstance(gpus, (int, str)):
        items: list[int | str] = [gpus]
    else:
        items = list(gpus)
    out: list[str] = []
    for item in items:
        if isinstance(item, bool):
            raise InvalidGpuIdError(item)
        if isinstance(item, int):
            if item < 0:
                raise InvalidGpuIdError(item)
            out.append(str(item))
            continue
        if not isinstance(item, str):
            raise InvalidGpuIdError(item)
        for part in item.split(","):
            part = part.strip()
            if part.isdigit() and part.isascii():
                out.append(str(int(part)))
            elif _UUID_RE.fullmatch(part) or _BUS_RE.fullmatch(part):
                out.append(part)
            else:
                raise InvalidGpuIdError(part)
    if not out:
        raise InvalidGpuIdError(gpus)
    return tuple(dict.fromkeys(out))


def build_argv(
    binary: str,
    fields: Sequence[Field],
    gpus: Sequence[str] = (),
    *,
    interval: float | None = None,
) -> list[str]:
    """The nvidia-smi argument list for a query (one-shot, or loop mode when ``interval`` is given).

    Whole seconds use ``-l N``; anything else uses ``-lms N`` (milliseconds, at least 1).
    """
    argv = [binary, "--query-gpu=" + ",".join(f.name for f in fields), "--format=csv,noheader,nounits"]
    if gpus:
        argv += ["-i", ",".join(gpus)]
    if interval is not None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        if interval >= 1 and float(interval).is_integer():
            argv += ["-l", str(int(interval))]
        else:
            argv += ["-lms", str(max(1, round(interval * 1000)))]
    return argv


def _check_and_parse(
    argv: Sequence[str], returncode: int, stdout: str, output: str, parser: CsvParser
) -> list[GpuSample]:
    if returncode not in (0, 14):
        raise failure_from_exit(argv, returncode, output)
    try:
        samples = list(parser.parse(stdout.splitlines()))
    except ParseError:
        if returncode == 14:
            raise failure_from_exit(argv, returncode, output) from None
        raise
    if returncode == 14:
        if not samples:
            raise failure_from_exit(argv, returncode, output)
        notice = parser.notices[0] if parser.notices else "infoROM warning"
        warnings.warn(f"nvidia-smi exited 14 ({notice}); rows returned", InfoRomWarning, stacklevel=3)
    return samples


def query(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    runner: Runner | None = None,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Take one snapshot: one record per GPU.

    Args:
        fields: a preset (``"default"``, ``"health"``, ``"memory"``...), ``"a,b,c"``, or a sequence of names.
        gpus: indices, UUIDs or PCI bus ids; None for all.
        nvidia_smi: path of the binary (default: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        timeout: seconds before the child is killed.
        runner: how to run it (tests inject one).
        tz: time zone of the timestamps (default: the host's).

    Returns:
        One record per GPU, in nvidia-smi's order.

    Raises:
        InvalidFieldError: an unknown field (raised before anything runs).
        InvalidGpuIdError: a malformed GPU id (raised before anything runs).
        NvidiaSmiNotFoundError: no usable binary.
        NvidiaSmiTimeoutError: no answer within ``timeout``.
        NvidiaSmiFailedError: a non-zero exit, as its typed subclass.
        ParseError: output that does not fit the fields.
    """
    flds = resolve_fields(fields)
    ids = normalize_gpus(gpus)
    binary = find_nvidia_smi(nvidia_smi)
    argv = build_argv(binary, flds, ids)
    done = (runner or SubprocessRunner()).run(argv, timeout)
    return _check_and_parse(argv, done.returncode, done.stdout, done.output, CsvParser(flds, tz=tz))


def query_df(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`query`, as a pandas DataFrame (nullable dtypes, units in ``df.attrs["units"]``)."""
    from smiquery.frames import to_dataframe

    return to_dataframe(query(fields, gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner))


# --------------------------------------------------------------------------------------------------- streams


class Sweep(tuple[GpuSample, ...]):
    """All GPUs' samples for one instant (one iteration of nvidia-smi's loop), in nvidia-smi's order."""

    __slots__ = ()

    @property
    def timestamp(self) -> datetime | None:
        """The first sample's timestamp (when queried)."""
        return self[0].timestamp if self else None

    def by_index(self) -> dict[int | None, GpuSample]:
        """The samples keyed by GPU index."""
        return {s.index: s for s in self}


class SweepGrouper:
    """Groups samples into sweeps (one sample per GPU for one instant), for streams and replays alike.

    A sweep is complete when it holds as many GPUs as the first complete sweep did (or ``expected``), or when a
    GPU index repeats.

    Args:
        expected: the number of GPUs per sweep, when known in advance.
    """

    def __init__(self, expected: int = 0) -> None:
        self.expected = expected
        self._current: list[GpuSample] = []
        self._seen: set[int | None] = set()

    def feed(self, sample: GpuSample) -> list[Sweep]:
        """Add one sample; returns the sweeps it completed (zero, one, or two for one-GPU sweeps)."""
        done: list[Sweep] = []
        idx = sample.index if "index" in sample else None
        if idx in self._seen:
            done.append(Sweep(self._current))
            self.expected = self.expected or len(self._current)
            self._current, self._seen = [], set()
        self._current.append(sample)
        self._seen.add(idx)
        if self.expected and len(self._current) >= self.expected:
            done.append(Sweep(self._current))
            self._current, self._seen = [], set()
        return done

    def flush(self) -> Sweep | None:
        """The unfinished sweep at the end of the input, if any."""
        if not self._current:
            return None
        sweep = Sweep(self._current)
        self._current, self._seen = [], set()
        return sweep

    @property
    def pending(self) -> int:
        """Samples waiting for their sweep to complete."""
        return len(self._current)


class LatestSweep:
    """The newest complete sweep, published by the reading thread and read from any thread without blocking."""

    _lock: threading.Lock
    _latest: tuple[Sweep, float] | None
    stats: StreamStats

    def _publish(self, sweep: Sweep) -> None:
        self.stats.sweeps += 1
        with self._lock:
            self._latest = (sweep, time.monotonic())

    def _group(
        self, samples: Iterable[GpuSample], grouper: SweepGrouper, count: int | None, *, flush: bool
    ) -> Iterator[Sweep]:
        """Group ``samples`` into sweeps, publishing each; stop after ``count``; ``flush`` yields a last partial one."""
        done = 0
        for sample in samples:
            for sweep in grouper.feed(sample):
                self._publish(sweep)
                yield sweep
                done += 1
                if count is not None and done >= count:
                    return
        last = grouper.flush() if flush else None
        if last is not None:
            self._publish(last)
            yield last

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest complete sweep and its age in seconds, without blocking; ``(None, None)`` before the first."""
        with self._lock:
            got = self._latest
        if got is None:
            return None, None
        return got[0], time.monotonic() - got[1]


@dataclass(frozen=True)
class StreamEvent:
    """Something that happened to a stream: ``restart``, ``error``, ``dropped_row``, ``gpu_lost``, ``gpu_back``.

    Attributes:
        kind: what happened.
        error: the error behind it, if any.
        detail: one line for people.
        gpu: the GPU index concerned, if any.
    """

    kind: str
    error: BaseException | None = None
    detail: str = ""
    gpu: int | None = None


@dataclass
class StreamStats:
    """Counters of a stream, for monitors and exporters.

    Attributes:
        rows: samples delivered.
        sweeps: complete sweeps seen.
        restarts: nvidia-smi children restarted after a failure.
        starts: nvidia-smi children started in all.
        dropped_rows: rows rejected by the parser (garbage, truncated, wrong column count).
        errors: failures by error class name.
        lost_gpus: indices currently reported as ``[GPU is lost]``.
        last_error: the newest failure, as one line.
    """

    rows: int = 0
    sweeps: int = 0
    restarts: int = 0
    starts: int = 0
    dropped_rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_gpus: set[int] = field(default_factory=set)
    last_error: str | None = None


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


# ------------------------------------------------------------------------------------------------ processes


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on a GPU.

    Attributes:
        pid: process id (in nvidia-smi's PID namespace).
        process_name: the name or path the driver recorded.
        gpu_uuid: the GPU's UUID (the parent GPU's for a MIG instance).
        gpu_index: the GPU's index, joined from ``--query-gpu``; None if that GPU was not listed.
        used_memory: GPU memory used in MiB; None when nvidia-smi cannot tell (``[N/A]`` on Windows WDDM).
        missing: field -> reason for missing values.
    """

    pid: int
    process_name: str
    gpu_uuid: str
    gpu_index: int | None
    used_memory: int | None
    missing: dict[str, str] = field(default_factory=dict)


_APPS_FIELDS = "pid,process_name,gpu_uuid,used_memory"


def _parse_apps(argv: Sequence[str], stdout: str) -> list[tuple[int, str, str, int | None, dict[str, str]]]:
    rows = []
    for lineno, line in enumerate(stdout.splitlines(), 1):
        line = line.rstrip("\r\n\t ")
        if not line:
            continue
        cells = line.split(", ")
        if len(cells) < 4:
            raise ParseError("expected 4 columns (pid, process_name, gpu_uuid, used_memory)", lineno=lineno, line=line)
        # process_name is the only free-text column; nvidia-smi does not quote, so rejoin surplus cells into it.
        pid_s, name, uuid, mem_s = cells[0], ", ".join(cells[1:-2]), cells[-2], cells[-1]
        missing: dict[str, str] = {}
        try:
            pid = int(pid_s)
        except ValueError:
            raise ParseError(f"{pid_s!r} is not a pid", lineno=lineno, line=line, field="pid") from None
        mem: int | None
        reason = missing_reason(mem_s)
        if reason is not None:
            mem = None
            missing["used_memory"] = reason
        else:
            try:
                mem = int(mem_s.removesuffix(" MiB"))
            except ValueError:
                raise ParseError(f"{mem_s!r} is not MiB", lineno=lineno, line=line, field="used_memory") from None
        rows.append((pid, name, uuid.strip(), mem, missing))
    return rows


def processes(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    runner: Runner | None = None,
) -> list[GpuProcess]:
    """The compute processes on each GPU with their memory: the answer to "which job holds this memory?".

    Runs ``--query-compute-apps`` and joins each row to its GPU's index. An idle machine has no rows, which
    is not an error.

    Args:
        gpus: only these GPUs (indices, UUIDs or PCI bus ids).
        nvidia_smi: path of the binary.
        timeout: seconds per nvidia-smi call.
        runner: how to run nvidia-smi.

    Returns:
        The processes sorted by GPU index, then pid.

    Raises:
        InvalidGpuIdError, NvidiaSmiNotFoundError, NvidiaSmiTimeoutError, NvidiaSmiFailedError, ParseError.
    """
    ids = normalize_gpus(gpus)
    binary = find_nvidia_smi(nvidia_smi)
    run = (runner or SubprocessRunner()).run
    gpu_rows = query(["index", "uuid"], gpus=ids or None, nvidia_smi=binary, timeout=timeout, runner=runner)
    by_uuid = {s.uuid: s.index for s in gpu_rows}
    argv = [binary, "--query-compute-apps=" + _APPS_FIELDS, "--format=csv,noheader,nounits"]
    done = run(argv, timeout)
    if done.returncode != 0:
        raise failure_from_exit(argv, done.returncode, done.output)
    out = []
    for pid, name, uuid, mem, missing in _parse_apps(argv, done.stdout):
        if ids and uuid not in by_uuid:
            continue
        out.append(GpuProcess(pid, name, uuid, by_uuid.get(uuid), mem, missing))
    out.sort(key=lambda p: (p.gpu_index if p.gpu_index is not None else 1 << 30, p.pid))
    return out


def processes_df(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`processes`, as a DataFrame with columns gpu_index, gpu_uuid, pid, process_name, used_memory."""
    import pandas as pd

    rows = processes(gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
    df = pd.DataFrame(
        {
            "gpu_index": pd.array([p.gpu_index for p in rows], dtype="Int64"),
            "gpu_uuid": pd.array([p.gpu_uuid for p in rows], dtype="string"),
            "pid": pd.array([p.pid for p in rows], dtype="Int64"),
            "process_name": pd.array([p.process_name for p in rows], dtype="string"),
            "used_memory": pd.array([p.used_memory for p in rows], dtype="Int64"),
        }
    )
    df.attrs["units"] = {"used_memory": "MiB"}
    return cast("pd.DataFrame", df)


# ------------------------------------------------------------------------------------------- get_gpu_status

_STATUS_FIELDS = ("timestamp", "index", "name", "temperature.gpu", "utilization.gpu", "utilization.memory")
_STATUS_KEYS = {
    "index": "index",
    "name": "name",
    "temperature.gpu": "temperature_c",
    "utilization.gpu": "gpu_util_percent",
    "utilization.memory": "memory_util_percent",
}


def get_gpu_status(
    fields: Sequence[str] | str | None = None,
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    runner: Runner | None = None,
) -> dict[str, Any]:
    """One call for scripts and training loops; never raises for anything nvidia-smi does.

    Success: ``{"success": True, "data": [{"index", "name", "temperature_c", "gpu_util_percent",
    "memory_util_percent", "timestamp"}, ...]}`` (missing values are None; ``timestamp`` is ISO 8601; extra
    ``fields`` add snake_case keys such as ``power_draw``). Failure: ``{"success": False, "error": "<one line>",
    "error_type": "<exception class name>"}``. It returns within ``timeout`` seconds even when nvidia-smi hangs.

    Args:
        fields: extra fields to include (names or a comma list).
        nvidia_smi: path of the binary.
        timeout: the most seconds this call may take.
        runner: how to run nvidia-smi.

    Returns:
        The status dict described above.
    """
    try:
        extra: list[str] = []
        if fields:
            extra = [f.name for f in resolve_fields(fields) if f.name not in _STATUS_FIELDS]
        samples = query([*_STATUS_FIELDS, *extra], nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
        extra_attrs = [(n, n.replace(".", "_")) for n in extra]
        data = []
        for s in samples:
            ts = s.timestamp
            item: dict[str, Any] = {key: s[name] for name, key in _STATUS_KEYS.items()}
            item["timestamp"] = ts.isoformat(timespec="milliseconds") if ts is not None else None
            for name, attr in extra_attrs:
                value = s[name]
                item[attr] = value.isoformat() if isinstance(value, datetime) else value
            data.append(item)
        return {"success": True, "data": data}
    except Exception as exc:  # the contract: a dict, never an exception
        message = " ".join(str(exc).split()) or type(exc).__name__
        return {"success": False, "error": message, "error_type": type(exc).__name__}
