"""The framework-neutral training run monitor: one nvidia-smi beside a training loop, summarised per epoch.

:class:`RunMonitor` (and :func:`watch`, its plain-loop front door) owns the stream, the per-epoch aggregation, the
alerts stamped with the training position, the recording, the energy figures, the job's own Prometheus metrics and,
with ``process_share``, one ``nvidia-smi pmon`` for the run's own share of each GPU.
The Keras and Lightning callbacks (``smiquery.keras``, ``smiquery.lightning``) only translate their hooks into
:meth:`RunMonitor.begin_epoch`, :meth:`RunMonitor.step` and :meth:`RunMonitor.end_epoch`.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import re
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, cast

from smiquery._log import get_logger
from smiquery.alerts import BUILTIN_RULES, AlertEvent, Rule, arrival
from smiquery.clock import elapsed
from smiquery.fields import Field, resolve_fields
from smiquery.notify import AlertHandler, LogHandler, Notifier

if TYPE_CHECKING:
    from smiquery.display import SampleWriter
    from smiquery.pmon import PmonRow, PmonStream, ProcessShare
    from smiquery.sample import GpuSample
    from smiquery.source import SampleSource, StreamEvent, Sweep

__all__ = [
    "TRAINING_RULES",
    "TRAINING_STALL_SECONDS",
    "FrameworkMemory",
    "MemoryView",
    "Position",
    "RunMonitor",
    "TrainingAlert",
    "VisibleDevices",
    "own_pids",
    "stall_rule",
    "visible_devices",
    "watch",
]

log = get_logger("smiquery.monitor")

# ------------------------------------------------------------------------------------------ stall definition

#: Seconds of low utilisation (with memory held) after which the training monitor calls it a data-pipeline stall.
#: The condition itself is the one ``smiquery report`` calls a stall (see :func:`stall_rule`); a minute is long
#: enough to ignore a checkpoint or an evaluation pass and short enough to be useful during a run.
TRAINING_STALL_SECONDS = 60.0


def stall_rule(seconds: float = TRAINING_STALL_SECONDS) -> str:
    """The stall alert as an expression: ``smiquery report``'s stall condition held for ``seconds``.

    Args:
        seconds: how long utilisation must stay low.

    Returns:
        For example ``"utilization.gpu < 20 for 60s while memory.used >= 1024"``.
    """
    from smiquery.report import BUSY_MEMORY_MIB, STALL_UTILIZATION

    return f"utilization.gpu < {STALL_UTILIZATION:g} for {seconds:g}s while memory.used >= {BUSY_MEMORY_MIB:g}"


#: The default rules of a training monitor: the built-in health rules, with the 30-minute idle rule (meant for a
#: fleet) replaced by the one-minute data-pipeline stall of :func:`stall_rule`.
TRAINING_RULES: tuple[str, ...] = (
    *(r for r in BUILTIN_RULES if not r.startswith("utilization.gpu <")),
    stall_rule(),
)

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
# the per-step keys of log_every="batch": the newest sample's value
_BATCH: tuple[tuple[str, str], ...] = (
    ("utilization.gpu", "util"),
    ("temperature.gpu", "temp"),
    ("memory.used", "mem_used_mib"),
    ("power.draw", "power_w"),
)
_UUID_PREFIX_RE = re.compile(r"GPU-[0-9a-fA-F-]+")
_FULL_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_REJECTED_RE = re.compile(r"""Field\s+["']([^"']+)["']\s+is not a valid field""", re.IGNORECASE)
# the gap between driver-used and framework memory must grow this much (MiB) over _GAP_EPOCHS epochs in a row
_GAP_GROWTH_MIB = 256.0
_GAP_EPOCHS = 3
_EVENT_QUEUE = 1000

# --------------------------------------------------------------------------------------------- visible devices


@dataclass(frozen=True)
class VisibleDevices:
    """The GPUs a CUDA process can see, as ``CUDA_VISIBLE_DEVICES`` names them, in CUDA's order.

    Attributes:
        ids: indices (``"1"``) or UUIDs (``"GPU-8932f937-..."``, prefixes allowed as CUDA allows them), in the
            order CUDA numbers them (``cuda:0`` is ``ids[0]``); None when the variable is unset (all GPUs).
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
        """The CUDA ordinal (``cuda:k``) of an nvidia-smi GPU, or None when it is not visible."""
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

    def nvsmi_index(self, ordinal: int, known: Mapping[int, str | None]) -> int | None:
        """The nvidia-smi index of CUDA device ``ordinal``, given the known GPUs (index -> UUID)."""
        if self.ids is None:
            return ordinal
        if ordinal >= len(self.ids):
            return None
        item = self.ids[ordinal]
        if item.isdigit():
            return int(item)
        for idx, uuid in known.items():
            if (uuid or "").lower().startswith(item.lower()):
                return idx
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


# ----------------------------------------------------------------------------------------------- aggregation


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


def number(value: object) -> float | None:
    """A float from a sample value; None for missing, text or anything else that is not a number."""
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    return None


class EpochAccumulator:
    """The running sums of one epoch: per GPU and field count/sum/max, energy in joules, sweeps seen.

    Constant memory whatever the epoch's length; fed by the reading thread, read once at the epoch's end.

    Args:
        summary: (field, log key suffix, statistic) triples to keep.
    """

    __slots__ = ("accs", "joules", "late", "summary", "sweeps")

    def __init__(self, summary: Sequence[tuple[str, str, str]]) -> None:
        self.summary = summary
        self.accs: dict[int, dict[str, _Acc]] = {}
        self.joules: dict[int, float] = {}
        self.sweeps = 0
        self.late = 0

    def add(self, idx: int, sample: GpuSample, seconds: float | None) -> None:
        """Add one sample of GPU ``idx``; ``seconds`` since that GPU's previous sample integrates ``power.draw``."""
        accs = self.accs.get(idx)
        if accs is None:
            accs = self.accs[idx] = {}
        for name, _suffix, _stat in self.summary:
            v = number(sample.get(name))
            if v is not None:
                acc = accs.get(name)
                if acc is None:
                    acc = accs[name] = _Acc()
                acc.add(v)
        if seconds is not None:
            watts = number(sample.get("power.draw"))
            if watts is not None:
                self.joules[idx] = self.joules.get(idx, 0.0) + watts * seconds

    def values(self, order: Sequence[int], latest: Mapping[int, GpuSample] | None = None) -> dict[str, float]:
        """The log keys for the GPUs in ``order``: NaN where the epoch had no value.

        Args:
            order: nvidia-smi indices, in the order the keys are written.
            latest: the newest sample per GPU, standing in for an epoch shorter than the sampling interval.
        """
        out: dict[str, float] = {}
        for idx in order:
            accs = self.accs.get(idx) or {}
            last = latest.get(idx) if latest is not None and not accs else None
            for name, suffix, stat in self.summary:
                a = accs.get(name)
                if a is not None and a.n:
                    v = a.value(stat)
                else:
                    x = number(last.get(name)) if last is not None else None
                    v = math.nan if x is None else x
                out[f"gpu{idx}_{suffix}"] = v
            joules = self.joules.get(idx)
            out[f"gpu{idx}_energy_wh"] = math.nan if joules is None else joules / 3600.0
        return out

    def merge(self, other: EpochAccumulator) -> None:
        """Add another accumulator's sums to this one (late sweeps of an epoch already summarised)."""
        for idx, accs in other.accs.items():
            mine = self.accs.setdefault(idx, {})
            for name, a in accs.items():
                m = mine.setdefault(name, _Acc())
                m.n += a.n
                m.total += a.total
                m.max = max(m.max, a.max)
        for idx, j in other.joules.items():
            self.joules[idx] = self.joules.get(idx, 0.0) + j
        self.sweeps += other.sweeps


def summary_spec(extra: Iterable[Field]) -> list[tuple[str, str, str]]:
    """The (field, key suffix, statistic) triples: the built-in summary, then mean/max (or share true) per extra."""
    spec = list(_SUMMARY)
    for fld in extra:
        if fld.name in SUMMARY_FIELDS or fld.name in ("index", "uuid", "timestamp"):
            continue
        if fld.kind.is_quantity:
            spec += [(fld.name, f"{fld.attr}_mean", "mean"), (fld.name, f"{fld.attr}_max", "max")]
        elif fld.kind.is_bool:
            spec.append((fld.name, f"{fld.attr}_frac", "mean"))
    return spec


def throughput_values(
    energy_wh: float, steps: int, samples: int | None, seconds: float, data_wait: float | None
) -> dict[str, float]:
    """The job-level keys of one epoch: total energy, steps and samples per joule, data-wait time and share.

    Args:
        energy_wh: energy of every watched GPU over the epoch (NaN when unknown).
        steps: optimizer steps in the epoch.
        samples: training samples in the epoch, when known.
        seconds: the epoch's wall time.
        data_wait: seconds spent between steps (waiting for input), when measured.

    Returns:
        ``energy_wh``, ``steps_per_joule``, ``samples_per_joule`` (when samples are known), ``data_wait_s`` and
        ``data_wait_frac`` (when measured).
    """
    joules = energy_wh * 3600.0
    ok = joules > 0 and not math.isnan(joules)
    out = {"energy_wh": energy_wh, "steps_per_joule": steps / joules if ok else math.nan}
    if samples is not None:
        out["samples_per_joule"] = samples / joules if ok else math.nan
    if data_wait is not None:
        out["data_wait_s"] = data_wait
        out["data_wait_frac"] = data_wait / seconds if seconds > 0 else math.nan
    return out


# ------------------------------------------------------------------------------------------- process share


def _parent_pid(pid: int, root: str) -> int | None:
    """The parent of ``pid`` from ``ROOT/PID/stat`` (None when it is gone or unreadable)."""
    try:
        with open(f"{root}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    tail = text[text.rfind(b")") + 2 :].split()
    try:
        return int(tail[1])
    except (IndexError, ValueError):
        return None


def own_pids(pids: Iterable[int] | None = None, *, root: str = "/proc") -> frozenset[int]:
    """The run's own processes: this process and its descendants (data-loader workers, spawned helpers).

    On Linux each candidate's parent chain is read from ``/proc/PID/stat``; where there is no ``/proc``
    (macOS, Windows) only this process itself counts, so its children's GPU use is counted as someone else's.
    pids are those of this PID namespace: nvidia-smi inside a container with its own PID namespace may report
    other numbers, and then the run's processes are not recognised.

    Args:
        pids: the candidates (e.g. the pids pmon printed); None for every process under ``root``.
        root: the procfs mount.

    Returns:
        Those of the candidates (or of all processes) that are this process or descend from it.
    """
    me = os.getpid()
    if not os.path.isdir(root):
        return frozenset({me} if pids is None or me in set(pids) else ())
    if pids is None:
        pids = [int(name) for name in os.listdir(root) if name.isdigit()]
    known: dict[int, bool] = {me: True, 0: False, 1: me == 1}
    out = set()
    for pid in pids:
        chain: list[int] = []
        cur: int | None = pid
        while cur is not None and cur not in known and len(chain) < 4096:
            chain.append(cur)
            cur = _parent_pid(cur, root)
        verdict = known.get(cur, False) if cur is not None else False
        for p in chain:
            known[p] = verdict
        if known.get(pid, False):
            out.add(pid)
    return frozenset(out)


class _ShareAcc:
    """One GPU's SM use over an epoch: the run's part, the total, the pmon instants seen, the other pids."""

    __slots__ = ("instants", "mine", "others", "total")

    def __init__(self) -> None:
        self.mine = 0.0
        self.total = 0.0
        self.instants = 0
        self.others: set[int] = set()

    def add(self, share: ProcessShare) -> None:
        self.instants += 1
        if share.mine_sm is not None or share.others_sm is not None:
            self.mine += share.mine_sm or 0
            self.total += (share.mine_sm or 0) + (share.others_sm or 0)
        self.others.update(share.other_pids)

    def merge(self, other: _ShareAcc) -> None:
        self.instants += other.instants
        self.mine += other.mine
        self.total += other.total
        self.others |= other.others

    def values(self) -> tuple[float, float]:
        """``(share, other_processes)``: NaN share without SM use, NaN count without any pmon instant."""
        share = self.mine / self.total if self.total > 0 else math.nan
        return share, float(len(self.others)) if self.instants else math.nan


def instant_shares(rows: Iterable[PmonRow], mine: Iterable[int]) -> dict[int, ProcessShare]:
    """Per GPU of one pmon instant, the SM use of ``mine`` against every other process.

    Unlike :func:`smiquery.pmon.process_share` every GPU in the instant is reported, also one the run does not
    use (its share is then 0 when others keep it busy) and an idle one (share None).

    Args:
        rows: one pmon instant.
        mine: the run's own pids.

    Returns:
        GPU index -> share; ``share`` is None when no process reported SM use.
    """
    from smiquery.pmon import ProcessShare

    own = set(mine)
    per: dict[int, tuple[list[int], list[int], dict[int, None]]] = {}
    for row in rows:
        if row.gpu is None:
            continue
        m, o, pids = per.setdefault(row.gpu, ([], [], {}))
        if row.pid is None:
            continue
        if row.pid in own:
            if row.sm is not None:
                m.append(row.sm)
        else:
            pids[row.pid] = None
            if row.sm is not None:
                o.append(row.sm)
    out: dict[int, ProcessShare] = {}
    for gpu, (m, o, pids) in per.items():
        mine_sm = sum(m) if m else None
        others_sm = sum(o) if o else None
        total = (mine_sm or 0) + (others_sm or 0)
        out[gpu] = ProcessShare(
            gpu=gpu,
            mine_sm=mine_sm,
            others_sm=others_sm,
            share=(mine_sm or 0) / total if total > 0 else None,
            mine_fb=None,
            others_fb=None,
            other_pids=tuple(pids),
        )
    return out


def _pmon_unsupported(exc: BaseException) -> bool:
    """True for pmon's "Not supported on the device(s)" (old GeForce drivers), whatever the exit status."""
    from smiquery.errors import NotSupportedError, NvidiaSmiFailedError

    if isinstance(exc, NotSupportedError):
        return True
    output = getattr(exc, "output", "") if isinstance(exc, NvidiaSmiFailedError) else ""
    return "not supported on the device" in (output or "").lower()


# ------------------------------------------------------------------------------------------ framework memory


@dataclass(frozen=True)
class MemoryView:
    """What a framework says about its memory on one CUDA device, in bytes (None where it does not say).

    Attributes:
        ordinal: the CUDA device ordinal (``cuda:k``, TensorFlow's ``GPU:k``).
        current: bytes held by live tensors.
        peak: the most ``current`` has been.
        reserved: bytes held by the framework's caching allocator (tensors plus its free pool).
    """

    ordinal: int
    current: float | None
    peak: float | None = None
    reserved: float | None = None


class FrameworkMemory(Protocol):
    """A framework's view of its GPU memory (TensorFlow, PyTorch), read at each epoch's end."""

    name: str

    def available(self) -> str | None:
        """None when the view can be read; otherwise why not, in one line."""
        ...

    def read(self) -> list[MemoryView]:
        """The view of every device the framework uses."""
        ...


def gap_note(idx: int, framework: str, view: MemoryView, history: Sequence[float]) -> str:
    """The warning for a gap between the driver's and the framework's figure that grew for several epochs.

    Worded by what is known: with the allocator's reserved figure the gap is memory outside the framework's pool
    (another process, a leaked context, a library allocating on its own); with only the peak the framework's own
    pool may be part of it.

    Args:
        idx: the nvidia-smi index.
        framework: ``"TensorFlow"``, ``"PyTorch"``...
        view: the newest view.
        history: the gaps (MiB) of the last epochs, oldest first.
    """
    grew = history[-1] - history[0]
    if view.reserved is not None:
        what = (
            f"the memory the driver reports used on GPU {idx} exceeds what {framework}'s allocator reserves by "
            f"{history[-1]:.0f} MiB, and the difference grew for {len(history) - 1} epochs in a row (+{grew:.0f} MiB). "
            f"That memory is outside {framework}'s pool: another process, a leaked CUDA context or a library "
            "allocating on its own; check `smiquery ps`"
        )
    else:
        basis = "peak allocation" if view.peak else "allocation"
        what = (
            f"the memory the driver reports used on GPU {idx} exceeds {framework}'s {basis} by {history[-1]:.0f} MiB, "
            f"and the difference grew for {len(history) - 1} epochs in a row (+{grew:.0f} MiB). {framework} does not "
            "report its allocator's reserved pool, so part of this may be its own pool growing; the rest is another "
            "process, a leaked context or a library allocating on its own; check `smiquery ps`"
        )
    return what


# -------------------------------------------------------------------------------------------- records


class Position(NamedTuple):
    """Where training was at one moment.

    Attributes:
        epoch: the epoch (0-based) or None before the first.
        batch: steps taken in this epoch (the batch in progress), or None.
        step: steps taken since training began.
        phase: ``"setup"``, ``"train"``, ``"validation"`` or ``"done"``.
    """

    epoch: int | None
    batch: int | None
    step: int
    phase: str


@dataclass(frozen=True)
class TrainingAlert:
    """An alert event with where training was when its sample arrived.

    Attributes:
        event: the alert event (rule, GPU, value, state, duration).
        epoch: the epoch (0-based) or None before the first epoch began.
        batch: steps taken in this epoch when the sample arrived, if known.
        step: steps taken since training began (the framework's count where it has one).
        learning_rate: the learning rate at that moment, if the adapter can read it.
        phase: ``"train"``, ``"validation"``, ``"setup"`` (before the first epoch) or ``"done"``.
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


@dataclass
class Totals:
    """Counters of a run, read by the metrics collector at scrape time (no per-step Prometheus cost).

    Attributes:
        steps: steps taken.
        samples: training samples processed (when the adapter knows batch sizes).
        data_wait: seconds spent between steps.
        epoch: the current epoch (0-based) or None.
        joules: energy per nvidia-smi index since the run began.
        memory: the newest framework memory view per nvidia-smi index.
    """

    steps: int = 0
    samples: int = 0
    data_wait: float = 0.0
    epoch: int | None = None
    joules: dict[int, float] = field(default_factory=dict)
    memory: dict[int, MemoryView] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the monitor

SourceFactory = Callable[..., "SampleSource"]


def _open_stream(
    fields: Sequence[str],
    *,
    interval: float,
    gpus: Sequence[str] | None,
    nvidia_smi: str | os.PathLike[str] | None,
    on_event: Callable[[StreamEvent], None],
) -> SampleSource:
    """A live stream, listened to through ``subscribe()`` where the source has it, else ``on_event=``."""
    from smiquery.supervisor import Stream, stream

    if hasattr(Stream, "subscribe"):
        source: Any = stream(list(fields), interval=interval, gpus=gpus, nvidia_smi=nvidia_smi)
        source.subscribe(on_event)
        return cast("SampleSource", source)
    old: Any = stream(list(fields), interval=interval, gpus=gpus, nvidia_smi=nvidia_smi, on_event=on_event)
    return cast("SampleSource", old)


def _open_pmon(
    *,
    interval: float,
    gpus: Sequence[str] | None,
    nvidia_smi: str | os.PathLike[str] | None,
    on_event: Callable[[StreamEvent], None],
) -> PmonStream:
    """The one ``nvidia-smi pmon`` stream of a monitor with ``process_share`` (SM use only, 1..10 s apart).

    The only place the monitor builds a pmon stream, so that a change in :func:`smiquery.pmon.stream`'s options
    is adapted here. Failures reach the monitor through ``on_event`` (an unsupported pmon as an ``error`` event).
    """
    from smiquery import pmon

    seconds = max(1, min(10, round(interval)))
    ids = list(gpus)[:4] if gpus else None  # pmon watches four GPUs at most
    return pmon.stream(gpus=ids, interval=seconds, select="u", nvidia_smi=nvidia_smi, on_event=on_event)


class RunMonitor:
    """Watches the GPUs while a training run goes on, whatever the framework.

    It starts ONE nvidia-smi in loop mode (:meth:`start`) and a reading thread that stamps every sweep with the
    training position at the moment it arrived, sums it into that epoch's accumulator (constant memory), appends
    it to the recording and checks it against the alert rules. Alert handlers run on a separate worker thread
    behind a bounded queue, so a slow webhook delays nothing. The training thread only moves the position
    (:meth:`step`, :meth:`begin_epoch`) and collects each epoch's numbers (:meth:`end_epoch`, which never waits
    on nvidia-smi except, once, for the first sample).

    Epoch numbers, for each watched GPU ``N`` (nvidia-smi's index): ``gpuN_util_mean``, ``gpuN_util_max``,
    ``gpuN_temp_max``, ``gpuN_mem_used_max_mib``, ``gpuN_power_mean_w``, ``gpuN_energy_wh``, the mean/max (or share
    true) of each extra field, and with a framework memory view ``gpuN_mem_framework_mib`` (live tensors),
    ``gpuN_mem_framework_peak_mib``, ``gpuN_mem_framework_reserved_mib`` (where the framework says) and
    ``gpuN_mem_gap_mib`` (driver-used minus the framework's largest figure). Job keys: ``energy_wh``,
    ``steps_per_joule``, ``samples_per_joule`` (when samples are counted), ``data_wait_s`` and
    ``data_wait_frac`` (time between steps, when steps are reported), and ``gpu_late_sweeps`` when sweeps that
    arrived after their epoch was summarised were folded in (see :attr:`epochs` for the corrected figures).
    With ``process_share=True``, per watched GPU also ``gpuN_share`` (the run's part of the SM use, 0..1) and
    ``gpuN_other_processes`` (other processes seen on it during the epoch); see ``process_share`` below.

    Use :func:`watch` in a plain loop; the Keras and Lightning callbacks wrap it.

    Args:
        fields: extra fields to summarise per epoch (names or a comma list), beyond the built-in summary.
        interval: seconds between samples.
        alerts: rules or ``--alert`` expressions; None for :data:`TRAINING_RULES`, ``()`` for none. A rule whose
            field this driver rejects is dropped with one warning; the rest of the query goes on.
        handlers: where alert events go (default: a :class:`~smiquery.notify.LogHandler`).
        log_every: ``"epoch"``, or ``"batch"`` to offer the newest sample per step (:meth:`batch_values`).
        nvidia_smi: path of nvidia-smi (default: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        gpus: nvidia-smi indices or UUIDs to watch instead of those ``CUDA_VISIBLE_DEVICES`` gives.
        record: write every sample of the watched GPUs to this file (``.csv``, ``.jsonl``, ``.parquet``) from the
            same nvidia-smi; ``smiquery report`` and ``smiquery plot`` read it.
        metrics_port: serve the job's metrics (steps, samples, data wait, epoch, energy, framework memory) for
            Prometheus on this port (``pip install 'smiquery[export]'``).
        metrics_addr: the address to bind for ``metrics_port``.
        pushgateway: push the same metrics to this Pushgateway URL every ``push_interval`` seconds and at the end.
        push_interval: seconds between pushes.
        job: the ``job`` label of pushed metrics.
        framework: the framework's memory view, read at each epoch's end.
        first_sample_timeout: at the first epoch's end, seconds to wait for nvidia-smi's first sample when none
            has come yet (so that the log keys are known); later epoch ends never wait.
        source: a function ``(fields, interval=, gpus=, nvidia_smi=, on_event=)`` returning a
            :class:`~smiquery.source.SampleSource`; default a live :func:`smiquery.stream`.
        env: the environment whose ``CUDA_VISIBLE_DEVICES`` is read (default ``os.environ``).
        process_share: also run one ``nvidia-smi pmon`` (a second child, started and reaped with the monitor) and
            report how much of each GPU's SM use is the run's own (this process and its descendants, see
            :func:`own_pids`) against other processes: ``gpuN_share`` = own SM % / all processes' SM %, NaN when
            no process reported SM use or no pmon sample came in the epoch; ``gpuN_other_processes`` = distinct
            other pids seen on the GPU in the epoch. Another process on a watched GPU is said once per GPU
            (:attr:`notes`); the job's metrics gain ``smiquery_training_gpu_process_share`` and
            ``smiquery_training_gpu_other_processes``. Off by default (one more child per run, pmon's 1 s
            minimum interval and four-GPU limit). Where pmon is not supported (older GeForce drivers) it is turned
            off with one note and the keys stay NaN; a failing or hung pmon never delays a training step.

    Raises:
        ValueError: ``log_every`` or ``interval`` is invalid.
        InvalidFieldError: a field name is unknown.
        InvalidRuleError: an alert expression cannot be parsed.
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
        record: str | os.PathLike[str] | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        pushgateway: str | None = None,
        push_interval: float = 15.0,
        job: str = "training",
        framework: FrameworkMemory | None = None,
        first_sample_timeout: float = 5.0,
        source: SourceFactory | None = None,
        env: Mapping[str, str] | None = None,
        process_share: bool = False,
    ) -> None:
        if log_every not in ("epoch", "batch"):
            raise ValueError(f"log_every must be 'epoch' or 'batch', not {log_every!r}")
        if not interval > 0:
            raise ValueError("interval must be positive")
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0-65535, not {metrics_port}")
        if pushgateway is not None and not pushgateway.lower().startswith(("http://", "https://")):
            raise ValueError("pushgateway must be an http:// or https:// URL")
        self.interval = float(interval)
        self.log_every = log_every
        self.rules: tuple[Rule, ...] = tuple(
            r if isinstance(r, Rule) else Rule.parse(r) for r in (TRAINING_RULES if alerts is None else alerts)
        )
        self.handlers = tuple(handlers) if handlers is not None else (LogHandler(),)
        self.extra_fields: tuple[Field, ...] = resolve_fields(fields) if fields else ()
        self.nvidia_smi = nvidia_smi
        self.gpus_override = tuple(str(g) for g in gpus) if gpus is not None else None
        self.record = record
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.pushgateway = pushgateway
        self.push_interval = float(push_interval)
        self.job = job
        self.framework = framework
        self.first_sample_timeout = first_sample_timeout
        self._source_factory: SourceFactory = source or _open_stream
        self._env = env
        self.process_share = bool(process_share)
        self.host = socket.gethostname()
        #: the alerts of the current (or last) run, with their training position
        self.alerts: list[TrainingAlert] = []
        #: per epoch, the numbers added to the logs (corrected when late sweeps arrive)
        self.epochs: list[dict[str, float]] = []
        #: messages said once (monitoring unavailable, rules dropped, framework view missing, growing gap)
        self.notes: list[str] = []
        #: rules dropped because this driver lacks their field
        self.dropped_rules: list[Rule] = []
        #: alert events not handled because the handler queue was full
        self.dropped_events = 0
        #: counters of the run (steps, samples, data wait, energy): what the metrics report
        self.totals = Totals()
        #: wall time of the run's phases: ``first_data`` (start to first sample, s), ``epoch_end_max`` (longest
        #: :meth:`end_epoch` on the training thread, s), ``reader_cpu`` and ``worker_cpu`` (thread CPU time, s)
        self.cost: dict[str, float] = {}
        #: optional function returning extra alert context (the learning rate), called on the reading thread
        self.context_extra: Callable[[], Mapping[str, Any]] | None = None
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._summary = summary_spec(self.extra_fields)
        self._reset()

    # ------------------------------------------------------------------------------------------ state

    def _reset(self) -> None:
        self.alerts = []
        self.epochs = []
        self.dropped_events = 0
        self.totals = Totals()
        self.cost = {
            "first_data": math.nan,
            "start": 0.0,
            "close": 0.0,
            "epoch_end_max": 0.0,
            "reader_cpu": 0.0,
            "worker_cpu": 0.0,
            "pmon_cpu": 0.0,
        }
        #: wall time of each :meth:`end_epoch` on the training thread, seconds
        self.epoch_end_seconds: list[float] = []
        self._pos = Position(None, None, 0, "setup")
        self._accs: dict[int | None, EpochAccumulator] = {}
        self._done_epochs: dict[int, EpochAccumulator] = {}
        self._epoch_meta: dict[int, tuple[int, int | None, float, float | None]] = {}
        self._latest: dict[int, GpuSample] = {}
        self._last_t: dict[int, float] = {}
        #: per GPU, the time its previous sample stands at for energy: nvidia-smi's timestamp, else arrival
        self._last_stamp: dict[int, datetime | float] = {}
        self._batch_values: dict[str, float] = {}
        self._order: list[int] | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._source: SampleSource | None = None
        self._reader: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._events: queue.Queue[tuple[AlertEvent, dict[str, Any]] | None] = queue.Queue(_EVENT_QUEUE)
        self._notifier: Notifier | None = None
        self._recorder: SampleWriter | None = None
        self._metrics: _JobMetrics | None = None
        self._devices = VisibleDevices(None)
        self._cuda = VisibleDevices(None)
        self._started_at = 0.0
        self._epoch_start = 0.0
        self._epoch_step0 = 0
        self._epoch_samples0 = 0
        self._epoch_wait0 = 0.0
        self._step_end: float | None = None
        self._waits = False
        self._counts_samples = False
        self._gaps: dict[int, deque[float]] = {}
        self._rejected: BaseException | None = None
        self._fields: list[str] = []
        self._pending_late = 0
        self._pmon: PmonStream | None = None
        self._pmon_reader: threading.Thread | None = None
        self._share_accs: dict[int | None, dict[int, _ShareAcc]] = {}
        self._shares: dict[int, ProcessShare] = {}
        self._share_off = False

    def say(self, message: str, level: int = logging.WARNING, *, key: str | None = None) -> None:
        """Log a message once per monitor (by its text, or by ``key``), so that a long run is not flooded.

        Args:
            message: the text.
            level: the logging level.
            key: what makes two messages the same (default the text).
        """
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
        with self._lock:
            return dict(self._shares)

    @property
    def metrics_bound_port(self) -> int | None:
        """The port the metrics are served on (useful with ``metrics_port=0``), or None."""
        metrics = self._metrics
        return metrics.port if metrics is not None else None

    # ------------------------------------------------------------------------------------------ start

    def start(self) -> RunMonitor:
        """Start monitoring a run: the stream, its reading thread, the handler worker, recording and metrics.

        Starting again closes the previous run first. Failures are said once and never raised: training goes on
        without GPU numbers.

        Returns:
            self.
        """
        self.close()
        self._reset()
        self._started_at = self._epoch_start = time.monotonic()
        try:
            return self._start()
        finally:
            self.cost["start"] = time.monotonic() - self._started_at

    def _start(self) -> RunMonitor:
        self._notifier = Notifier(self.rules, self.handlers) if self.rules else None
        self._cuda = visible_devices(self._env)
        if self.gpus_override is not None:
            self._devices = VisibleDevices(self.gpus_override)
        else:
            self._devices = self._cuda
            if self._devices.note:
                self.say(self._devices.note)
        if self._devices.none:
            self.say("CUDA_VISIBLE_DEVICES hides every GPU: GPU monitoring is off")
            return self
        names = ["index", "uuid", "timestamp", *SUMMARY_FIELDS]
        names += [f.name for f in self.extra_fields]
        names += [f.name for r in self.rules for f in r.fields]
        self._fields = list(dict.fromkeys(names))
        try:
            self._source = self._open()
        except Exception as exc:  # monitoring must never stop training
            self.say(f"GPU monitoring is off: {exc}")
            self._source = None
            return self
        self._start_outputs()
        self._worker = threading.Thread(target=self._work, name="smiquery-monitor-handlers", daemon=True)
        self._worker.start()
        self._reader = threading.Thread(target=self._read, name="smiquery-monitor-reader", daemon=True)
        self._reader.start()
        _OPEN.add(self)
        if self.process_share:
            self._start_pmon()
        return self

    def _start_pmon(self) -> None:
        try:
            self._pmon = _open_pmon(
                interval=self.interval,
                gpus=self._devices.stream_gpus(),
                nvidia_smi=self.nvidia_smi,
                on_event=self._on_pmon_event,
            )
        except Exception as exc:
            self._share_off = True
            self.say(f"the process share is off: {exc}", key="share-off")
            return
        self._pmon_reader = threading.Thread(target=self._read_pmon, name="smiquery-monitor-pmon", daemon=True)
        self._pmon_reader.start()

    def _open(self) -> SampleSource:
        return self._source_factory(
            self._fields,
            interval=self.interval,
            gpus=self._devices.stream_gpus(),
            nvidia_smi=self.nvidia_smi,
            on_event=self._on_source_event,
        )

    def _start_outputs(self) -> None:
        if self.record is not None:
            try:
                from smiquery.display import open_recorder

                self._recorder = open_recorder(self.record, resolve_fields(self._fields))
            except Exception as exc:
                self.say(f"cannot record to {os.fspath(self.record)!r} ({exc}): the run is not recorded")
        if self.metrics_port is not None or self.pushgateway is not None:
            try:
                self._metrics = _JobMetrics(self)
            except Exception as exc:
                self.say(f"the training metrics are off: {exc}")

    def _on_source_event(self, event: StreamEvent) -> None:
        err = event.error
        if event.kind == "error" and err is not None and self._is_rejection(err):
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

    @staticmethod
    def _is_rejection(exc: BaseException) -> bool:
        from smiquery.errors import InvalidArgumentError, InvalidFieldError

        return isinstance(exc, (InvalidArgumentError, InvalidFieldError))

    def _drop_rejected(self, exc: BaseException) -> bool:
        """Drop the rules (and extra fields) the driver rejected; True when the query changed and can be retried."""
        text = f"{exc} {getattr(exc, 'stderr', '') or ''}"
        m = _REJECTED_RE.search(text)
        named = getattr(exc, "field", None) or (m.group(1) if m else None)
        needed = {"index", "uuid", "timestamp", *SUMMARY_FIELDS}
        rule_only = {f.name for r in self.rules for f in r.fields} - needed - {f.name for f in self.extra_fields}
        if named:
            try:
                gone = {resolve_fields([named])[0].name}
            except Exception:
                gone = {named}
            if gone <= needed:
                return False
        else:
            gone = rule_only  # nvidia-smi did not say which: keep only what the summary needs
        keep = [r for r in self.rules if not {f.name for f in r.fields} & gone]
        dropped = [r for r in self.rules if r not in keep]
        extras = [f for f in self.extra_fields if f.name not in gone]
        if not dropped and len(extras) == len(self.extra_fields):
            return False
        self.dropped_rules += dropped
        self.rules = tuple(keep)
        self.extra_fields = tuple(extras)
        self._summary = summary_spec(self.extra_fields)
        self._fields = [n for n in self._fields if n not in gone]
        what = ", ".join(sorted(gone))
        self.say(
            f"this nvidia-smi rejects {what}: dropped {len(dropped)} alert rule(s) "
            f"({'; '.join(str(r) for r in dropped) or 'none'}) and kept watching the other fields",
            key=f"rejected-{what}",
        )
        self._notifier = Notifier(self.rules, self.handlers) if self.rules else None
        return True

    # --------------------------------------------------------------------------------------- reading

    def _read(self) -> None:
        select = self._devices.ids is not None and self._devices.stream_gpus() is None
        try:
            while not self._stop.is_set():
                source = self._source
                if source is None:
                    return
                failure: BaseException | None = None
                try:
                    for sweep in source.sweeps():
                        if self._stop.is_set():
                            return
                        self._take(sweep, select)
                except Exception as exc:
                    failure = exc
                rejected = self._rejected or (failure if failure is not None and self._is_rejection(failure) else None)
                if self._stop.is_set():
                    return
                if rejected is not None:
                    self._rejected = None
                    try:
                        source.close(2.0)
                    except Exception:
                        log.debug("smiquery: closing the rejected stream failed", exc_info=True)
                    if self._drop_rejected(rejected):
                        self._source = self._open()
                        continue
                if failure is not None:
                    self.say(f"GPU monitoring stopped: {failure}")
                return
        except Exception as exc:
            if not self._stop.is_set():
                self.say(f"GPU monitoring stopped: {exc}")
        finally:
            self.cost["reader_cpu"] = time.thread_time()

    def _take(self, sweep: Sweep, select: bool) -> None:
        """Stamp one sweep with the position now, sum it into that epoch, record it, check the rules."""
        pos = self._pos
        now = arrival(sweep)
        chosen = [s for s in sweep if s.index is not None and (not select or self._devices.selects(s.index, s.uuid))]
        if not chosen:
            return
        recorder = self._recorder
        if recorder is not None:
            try:
                for s in chosen:
                    recorder.write(s)
            except Exception as exc:
                self.say(f"recording stopped: {exc}")
                self._recorder = None
        cap = max(3.0 * self.interval, 5.0)
        batch: dict[str, float] = {}
        with self._lock:
            acc = self._accs.get(pos.epoch)
            if acc is None:
                acc = self._accs[pos.epoch] = EpochAccumulator(self._summary)
            acc.sweeps += 1
            for s in chosen:
                idx = s.index
                assert idx is not None
                # energy integrates over nvidia-smi's own timestamps (two sweeps delivered together are still an
                # interval apart), the arrival without them; a step back counts 0, a jump one interval
                ts = s.timestamp if "timestamp" in s else None
                stamp: datetime | float = ts if ts is not None else now
                prev = self._last_stamp.get(idx)
                seconds = None if prev is None else elapsed(prev, stamp)
                if seconds is not None and seconds > cap:
                    seconds = self.interval
                self._last_stamp[idx] = stamp
                self._last_t[idx] = now
                acc.add(idx, s, seconds)
                if seconds is not None:
                    watts = number(s.get("power.draw"))
                    if watts is not None:
                        self.totals.joules[idx] = self.totals.joules.get(idx, 0.0) + watts * seconds
                self._latest[idx] = s
                if self.log_every == "batch":
                    for name, suffix in _BATCH:
                        v = number(s.get(name))
                        batch[f"gpu{idx}_{suffix}"] = math.nan if v is None else v
            if batch:
                self._batch_values = batch
        if not self._first.is_set():
            self.cost["first_data"] = now - self._started_at
            self._first.set()
        notifier = self._notifier
        if notifier is None:
            return
        for s in chosen:
            notifier.observe(s)
            for event in notifier.evaluate(s, now):
                alert = self._alert(event, pos)
                self.alerts.append(alert)
                try:
                    self._events.put_nowait((event, alert.context()))
                except queue.Full:
                    self.dropped_events += 1
                    self.say("alert handlers fall behind: events are being dropped", key="events-full")

    def _on_pmon_event(self, event: StreamEvent) -> None:
        err = event.error
        if event.kind != "error" or err is None or self._share_off:
            return
        if _pmon_unsupported(err):
            self._share_off = True
            self.say(
                "per-process monitoring (nvidia-smi pmon) is not supported on this GPU or driver: the process share "
                "is off and gpuN_share / gpuN_other_processes stay NaN",
                key="share-unsupported",
            )
            pmon = self._pmon
            if pmon is not None:
                pmon.close()  # ends its retries; the pmon thread then ends
            return
        self.say(
            f"nvidia-smi pmon failed ({type(err).__name__}: {event.detail or err}); it is retried, and the process "
            "share has a gap until it recovers",
            key=f"share-error-{type(err).__name__}",
        )

    def _read_pmon(self) -> None:
        pmon = self._pmon
        try:
            if pmon is None:
                return
            for instant in pmon.samples():
                if self._stop.is_set() or self._share_off:
                    return
                self._take_instant(instant)
        except Exception as exc:
            if not self._stop.is_set() and not self._share_off:
                self.say(f"the process share stopped: {exc}", key="share-stopped")
        finally:
            self.cost["pmon_cpu"] = time.thread_time()

    def _take_instant(self, rows: Sequence[PmonRow]) -> None:
        """Sum one pmon instant into the epoch it arrived in; say once per GPU when another process is on it."""
        pos = self._pos
        shares = instant_shares(rows, own_pids({r.pid for r in rows if r.pid is not None}))
        if self._devices.ids is not None:
            uuids = self.uuids()
            shares = {g: v for g, v in shares.items() if self._devices.selects(g, uuids.get(g))}
        with self._lock:
            accs = self._share_accs.setdefault(pos.epoch, {})
            for gpu, share in shares.items():
                acc = accs.get(gpu)
                if acc is None:
                    acc = accs[gpu] = _ShareAcc()
                acc.add(share)
            self._shares = shares
        for gpu, share in shares.items():
            if share.other_pids:
                rows_of = {r.pid: r for r in rows if r.gpu == gpu and r.pid in share.other_pids}
                first = rows_of.get(share.other_pids[0])
                who = f"pid {share.other_pids[0]}" + (f" ({first.command})" if first and first.command else "")
                more = f" and {len(share.other_pids) - 1} more" if len(share.other_pids) > 1 else ""
                use = "no SM use reported" if share.others_sm is None else f"{share.others_sm}% SM"
                self.say(
                    f"another process uses GPU {gpu} beside this run: {who}{more}, {use}; gpu{gpu}_share tells this "
                    "run's part of the GPU's SM use (see `smiquery ps`)",
                    key=f"share-other-{gpu}",
                )

    def _alert(self, event: AlertEvent, pos: Position) -> TrainingAlert:
        lr: float | None = None
        step: int | None = pos.step
        extra = self.context_extra
        if extra is not None:
            try:
                got = extra()
                lr = got.get("learning_rate")
                step = got.get("step", step)
            except Exception:  # a half-built or torn-down model: context without these
                pass
        return TrainingAlert(event, pos.epoch, pos.batch, step, lr, pos.phase)

    def _work(self) -> None:
        try:
            while True:
                item = self._events.get()
                if item is None:
                    return
                notifier = self._notifier
                if notifier is not None:
                    notifier.dispatch(*item)
        finally:
            self.cost["worker_cpu"] = time.thread_time()

    # ------------------------------------------------------------------------------------ training side

    def begin_epoch(self, epoch: int) -> None:
        """Training enters ``epoch`` (0-based): samples arriving from now on belong to it.

        Args:
            epoch: the epoch number.
        """
        self._epoch_start = time.monotonic()
        self._epoch_step0 = self.totals.steps
        self._epoch_samples0 = self.totals.samples
        self._epoch_wait0 = self.totals.data_wait
        self.totals.epoch = epoch
        self._pos = Position(epoch, 0, self._pos.step, "train")
        # the time up to the first step counts as data wait (the loader's first fetch); the gap since the
        # previous epoch's last step (validation, checkpoints) does not
        self._step_end = time.perf_counter()

    def step_begin(self) -> None:
        """A step starts now: the time since the previous step ended counts as data wait."""
        ended = self._step_end
        if ended is not None:
            self.totals.data_wait += time.perf_counter() - ended
            self._waits = True

    def step(
        self,
        epoch: int | None = None,
        batch: int | None = None,
        *,
        samples: int | None = None,
        step: int | None = None,
    ) -> None:
        """One optimizer step is done.

        Args:
            epoch: the epoch it belongs to; a new value starts that epoch (the previous one is summarised by the
                next :meth:`end_epoch`).
            batch: its number within the epoch (0-based); default the next one.
            samples: training samples in it (adds to ``samples_per_joule`` and the samples counter).
            step: the framework's global step count after it, when it keeps one.
        """
        pos = self._pos
        if epoch is not None and epoch != pos.epoch:
            self.begin_epoch(epoch)
            pos = self._pos
        t = self.totals
        t.steps += 1
        if samples is not None:
            t.samples += samples
            self._counts_samples = True
        done = (batch + 1) if batch is not None else (pos.batch or 0) + 1
        self._pos = Position(pos.epoch, done, step if step is not None else pos.step + 1, pos.phase)
        self._step_end = time.perf_counter()

    def phase(self, phase: str) -> None:
        """Name what training does now (``"train"``, ``"validation"``); alerts carry it.

        Args:
            phase: the phase.
        """
        pos = self._pos
        self._pos = Position(pos.epoch, pos.batch, pos.step, phase)
        if phase != "train":
            self._step_end = None  # validation time is not data wait

    def batch_values(self) -> dict[str, float]:
        """The newest sample of each GPU as per-step keys (``gpuN_util``...), prepared by the reading thread."""
        return self._batch_values

    def end_epoch(self, epoch: int | None = None) -> dict[str, float]:
        """Summarise the epoch: GPU statistics, energy, throughput per joule, data wait, framework memory.

        Never waits on nvidia-smi, except at the first epoch's end for the first sample (``first_sample_timeout``)
        when none has come yet.

        Args:
            epoch: the epoch that ends (default the current one).

        Returns:
            The epoch's keys (empty when GPU monitoring is off and no GPU was ever seen).
        """
        began = time.perf_counter()
        try:
            return self._end_epoch(self._pos.epoch if epoch is None else epoch)
        except Exception:
            log.exception("smiquery: summarising the epoch's GPU samples failed")
            return {}
        finally:
            spent = time.perf_counter() - began
            self.epoch_end_seconds.append(spent)
            self.cost["epoch_end_max"] = max(self.cost.get("epoch_end_max", 0.0), spent)

    def _end_epoch(self, epoch: int | None) -> dict[str, float]:
        if self._source is None and self._order is None:
            return {}
        if self._order is None and not self._first.is_set() and self.running and self.first_sample_timeout > 0:
            self._first.wait(self.first_sample_timeout)
        now = time.monotonic()
        with self._lock:
            acc = self._accs.pop(epoch, None) or EpochAccumulator(self._summary)
            setup = self._accs.pop(None, None)
            if setup is not None and not self.epochs:
                acc.merge(setup)  # samples before the first epoch began: setup of the first epoch
            elif setup is not None:
                self._accs[None] = setup
            late = {k: self._accs.pop(k) for k in list(self._accs) if k is not None and epoch is not None and k < epoch}
            latest = dict(self._latest)
            fresh = now - max(self._last_t.values(), default=-math.inf) <= max(3 * self.interval, 5.0)
        if self._order is None:
            order = sorted(set(acc.accs) | set(latest))
            if not order and self._devices.ids and all(i.isdigit() for i in self._devices.ids):
                order = sorted(int(i) for i in self._devices.ids)
            if order:
                self._order = order
                if self.epochs or (epoch or 0) > 0:
                    self.say(
                        f"nvidia-smi's first sample came {self.cost.get('first_data', math.nan):.1f} s after training "
                        f"began, after epoch {len(self.epochs) - 1 if self.epochs else 0}: earlier epochs have no "
                        "GPU numbers in their logs (slow nvidia-smi start; persistence mode shortens it)",
                        key="late-first",
                    )
            else:
                self.say("nvidia-smi gave no sample before the first epoch ended: no GPU numbers in these logs yet")
        order = self._order or []
        values = acc.values(order, latest if fresh else None)
        late_sweeps = self._fold_late(late, order)
        if late_sweeps:
            values["gpu_late_sweeps"] = float(late_sweeps)
        energy = [v for k, v in values.items() if k.endswith("_energy_wh") and not math.isnan(v)]
        t = self.totals
        seconds = now - self._epoch_start
        steps = t.steps - self._epoch_step0
        samples = t.samples - self._epoch_samples0 if self._counts_samples else None
        wait = t.data_wait - self._epoch_wait0 if self._waits else None
        if order:
            values.update(throughput_values(sum(energy) if energy else math.nan, steps, samples, seconds, wait))
            values.update(self._framework_values(latest))
            if self.process_share:
                values.update(self._share_values(epoch, order))
        if epoch is not None:
            self._done_epochs[epoch] = acc
        self.epochs.append(dict(values))  # a copy: late sweeps correct this record, not the logs handed out
        return values

    def _share_values(self, epoch: int | None, order: Sequence[int]) -> dict[str, float]:
        """``gpuN_share`` and ``gpuN_other_processes`` of the epoch (pmon instants that arrived during it)."""
        with self._lock:
            accs = self._share_accs.pop(epoch, None) or {}
            setup = self._share_accs.pop(None, None)
            if setup is not None and len(self.epochs) == 0:
                for gpu, extra in setup.items():
                    accs.setdefault(gpu, _ShareAcc()).merge(extra)
            for k in [k for k in self._share_accs if k is not None and epoch is not None and k < epoch]:
                del self._share_accs[k]  # instants of epochs already summarised: the share is not corrected
        out: dict[str, float] = {}
        for idx in order:
            acc = accs.get(idx)
            share, others = acc.values() if acc is not None else (math.nan, math.nan)
            out[f"gpu{idx}_share"] = share
            out[f"gpu{idx}_other_processes"] = others
        return out

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

    # -------------------------------------------------------------------------------------- framework view

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
            self.totals.memory[idx] = view
            mib = 2.0**20
            if view.current is not None:
                out[f"gpu{idx}_mem_framework_mib"] = view.current / mib
            if view.peak is not None:
                out[f"gpu{idx}_mem_framework_peak_mib"] = view.peak / mib
            if view.reserved is not None:
                out[f"gpu{idx}_mem_framework_reserved_mib"] = view.reserved / mib
            s = latest.get(idx)
            used = number(s.get("memory.used")) if s is not None else None
            mine = max((x for x in (view.current, view.peak, view.reserved) if x is not None), default=None)
            gap = math.nan if used is None or mine is None else used - mine / mib
            out[f"gpu{idx}_mem_gap_mib"] = gap
            self.watch_gap(idx, gap, view, fw.name)
        return out

    def watch_gap(self, idx: int, gap: float, view: MemoryView, framework: str) -> None:
        """Track one GPU's driver-vs-framework gap; say once when it grew for several epochs in a row.

        Args:
            idx: the nvidia-smi index.
            gap: the gap this epoch, MiB (NaN ignored).
            view: the framework's view this epoch.
            framework: its name for the message.
        """
        if math.isnan(gap):
            return
        history = self._gaps.setdefault(idx, deque(maxlen=_GAP_EPOCHS + 1))
        history.append(gap)
        if len(history) <= _GAP_EPOCHS:
            return
        steps = [b - a for a, b in zip(history, list(history)[1:])]
        if all(d > 0 for d in steps) and history[-1] - history[0] >= _GAP_GROWTH_MIB:
            self.say(gap_note(idx, framework, view, list(history)), key=f"gap-{idx}")

    def uuids(self) -> dict[int, str]:
        """The UUID of each watched GPU seen so far (nvidia-smi index -> UUID)."""
        with self._lock:
            return {idx: s.uuid for idx, s in self._latest.items() if s.uuid}

    # ------------------------------------------------------------------------------------------ close

    def close(self, timeout: float = 5.0) -> None:
        """Stop monitoring: nvidia-smi terminated and reaped, threads ended, recording closed, metrics pushed.

        Alert handlers get at most about two seconds to finish (a dead webhook is cut off and counted).
        Idempotent; safe from any thread.

        Args:
            timeout: most seconds to wait for the stream to stop.
        """
        began = time.monotonic()
        with self._closing:
            if (
                self._source is None
                and self._reader is None
                and self._worker is None
                and self._metrics is None
                and self._pmon_reader is None
            ):
                return  # nothing open: keep the last run's cost figures
            self._close_locked(timeout)
        self.cost["close"] = time.monotonic() - began

    def _close_locked(self, timeout: float) -> None:
        self._stop.set()
        self._pos = Position(self._pos.epoch, self._pos.batch, self._pos.step, "done")
        source = self._source
        self._source = None
        if source is not None:
            try:
                source.close(timeout)
            except Exception:
                log.exception("smiquery: stopping nvidia-smi failed")
        pmon = self._pmon
        self._pmon = None
        if pmon is not None:
            try:
                pmon.close()
            except Exception:
                log.exception("smiquery: stopping nvidia-smi pmon failed")
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)
        self._reader = None
        pmon_reader = self._pmon_reader
        if pmon_reader is not None and pmon_reader is not threading.current_thread():
            pmon_reader.join(timeout)
        self._pmon_reader = None
        worker = self._worker
        if worker is not None:
            try:
                self._events.put(None, timeout=1.0)
            except queue.Full:
                pass
            if worker is not threading.current_thread():
                worker.join(2.0)
        self._worker = None
        if self._notifier is not None:
            self._notifier.close(timeout=2.0)
        recorder = self._recorder
        self._recorder = None
        if recorder is not None:
            try:
                recorder.close()
            except Exception:
                log.exception("smiquery: closing the recording failed")
        metrics = self._metrics
        self._metrics = None
        if metrics is not None:
            metrics.close()
        _OPEN.discard(self)

    def __enter__(self) -> RunMonitor:
        return self.start() if self._source is None and not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- plain loops


class Watch:
    """A :class:`RunMonitor` for a hand-written loop, as :func:`watch` returns it.

    Attributes:
        monitor: the underlying monitor (its :attr:`~RunMonitor.epochs`, :attr:`~RunMonitor.alerts`...).
    """

    def __init__(self, monitor: RunMonitor, on_epoch: Callable[[int, dict[str, float]], object] | None) -> None:
        self.monitor = monitor
        self.on_epoch = on_epoch
        self._epoch: int | None = None

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield the items of a data loader, timing each fetch as data wait.

        Args:
            iterable: the loader (a ``torch.utils.data.DataLoader``, a generator...).

        Yields:
            Its items.
        """
        it = iter(iterable)
        m = self.monitor
        while True:
            began = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            m.totals.data_wait += time.perf_counter() - began
            m._waits = True
            yield item

    def step(self, epoch: int | None = None, batch: int | None = None, *, samples: int | None = None) -> None:
        """One step is done (see :meth:`RunMonitor.step`); a new ``epoch`` summarises the previous one.

        Args:
            epoch: the epoch it belongs to.
            batch: its number within the epoch.
            samples: training samples in it.
        """
        if epoch is not None and self._epoch is not None and epoch != self._epoch:
            self.end_epoch()
        if epoch is not None and epoch != self._epoch:
            self._epoch = epoch
            self.monitor.begin_epoch(epoch)
        self.monitor.step(None, batch, samples=samples)

    def end_epoch(self) -> dict[str, float]:
        """Summarise the current epoch now (otherwise done when the next epoch's first step or the end comes).

        Returns:
            The epoch's keys.
        """
        if self._epoch is None:
            return {}
        epoch, self._epoch = self._epoch, None
        values = self.monitor.end_epoch(epoch)
        if self.on_epoch is not None:
            try:
                self.on_epoch(epoch, values)
            except Exception:
                log.exception("smiquery: the on_epoch function failed")
        return values

    @property
    def epochs(self) -> list[dict[str, float]]:
        """The epochs summarised so far."""
        return self.monitor.epochs

    @property
    def alerts(self) -> list[TrainingAlert]:
        """The alerts so far, with the training position of each."""
        return self.monitor.alerts

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._epoch is not None:
                self.end_epoch()
        finally:
            self.monitor.close()


def watch(
    fields: str | Sequence[str] | None = None,
    interval: float = 1.0,
    *,
    on_epoch: Callable[[int, dict[str, float]], object] | None = None,
    **options: Any,
) -> Watch:
    """Monitor a hand-written training loop (any framework) with one nvidia-smi.

    Example (PyTorch)::

        with smiquery.monitor.watch(record="run.csv", framework=smiquery.monitor.torch_memory()) as w:
            for epoch in range(epochs):
                for i, (x, y) in enumerate(w.batches(loader)):   # fetch time counts as data wait
                    loss = loss_fn(model(x.cuda()), y.cuda())
                    opt.zero_grad(); loss.backward(); opt.step()
                    w.step(epoch=epoch, batch=i, samples=len(x))
        print(w.epochs[-1]["gpu0_util_mean"], w.epochs[-1]["samples_per_joule"])

    Args:
        fields: extra fields to summarise per epoch.
        interval: seconds between samples.
        on_epoch: called with ``(epoch, values)`` when an epoch is summarised (to log them).
        **options: any other :class:`RunMonitor` argument (``alerts``, ``handlers``, ``record``, ``metrics_port``,
            ``pushgateway``, ``framework``, ``nvidia_smi``, ``gpus``, ``process_share``...).

    Returns:
        A context manager; leaving it summarises the last epoch and reaps nvidia-smi.
    """
    monitor = RunMonitor(fields, interval, **options)
    monitor.start()
    return Watch(monitor, on_epoch)


class TorchMemory:
    """PyTorch's view of its GPU memory: allocated (current), peak and reserved (its caching allocator's pool)."""

    name = "PyTorch"

    def available(self) -> str | None:
        """None when ``torch.cuda`` can be asked; else why not."""
        try:
            import torch
        except Exception as exc:
            return f"cannot import torch ({exc}): the driver-vs-framework memory gap is not reported"
        if not torch.cuda.is_available():
            build = "a CPU-only build" if not torch.version.cuda else "unable to use CUDA here"
            return (
                f"PyTorch is {build} while nvidia-smi sees GPUs: training runs on the CPU and the "
                "driver-vs-framework memory gap is not reported"
            )
        return None

    def read(self) -> list[MemoryView]:
        """Every CUDA device PyTorch sees."""
        import torch

        return [
            MemoryView(
                k,
                float(torch.cuda.memory_allocated(k)),
                float(torch.cuda.max_memory_allocated(k)),
                float(torch.cuda.memory_reserved(k)),
            )
            for k in range(torch.cuda.device_count())
        ]


def torch_memory() -> FrameworkMemory:
    """PyTorch's memory view, for ``framework=`` of :func:`watch` (torch is imported only when it is read)."""
    return TorchMemory()


# ------------------------------------------------------------------------------------------------- metrics


class _JobMetrics:
    """The job's own metrics, computed from the monitor's counters at scrape (or push) time."""

    def __init__(self, monitor: RunMonitor) -> None:
        from prometheus_client import CollectorRegistry

        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(monitor))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None
        if monitor.metrics_port is not None:
            from prometheus_client import start_http_server

            got = start_http_server(monitor.metrics_port, monitor.metrics_addr, self.registry)
            if isinstance(got, tuple):
                self._server, self._thread = got
        if monitor.pushgateway is not None:
            self._pusher = threading.Thread(target=self._push_loop, name="smiquery-monitor-push", daemon=True)
            self._pusher.start()

    @property
    def port(self) -> int | None:
        """The port actually bound (for ``metrics_port=0``)."""
        if self._server is None:
            return None
        return int(self._server.server_address[1])

    def push(self) -> None:
        from prometheus_client import push_to_gateway

        m = self.monitor
        assert m.pushgateway is not None
        push_to_gateway(m.pushgateway, job=m.job, registry=self.registry, grouping_key={"host": m.host}, timeout=2.0)

    def _push_loop(self) -> None:
        while not self._stop.wait(self.monitor.push_interval):
            try:
                self.push()
            except Exception as exc:
                self.monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")

    def close(self) -> None:
        self._stop.set()
        if self.monitor.pushgateway is not None:
            try:
                self.push()  # the final figures
            except Exception as exc:
                self.monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")
        if self._pusher is not None:
            self._pusher.join(3.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(2.0)


class _Collector:
    """prometheus_client collector over a :class:`RunMonitor`'s totals, one series per watched GPU (by UUID)."""

    def __init__(self, monitor: RunMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.monitor
        t = m.totals
        uuids = m.uuids()
        labels = ["uuid", "host"]
        steps = CounterMetricFamily("smiquery_training_steps", "Optimizer steps taken by the job.", labels=labels)
        samples = CounterMetricFamily(
            "smiquery_training_samples", "Training samples processed by the job.", labels=labels
        )
        wait = CounterMetricFamily(
            "smiquery_training_data_wait_seconds",
            "Seconds the job spent between steps (waiting for input).",
            labels=labels,
        )
        epoch = GaugeMetricFamily("smiquery_training_epoch", "The epoch the job is in (0-based).", labels=labels)
        energy = CounterMetricFamily(
            "smiquery_training_energy_joules", "Energy drawn by the GPU during training (power.draw).", labels=labels
        )
        used = GaugeMetricFamily(
            "smiquery_training_memory_used_bytes", "GPU memory held by the framework's live tensors.", labels=labels
        )
        peak = GaugeMetricFamily(
            "smiquery_training_memory_peak_bytes", "The framework's peak tensor memory on the GPU.", labels=labels
        )
        reserved = GaugeMetricFamily(
            "smiquery_training_memory_reserved_bytes",
            "GPU memory reserved by the framework's allocator.",
            labels=labels,
        )
        for idx, uuid in sorted(uuids.items()):
            lv = [uuid, m.host]
            steps.add_metric(lv, float(t.steps))
            samples.add_metric(lv, float(t.samples))
            wait.add_metric(lv, t.data_wait)
            if t.epoch is not None:
                epoch.add_metric(lv, float(t.epoch))
            joules = t.joules.get(idx)
            if joules is not None:  # no power.draw (N/A on this GPU): no series rather than a made-up 0
                energy.add_metric(lv, joules)
            view = t.memory.get(idx)
            if view is not None:
                if view.current is not None:
                    used.add_metric(lv, view.current)
                if view.peak is not None:
                    peak.add_metric(lv, view.peak)
                if view.reserved is not None:
                    reserved.add_metric(lv, view.reserved)
        yield from (steps, samples, wait, epoch, energy, used, peak, reserved)
        if m.process_share:
            yield from self._share_families(m, uuids, labels)

    @staticmethod
    def _share_families(m: RunMonitor, uuids: Mapping[int, str], labels: list[str]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        share = GaugeMetricFamily(
            "smiquery_training_gpu_process_share",
            "The job's part of the GPU's SM use in the newest nvidia-smi pmon sample (0..1).",
            labels=labels,
        )
        others = GaugeMetricFamily(
            "smiquery_training_gpu_other_processes",
            "Processes other than the job's on the GPU in the newest nvidia-smi pmon sample.",
            labels=labels,
        )
        shares = m.process_shares()
        for idx, uuid in sorted(uuids.items()):
            got = shares.get(idx)
            if got is None:
                continue  # no pmon sample of this GPU: no series rather than a made-up 0
            if got.share is not None:
                share.add_metric([uuid, m.host], got.share)
            others.add_metric([uuid, m.host], float(len(got.other_pids)))
        yield from (share, others)


# Monitors whose stream is open; closed at interpreter exit so that no nvidia-smi outlives the process.
_OPEN: weakref.WeakSet[RunMonitor] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for monitor in list(_OPEN):
        try:
            monitor.close(timeout=2.0)
        except Exception:
            pass
