"""One epoch's GPU numbers: running sums per GPU and field (constant memory), energy, and the job-level keys."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from smiquery.fields import Field
from smiquery.kinds import to_number

if TYPE_CHECKING:
    from smiquery.sample import GpuSample

__all__ = [
    "BATCH",
    "BETWEEN",
    "SUMMARY",
    "SUMMARY_FIELDS",
    "EnergySplitter",
    "EpochAccumulator",
    "summary_spec",
    "throughput_values",
]

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
    ``max(3 * interval, 5 s)`` one ``interval``.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.cap = max(3.0 * interval, 5.0)
        self.last: dict[int, float] = {}
        self.watts: dict[int, float] = {}
        self.credited: dict[int, float] = {}
        self.marks: list[tuple[float, Owner]] = []
        self.began: float | None = None
        #: seconds of a first sample's power held back, per owner (the longest of the GPUs)
        self.held: dict[Owner, float] = {}

    def start(self, wall: float) -> None:
        """The run began at ``wall``: each GPU's first sample stands for the time since then."""
        self.began = wall

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
