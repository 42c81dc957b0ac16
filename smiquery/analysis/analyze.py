"""What happened in a recorded run: statistics, thresholds, alerts, stalls, health counters, energy, clock steps.

Every duration runs along each GPU's own timeline (:func:`smiquery.analysis.series.split_gpus`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any, cast

from smiquery.alerts import BUILTIN_RULES, Rule
from smiquery.alerts.rules import STALL, StallRule
from smiquery.analysis.findings import findings
from smiquery.analysis.model import AlertSpan, FieldStats, GpuName, HealthCount, Periods, Report, Stretch, ThresholdTime
from smiquery.analysis.series import GpuSeries, catalogue_field, load_recording, split_gpus
from smiquery.clock import REPORTED_STEP_BACK, ClockStep, later
from smiquery.errors import ReportError
from smiquery.fields import Field, Kind

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = ["DEFAULT_RULES", "report", "report_fields", "stalls_and_alerts"]

#: Thresholds the report (and :mod:`smiquery.analysis.plot`) use when no rules are given: the built-in health rules.
DEFAULT_RULES: tuple[str, ...] = BUILTIN_RULES


def report_fields(rules: Iterable[Rule | str] | None = None) -> tuple[str, ...]:
    """The fields a report needs: what the stall check and the ``rules`` (default :data:`DEFAULT_RULES`) watch.

    ``smiquery stream --output`` records these besides the default preset, so that nothing is "not recorded".
    """
    names = ["timestamp", "index", "utilization.gpu", "memory.used"]
    names += [f.name for r in _parse_rules(rules) for f in r.fields]
    return tuple(dict.fromkeys(names))


_SKIP_STATS = frozenset({"index", "count", "timestamp"})


def _numeric_fields(df: pd.DataFrame) -> list[Field]:
    """The columns with statistics: the catalogue's quantities, and columns the recording names a unit of."""
    units = df.attrs.get("units") or {}
    found = [
        catalogue_field(str(c)) or (Field(str(c), Kind.FLOAT, unit=str(units[c])) if c in units else None)
        for c in df.columns
    ]
    return [f for f in found if f is not None and f.attr not in _SKIP_STATS and f.kind.is_quantity]


def _parse_rules(rules: Iterable[Rule | str] | None, df: pd.DataFrame | None = None) -> tuple[Rule, ...]:
    """The rules given; by default the built-in ones and those the recording was made with (``attrs["rules"]``)."""
    chosen = [*DEFAULT_RULES, *(df.attrs.get("rules") or () if df is not None else ())] if rules is None else rules
    return tuple({str(r): r for r in map(Rule.of, chosen)}.values())


def report(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    rules: Iterable[Rule | str] | None = None,
    stall_utilization: float = STALL.utilization,
    min_stall: float = STALL.min_seconds,
    busy_memory: float = STALL.busy_memory_mib,
    name: str | None = None,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> Report:
    """Analyse a recorded run: the :class:`Report`.

    ``source``, ``fields`` and ``tz`` are as :func:`~smiquery.analysis.load_recording` takes them; ``name`` is what
    the report calls the recording (default: the file name). A *stall* is a stretch of at least ``min_stall`` seconds
    during which a GPU's ``utilization.gpu`` stayed under ``stall_utilization`` percent while its ``memory.used`` was
    at least ``busy_memory`` MiB (a job held the GPU but gave it no work; without ``memory.used``, utilization alone
    decides). Stalls that overlap on several GPUs are reported together as well, since they point at a shared cause.

    The ``rules`` (or ``--alert`` expressions; default :data:`DEFAULT_RULES` and the rules the recording was made
    with, which ``stream --alert ... --output`` records beside it) are checked: time past a threshold counts every
    sample for which a rule's condition held (ignoring its hold); the alerts are those the rules would have fired
    live (honouring the hold). Missing values keep the state they follow.

    Raises ReportError when the recording cannot be read or holds no samples, InvalidRuleError for a rule that
    cannot be parsed.
    """
    df = load_recording(source, fields=fields, tz=tz)
    if df.empty:
        raise ReportError("the recording holds no samples")
    label = name or (os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "recording")
    parsed = _parse_rules(rules, df)
    gpus, interval = split_gpus(df)
    stats, constants, overall = _stats(df, gpus)
    sweeps = max(len(g.times) for g in gpus)
    single = sweeps <= 1  # a single snapshot stands for no length of time: no energy, no interval
    thresholds: list[ThresholdTime] = []  # the time past each rule's threshold, filled in by _alerts
    result = Report(
        source=label,
        gpus=tuple(g.index for g in gpus),
        start=min(g.stamp(0) for g in gpus),
        end=max(g.stamp(len(g.times) - 1) for g in gpus),
        sweeps=sweeps,
        interval=0.0 if single else round(interval, 3),
        stats=stats,
        overall=overall,
        constants=constants,
        alerts=_alerts(parsed, gpus, thresholds),
        thresholds=thresholds,
        stalls=_stalls(gpus, StallRule(stall_utilization, busy_memory, min_stall)),
        rules=tuple(str(r) for r in parsed),
        stall_utilization=stall_utilization,
        min_stall=min_stall,
        skipped=df.attrs.get("skipped"),
        skipped_files=tuple(df.attrs.get("skipped_files") or ()),
        health=_health(df, gpus),
        energy_wh={} if single else _energy(df, gpus),
        elapsed=max(float(g.times[-1]) for g in gpus) - min(float(g.times[0]) for g in gpus),
        names=_names(df, [g.index for g in gpus]),
    )
    result.not_recorded, result.unchecked_rules = _not_recorded(df, parsed)
    result.clock_steps, result.zone_changes = _clock_changes(gpus)
    result.findings = findings(result, parsed, gpus)
    return result


def stalls_and_alerts(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    rules: Iterable[Rule | str] | None = None,
    stall_utilization: float = STALL.utilization,
    min_stall: float = STALL.min_seconds,
    busy_memory: float = STALL.busy_memory_mib,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> Periods:
    """Only the stalls and alerts of a recording (what the plot shades), as :func:`report` finds them, for less.

    The arguments and errors are :func:`report`'s.
    """
    df = load_recording(source, fields=fields, tz=tz)
    if df.empty:
        raise ReportError("the recording holds no samples")
    gpus, _ = split_gpus(df)
    return Periods(
        _stalls(gpus, StallRule(stall_utilization, busy_memory, min_stall)), _alerts(_parse_rules(rules, df), gpus)
    )


def _not_recorded(df: pd.DataFrame, rules: Sequence[Rule]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The fields the stall check and the rules need that hold no value in the recording; the rules watching them."""

    def recorded(attr: str) -> bool:
        return attr in df.columns and bool(df[attr].notna().any())

    missing: dict[str, None] = {}
    if not recorded("utilization_gpu"):
        missing["utilization.gpu"] = None
    unchecked: list[str] = []
    for rule in rules:
        lacking = [c.field.name for c in (rule, *rule.when) if not recorded(c.field.attr)]
        if lacking:
            unchecked.append(str(rule))
            missing.update(dict.fromkeys(lacking))
    return tuple(missing), tuple(unchecked)


def _stats(
    df: pd.DataFrame, gpus: list[GpuSeries]
) -> tuple[list[FieldStats], dict[str, dict[int, Any]], list[FieldStats]]:
    import numpy as np

    stats: list[FieldStats] = []
    overall: list[FieldStats] = []
    constants: dict[str, dict[int, Any]] = {}
    for fld in _numeric_fields(df):
        per = [s for g in gpus if (s := _summary(fld, g.index, g.floats(fld.attr))) is not None]
        if not per:
            continue
        if all(s.min == s.max for s in per):
            constants[fld.name] = {s.gpu: s.max for s in per}
            continue
        stats += per
        overall.append(cast(FieldStats, _summary(fld, -1, np.concatenate([g.floats(fld.attr) for g in gpus]))))
    return stats, constants, overall


def _summary(fld: Field, gpu: int, values: np.ndarray) -> FieldStats | None:
    """The statistics of ``values`` (NaN: missing) as ``gpu``'s (-1: all GPUs'); None when none is present."""
    import numpy as np

    present = values[~np.isnan(values)]
    if not len(present):
        return None
    mean, p95 = float(present.mean()), float(np.percentile(present, 95))
    return FieldStats(fld.name, fld.unit, gpu, mean, p95, float(present.max()), float(present.min()), len(present),
                      len(values) - len(present))  # fmt: skip


# Counters and flags of memory health (nvidia-smi names, by prefix or exact name).
_HEALTH_PREFIXES = ("ecc.errors.", "retired_pages.", "remapped_rows.")


def _names(df: pd.DataFrame, gpus: Sequence[int]) -> dict[int, GpuName]:
    """A fleet frame's GPU names (``attrs["gpu_names"]``, see :class:`GpuName`) of the GPUs in the report."""
    got = df.attrs.get("gpu_names") or {}
    return {g: got[g] for g in gpus if g in got}


def _health(df: pd.DataFrame, gpus: list[GpuSeries]) -> list[HealthCount]:
    """The memory-health counters and flags that were non-zero (or set) at some point, per GPU."""
    import numpy as np

    found: list[HealthCount] = []
    for col in df.columns:
        fld = catalogue_field(str(col))
        if fld is None or not fld.name.startswith(_HEALTH_PREFIXES) or ".histogram." in fld.name:
            continue
        if not (fld.kind is Kind.INT or fld.kind.is_bool):
            continue
        for g in gpus:
            values = g.floats(fld.attr)
            present = values[~np.isnan(values)]
            if not len(present) or present.max() <= 0:
                continue
            found.append(HealthCount(fld.name, g.index, float(present[0]), float(present[-1]), float(present.max())))
    return found


def _energy(df: pd.DataFrame, gpus: Sequence[GpuSeries]) -> dict[int, float]:
    """Watt-hours per GPU: each sample's power.draw times its duration (gaps count one interval, as elsewhere)."""
    if "power_draw" not in df.columns:
        return {}
    import numpy as np

    out: dict[int, float] = {}
    for g in gpus:
        watts = g.floats("power_draw")
        ok = ~np.isnan(watts)
        if ok.any():
            out[g.index] = float(np.sum(watts[ok] * g.dur[ok])) / 3600.0
    return out


def _clock_changes(gpus: list[GpuSeries]) -> tuple[list[ClockStep], list[tuple[datetime, str, str]]]:
    """The recorded clock's steps back and a zone's offset changes, from the GPU with the most samples."""
    import numpy as np

    g = max(gpus, key=lambda g: len(g.times))
    ns = np.asarray(g.stamps, dtype="datetime64[ns]").astype("int64")
    back = np.flatnonzero(np.diff(ns) < -REPORTED_STEP_BACK * 1e9).tolist()
    steps = [ClockStep(g.stamp(i), g.stamp(i + 1), (int(ns[i]) - int(ns[i + 1])) / 1e9) for i in back]
    changes: list[tuple[datetime, str, str]] = []
    if g.zone is not None:
        import pandas as pd

        local = pd.DatetimeIndex(ns.astype("datetime64[ns]")).tz_localize("UTC").tz_convert(g.zone)
        # where the wall clock moved otherwise than the instants, the zone's offset changed
        moved = np.flatnonzero(np.diff(local.tz_localize(None).asi8) != np.diff(ns)).tolist()
        changes = [(g.stamp(i + 1), _offset_text(g.stamp(i)), _offset_text(g.stamp(i + 1))) for i in moved]
    return steps, changes


def _offset_text(ts: datetime) -> str:
    offset = ts.strftime("%z")  # +0100
    return f"UTC{offset[:3]}:{offset[3:5]}"


_NUMPY_OPS = {">": "greater", ">=": "greater_equal", "<": "less", "<=": "less_equal", "==": "equal", "!=": "not_equal"}


def _condition_values(rule: Rule, g: GpuSeries) -> np.ndarray:
    """1.0 where the rule's condition holds, 0.0 where not, NaN where a value is missing (decides nothing)."""
    import numpy as np

    parts: list[np.ndarray] = []
    for cond in (rule, *rule.when):
        col = cond.field.attr
        if col not in g.df.columns:
            return np.full(len(g.times), np.nan)
        kind = cond.field.kind
        if isinstance(cond.threshold, (int, float)) and (kind.is_numeric or kind.is_bool):
            values = g.floats(col)
            with np.errstate(invalid="ignore"):
                out = getattr(np, _NUMPY_OPS[cond.op])(values, float(cond.threshold)).astype("float64")
            out[np.isnan(values)] = np.nan
        else:  # text and other thresholds: the rule's own comparison, value by value (None: NaN)
            column = g.df[col].iloc[g.rows]
            verdicts = [None if na else cond.holds(v) for v, na in zip(column.tolist(), column.isna(), strict=True)]
            out = np.array(verdicts, dtype="float64")
        parts.append(out)
    result = parts[0]
    for p in parts[1:]:
        result = np.where((result == 0) | (p == 0), 0.0, np.where(np.isnan(result) | np.isnan(p), np.nan, 1.0))
    return result


def _runs(g: GpuSeries, cond: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(firsts, lasts): sample positions of the stretches where ``cond`` holds, as two int arrays.

    A missing value keeps the state it follows (as the live evaluator does); a gap in time ends a stretch.
    """
    import numpy as np

    n = len(cond)  # never 0: a GPU has a sample or more
    gap = np.zeros(n, dtype=bool)
    gap[1:] = np.diff(g.times) > g.gap_limit
    gap[0] = True
    state = cond.copy()
    # a missing value at the start of a segment (after a gap) holds nothing
    state[gap & np.isnan(state)] = 0.0
    known = ~np.isnan(state)
    last_known = np.maximum.accumulate(np.where(known, np.arange(n), 0))
    held = state[last_known] > 0  # NaNs take the state they follow
    starts = held & (gap | ~np.concatenate(([False], held[:-1])))
    ends = held & np.concatenate((gap[1:] | ~held[1:], [True]))
    return np.flatnonzero(starts), np.flatnonzero(ends)


def _peak(values: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, pick_max: bool) -> float | None:
    """The most extreme present value inside any of the stretches."""
    import numpy as np

    inside = np.zeros(len(values) + 1, dtype=np.int64)
    np.add.at(inside, firsts, 1)
    np.add.at(inside, lasts + 1, -1)
    window = values[np.cumsum(inside[:-1]) > 0]
    window = window[~np.isnan(window)]
    if not len(window):
        return None
    return float(window.max() if pick_max else window.min())


def _stretch(g: GpuSeries, first: int, last: int, values: np.ndarray | None, pick_max: bool) -> Stretch:
    import numpy as np

    seconds = float(g.seconds(first, last))
    end = later(g.stamp(last), timedelta(seconds=float(g.dur[last])))
    peak = mean = None
    if values is not None:
        window = values[first : last + 1]
        window = window[~np.isnan(window)]
        if len(window):
            peak = float(window.max() if pick_max else window.min())
            mean = float(window.mean())
    return Stretch(g.index, g.stamp(first), end, seconds, last - first + 1, peak, mean, last == len(g.times) - 1)


def _fired_at(rule: Rule, g: GpuSeries, first: int, last: int, cond: np.ndarray) -> int | None:
    """The sample at which a live evaluator would have fired within the stretch, or None."""
    import numpy as np

    counted = first + np.flatnonzero(~np.isnan(cond[first : last + 1]))
    if rule.hold_seconds is not None:
        ok = counted[g.times[counted] - g.times[first] >= rule.hold_seconds]
        return int(ok[0]) if len(ok) else None
    need = rule.hold_samples or 1
    return int(counted[need - 1]) if len(counted) >= need else None


def _alerts(
    rules: Sequence[Rule], gpus: list[GpuSeries], thresholds: list[ThresholdTime] | None = None
) -> list[AlertSpan]:
    """The alerts the rules would have fired, per rule and GPU; the time past each threshold goes to ``thresholds``."""
    alerts: list[AlertSpan] = []
    for rule in rules:
        for g in gpus:
            cond = _condition_values(rule, g)
            firsts, lasts = _runs(g, cond)
            if not len(firsts):
                continue
            values = g.floats(rule.field.attr) if rule.field.kind.is_quantity else None
            pick_max = rule.op in (">", ">=")
            if thresholds is not None:
                seconds = g.seconds(firsts, lasts)
                peak = None if values is None else _peak(values, firsts, lasts, pick_max)
                total, longest = float(seconds.sum()), float(seconds.max())
                thresholds.append(ThresholdTime(str(rule), g.index, total, len(firsts), longest, peak))
            # Only stretches long enough for the hold can have fired (a noisy field makes thousands of short ones).
            if rule.hold_seconds is not None:
                long_enough = g.times[lasts] - g.times[firsts] >= rule.hold_seconds
            else:
                long_enough = lasts - firsts + 1 >= (rule.hold_samples or 1)
            for a, b in zip(firsts[long_enough].tolist(), lasts[long_enough].tolist(), strict=True):
                at = _fired_at(rule, g, a, b, cond)
                if at is None:
                    continue
                s = _stretch(g, a, b, values, pick_max)
                alerts.append(
                    AlertSpan(str(rule), g.index, s.start, g.stamp(at), s.end, s.seconds, s.peak, not s.ongoing)
                )
    return alerts


def _stalls(gpus: list[GpuSeries], stall: StallRule) -> list[Stretch]:
    """Stretches of at least ``stall.min_seconds`` under the stall utilization (while memory was held), per GPU."""
    found: list[Stretch] = []
    for g in gpus:
        if "utilization_gpu" not in g.df.columns:
            break
        util = g.floats("utilization_gpu")
        cond = stall.mask(util, g.floats("memory_used") if "memory_used" in g.df.columns else None)
        firsts, lasts = _runs(g, cond)
        long_enough = g.seconds(firsts, lasts) >= stall.min_seconds
        for a, b in zip(firsts[long_enough].tolist(), lasts[long_enough].tolist(), strict=True):
            found.append(_stretch(g, a, b, util, pick_max=False))
    return found
