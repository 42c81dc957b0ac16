"""A Keras callback that watches the GPUs during ``model.fit``: :class:`GpuMonitor` (``pip install 'smiquery[keras]'``).

One nvidia-smi child in loop mode runs beside the training for its whole length (never one per batch); its
sweeps are summarised into the epoch logs and checked against alert rules. ``import smiquery`` never imports
this module (it imports Keras).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import keras

from smiquery.alerts import AlertEvent, Rule
from smiquery.fields import Field, Kind, resolve_fields
from smiquery.notify import AlertHandler, LogHandler, Notifier
from smiquery.report import DEFAULT_RULES

if TYPE_CHECKING:
    from smiquery.records import GpuSample
    from smiquery.source import StreamEvent, Sweep
    from smiquery.supervisor import Stream

__all__ = ["GpuMonitor", "TrainingAlert", "VisibleDevices", "visible_devices"]

log = logging.getLogger("smiquery.keras")

#: Fields always streamed: what the epoch summary needs.
SUMMARY_FIELDS: tuple[str, ...] = ("utilization.gpu", "temperature.gpu", "memory.used", "power.draw")

# (field, log key suffix, statistic) of the epoch summary; the key is f"gpu{index}_{suffix}".
_SUMMARY: tuple[tuple[str, str, str], ...] = (
    ("utilization.gpu", "util_mean", "mean"),
    ("utilization.gpu", "util_max", "max"),
    ("temperature.gpu", "temp_max", "max"),
    ("memory.used", "mem_used_max_mib", "max"),
    ("power.draw", "power_mean_w", "mean"),
)
# the per-batch keys of log_every="batch": the newest sample's value
_BATCH: tuple[tuple[str, str], ...] = (
    ("utilization.gpu", "util"),
    ("temperature.gpu", "temp"),
    ("memory.used", "mem_used_mib"),
    ("power.draw", "power_w"),
)
_UUID_PREFIX_RE = re.compile(r"GPU-[0-9a-fA-F-]+")
_FULL_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_WATCH_PERIOD = 0.2
# the gap between driver-used and framework-allocated memory must grow this much (MiB) over
# _GAP_EPOCHS epochs in a row before it is reported as growing
_GAP_GROWTH_MIB = 256.0
_GAP_EPOCHS = 3


# --------------------------------------------------------------------------------------------- visible devices


@dataclass(frozen=True)
class VisibleDevices:
    """The GPUs a CUDA process can see, as ``CUDA_VISIBLE_DEVICES`` names them, in CUDA's order.

    Attributes:
        ids: indices (``"1"``) or UUIDs (``"GPU-8932f937-..."``, prefixes allowed as CUDA allows them), in the
            order CUDA numbers them (``GPU:0`` is ``ids[0]``); None when the variable is unset (all GPUs).
        note: why something could not be honoured (MIG instances, an invalid entry), or ``""``.
    """

    ids: tuple[str, ...] | None
    note: str = ""

    @property
    def none(self) -> bool:
        """True when the process sees no GPU at all (``""`` or ``-1``)."""
        return self.ids is not None and not self.ids

    def stream_gpus(self) -> tuple[str, ...] | None:
        """The ``-i`` ids for nvidia-smi, or None to query all GPUs (and filter with :meth:`selects`)."""
        if self.ids is None or not self.ids:
            return None
        if all(i.isdigit() or _FULL_UUID_RE.fullmatch(i) for i in self.ids):
            return self.ids
        return None  # UUID prefixes: nvidia-smi wants whole UUIDs, so filter the rows instead

    def selects(self, index: int | None, uuid: str | None) -> bool:
        """Whether an nvidia-smi GPU (by index and UUID) is one of the visible ones."""
        return self.position(index, uuid) is not None if self.ids else self.ids is None

    def position(self, index: int | None, uuid: str | None) -> int | None:
        """The CUDA ordinal (``GPU:k``) of an nvidia-smi GPU, or None when it is not visible."""
        if self.ids is None:
            return index
        u = (uuid or "").lower()
        for k, item in enumerate(self.ids):
            if item.isdigit():
                if index is not None and int(item) == index:
                    return k
            elif u and u.startswith(item.lower()):
                return k
        return None


def visible_devices(env: Mapping[str, str] | None = None) -> VisibleDevices:
    """Read ``CUDA_VISIBLE_DEVICES`` the way CUDA does.

    Entries are indices or UUIDs (whole or a unique prefix such as ``GPU-8932f937``); CUDA stops at the first
    invalid entry (``"0,2,-1,3"`` means 0 and 2), and ``""`` or ``-1`` hides every GPU. Indices follow
    nvidia-smi's (PCI bus) order only when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are all the same model;
    CUDA's default order puts the fastest GPU first. MIG instances (``MIG-...``) cannot be mapped to their
    parent GPU from the variable alone; then every GPU is watched and :attr:`VisibleDevices.note` says why.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The visible devices.
    """
    environ = os.environ if env is None else env
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return VisibleDevices(None)
    ids: list[str] = []
    note = ""
    for part in raw.split(","):
        item = part.strip()
        if item.isdigit() and item.isascii():
            ids.append(str(int(item)))
        elif _UUID_PREFIX_RE.fullmatch(item):
            ids.append(item)
        elif item.startswith("MIG-"):
            return VisibleDevices(
                None,
                f"CUDA_VISIBLE_DEVICES={raw!r} names MIG instances, whose parent GPUs it does not tell; "
                "watching every GPU",
            )
        else:
            if item and item != "-1":
                note = (
                    f"CUDA_VISIBLE_DEVICES={raw!r}: {item!r} is not a GPU index or UUID; CUDA ignores it and the rest"
                )
            break  # CUDA stops at the first invalid entry
    return VisibleDevices(tuple(dict.fromkeys(ids)), note)


# ----------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TrainingAlert:
    """An alert event with where training was when it happened.

    Attributes:
        event: the alert event (rule, GPU, value, state, duration).
        epoch: the epoch (0-based, as Keras counts) or None before the first epoch began.
        batch: optimizer steps taken in this epoch when the alert was seen (the batch in progress), if known.
        step: optimizer steps taken since training began (``optimizer.iterations``), if known.
        learning_rate: the optimizer's learning rate at that moment (schedules evaluated), if known.
        phase: ``"train"``, ``"validation"`` or ``"setup"`` (before the first epoch).
    """

    event: AlertEvent
    epoch: int | None
    batch: int | None
    step: int | None
    learning_rate: float | None
    phase: str

    def context(self) -> dict[str, Any]:
        """The context as handlers receive it."""
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "step": self.step,
            "learning_rate": self.learning_rate,
            "phase": self.phase,
        }

    def to_dict(self) -> dict[str, Any]:
        """The event and its context as one JSON-ready dict."""
        return {**self.event.to_dict(), **self.context()}


class _Acc:
    """Running count, sum and maximum of one field on one GPU."""

    __slots__ = ("max", "n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.max = -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if x > self.max:
            self.max = x

    def value(self, stat: str) -> float:
        if not self.n:
            return math.nan
        return self.total / self.n if stat == "mean" else self.max


def _number(value: object) -> float | None:
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _scalar(value: Any) -> float | None:
    """A Python float from a Keras variable, tensor, schedule value or number; None when it cannot be read."""
    if value is None:
        return None
    try:
        return float(keras.ops.convert_to_numpy(value))
    except Exception:
        try:
            return float(value)
        except Exception:
            return None


# ------------------------------------------------------------------------------------------------- callback


class GpuMonitor(keras.callbacks.Callback):  # type: ignore[misc]
    """Watches the GPUs while ``model.fit`` runs and writes what it saw into the epoch logs.

    At ``on_train_begin`` it starts ONE background nvidia-smi in loop mode (``-lms``/``-l``); a thread reads its
    sweeps into per-epoch running sums (constant memory) and checks them against alert rules. At
    ``on_train_end`` it stops and reaps the child. Keras does not call ``on_train_end`` when ``fit`` raises, so a
    watchdog thread notices that ``fit`` has left the stack (an exception, Ctrl-C) and stops it then, within
    0.2 s. Nothing runs per batch unless ``log_every="batch"``, and even then nvidia-smi is not called: the
    newest sample is read from memory.

    Per epoch it adds these keys to ``logs`` (so ``History``, ``CSVLogger`` and ``TensorBoard`` record them;
    list ``GpuMonitor`` before those callbacks), for each watched GPU ``N`` (nvidia-smi's index):

    ============================  =================================================================
    ``gpuN_util_mean``            mean ``utilization.gpu`` over the epoch's samples, percent
    ``gpuN_util_max``             highest ``utilization.gpu``, percent
    ``gpuN_temp_max``             highest ``temperature.gpu``, C
    ``gpuN_mem_used_max_mib``     peak ``memory.used`` as the driver reports it, MiB
    ``gpuN_power_mean_w``         mean ``power.draw``, W
    ``gpuN_<attr>_mean/_max``     the same for each extra numeric field in ``fields``
    ``gpuN_<attr>_frac``          share of samples in which an extra yes/no field was true (0 to 1)
    ``gpuN_mem_framework_mib``    memory TensorFlow has allocated on that GPU (when TensorFlow sees it)
    ``gpuN_mem_gap_mib``          driver-reported used minus TensorFlow-allocated memory, MiB
    ============================  =================================================================

    An epoch shorter than the sampling interval reports the newest sample. The key set is fixed at the first
    epoch (CSVLogger needs that); a value with no data is NaN. A gap that grows for several epochs in a row
    is logged once: memory held outside TensorFlow's allocator (another process, a leaked context, a library
    allocating on its own). Without TensorFlow's view (CPU-only TensorFlow, another backend) it says so once.

    With ``log_every="batch"`` each batch's logs also get ``gpuN_util``, ``gpuN_temp``, ``gpuN_mem_used_mib``
    and ``gpuN_power_w`` (the newest sample; cheap).

    When an alert fires or clears, the handlers get the event with its context: epoch, batch, step, learning
    rate and phase (see :class:`TrainingAlert`); :attr:`alerts` keeps them.

    Only the GPUs this process can see are watched: ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) is mapped to
    nvidia-smi's GPUs (see :func:`visible_devices`). No nvidia-smi, or no visible GPU, is said once, and
    training goes on without the numbers. Monitoring never raises into training.

    Example::

        monitor = GpuMonitor(alerts=["temperature.gpu > 85 for 3"], handlers=[LogHandler(), WebhookHandler(url)])
        model.fit(x, y, epochs=10, callbacks=[monitor, keras.callbacks.CSVLogger("train.csv")])

    Args:
        fields: extra fields to summarise per epoch (names or a comma list), beyond the built-in summary.
        interval: seconds between samples.
        alerts: rules or ``--alert`` expressions; None for :data:`smiquery.alerts.BUILTIN_RULES`, ``()`` for none.
        handlers: where alert events go (default: a :class:`~smiquery.notify.LogHandler`).
        log_every: ``"epoch"``, or ``"batch"`` to add the newest sample to every batch's logs as well.
        nvidia_smi: path of nvidia-smi (default: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        gpus: nvidia-smi indices or UUIDs to watch instead of those ``CUDA_VISIBLE_DEVICES`` gives (the
            mapping of TensorFlow's devices for the memory gap still follows ``CUDA_VISIBLE_DEVICES``).
        framework_memory: read TensorFlow's per-GPU allocation and report the gap to the driver's figure.
        first_sample_timeout: at the first epoch end, seconds to wait for nvidia-smi's first sample when none
            has come yet (so that the log keys are known).

    Raises:
        ValueError: ``log_every`` or ``interval`` is invalid.
        InvalidFieldError: a field name is unknown.
        InvalidRuleError: an alert expression cannot be parsed.
    """

    # the batch hook only reads memory, so Keras may dispatch it asynchronously
    async_safe = True

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
        framework_memory: bool = True,
        first_sample_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        if log_every not in ("epoch", "batch"):
            raise ValueError(f"log_every must be 'epoch' or 'batch', not {log_every!r}")
        if not interval > 0:
            raise ValueError("interval must be positive")
        self.interval = float(interval)
        self.log_every = log_every
        self.rules: tuple[Rule, ...] = tuple(
            r if isinstance(r, Rule) else Rule.parse(r) for r in (DEFAULT_RULES if alerts is None else alerts)
        )
        self.handlers = tuple(handlers) if handlers is not None else (LogHandler(),)
        self.extra_fields: tuple[Field, ...] = resolve_fields(fields) if fields else ()
        self.nvidia_smi = nvidia_smi
        self.gpus_override = tuple(str(g) for g in gpus) if gpus is not None else None
        self.framework_memory = framework_memory
        self.first_sample_timeout = first_sample_timeout
        self._summary = list(_SUMMARY)
        for fld in self.extra_fields:
            if fld.name in SUMMARY_FIELDS or fld.name in ("index", "uuid", "timestamp"):
                continue
            if fld.kind in (Kind.INT, Kind.FLOAT):
                self._summary += [(fld.name, f"{fld.attr}_mean", "mean"), (fld.name, f"{fld.attr}_max", "max")]
            elif fld.kind.is_bool:
                self._summary.append((fld.name, f"{fld.attr}_frac", "mean"))
        #: the alerts of the current (or last) fit, with their training context
        self.alerts: list[TrainingAlert] = []
        #: per epoch, the numbers added to the logs
        self.epochs: list[dict[str, float]] = []
        #: messages said once (monitoring unavailable, framework view missing, growing gap)
        self.notes: list[str] = []
        #: what monitoring cost in the last fit, in seconds: ``hooks`` (wall time inside this callback's hooks on
        #: the training thread), ``reader_cpu`` and ``watchdog_cpu`` (CPU time of its two threads)
        self.cost: dict[str, float] = {"hooks": 0.0, "reader_cpu": 0.0, "watchdog_cpu": 0.0}
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._acc: dict[int, dict[str, _Acc]] = {}
        self._latest: dict[int, GpuSample] = {}
        self._latest_at = 0.0
        self._order: list[int] | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._stream: Stream | None = None
        self._reader: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._notifier: Notifier | None = None
        self._devices = VisibleDevices(None)
        self._cuda = VisibleDevices(None)
        self._epoch: int | None = None
        self._batch: int | None = None
        self._phase = "setup"
        self._steps_at_epoch: int | None = None
        self._fit_frame: tuple[int, int, Any] | None = None
        self._framework: list[tuple[str, int]] | None = None
        self._gaps: dict[int, deque[float]] = {}
        if log_every == "batch":
            # assigned per instance, so that epoch-only monitors leave Keras's batch dispatch untouched
            self.on_train_batch_end = self._batch_end

    # ----------------------------------------------------------------------------------------- keras hooks

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Start the background nvidia-smi and the threads that read and watch it."""
        began = time.perf_counter()
        self.close()
        self.cost = {"hooks": 0.0, "reader_cpu": 0.0, "watchdog_cpu": 0.0}
        self.alerts = []
        self.epochs = []
        self._stop = threading.Event()
        self._first = threading.Event()
        self._acc, self._latest, self._order = {}, {}, None
        self._epoch = self._batch = self._steps_at_epoch = None
        self._phase = "setup"
        self._gaps = {}
        self._notifier = Notifier(self.rules, self.handlers) if self.rules else None
        try:
            self._start_stream()
        except Exception as exc:  # monitoring must never stop training
            self._say(f"GPU monitoring is off: {exc}", logging.WARNING)
            self._stream = None
        self._framework = self._framework_devices() if self.framework_memory and self._stream is not None else None
        if self._stream is not None:
            self._find_fit_frame()
            self._watchdog = threading.Thread(target=self._watch, name="smiquery-keras-watchdog", daemon=True)
            self._watchdog.start()
        self.cost["hooks"] += time.perf_counter() - began

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Note the epoch and the step count at its start (for the alert context)."""
        began = time.perf_counter()
        self._epoch = epoch
        self._batch = None
        self._phase = "train"
        if self._stream is not None:
            self._steps_at_epoch = self._steps()
        self.cost["hooks"] += time.perf_counter() - began

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Validation inside ``fit`` starts (alerts now say phase ``validation``)."""
        if self._phase == "train":
            self._phase = "validation"

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Validation inside ``fit`` ends."""
        if self._phase == "validation":
            self._phase = "train"

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Add the epoch's GPU summary (and the framework's memory view) to ``logs``."""
        began = time.perf_counter()
        self._phase = "train"
        if self._stream is None and self._order is None:
            return
        try:
            values = self._epoch_values()
        except Exception:
            log.exception("smiquery: summarising the epoch's GPU samples failed")
            return
        self.epochs.append(values)
        if logs is not None:
            logs.update(values)
        self.cost["hooks"] += time.perf_counter() - began

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Stop the background nvidia-smi (reaped) and the threads."""
        began = time.perf_counter()
        self.close()
        self.cost["hooks"] += time.perf_counter() - began

    def _batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch = batch
        if logs is None or (self._order is None and not self._latest):
            return
        latest = self._latest
        for idx in self._order or sorted(latest):
            s = latest.get(idx)
            for name, suffix in _BATCH:
                v = _number(s.get(name)) if s is not None else None
                logs[f"gpu{idx}_{suffix}"] = math.nan if v is None else v

    # --------------------------------------------------------------------------------------------- stream

    def _say(self, message: str, level: int = logging.WARNING, *, key: str | None = None) -> None:
        """Log a message once per monitor (by its text, or by ``key``), so that a long run is not flooded."""
        key = key or message
        if key in self._said:
            return
        self._said.add(key)
        self.notes.append(message)
        log.log(level, "smiquery: %s", message)

    def _start_stream(self) -> None:
        from smiquery.supervisor import stream

        self._cuda = visible_devices()
        if self.gpus_override is not None:
            self._devices = VisibleDevices(self.gpus_override)
        else:
            self._devices = self._cuda
            if self._devices.note:
                self._say(self._devices.note, logging.WARNING)
        if self._devices.none:
            self._say("CUDA_VISIBLE_DEVICES hides every GPU: GPU monitoring is off", logging.WARNING)
            self._stream = None
            return
        names = ["index", "uuid", "timestamp", *SUMMARY_FIELDS]
        names += [f.name for f in self.extra_fields]
        names += [f.name for r in self.rules for f in r.fields]
        self._stream = stream(
            list(dict.fromkeys(names)),
            interval=self.interval,
            gpus=self._devices.stream_gpus(),
            nvidia_smi=self.nvidia_smi,
            on_event=self._on_stream_event,
        )
        self._reader = threading.Thread(target=self._read, name="smiquery-keras-reader", daemon=True)
        self._reader.start()
        _OPEN.add(self)

    def _on_stream_event(self, event: StreamEvent) -> None:
        if event.kind == "restart":
            self._say(f"nvidia-smi is being restarted ({event.detail}); GPU numbers may have gaps", logging.WARNING)

    def _read(self) -> None:
        stream_ = self._stream
        if stream_ is None:
            return
        select = self._devices.ids is not None and self._devices.stream_gpus() is None
        try:
            for sweep in stream_.sweeps():
                if self._stop.is_set():
                    break
                self._take(sweep, select)
        except Exception as exc:
            if not self._stop.is_set():
                self._say(f"GPU monitoring stopped: {exc}", logging.WARNING)
        finally:
            self.cost["reader_cpu"] = time.thread_time()

    def _take(self, sweep: Sweep, select: bool) -> None:
        chosen = [s for s in sweep if not select or self._devices.selects(s.index, s.uuid)]
        with self._lock:
            for s in chosen:
                idx = s.index
                if idx is None:
                    continue
                accs = self._acc.get(idx)
                if accs is None:
                    accs = self._acc[idx] = {}
                for name, _suffix, _stat in self._summary:
                    v = _number(s.get(name))
                    if v is not None:
                        acc = accs.get(name)
                        if acc is None:
                            acc = accs[name] = _Acc()
                        acc.add(v)
                self._latest[idx] = s
            self._latest_at = time.monotonic()
        if chosen:
            self._first.set()
        notifier = self._notifier
        if notifier is None:
            return
        for s in chosen:
            for event in notifier.evaluate(s):
                alert = self._alert(event)
                self.alerts.append(alert)
                notifier.dispatch(event, alert.context())

    # ----------------------------------------------------------------------------------------- context

    def _optimizer(self) -> Any:
        try:
            model = self.model
        except Exception:
            return None
        return getattr(model, "optimizer", None)

    def _steps(self) -> int | None:
        opt = self._optimizer()
        steps = _scalar(getattr(opt, "iterations", None)) if opt is not None else None
        return None if steps is None else int(steps)

    def _learning_rate(self) -> float | None:
        opt = self._optimizer()
        if opt is None:
            return None
        try:
            lr = opt.learning_rate
        except Exception:
            lr = getattr(opt, "lr", None)
        if callable(lr) and not hasattr(lr, "numpy"):
            try:
                lr = lr(opt.iterations)  # a schedule given as a function of the step
            except Exception:
                return None
        return _scalar(lr)

    def _alert(self, event: AlertEvent) -> TrainingAlert:
        step = batch = None
        lr = None
        try:
            step = self._steps()
            lr = self._learning_rate()
        except Exception:  # a half-built or torn-down model: context without these
            pass
        if self._batch is not None:
            batch = self._batch
        elif step is not None and self._steps_at_epoch is not None:
            batch = step - self._steps_at_epoch
        return TrainingAlert(event, self._epoch, batch, step, lr, self._phase)

    # -------------------------------------------------------------------------------------------- epoch

    def _epoch_values(self) -> dict[str, float]:
        if self._order is None and not self._first.is_set() and self._stream is not None:
            self._first.wait(self.first_sample_timeout)
        with self._lock:
            acc, self._acc = self._acc, {}
            latest = dict(self._latest)
            fresh = time.monotonic() - self._latest_at <= max(3 * self.interval, 5.0)
        if self._order is None:
            order = sorted(set(acc) | set(latest))
            if not order and self._devices.ids and all(i.isdigit() for i in self._devices.ids):
                order = sorted(int(i) for i in self._devices.ids)
            self._order = order
            if not order:
                self._say("nvidia-smi gave no sample before the first epoch ended: no GPU numbers in the logs")
        values: dict[str, float] = {}
        for idx in self._order:
            accs = acc.get(idx) or {}
            last = latest.get(idx) if fresh else None
            for name, suffix, stat in self._summary:
                a = accs.get(name)
                if a is not None and a.n:
                    v = a.value(stat)
                else:
                    # an epoch shorter than the interval: the newest sample stands for it
                    x = _number(last.get(name)) if last is not None else None
                    v = math.nan if x is None else x
                values[f"gpu{idx}_{suffix}"] = v
        values.update(self._framework_values(latest))
        return values

    # -------------------------------------------------------------------------------- framework view

    def _framework_devices(self) -> list[tuple[str, int]] | None:
        """(TensorFlow device name, CUDA ordinal) of each GPU TensorFlow sees, or None (said once why)."""
        backend = keras.backend.backend()
        if backend != "tensorflow":
            self._say(
                f"the Keras backend is {backend}: the framework's memory view is read only with TensorFlow; "
                "the driver-vs-framework memory gap is not reported",
                logging.INFO,
            )
            return None
        try:
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
        except Exception as exc:
            self._say(f"cannot ask TensorFlow for its GPUs ({exc}): the memory gap is not reported", logging.INFO)
            return None
        if not gpus:
            self._say(
                "TensorFlow sees no GPU (CPU-only build or no visible device): "
                "the driver-vs-framework memory gap is not reported",
                logging.WARNING,
            )
            return None
        return [(f"GPU:{k}", k) for k in range(len(gpus))]

    def _nvsmi_index(self, ordinal: int, latest: Mapping[int, GpuSample]) -> int | None:
        """The nvidia-smi index of CUDA device ``ordinal`` (TensorFlow's ``GPU:k``)."""
        ids = self._cuda.ids
        if ids is None:
            return ordinal
        if ordinal >= len(ids):
            return None
        item = ids[ordinal]
        if item.isdigit():
            return int(item)
        for idx, s in latest.items():
            if (s.uuid or "").lower().startswith(item.lower()):
                return idx
        return None

    def _framework_values(self, latest: Mapping[int, GpuSample]) -> dict[str, float]:
        if not self._framework:
            return {}
        import tensorflow as tf

        out: dict[str, float] = {}
        for name, ordinal in self._framework:
            idx = self._nvsmi_index(ordinal, latest)
            if idx is None or (self._order is not None and idx not in self._order):
                continue
            try:
                info = tf.config.experimental.get_memory_info(name)
            except Exception as exc:
                self._say(f"TensorFlow cannot report memory for {name} ({exc}): the gap is not reported", logging.INFO)
                self._framework = None
                return {}
            framework_mib = float(info.get("current", 0)) / 2**20
            s = latest.get(idx)
            used = _number(s.get("memory.used")) if s is not None else None
            gap = math.nan if used is None else used - framework_mib
            out[f"gpu{idx}_mem_framework_mib"] = framework_mib
            out[f"gpu{idx}_mem_gap_mib"] = gap
            self._watch_gap(idx, gap)
        return out

    def _watch_gap(self, idx: int, gap: float) -> None:
        if math.isnan(gap):
            return
        history = self._gaps.setdefault(idx, deque(maxlen=_GAP_EPOCHS + 1))
        history.append(gap)
        if len(history) <= _GAP_EPOCHS:
            return
        steps = [b - a for a, b in zip(history, list(history)[1:])]
        if all(d > 0 for d in steps) and history[-1] - history[0] >= _GAP_GROWTH_MIB:
            self._say(
                f"GPU {idx}: the memory the driver reports used exceeds what TensorFlow allocated by "
                f"{history[-1]:.0f} MiB and the gap grew for {_GAP_EPOCHS} epochs in a row "
                f"(+{history[-1] - history[0]:.0f} MiB): another process or a leaked context holds GPU memory; "
                "check `smiquery ps`",
                logging.WARNING,
                key=f"gap-{idx}",
            )

    # -------------------------------------------------------------------------------------------- watchdog

    def _find_fit_frame(self) -> None:
        """Remember the ``fit`` frame that called us, so the watchdog can tell when ``fit`` has left the stack."""
        try:
            model = self.model
        except Exception:
            model = None
        frame: FrameType | None = sys._getframe(1)
        found: FrameType | None = None
        while frame is not None:
            if frame.f_code.co_name == "fit":
                try:
                    if frame.f_locals.get("self") is model:
                        found = frame  # keep going: the outermost fit of this model wins
                except Exception:
                    pass
            frame = frame.f_back
        # ids only: holding the frame would keep the training data alive after fit returns
        self._fit_frame = (threading.get_ident(), id(found), found.f_code) if found is not None else None

    def _fit_running(self) -> bool:
        if self._fit_frame is None:
            return True
        tid, fid, code = self._fit_frame
        frame = sys._current_frames().get(tid)
        while frame is not None:
            if id(frame) == fid and frame.f_code is code:
                return True
            frame = frame.f_back
        return False

    def _watch(self) -> None:
        try:
            while not self._stop.wait(_WATCH_PERIOD):
                if not self._fit_running():
                    log.debug("smiquery: fit ended without on_train_end (an exception); stopping nvidia-smi")
                    self._shutdown(from_watchdog=True)
                    return
        finally:
            self.cost["watchdog_cpu"] = time.thread_time()

    # ----------------------------------------------------------------------------------------------- close

    def _shutdown(self, *, from_watchdog: bool = False) -> None:
        with self._closing:
            self._close_locked(from_watchdog)

    def _close_locked(self, from_watchdog: bool) -> None:
        self._stop.set()
        stream_ = self._stream
        self._stream = None
        if stream_ is not None:
            try:
                stream_.close(timeout=5.0)
            except Exception:
                log.exception("smiquery: stopping nvidia-smi failed")
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(5.0)
        self._reader = None
        watchdog = self._watchdog
        if watchdog is not None and not from_watchdog and watchdog is not threading.current_thread():
            watchdog.join(2.0)
        self._watchdog = None
        self._fit_frame = None
        if self._notifier is not None:
            self._notifier.close()
        _OPEN.discard(self)

    def close(self) -> None:
        """Stop monitoring: the nvidia-smi child is terminated and reaped, the threads end. Idempotent."""
        self._shutdown()

    @property
    def running(self) -> bool:
        """True while the background nvidia-smi is being read."""
        return self._reader is not None and self._reader.is_alive()

    def latest(self) -> dict[int, GpuSample]:
        """The newest sample of each watched GPU (by nvidia-smi index)."""
        with self._lock:
            return dict(self._latest)

    def __enter__(self) -> GpuMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Monitors whose stream is open; closed at interpreter exit so that no nvidia-smi outlives the process.
_OPEN: weakref.WeakSet[GpuMonitor] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for monitor in list(_OPEN):
        try:
            monitor.close()
        except Exception:
            pass
