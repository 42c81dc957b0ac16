"""The framework-neutral training run monitor, :class:`RunMonitor`: one nvidia-smi beside a training loop.

The Keras and Lightning callbacks and :func:`~smiquery.training.watch.watch` only translate their hooks into its
:meth:`~RunMonitor.begin_epoch`, :meth:`~RunMonitor.step` and :meth:`~RunMonitor.end_epoch`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from smiquery._log import get_logger
from smiquery.alerts import BUILTIN_RULES, STALL, AlertEvent, AlertHandler, LogHandler, Notifier, Rule, arrival
from smiquery.errors import InvalidArgumentError, InvalidFieldError
from smiquery.fields import Field, resolve_fields
from smiquery.kinds import to_number
from smiquery.training.devices import VisibleDevices, order_check, visible_devices
from smiquery.training.epochs import (
    BATCH,
    BETWEEN,
    SUMMARY_FIELDS,
    EnergySplitter,
    EpochAccumulator,
    ShareTracker,
    summary_spec,
    throughput_values,
)
from smiquery.training.memory import FrameworkMemory, MemoryView, gap_event, gap_grew

if TYPE_CHECKING:
    from smiquery.sample import GpuSample
    from smiquery.source import SampleSource, StreamEvent, Sweep
    from smiquery.sources.latest import Latest
    from smiquery.sources.pmon import ProcessShare

__all__ = [
    "OPEN_MONITORS",
    "TRAINING_RULES",
    "TRAINING_STALL_SECONDS",
    "MonitorView",
    "Output",
    "Position",
    "RunMonitor",
    "Totals",
    "TrainingAlert",
    "stall_rule",
]

log = get_logger("smiquery.training.monitor")

#: what nvidia-smi answers to a field this driver lacks
_REJECTIONS = (InvalidArgumentError, InvalidFieldError)
_REJECTED_RE = re.compile(r"""Field\s+["']([^"']+)["']\s+is not a valid field""", re.IGNORECASE)
_ALWAYS = ("index", "uuid", "timestamp", *SUMMARY_FIELDS)
_EVENT_QUEUE = 1000
_Events = queue.Queue[tuple[AlertEvent, dict[str, Any]] | None]

#: Seconds of ``smiquery report``'s stall condition after which the training monitor alerts (beyond a checkpoint).
TRAINING_STALL_SECONDS = 60.0


def stall_rule(seconds: float = TRAINING_STALL_SECONDS) -> str:
    """The stall alert: ``smiquery report``'s stall condition held for ``seconds``, as an expression."""
    return f"utilization.gpu < {STALL.utilization:g} for {seconds:g}s while memory.used >= {STALL.busy_memory_mib:g}"


#: The default rules of a training monitor: the built-in health rules, the 30-minute idle rule as :func:`stall_rule`.
TRAINING_RULES: tuple[str, ...] = (*(r for r in BUILTIN_RULES if not r.startswith("utilization.gpu <")), stall_rule())


class Position(NamedTuple):
    """Where training was at one moment.

    ``epoch``: 0-based, None before the first; ``batch``: steps taken in it (the batch in progress), or None;
    ``step``: steps since training began; ``phase``: ``"setup"``, ``"train"``, ``"validation"`` or ``"done"``.
    """

    epoch: int | None
    batch: int | None
    step: int
    phase: str


@dataclass(frozen=True)
class TrainingAlert:
    """An alert ``event`` with the :class:`Position` of training when its sample arrived.

    ``step``: the framework's count where it has one; ``learning_rate``: where the adapter can read it.
    """

    event: AlertEvent
    epoch: int | None
    batch: int | None
    step: int | None
    learning_rate: float | None
    phase: str

    def context(self) -> dict[str, Any]:
        """The context as handlers receive it."""
        return {k: v for k, v in vars(self).items() if k != "event"}

    def to_dict(self) -> dict[str, Any]:
        """The event and its context as one JSON-ready dict."""
        return {**self.event.to_dict(), **self.context()}


SourceFactory = Callable[..., "SampleSource"]


@dataclass
class Totals:
    """Counters of a run, read by the job's metrics at scrape time (``joules`` and ``memory`` by nvidia-smi index)."""

    steps: int = 0
    samples: int = 0
    data_wait: float = 0.0
    epoch: int | None = None
    joules: dict[int, float] = field(default_factory=dict)
    memory: dict[int, MemoryView] = field(default_factory=dict)


class Output:
    """What a run feeds besides its logs (a recording, the job's metrics, the kernel log's Xid alerts): a base class.

    Opened with each run, fed each sweep's samples of the watched GPUs on the reading thread, closed with the run;
    it says its failures through :meth:`RunMonitor.say`, never raises. ``fields``: what it needs streamed.
    """

    fields: tuple[str, ...] = ()

    def open(self, monitor: RunMonitor) -> None:
        """Start feeding ``monitor``'s run."""

    def take(self, samples: Sequence[GpuSample]) -> None:
        """One sweep's samples of the watched GPUs (by default ignored)."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop; idempotent."""


def _open_stream(fields: Sequence[str], **options: Any) -> SampleSource:
    from smiquery.streams.sync import stream

    return stream(list(fields), **options)


class RunMonitor:
    """Watches the GPUs while a training run goes on, whatever the framework.

    :meth:`start` runs ONE nvidia-smi and a reading thread that stamps each sweep with the training position at its
    arrival, sums it into that epoch, feeds the outputs and checks the alert rules. The training thread only moves
    the position (:meth:`step`, :meth:`begin_epoch`) and collects each epoch's keys (:meth:`end_epoch`).

    ``fields``: extra fields to summarise per epoch; ``alerts``: rules, None for :data:`TRAINING_RULES`;
    ``handlers``: default a :class:`~smiquery.alerts.LogHandler`; ``log_every="batch"`` also offers the newest sample
    per step (:meth:`batch_values`); ``gpus``: nvidia-smi indices or UUIDs to watch instead of
    ``CUDA_VISIBLE_DEVICES`` (of ``env``); ``framework``: its memory view, read at each epoch's end;
    ``first_sample_timeout``: how long the first epoch's end waits for a sample; ``source``: ``(fields, interval=,
    gpus=, nvidia_smi=, on_event=) -> SampleSource`` (default :func:`smiquery.stream`); ``process_share`` and
    ``outputs``: see the Training page of the docs. Raises ValueError, InvalidFieldError or InvalidRuleError.
    """

    def __init__(
        self,
        fields: str | Sequence[str] | None = None,
        interval: float = 1.0,
        alerts: Iterable[Rule | str] | None = None,
        handlers: Sequence[AlertHandler | Callable[[AlertEvent, Mapping[str, Any]], object]] | None = None,
        log_every: Literal["epoch", "batch"] = "epoch",
        *,
        nvidia_smi: str | os.PathLike[str] | None = None,
        gpus: Sequence[int | str] | None = None,
        framework: FrameworkMemory | None = None,
        first_sample_timeout: float = 5.0,
        source: SourceFactory | None = None,
        env: Mapping[str, str] | None = None,
        process_share: bool = False,
        outputs: Sequence[Output] = (),
    ) -> None:
        if log_every not in ("epoch", "batch"):
            raise ValueError(f"log_every must be 'epoch' or 'batch', not {log_every!r}")
        if not interval > 0:
            raise ValueError("interval must be positive")
        self.interval = float(interval)
        self.log_every = log_every
        self.rules: tuple[Rule, ...] = tuple(map(Rule.of, TRAINING_RULES if alerts is None else alerts))
        self.handlers = tuple(handlers) if handlers is not None else (LogHandler(),)
        self.extra_fields: tuple[Field, ...] = resolve_fields(fields) if fields else ()
        self.nvidia_smi = nvidia_smi
        self.gpus_override = tuple(str(g) for g in gpus) if gpus is not None else None
        self.framework = framework
        self.first_sample_timeout = first_sample_timeout
        self._source_factory: SourceFactory = source or _open_stream
        self._env = env
        self.process_share = bool(process_share)
        self.outputs: tuple[Output, ...] = tuple(outputs)
        #: messages said once (:meth:`say`)
        self.notes: list[str] = []
        #: rules dropped because this driver lacks their field
        self.dropped_rules: list[Rule] = []
        #: optional function returning extra alert context (the learning rate), called on the reading thread
        self.context_extra: Callable[[], Mapping[str, Any]] | None = None
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._summary = summary_spec(self.extra_fields)
        self._reset()

    def _reset(self) -> None:
        #: the alerts of the current (or last) run, with their training position
        self.alerts: list[TrainingAlert] = []
        #: per epoch, the keys added to the logs (corrected by late sweeps, the first with ``energy_held_back_s``)
        self.epochs: list[dict[str, float]] = []
        #: counters of the run (steps, samples, data wait, energy): what the metrics report
        self.totals = Totals()
        #: seconds spent: ``first_data`` (start to first sample), ``start``, ``close``, the threads' CPU (``*_cpu``)
        self.cost = dict.fromkeys(("start", "close", "reader_cpu", "worker_cpu", "pmon_cpu"), 0.0)
        self.cost["first_data"] = math.nan
        #: wall time of each :meth:`end_epoch` on the training thread, seconds
        self.epoch_end_seconds: list[float] = []
        self._pos = Position(None, None, 0, "setup")
        self._accs: dict[int | None, EpochAccumulator] = {}
        self._done_epochs: dict[int, EpochAccumulator] = {}
        self._latest: dict[int, GpuSample] = {}
        self._last_t: dict[int, float] = {}
        self._wall_offset = time.time() - time.monotonic()  # arrival (monotonic) -> wall, for untimed samples
        self._batch_values: dict[str, float] = {}
        self._order: list[int] | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._source: SampleSource | None = None
        self._reader: threading.Thread | None = None
        self._worker: threading.Thread | None = None  # the alert handlers', behind a bounded queue
        self._events: _Events = queue.Queue(_EVENT_QUEUE)
        self._notifier = Notifier(self.rules, self.handlers)
        self._opened: tuple[Output, ...] = ()
        self._devices = self._cuda = VisibleDevices(None)
        self._unsure = self._moved = False  # indices in CUDA's default order, checked by _order_check
        self._order_check: Latest[Any] | None = None
        self._pid = os.getpid()  # only the process that started the run closes it (not a forked child)
        self._started_at = time.monotonic()
        self._epoch0 = (self._started_at, 0, 0, 0.0)  # the epoch's start: monotonic time, steps, samples, data wait
        self._energy = EnergySplitter(self.interval, time.time())  # split at epoch boundaries
        self._step_end: float | None = None
        self._waits = self._counts_samples = False
        self._gaps: dict[int, deque[float]] = {}  # each GPU's driver-vs-framework gap over the last epochs
        self._rejected: BaseException | None = None
        self._fields: list[str] = []
        self._share = ShareTracker(self.say, lambda: self._pos.epoch, self._watched_gpu) if self.process_share else None

    def say(self, message: str, level: int = logging.WARNING, *, key: str | None = None) -> None:
        """Log a message once per monitor (by ``key``, default its text) and keep it in :attr:`notes`."""
        key = key or message
        if key in self._said:
            return
        self._said.add(key)
        self.notes.append(message)
        log.log(level, "smiquery: %s", message)

    @property
    def position(self) -> Position:
        """Where training is now, as the adapter last said."""
        return self._pos

    @property
    def running(self) -> bool:
        """True while the nvidia-smi stream is being read."""
        return self._reader is not None and self._reader.is_alive()

    @property
    def source(self) -> SampleSource | None:
        """The sample source being read, if any."""
        return self._source

    def latest(self) -> dict[int, GpuSample]:
        """The newest sample of each watched GPU (by nvidia-smi index)."""
        with self._lock:
            return dict(self._latest)

    def process_shares(self) -> dict[int, ProcessShare]:
        """The newest pmon instant's share per watched GPU (empty without ``process_share`` or before the first)."""
        return self._share.latest() if self._share is not None else {}

    @property
    def stream_fields(self) -> list[str]:
        """The fields nvidia-smi is asked for (the summary's, the extra fields, the rules' and the outputs')."""
        return list(self._fields)

    def start(self) -> RunMonitor:
        """Start a run: the stream, its reading thread, the handler worker and the outputs; returns self.

        Starting again closes the previous run first. Failures are said once, never raised: training goes on
        without GPU numbers.
        """
        self.close()
        self._reset()
        try:
            self._cuda = visible_devices(self._env)
            self._devices = self._cuda if self.gpus_override is None else VisibleDevices(self.gpus_override)
            if self._devices.note:
                self.say(self._devices.note)
            if self._devices.none:
                self.say("CUDA_VISIBLE_DEVICES hides every GPU: GPU monitoring is off")
                return self
            self._unsure = self.gpus_override is None and self._devices.order_unsure
            names = [*_ALWAYS, *(f.name for f in self.extra_fields), *(f.name for r in self.rules for f in r.fields)]
            self._fields = list(dict.fromkeys(names + [name for out in self.outputs for name in out.fields]))
            try:
                self._source = self._open()
            except Exception as exc:  # monitoring must never stop training
                self.say(f"GPU monitoring is off: {exc}")
                return self
            for out in self.outputs:
                out.open(self)
            self._opened = self.outputs
            self._worker = threading.Thread(
                target=self._dispatch, args=(self._events, self.cost), name="smiquery-monitor-handlers", daemon=True
            )
            self._worker.start()
            self._reader = threading.Thread(target=self._read, name="smiquery-monitor-reader", daemon=True)
            self._reader.start()
            OPEN_MONITORS.add(self)
            if self._unsure:
                self._order_check = order_check(self._cuda, self.nvidia_smi, self._order_known).start()
            if self._share is not None:
                self._share.start(interval=self.interval, gpus=self._devices.stream_gpus(), nvidia_smi=self.nvidia_smi)
            return self
        finally:
            self.cost["start"] = time.monotonic() - self._started_at

    def _order_known(self, devices: VisibleDevices | None, message: str, final: bool) -> None:
        """What :func:`~smiquery.training.devices.order_check` found: the job's GPUs (until the keys are fixed)."""
        if devices is not None:
            with self._lock:
                if self._order is not None:
                    return  # the first epoch is logged: its keys stay
                self._devices = devices
                accs = self._accs.values()
                for idx in [i for i, s in self._latest.items() if not devices.selects(i, s.uuid)]:
                    self._energy.drop(idx)  # the GPU turned out not to be the job's: forget it
                    known: list[dict[int, Any]] = [self._latest, self._last_t, self.totals.joules]
                    for known_by_gpu in known + [a.accs for a in accs] + [a.joules for a in accs]:
                        known_by_gpu.pop(idx, None)
                self._moved, source = True, self._source
            if source is not None:
                source.close(2.0)  # the reader opens a stream of the job's GPUs
            if len(devices.ids or ()) == len(self._cuda.ids or ()) == 1:
                self._cuda = devices  # cuda:0 is that GPU (the framework's memory view)
        if message:
            self.say(message, logging.INFO if devices is not None else logging.WARNING, key=f"gpu-order-{final}")

    def _open(self) -> SampleSource:
        return self._source_factory(
            self._fields,
            interval=self.interval,
            gpus=self._devices.stream_gpus(),
            nvidia_smi=self.nvidia_smi,
            on_event=self._on_source_event,
        )

    def _on_source_event(self, event: StreamEvent) -> None:
        err = event.error
        if event.kind == "error" and isinstance(err, _REJECTIONS):
            self._rejected = err
            source = self._source
            if source is not None:
                # not from this thread: the source may be calling us from its own reading thread
                threading.Thread(target=source.close, args=(2.0,), name="smiquery-monitor-reopen", daemon=True).start()
        elif event.kind == "error" and err is not None:
            self.say(
                f"nvidia-smi failed ({type(err).__name__}: {event.detail or err}); it is retried, and the GPU "
                "numbers have a gap until it recovers",
                key=f"error-{type(err).__name__}",
            )
        elif event.kind == "restart":
            self.say(f"nvidia-smi is being restarted ({event.detail}); GPU numbers may have gaps", key="restart")

    def _drop_rejected(self, exc: BaseException) -> bool:
        """Drop the rules (and extra fields) the driver rejected; True when the query changed and can be retried."""
        m = _REJECTED_RE.search(f"{exc} {getattr(exc, 'stderr', '') or ''}")
        named = getattr(exc, "field", None) or (m.group(1) if m else None)
        if named:
            try:
                gone = {resolve_fields([named])[0].name}
            except Exception:
                gone = {named}
            if gone <= set(_ALWAYS):
                return False
        else:  # nvidia-smi did not say which: keep only what the summary needs
            gone = {f.name for r in self.rules for f in r.fields} - set(_ALWAYS) - {f.name for f in self.extra_fields}
        dropped = [r for r in self.rules if {f.name for f in r.fields} & gone]
        extras = tuple(f for f in self.extra_fields if f.name not in gone)
        if not dropped and len(extras) == len(self.extra_fields):
            return False
        self.dropped_rules += dropped
        self.rules = tuple(r for r in self.rules if r not in dropped)
        self.extra_fields = extras
        self._summary = summary_spec(extras)
        self._fields = [n for n in self._fields if n not in gone]
        what = ", ".join(sorted(gone))
        self.say(
            f"this nvidia-smi rejects {what}: dropped {len(dropped)} alert rule(s) "
            f"({'; '.join(str(r) for r in dropped) or 'none'}) and kept watching the other fields",
            key=f"rejected-{what}",
        )
        self._notifier = Notifier(self.rules, self.handlers)
        return True

    def _read(self) -> None:
        select = self._unsure or (self._devices.ids is not None and self._devices.stream_gpus() is None)
        try:
            while (source := self._source) is not None and not self._stop.is_set():
                failure: BaseException | None = None
                try:
                    for sweep in source.sweeps():
                        if self._stop.is_set():
                            return
                        self._take(sweep, select)
                except Exception as exc:
                    failure = exc
                rejected = self._rejected or (failure if isinstance(failure, _REJECTIONS) else None)
                if self._stop.is_set():
                    return
                if not self._moved and rejected is not None:
                    self._rejected = None
                    with contextlib.suppress(Exception):
                        source.close(2.0)
                    self._moved = self._drop_rejected(rejected) or self._moved
                if not self._moved:
                    if failure is not None:
                        self.say(f"GPU monitoring stopped: {failure}")
                    return
                self._moved = False
                self._source = self._open()
        except Exception as exc:
            if not self._stop.is_set():
                self.say(f"GPU monitoring stopped: {exc}")
        finally:
            self.cost["reader_cpu"] = time.thread_time()

    def _take(self, sweep: Sweep, select: bool) -> None:
        """Stamp one sweep with the position now, sum it into that epoch, hand it to the outputs, check the rules."""
        pos = self._pos
        now = arrival(sweep)
        chosen = [s for s in sweep if s.index is not None and (not select or self._devices.selects(s.index, s.uuid))]
        if not chosen:
            return
        for out in self._opened:
            out.take(chosen)
        batch: dict[str, float] = {}
        with self._lock:
            acc = self._accs.get(pos.epoch)
            if acc is None:
                acc = self._accs[pos.epoch] = EpochAccumulator(self._summary)
            acc.sweeps += 1
            for s in chosen:
                idx = s.index
                assert idx is not None
                # energy integrates over nvidia-smi's own timestamps (sweeps delivered together are still apart)
                ts = s.timestamp
                wall = ts.timestamp() if ts is not None else now + self._wall_offset
                self._last_t[idx] = now
                acc.add(idx, s)
                watts = to_number(s.get("power.draw"))
                self._credit(idx, self._energy.sample(idx, wall, watts, pos.epoch), pos.epoch, acc)
                self._latest[idx] = s
                if self.log_every == "batch":
                    for name, suffix in BATCH:
                        v = to_number(s.get(name))
                        batch[f"gpu{idx}_{suffix}"] = math.nan if v is None else v
            if batch:
                self._batch_values = batch
        if not self._first.is_set():
            self.cost["first_data"] = now - self._started_at
            self._first.set()
        notifier = self._notifier
        for s in chosen:
            notifier.observe(s)
            for event in notifier.evaluate(s, now):
                self.alert(event, pos)

    def alert(self, event: AlertEvent, pos: Position | None = None, message: str | None = None) -> None:
        """Keep ``event`` stamped with ``pos`` (default: now), queued for the handlers' thread (with ``message``)."""
        pos = self._pos if pos is None else pos
        got: Mapping[str, Any] = {}
        if self.context_extra is not None:
            with contextlib.suppress(Exception):  # a half-built or torn-down model: context without these
                got = self.context_extra()
        alert = TrainingAlert(
            event, pos.epoch, pos.batch, got.get("step", pos.step), got.get("learning_rate"), pos.phase
        )
        self.alerts.append(alert)
        context = alert.context() if message is None else {**alert.context(), "message": message}
        if self._worker is None:
            return
        try:
            self._events.put_nowait((event, context))
        except queue.Full:
            self.say("alert handlers fall behind: events are being dropped", key="events-full")

    def _dispatch(self, events: _Events, cost: dict[str, float]) -> None:
        try:
            while (item := events.get()) is not None:
                self._notifier.dispatch(*item)
        finally:
            cost["worker_cpu"] = time.thread_time()

    def _credit(
        self, idx: int, parts: Sequence[tuple[int | None, float]], owner: int | None, acc: EpochAccumulator
    ) -> None:
        """Add energy parts of GPU ``idx`` to the run's total and to their epochs (``acc`` is ``owner``'s)."""
        for who, joules in parts:
            self.totals.joules[idx] = self.totals.joules.get(idx, 0.0) + joules
            if who == BETWEEN:
                continue
            target = acc if who == owner else self._accs.get(who)
            if target is None:  # an epoch already summarised: folded back as a late part
                target = self._accs[who] = EpochAccumulator(self._summary)
            target.add_joules(idx, joules)

    def _watched_gpu(self, idx: int) -> bool:
        """Whether an nvidia-smi GPU seen by pmon is one this run watches."""
        return self._devices.ids is None or self._devices.selects(idx, self.uuids().get(idx))

    def begin_epoch(self, epoch: int) -> None:
        """Training enters ``epoch`` (0-based): samples arriving from now on belong to it."""
        t = self.totals
        self._epoch0 = (time.monotonic(), t.steps, t.samples, t.data_wait)
        t.epoch = epoch
        with self._lock:
            self._energy.mark(time.time(), epoch)
        self._pos = Position(epoch, 0, self._pos.step, "train")
        # the time up to the first step is data wait (the loader's first fetch), not the gap since the last epoch
        self._step_end = time.perf_counter()

    def step_begin(self) -> None:
        """A step starts now: the time since the previous step ended counts as data wait."""
        ended = self._step_end
        if ended is not None:
            self.add_data_wait(time.perf_counter() - ended)

    def add_data_wait(self, seconds: float) -> None:
        """Count ``seconds`` of waiting for input (a data loader's fetch) as data wait."""
        self.totals.data_wait += seconds
        self._waits = True

    def step(
        self, epoch: int | None = None, batch: int | None = None, *, samples: int | None = None, step: int | None = None
    ) -> None:
        """One optimizer step is done, of ``epoch`` (a new value starts that epoch) and ``batch`` (default the next).

        ``samples``: training samples in it (for ``samples_per_joule``); ``step``: the framework's global step count
        after it, when it keeps one.
        """
        if epoch is not None and epoch != self._pos.epoch:
            self.begin_epoch(epoch)
        pos = self._pos
        self.totals.steps += 1
        if samples is not None:
            self.totals.samples += samples
            self._counts_samples = True
        done = (batch + 1) if batch is not None else (pos.batch or 0) + 1
        self._pos = Position(pos.epoch, done, step if step is not None else pos.step + 1, pos.phase)
        self._step_end = time.perf_counter()

    def phase(self, phase: str) -> None:
        """Name what training does now (``"train"``, ``"validation"``); alerts carry it."""
        self._pos = self._pos._replace(phase=phase)
        if phase != "train":
            self._step_end = None  # validation time is not data wait

    def batch_values(self) -> dict[str, float]:
        """The newest sample of each GPU as per-step keys (``gpuN_util``...), prepared by the reading thread."""
        return self._batch_values

    def end_epoch(self, epoch: int | None = None) -> dict[str, float]:
        """Summarise the epoch (default the current one): its keys, empty when no GPU was ever seen.

        Never waits on nvidia-smi, except at the first epoch's end for the first sample (``first_sample_timeout``).
        """
        began = time.perf_counter()
        try:
            return self._end_epoch(self._pos.epoch if epoch is None else epoch)
        except Exception:
            log.exception("smiquery: summarising the epoch's GPU samples failed")
            return {}
        finally:
            self.epoch_end_seconds.append(time.perf_counter() - began)

    def _end_epoch(self, epoch: int | None) -> dict[str, float]:
        if self._source is None and self._order is None:
            return {}
        if self._order is None and not self._first.is_set() and self.running and self.first_sample_timeout > 0:
            self._first.wait(self.first_sample_timeout)
        now = time.monotonic()
        with self._lock:
            acc = self._accs.pop(epoch, None) or EpochAccumulator(self._summary)
            wall = time.time()  # the epoch's energy runs up to now: the newest power stands for the rest
            for idx in list(self._energy.last):
                self._credit(idx, self._energy.tail(idx, wall, epoch), epoch, acc)
            self._energy.mark(wall, BETWEEN if epoch is not None else None)
            held = self._energy.held.pop(epoch, 0.0) if epoch is not None else 0.0
            if not self.epochs:
                held += self._energy.held.pop(None, 0.0)
            if not self.epochs and None in self._accs:
                acc.merge(self._accs.pop(None))  # samples before the first epoch began: setup of the first epoch
            late = {k: self._accs.pop(k) for k in list(self._accs) if k is not None and epoch is not None and k < epoch}
            latest = dict(self._latest)
            fresh = now - max(self._last_t.values(), default=-math.inf) <= max(3 * self.interval, 5.0)
        if self._order_check is not None:
            self._order_check.close(0.0)  # the keys are fixed from here on
        if self._order is None:
            self._fix_order(acc, latest, epoch)
        order = self._order or []
        values = acc.values(order, latest if fresh else None)
        late_sweeps = self._fold_late(late, order)
        if late_sweeps:
            values["gpu_late_sweeps"] = float(late_sweeps)
        energy = [v for k, v in values.items() if k.endswith("_energy_wh") and not math.isnan(v)]
        t = self.totals
        began, steps0, samples0, wait0 = self._epoch0
        if order:
            samples = t.samples - samples0 if self._counts_samples else None
            wait = t.data_wait - wait0 if self._waits else None
            values.update(
                throughput_values(sum(energy) if energy else math.nan, t.steps - steps0, samples, now - began, wait)
            )
            values.update(self._framework_values(latest))
            if self._share is not None:
                values.update(self._share.epoch_values(epoch, order, first=not self.epochs))
        if epoch is not None:
            self._done_epochs[epoch] = acc
        record = dict(values)  # a copy: late sweeps correct this record, not the logs handed out
        if held > 0:
            record["energy_held_back_s"] = held
        self.epochs.append(record)
        return values

    def _fix_order(self, acc: EpochAccumulator, latest: Mapping[int, GpuSample], epoch: int | None) -> None:
        """Fix the GPUs whose keys the logs carry, at the first epoch end that has a sample."""
        order = sorted(set(acc.accs) | set(latest))
        if not order and self._devices.ids and all(i.isdigit() for i in self._devices.ids):
            order = sorted(int(i) for i in self._devices.ids)
        if not order:
            self.say("nvidia-smi gave no sample before the first epoch ended: no GPU numbers in these logs yet")
            return
        self._order = order
        if self.epochs or (epoch or 0) > 0:
            self.say(
                f"nvidia-smi's first sample came {self.cost.get('first_data', math.nan):.1f} s after training "
                f"began, after epoch {len(self.epochs) - 1 if self.epochs else 0}: earlier epochs have no "
                "GPU numbers in their logs (slow nvidia-smi start; persistence mode shortens it)",
                key="late-first",
            )

    def _fold_late(self, late: Mapping[int, EpochAccumulator], order: Sequence[int]) -> int:
        """Sweeps stamped with an epoch already summarised: correct :attr:`epochs`, return how many there were."""
        count = 0
        for k, extra in late.items():
            count += extra.sweeps
            base = self._done_epochs.get(k)
            if base is None:
                continue
            base.merge(extra)
            if 0 <= k < len(self.epochs):
                self.epochs[k].update(base.values(order))
        return count

    def _framework_values(self, latest: Mapping[int, GpuSample]) -> dict[str, float]:
        fw = self.framework
        if fw is None:
            return {}
        why = fw.available()
        if why is not None:
            self.say(why, logging.WARNING if "CPU" in why else logging.INFO, key="framework-unavailable")
            self.framework = None
            return {}
        try:
            views = fw.read()
        except Exception as exc:
            self.say(f"{fw.name} cannot report its GPU memory ({exc}): the memory gap is not reported", logging.INFO)
            self.framework = None
            return {}
        known = {idx: s.uuid for idx, s in latest.items()}
        out: dict[str, float] = {}
        for view in views:
            idx = self._cuda.nvsmi_index(view.ordinal, known)
            if idx is None or (self._order is not None and idx not in self._order):
                continue
            keys = view.values(idx, to_number(latest[idx].get("memory.used")) if idx in latest else None)
            out.update(keys)
            self.totals.memory[idx] = view
            self.watch_gap(idx, keys[f"gpu{idx}_mem_gap_mib"], view, fw.name)
        return out

    def watch_gap(self, idx: int, gap: float, view: MemoryView, framework: str) -> None:
        """Track GPU ``idx``'s driver-vs-framework ``gap`` (MiB, NaN ignored) against ``framework``'s ``view``.

        When it grew for several epochs in a row it is said once and handed to the handlers as an alert event.
        """
        history = gap_grew(self._gaps, idx, gap)
        if history is None or f"gap-{idx}" in self._said:
            return
        newest = self.latest().get(idx)
        at = newest.timestamp if newest is not None and newest.timestamp is not None else datetime.now().astimezone()
        note, event = gap_event(idx, self.uuids().get(idx), framework, view, history, at)
        self.say(note, key=f"gap-{idx}")
        self.alert(event, message=note)

    def uuids(self) -> dict[int, str]:
        """The UUID of each watched GPU seen so far (nvidia-smi index -> UUID)."""
        with self._lock:
            return {idx: s.uuid for idx, s in self._latest.items() if s.uuid}

    def close(self, timeout: float = 5.0) -> None:
        """Stop: nvidia-smi terminated and reaped, threads ended, outputs closed. Idempotent; safe from any thread.

        Alert handlers get about two seconds to finish; ``timeout`` bounds the wait for the stream to stop.
        """
        began = time.monotonic()
        if self._pid != os.getpid():
            self._reset()  # a forked child (a data-loader worker): let go of the parent's run, closing would end it
            return
        with self._closing:
            idle = not self._opened and all(x is None for x in (self._source, self._reader, self._worker))
            if idle and not (self._share is not None and self._share.open):
                return  # nothing open: keep the last run's cost figures
            self._stop.set()
            self._pos = self._pos._replace(phase="done")
            source, self._source = self._source, None
            if source is not None:
                try:
                    source.close(timeout)
                except Exception:
                    log.exception("smiquery: stopping nvidia-smi failed")
            check, self._order_check = self._order_check, None
            if check is not None:
                check.close(timeout)
            if self._share is not None:
                self._share.close(timeout)
                self.cost["pmon_cpu"] = self._share.cpu
            reader, self._reader = self._reader, None
            if reader is not None and reader is not threading.current_thread():
                reader.join(timeout)
            worker, self._worker = self._worker, None
            if worker is not None:  # the handlers finish the queued events, within about three seconds
                with contextlib.suppress(queue.Full):
                    self._events.put(None, timeout=1.0)
                if worker is not threading.current_thread():
                    worker.join(2.0)
            opened, self._opened = self._opened, ()
            for out in opened:
                out.close(timeout)
            self._notifier.close(timeout=2.0)
            OPEN_MONITORS.discard(self)
        self.cost["close"] = time.monotonic() - began

    def __enter__(self) -> RunMonitor:
        return self.start() if self._source is None and not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Monitors whose stream this process opened, closed at interpreter exit; a forked child starts with none.
OPEN_MONITORS: weakref.WeakSet[RunMonitor] = weakref.WeakSet()


@atexit.register
def _close_open_monitors() -> None:
    for monitor in list(OPEN_MONITORS):
        with contextlib.suppress(Exception):
            monitor.close(timeout=2.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=OPEN_MONITORS.clear)


def _view(name: str, doc: str) -> Any:
    return property(lambda self: getattr(self.monitor, name), doc=doc)


class MonitorView:
    """Read-only views of ``self.monitor``, the same in every framework's callback and in a plain loop's watch."""

    monitor: RunMonitor
    alerts: list[TrainingAlert] = _view(
        "alerts", "The alerts of the current (or last) run, with their training position."
    )
    epochs: list[dict[str, float]] = _view(
        "epochs", "Per epoch, the numbers added to the logs (or given to ``on_epoch``)."
    )
    notes: list[str] = _view("notes", "Messages said once (monitoring unavailable, rules dropped, a growing gap...).")
    cost: dict[str, float] = _view("cost", "What monitoring cost in the last run (see :attr:`RunMonitor.cost`).")
    running: bool = _view("running", "True while the background nvidia-smi is being read.")

    def latest(self) -> dict[int, GpuSample]:
        """The newest sample of each watched GPU (by nvidia-smi index)."""
        return self.monitor.latest()
