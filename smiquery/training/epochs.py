"""One epoch's GPU numbers: running sums per GPU and field (constant memory), energy, and the job-level keys."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from smiquery.fields import Field

if TYPE_CHECKING:
    from smiquery.sample import GpuSample

__all__ = ["BATCH", "SUMMARY", "SUMMARY_FIELDS", "EpochAccumulator", "number", "summary_spec", "throughput_values"]

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

    __slots__ = ("accs", "joules", "summary", "sweeps")

    def __init__(self, summary: Sequence[tuple[str, str, str]]) -> None:
        self.summary = summary
        self.accs: dict[int, dict[str, _Acc]] = {}
        self.joules: dict[int, float] = {}
        self.sweeps = 0

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
