"""One epoch's GPU numbers: sums per GPU and field, energy, the job-level keys, and the run's own share of each GPU."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.fields import Field
from smiquery.kinds import to_number
from smiquery.sources.pmon import pmon_unsupported, proc_stat, process_share

if TYPE_CHECKING:
    from smiquery.sample import GpuSample
    from smiquery.source import StreamEvent
    from smiquery.sources.pmon import PmonRow, ProcessShare
    from smiquery.streams.pmon import PmonStream

__all__ = [
    "BATCH",
    "BETWEEN",
    "SUMMARY",
    "SUMMARY_FIELDS",
    "EnergySplitter",
    "EpochAccumulator",
    "ShareTracker",
    "own_pids",
    "summary_spec",
    "throughput_values",
]

log = get_logger("smiquery.training.epochs")

#: Fields always streamed: what the epoch summary needs.
SUMMARY_FIELDS: tuple[str, ...] = ("utilization.gpu", "temperature.gpu", "memory.used", "power.draw")

#: (field, log key suffix, statistic) of the epoch summary; the key is f"gpu{index}_{suffix}".
SUMMARY: tuple[tuple[str, str, str], ...] = (
    ("utilization.gpu", "util_mean", "mean"),
    ("utilization.gpu", "util_max", "max"),
    ("temperature.gpu", "temp_max", "max"),
    ("memory.used", "mem_used_max_mib", "max"),
    ("power.draw", "power_mean_w", "mean"),
)
#: The per-step keys of ``log_every="batch"``: (field, key suffix), the newest sample's value.
BATCH: tuple[tuple[str, str], ...] = (
    ("utilization.gpu", "util"),
    ("temperature.gpu", "temp"),
    ("memory.used", "mem_used_mib"),
    ("power.draw", "power_w"),
)


class _Acc:
    """Running count, sum and maximum of one field on one GPU."""

    __slots__ = ("max", "n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.max = -math.inf

    def add(self, n: int, total: float, top: float) -> None:
        self.n += n
        self.total += total
        self.max = max(self.max, top)

    def value(self, stat: str) -> float:
        return self.total / self.n if stat == "mean" else self.max


class EpochAccumulator:
    """The running sums of one epoch for the ``summary`` triples: per GPU and field count/sum/max, joules, sweeps."""

    def __init__(self, summary: Sequence[tuple[str, str, str]]) -> None:
        self.summary = summary
        self.accs: dict[int, dict[str, _Acc]] = {}
        self.joules: dict[int, float] = {}
        self.sweeps = 0

    def add(self, idx: int, sample: GpuSample) -> None:
        """Add one sample of GPU ``idx``."""
        accs = self.accs.setdefault(idx, {})
        for name, _suffix, _stat in self.summary:
            v = to_number(sample.get(name))
            if v is not None:
                (accs.get(name) or accs.setdefault(name, _Acc())).add(1, v, v)

    def values(self, order: Sequence[int], latest: Mapping[int, GpuSample] | None = None) -> dict[str, float]:
        """The log keys for the GPUs in ``order`` (nvidia-smi indices): NaN where the epoch had no value.

        ``latest``, the newest sample per GPU, stands in for an epoch shorter than the sampling interval.
        """
        out: dict[str, float] = {}
        for idx in order:
            accs = self.accs.get(idx) or {}
            last = latest.get(idx) if latest is not None and not accs else None
            for name, suffix, stat in self.summary:
                a = accs.get(name)
                x = a.value(stat) if a is not None else to_number(last.get(name)) if last is not None else None
                out[f"gpu{idx}_{suffix}"] = math.nan if x is None else x
            joules = self.joules.get(idx)
            out[f"gpu{idx}_energy_wh"] = math.nan if joules is None else joules / 3600.0
        return out

    def add_joules(self, idx: int, joules: float) -> None:
        """Add energy of GPU ``idx`` to this epoch."""
        self.joules[idx] = self.joules.get(idx, 0.0) + joules

    def merge(self, other: EpochAccumulator) -> None:
        """Add another accumulator's sums to this one (late sweeps of an epoch already summarised)."""
        for idx, accs in other.accs.items():
            mine = self.accs.setdefault(idx, {})
            for name, a in accs.items():
                mine.setdefault(name, _Acc()).add(a.n, a.total, a.max)
        for idx, j in other.joules.items():
            self.add_joules(idx, j)
        self.sweeps += other.sweeps


#: The owner of the time between two epochs: its energy counts in the run's total only.
BETWEEN = -1

Owner = int | None


class EnergySplitter:
    """Per GPU, integrates ``power.draw`` over nvidia-smi's timestamps and splits each interval at epoch boundaries.

    Times are wall-clock seconds. A sample's power stands for the interval since that GPU's previous sample, split
    between the owners of the marks inside it. At an epoch's end :meth:`tail` credits the newest power up to the end;
    the next sample counts only what is left. A GPU's first sample's power is held back to the run's start or the end
    of the last epoch logged (:attr:`held`: for how long). A step back in the timestamps counts 0, a jump over
    ``max(3 * interval, 5 s)`` one ``interval``. ``began``: the run's start, which each GPU's first sample stands for.
    """

    def __init__(self, interval: float, began: float | None = None) -> None:
        self.interval = interval
        self.cap = max(3.0 * interval, 5.0)
        self.last: dict[int, float] = {}
        self.watts: dict[int, float] = {}
        self.credited: dict[int, float] = {}
        self.marks: list[tuple[float, Owner]] = []
        self.began = began
        #: seconds of a first sample's power held back, per owner (the longest of the GPUs)
        self.held: dict[Owner, float] = {}

    def mark(self, wall: float, owner: Owner) -> None:
        """From ``wall`` on, energy belongs to ``owner`` (an epoch, None for the setup, :data:`BETWEEN`)."""
        self.marks.append((wall, owner))
        if len(self.marks) > 8:  # a sample interval spans a few marks at most
            del self.marks[0]

    def _split(self, start: float, end: float, watts: float, default: Owner) -> list[tuple[Owner, float]]:
        owner = default
        cut = start
        parts: list[tuple[Owner, float]] = []
        for wall, who in self.marks:
            if wall <= start:
                owner = who
            elif wall < end:
                if wall > cut:
                    parts.append((owner, watts * (wall - cut)))
                owner, cut = who, wall
        parts.append((owner, watts * (end - cut)))
        return parts

    def sample(self, idx: int, wall: float, watts: float | None, default: Owner) -> list[tuple[Owner, float]]:
        """Energy of the interval ending at this sample of GPU ``idx`` (at ``wall``), as (owner, joules) parts.

        ``default`` owns the time before any mark (the epoch the sample arrived in).
        """
        prev = self.last.get(idx)
        self.last[idx] = wall
        if watts is None:
            self.watts.pop(idx, None)
            return []
        self.watts[idx] = watts
        if prev is None and self.began is not None:
            # not into an epoch already logged: nothing is made up for it
            began = max([self.began] + [w for w, who in self.marks if who == BETWEEN and w < wall])
            if began < wall:
                for who, seconds in self._split(began, wall, 1.0, None):
                    if who != BETWEEN:
                        self.held[who] = max(self.held.get(who, 0.0), seconds)
                return self._split(began, wall, watts, None)
        if prev is None or wall <= prev:
            return []  # the first sample (the run's start unknown), or the clock went back: nothing measured
        if wall - prev > self.cap:
            return [(self.marks[-1][1] if self.marks else default, watts * self.interval)]
        start = prev
        done = self.credited.pop(idx, None)
        if done is not None and prev < done <= wall + self.cap:  # far ahead: nvidia-smi's clock stepped back
            if done >= wall:  # sampled before an epoch's end, delivered after it: already credited
                self.credited[idx] = done
                return []
            start = done
        return self._split(start, wall, watts, default)

    def drop(self, idx: int) -> None:
        """Forget GPU ``idx`` (it turned out not to be the run's)."""
        for known in (self.last, self.watts, self.credited):
            known.pop(idx, None)

    def tail(self, idx: int, wall: float, default: Owner) -> list[tuple[Owner, float]]:
        """Credit GPU ``idx``'s newest power from its newest sample (or the last credit) up to ``wall`` now."""
        prev = self.last.get(idx)
        watts = self.watts.get(idx)
        if watts is None or prev is None:
            return []
        start = max(prev, self.credited.get(idx, prev))
        if not 0 < wall - start <= self.cap:
            return []
        self.credited[idx] = wall
        return self._split(start, wall, watts, default)


def summary_spec(extra: Iterable[Field]) -> list[tuple[str, str, str]]:
    """The (field, key suffix, statistic) triples: the built-in summary, then mean/max (or share true) per extra."""
    spec = list(SUMMARY)
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
    """The job-level keys of one epoch (``seconds``: its wall time; ``energy_wh`` NaN when unknown)."""
    joules = energy_wh * 3600.0
    ok = joules > 0 and not math.isnan(joules)
    out = {"energy_wh": energy_wh, "steps_per_joule": steps / joules if ok else math.nan}
    if samples is not None:
        out["samples_per_joule"] = samples / joules if ok else math.nan
    if data_wait is not None:
        out["data_wait_s"] = data_wait
        out["data_wait_frac"] = data_wait / seconds if seconds > 0 else math.nan
    return out


def own_pids(pids: Iterable[int] | None = None, *, root: str = "/proc") -> frozenset[int]:
    """The run's own processes among ``pids`` (default every process): this process and its descendants.

    Parent chains are read from ``ROOT/PID/stat``; without ``/proc`` (macOS, Windows) only this process counts.
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
            stat = proc_stat(cur, root)
            cur = int(stat[1]) if len(stat) > 1 and stat[1].isdigit() else None
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
        self.mine = self.total = 0.0
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


class ShareTracker:
    """The run's share of each GPU (``process_share=True``): one pmon child and its thread, summed per epoch.

    Each instant goes into the epoch ``epoch_now()`` says it arrived in. Failures are said once through ``say``, never
    raised; an unsupported pmon turns the share off (the keys stay NaN). ``watched(idx)``: whether the run watches a
    GPU (None: every GPU).
    """

    def __init__(
        self,
        say: Callable[..., None],
        epoch_now: Callable[[], int | None],
        watched: Callable[[int], bool] | None = None,
    ) -> None:
        self._say = say
        self._epoch_now = epoch_now
        self._watched = watched
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._accs: dict[int | None, dict[int, _ShareAcc]] = {}
        self._shares: dict[int, ProcessShare] = {}
        self._pmon: PmonStream | None = None
        self._reader: threading.Thread | None = None
        #: True once the share is given up (pmon unsupported or not startable)
        self.off = False
        #: CPU seconds of the reading thread, once it ended
        self.cpu = 0.0

    def start(self, *, interval: float, gpus: Sequence[str] | None, nvidia_smi: str | os.PathLike[str] | None) -> None:
        """Start pmon (SM use only, 1..10 s apart, four GPUs at most) and its reading thread."""
        from smiquery.streams import pmon

        seconds = max(1, min(10, round(interval)))
        ids = list(gpus)[:4] if gpus else None
        try:
            self._pmon = pmon.stream(
                gpus=ids, interval=seconds, select="u", nvidia_smi=nvidia_smi, on_event=self._event
            )
        except Exception as exc:
            self.off = True
            self._say(f"the process share is off: {exc}", key="share-off")
            return
        self._reader = threading.Thread(target=self._read, name="smiquery-monitor-pmon", daemon=True)
        self._reader.start()

    @property
    def open(self) -> bool:
        """True while pmon or its reading thread is not closed."""
        return self._pmon is not None or self._reader is not None

    def latest(self) -> dict[int, ProcessShare]:
        """The newest pmon instant's share per watched GPU (empty before the first)."""
        with self._lock:
            return dict(self._shares)

    def _event(self, event: StreamEvent) -> None:
        err = event.error
        if event.kind != "error" or err is None or self.off:
            return
        if pmon_unsupported(err):
            self.off = True
            self._say(
                "per-process monitoring (nvidia-smi pmon) is not supported on this GPU or driver: the process share "
                "is off and gpuN_share / gpuN_other_processes stay NaN",
                key="share-unsupported",
            )
            pmon = self._pmon
            if pmon is not None:
                pmon.close()  # ends its retries; the pmon thread then ends
            return
        self._say(
            f"nvidia-smi pmon failed ({type(err).__name__}: {event.detail or err}); it is retried, and the process "
            "share has a gap until it recovers",
            key=f"share-error-{type(err).__name__}",
        )

    def _read(self) -> None:
        pmon = self._pmon
        try:
            for instant in pmon.samples() if pmon is not None else ():
                if self._stop.is_set() or self.off:
                    return
                self.take(instant)
        except Exception as exc:
            if not self._stop.is_set() and not self.off:
                self._say(f"the process share stopped: {exc}", key="share-stopped")
        finally:
            self.cpu = time.thread_time()

    def take(self, rows: Sequence[PmonRow]) -> None:
        """Sum one pmon instant into the epoch it arrived in; say once per GPU when another process is on it."""
        epoch = self._epoch_now()
        shares = process_share(rows, own_pids({r.pid for r in rows if r.pid is not None}), every=True)
        if self._watched is not None:
            shares = {g: v for g, v in shares.items() if self._watched(g)}
        with self._lock:
            accs = self._accs.setdefault(epoch, {})
            for gpu, share in shares.items():
                accs.setdefault(gpu, _ShareAcc()).add(share)
            self._shares = shares
        for gpu, share in shares.items():
            if not share.other_pids:
                continue
            first = next((r for r in rows if r.gpu == gpu and r.pid == share.other_pids[0]), None)
            who = f"pid {share.other_pids[0]}" + (f" ({first.command})" if first and first.command else "")
            more = f" and {len(share.other_pids) - 1} more" if len(share.other_pids) > 1 else ""
            use = "no SM use reported" if share.others_sm is None else f"{share.others_sm}% SM"
            self._say(
                f"another process uses GPU {gpu} beside this run: {who}{more}, {use}; gpu{gpu}_share tells this "
                "run's part of the GPU's SM use (see `smiquery ps`)",
                key=f"share-other-{gpu}",
            )

    def epoch_values(self, epoch: int | None, order: Sequence[int], *, first: bool) -> dict[str, float]:
        """``gpuN_share`` and ``gpuN_other_processes`` of ``epoch`` for the GPUs in ``order`` (NaN without data).

        ``first``: the run's first summarised epoch, which also takes the instants before it.
        """
        with self._lock:
            accs = self._accs.pop(epoch, None) or {}
            setup = self._accs.pop(None, None)
            if setup is not None and first:
                for gpu, extra in setup.items():
                    accs.setdefault(gpu, _ShareAcc()).merge(extra)
            for k in [k for k in self._accs if k is not None and epoch is not None and k < epoch]:
                del self._accs[k]  # instants of epochs already summarised: the share is not corrected
        out: dict[str, float] = {}
        for idx in order:
            acc = accs.get(idx, _ShareAcc())
            out[f"gpu{idx}_share"] = acc.mine / acc.total if acc.total > 0 else math.nan
            out[f"gpu{idx}_other_processes"] = float(len(acc.others)) if acc.instants else math.nan
        return out

    def close(self, timeout: float) -> None:
        """Stop pmon (terminated and reaped) and its reading thread."""
        self._stop.set()
        pmon, self._pmon = self._pmon, None
        if pmon is not None:
            try:
                pmon.close()
            except Exception:
                log.exception("smiquery: stopping nvidia-smi pmon failed")
        reader, self._reader = self._reader, None
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)
