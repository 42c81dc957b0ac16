"""A recorded run, summarised: per-GPU statistics, time over thresholds, stalls, alerts and one-line verdicts.

:func:`analyze` reads a recording (CSV, JSONL or Parquet, as ``smiquery stream --output`` writes them, or a
DataFrame from :func:`smiquery.recordings.read_csv`) and returns a :class:`Report` that renders as text, JSON or
Markdown; :func:`stalls_and_alerts` finds only its stall and alert periods (what the plot shades), for less.
pandas and numpy are imported inside the functions, so ``import smiquery`` stays light.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Literal, cast

from smiquery.alerts import BUILTIN_RULES, Rule
from smiquery.clock import REPORTED_STEP_BACK, ClockStep, timeline
from smiquery.errors import InvalidFieldError, InvalidTimeZoneError, RecordingError, ReportError
from smiquery.fields import CATALOGUE, Field, Kind
from smiquery.recordings import SkippedLines
from smiquery.stalls import STALL, StallRule

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = [
    "DEFAULT_RULES",
    "AlertSpan",
    "FieldStats",
    "Finding",
    "HealthCount",
    "Periods",
    "Report",
    "ReportError",
    "StallRule",
    "Stretch",
    "ThresholdTime",
    "analyze",
    "format_duration",
    "load_recording",
    "stalls_and_alerts",
]

#: Thresholds the report (and :mod:`smiquery.plot`) use when no rules are given: the built-in health rules.
DEFAULT_RULES: tuple[str, ...] = BUILTIN_RULES

#: Utilization (percent) under which a GPU counts as stalled (from :data:`smiquery.stalls.STALL`).
STALL_UTILIZATION = STALL.utilization
#: Shortest stretch under :data:`STALL_UTILIZATION` that the report calls a stall, in seconds.
MIN_STALL_SECONDS = STALL.min_seconds
#: Memory used (MiB) from which a GPU counts as held by a job; an idle GPU without a job is not stalled.
BUSY_MEMORY_MIB = STALL.busy_memory_mib

_BY_ATTR: dict[str, Field] = {f.attr: f for f in CATALOGUE}
_SKIP_STATS = frozenset({"index", "count", "timestamp"})
_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}

Severity = Literal["critical", "warning", "info"]


# ------------------------------------------------------------------------------------------------- loading


def load_recording(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """A recording as a DataFrame with the columns of :func:`smiquery.recordings.frames.to_dataframe`, sorted by GPU.

    Files are read by :func:`smiquery.recordings.read_recording` (CSV with or without units or header, JSONL,
    Parquet; unreadable lines skipped and described in ``attrs["skipped"]``; a log without ``index`` is GPU 0).

    Args:
        source: a path (``.csv``, ``.jsonl``, ``.parquet``; other names are sniffed) or a DataFrame.
        fields: the columns of a headerless CSV log, in order; for a recording with a header (or JSONL, Parquet)
            each must be one of its columns.
        tz: the zone the recording was made in (e.g. ``"Europe/Berlin"``): naive timestamps are localized to it,
            aware ones converted. Default: as recorded (naive for nvidia-smi's CSV, never assumed to be UTC).

    Returns:
        One row per sample, in file order (rows without a timestamp or GPU index dropped).

    Raises:
        ReportError: the file is missing, unreadable, holds no readable row, has no ``timestamp``, or its
            columns do not agree with ``fields``.
        InvalidTimeZoneError: an unknown zone name in ``tz``.
    """
    import numpy as np
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        df = source
        if "index" not in df.columns:
            df = df.assign(index=pd.Series(np.zeros(len(df), dtype=np.int64), index=df.index, dtype="Int64"))
        if tz is not None and "timestamp" in df.columns:
            from smiquery.recordings import resolve_zone, set_zone

            df = df.copy(deep=False)
            set_zone(df, resolve_zone(tz))
    else:
        from smiquery.recordings import read_recording

        try:
            df = read_recording(source, fields=fields, tz=tz)
        except RecordingError as exc:
            raise ReportError(str(exc)) from exc
        except (InvalidFieldError, InvalidTimeZoneError):
            raise
        except (OSError, ValueError, ImportError) as exc:
            raise ReportError(f"cannot read recording {os.fspath(source)}: {exc}") from exc
    if "timestamp" not in df.columns:
        raise ReportError("the recording has no timestamp column; record with fields that include timestamp")
    bad = df["index"].isna() | df["timestamp"].isna()
    if bad.any():
        df = df[~bad].reset_index(drop=True)
    return df


def _field_of(column: str, df: pd.DataFrame) -> Field | None:
    fld = _BY_ATTR.get(column)
    if fld is not None:
        return fld
    units = df.attrs.get("units") or {}
    if column in units:
        return Field(column, Kind.FLOAT, unit=str(units[column]))
    return None


def _numeric_fields(df: pd.DataFrame) -> list[Field]:
    out = []
    for col in df.columns:
        fld = _field_of(str(col), df)
        if fld is None or fld.attr in _SKIP_STATS or not fld.kind.is_quantity:
            continue
        out.append(fld)
    return out


# ---------------------------------------------------------------------------------------------- formatting


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"1 min 30 s"``, ``"14 min"``, ``"2 h 5 min"``: how long, for people.

    Args:
        seconds: the duration.

    Returns:
        The duration rounded to the second below a minute, to the minute from an hour.
    """
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        m, rest = divmod(s, 60)
        return f"{m} min {rest} s" if rest else f"{m} min"
    h, rest = divmod(round(s / 60), 60)
    return f"{h} h {rest} min" if rest else f"{h} h"


def _zone_name(ts: datetime) -> str:
    """How the report names the zone of its times: the recording's zone, or that none was recorded."""
    if ts.tzinfo is None:
        return "recorder's local time"
    return str(ts.tzinfo)


def _clock(ts: datetime) -> str:
    return ts.strftime("%H:%M:%S")


def _stamp(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S")


def _num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _stat(x: float | None, fld: Field) -> str:
    """A statistic rounded to what the field's unit resolves: whole numbers for counts, MiB, %, C and MHz."""
    return _num(x, fld.kind.ops.summary_digits(fld.unit))


def _stat_field(name: str, unit: str) -> Field:
    """The catalogue's field for a statistic's column, else a decimal one in ``unit``."""
    return _BY_ATTR.get(name.replace(".", "_")) or Field(name, Kind.FLOAT, unit=unit)


def _peak_text(peak: float | None, rule: str) -> str:
    """An alert's peak, rounded to the unit of the field its rule watches (the rule's first word)."""
    m = re.match(r"[A-Za-z_][\w.]*", rule.strip())
    fld = _BY_ATTR.get(m.group(0).replace(".", "_")) if m else None
    return _num(peak) if fld is None else _stat(peak, fld)


def _gpu_list(gpus: Sequence[int]) -> str:
    """``"GPU 3"``, ``"GPUs 0-7"``, ``"GPUs 1, 3"``."""
    g = sorted(gpus)
    if len(g) == 1:
        return f"GPU {g[0]}"
    if g == list(range(g[0], g[-1] + 1)):
        return f"GPUs {g[0]}-{g[-1]}"
    return "GPUs " + ", ".join(str(x) for x in g)


def _unit(fld: Field) -> str:
    return fld.unit if fld.unit else ""


def _value_text(value: float | None, fld: Field) -> str:
    u = _unit(fld)
    text = _stat(value, fld)
    if not u or text == "n/a":
        return text
    return f"{text}{u}" if u == "%" else f"{text} {u}"


# ------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class FieldStats:
    """Mean, 95th percentile and maximum of one field on one GPU.

    Attributes:
        field: the field's nvidia-smi name.
        unit: its unit (``""`` when dimensionless).
        gpu: the GPU index.
        mean: mean of the present values.
        p95: 95th percentile.
        max: maximum.
        min: minimum.
        count: present values.
        missing: samples where the value was missing (``[N/A]`` and the like).
    """

    field: str
    unit: str
    gpu: int
    mean: float
    p95: float
    max: float
    min: float
    count: int
    missing: int


@dataclass(frozen=True)
class Stretch:
    """A continuous stretch of time during which a condition held on one GPU.

    Attributes:
        gpu: the GPU index.
        start: the first sample's time.
        end: the end of the last sample (its time plus the sampling interval).
        seconds: the length.
        samples: samples in the stretch.
        peak: the most extreme value of the watched field (max for ``>``, min for ``<``).
        mean: the mean of the watched field.
    """

    gpu: int
    start: datetime
    end: datetime
    seconds: float
    samples: int
    peak: float | None = None
    mean: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "gpu": self.gpu,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "seconds": round(self.seconds, 3),
            "samples": self.samples,
            "peak": self.peak,
            "mean": None if self.mean is None else round(self.mean, 3),
        }


@dataclass(frozen=True)
class ThresholdTime:
    """How long one GPU spent past one rule's threshold (ignoring the rule's hold).

    Attributes:
        rule: the rule's text.
        gpu: the GPU index.
        seconds: total time past the threshold.
        stretches: how many separate stretches.
        longest: the longest stretch in seconds.
        peak: the most extreme value seen while past it.
    """

    rule: str
    gpu: int
    seconds: float
    stretches: int
    longest: float
    peak: float | None


@dataclass(frozen=True)
class AlertSpan:
    """An alert that would have fired: the rule held for its hold on one GPU.

    Attributes:
        rule: the rule's text.
        gpu: the GPU index.
        since: when the condition started to hold.
        fired: when the hold was reached (when a live alert would have fired).
        end: when the condition stopped holding (or the recording ended).
        seconds: from ``since`` to ``end``.
        peak: the most extreme value of the rule's field.
        cleared: False when the recording ended while it was still firing.
    """

    rule: str
    gpu: int
    since: datetime
    fired: datetime
    end: datetime
    seconds: float
    peak: float | None
    cleared: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "rule": self.rule,
            "gpu": self.gpu,
            "since": self.since.isoformat(),
            "fired": self.fired.isoformat(),
            "end": self.end.isoformat(),
            "seconds": round(self.seconds, 3),
            "peak": self.peak,
            "cleared": self.cleared,
        }


@dataclass(frozen=True)
class HealthCount:
    """A memory-health counter or flag of one GPU that was not clean: ECC errors, retired pages, remapped rows.

    Attributes:
        field: the nvidia-smi name (``ecc.errors.uncorrected.aggregate.total``, ``remapped_rows.pending``).
        gpu: the GPU index.
        first: the value at the start of the run (flags: 1 for yes).
        last: the value at the end.
        max: the highest value seen.
    """

    field: str
    gpu: int
    first: float
    last: float
    max: float

    @property
    def grew(self) -> bool:
        """Whether the count rose during the run."""
        return self.max > self.first

    @property
    def severity(self) -> Severity:
        """critical for uncorrectable errors, retired double-bit pages and remapping failures; else warning."""
        name = self.field
        if "uncorrected" in name or "double_bit" in name or "uncorrectable" in name or name.endswith(".failure"):
            return "critical"
        return "warning" if self.grew or name.endswith(".pending") else "info"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"field": self.field, "gpu": self.gpu, "first": self.first, "last": self.last, "max": self.max}


@dataclass(frozen=True)
class Finding:
    """Something worth acting on, with a one-line verdict.

    Attributes:
        kind: ``stall``, ``stall_together``, ``hot``, ``warm``, ``throttle``, ``memory_full``, ``imbalance``,
            ``ecc``, ``alert`` or ``clock`` (the recorded clock stepped back, or a zone's offset changed).
        severity: ``critical``, ``warning`` or ``info``.
        gpus: the GPUs concerned.
        verdict: one line for people: what happened and what to check.
        seconds: how long it lasted in all (per GPU where it concerns one GPU).
        start: when it (first) started.
    """

    kind: str
    severity: Severity
    gpus: tuple[int, ...]
    verdict: str
    seconds: float = 0.0
    start: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "kind": self.kind,
            "severity": self.severity,
            "gpus": list(self.gpus),
            "verdict": self.verdict,
            "seconds": round(self.seconds, 3),
            "start": None if self.start is None else self.start.isoformat(),
        }


@dataclass
class Report:
    """The analysis of one recording. Render it with :meth:`to_text`, :meth:`to_json` or :meth:`to_markdown`.

    Attributes:
        source: where the recording came from.
        gpus: the GPU indices seen.
        start: the first sample's time.
        end: the last sample's time.
        sweeps: samples per GPU (the most any GPU has).
        interval: the median seconds between two samples of one GPU.
        stats: per field and GPU statistics of the fields that vary.
        overall: the same fields over all GPUs together (``gpu`` is -1).
        skipped: the lines of the recording that could not be read, if any.
        health: memory-health counters (ECC, retired pages, remapped rows) that were non-zero, per GPU.
        constants: fields that never changed, with their value per GPU.
        thresholds: time past each rule's threshold, per GPU (only GPUs that got past it).
        stalls: stretches of at least ``min_stall`` seconds under the stall utilization while memory was held.
        alerts: alerts the rules would have fired during the run.
        findings: what to act on, most severe first.
        rules: the rules' texts.
        stall_utilization: the stall threshold in percent.
        min_stall: the shortest stall reported, in seconds.
        clock_steps: where the recorded clock stepped back (a DST fall-back read without a zone, an NTP step);
            every duration skips such a step.
        zone_changes: where the UTC offset changed in a recording read in its zone (``tz=``): (time, offset
            before, offset after).
        elapsed: seconds the run lasted along its timeline (steps back skipped); None: ``end - start``.
    """

    source: str
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    sweeps: int
    interval: float
    stats: list[FieldStats] = field(default_factory=list)
    constants: dict[str, dict[int, Any]] = field(default_factory=dict)
    thresholds: list[ThresholdTime] = field(default_factory=list)
    stalls: list[Stretch] = field(default_factory=list)
    alerts: list[AlertSpan] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rules: tuple[str, ...] = ()
    stall_utilization: float = STALL_UTILIZATION
    min_stall: float = MIN_STALL_SECONDS
    units: dict[str, str] = field(default_factory=dict)
    skipped: SkippedLines | None = None
    health: list[HealthCount] = field(default_factory=list)
    overall: list[FieldStats] = field(default_factory=list)
    energy_wh: dict[int, float] = field(default_factory=dict)
    clock_steps: list[ClockStep] = field(default_factory=list)
    zone_changes: list[tuple[datetime, str, str]] = field(default_factory=list)
    elapsed: float | None = None

    @property
    def duration(self) -> float:
        """Seconds from the first sample to the last, never negative: a step back of the clock is skipped."""
        if self.elapsed is not None:
            return self.elapsed
        return max(0.0, (self.end - self.start).total_seconds())

    def stalls_of(self, gpu: int) -> list[Stretch]:
        """The stalls of one GPU."""
        return [s for s in self.stalls if s.gpu == gpu]

    def time_over(self, rule: str, gpu: int) -> float:
        """Seconds GPU ``gpu`` spent past the threshold of ``rule`` (its text as given); 0 when never."""
        norm = " ".join(rule.split())
        return sum(t.seconds for t in self.thresholds if t.gpu == gpu and t.rule == norm)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready dicts and lists."""
        return {
            "source": self.source,
            "gpus": list(self.gpus),
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "duration_seconds": round(self.duration, 3),
            "samples_per_gpu": self.sweeps,
            "interval_seconds": round(self.interval, 3),
            "energy_wh": {str(g): round(wh, 3) for g, wh in self.energy_wh.items()},
            "rules": list(self.rules),
            "stall_utilization": self.stall_utilization,
            "min_stall_seconds": self.min_stall,
            "findings": [f.to_dict() for f in self.findings],
            "stalls": [s.to_dict() for s in self.stalls],
            "thresholds": [
                {
                    "rule": t.rule,
                    "gpu": t.gpu,
                    "seconds": round(t.seconds, 3),
                    "stretches": t.stretches,
                    "longest_seconds": round(t.longest, 3),
                    "peak": t.peak,
                }
                for t in self.thresholds
            ],
            "alerts": [a.to_dict() for a in self.alerts],
            "stats": [
                {
                    "field": s.field,
                    "unit": s.unit,
                    "gpu": s.gpu,
                    "mean": round(s.mean, 4),
                    "p95": round(s.p95, 4),
                    "max": s.max,
                    "min": s.min,
                    "count": s.count,
                    "missing": s.missing,
                }
                for s in self.stats
            ],
            "constants": {name: {str(g): v for g, v in per.items()} for name, per in self.constants.items()},
            "health": [h.to_dict() for h in self.health],
            "skipped_lines": None
            if self.skipped is None
            else {"count": self.skipped.count, "first_line": self.skipped.first_lineno},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON document (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    # -- text

    def _headline(self) -> str:
        return (
            f"{self.source}: {len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}, {self.sweeps} samples each, "
            f"{_stamp(self.start)} to {_clock(self.end)} ({format_duration(self.duration)}, "
            f"{_zone_name(self.start)}), every {self.interval:g} s"
        )

    def _notes(self) -> list[str]:
        return [] if self.skipped is None else [self.skipped.message(self.source)]

    def _stall_rows(self) -> list[list[str]]:
        """One row per stall, except that GPUs which stalled together (same start and length) share a row."""
        rows: list[list[str]] = []
        groups: list[list[Stretch]] = []
        for st in sorted(self.stalls, key=lambda x: (x.start, x.gpu)):
            last = groups[-1][0] if groups else None
            if (
                last is not None
                and abs((st.start - last.start).total_seconds()) <= 2 * self.interval
                and abs(st.seconds - last.seconds) <= 2 * self.interval
            ):
                groups[-1].append(st)
            else:
                groups.append([st])
        for group in groups:
            means = [x.mean for x in group if x.mean is not None]
            mean = sum(means) / len(means) if means else None
            who = _gpu_list([x.gpu for x in group]).removeprefix("GPUs ").removeprefix("GPU ")
            rows.append([who, _stamp(group[0].start), format_duration(group[0].seconds), f"{_num(mean)}%"])
        return rows

    def _overall_rows(self) -> tuple[list[str], list[list[str]]]:
        per: dict[str, list[FieldStats]] = {}
        for s in self.stats:
            per.setdefault(s.field, []).append(s)
        any_missing = any(o.missing for o in self.overall)
        head = ["field", "mean", "p95", "max", "highest mean", "lowest mean"] + (["missing"] if any_missing else [])
        rows = []
        for o in self.overall:
            fld = _stat_field(o.field, o.unit)
            gpus = per.get(o.field, [])
            hi = max(gpus, key=lambda s: s.mean)
            lo = min(gpus, key=lambda s: s.mean)
            row = [
                f"{o.field} [{o.unit}]" if o.unit else o.field,
                _stat(o.mean, fld),
                _stat(o.p95, fld),
                _stat(o.max, fld),
                f"GPU {hi.gpu}: {_stat(hi.mean, fld)}",
                f"GPU {lo.gpu}: {_stat(lo.mean, fld)}",
            ]
            if any_missing:
                row.append(str(o.missing))
            rows.append(row)
        return head, rows

    def _threshold_table(self) -> tuple[list[str], list[list[str]]]:
        rules = list(dict.fromkeys(t.rule for t in self.thresholds))
        head = ["GPU", *rules]
        rows = []
        for g in self.gpus:
            cells = [f"GPU {g}"]
            any_time = False
            for r in rules:
                got = [t for t in self.thresholds if t.gpu == g and t.rule == r]
                if got:
                    any_time = True
                    t = got[0]
                    cells.append(f"{format_duration(t.seconds)} ({t.stretches}x)")
                else:
                    cells.append("-")
            if any_time:
                rows.append(cells)
        return head, rows

    def to_text(self) -> str:
        """A plain-text report for a terminal."""
        out = [self._headline(), *self._notes(), ""]
        out.append("Findings:")
        if self.findings:
            out += [f"  [{f.severity}] {f.verdict}" for f in self.findings]
        else:
            out.append("  nothing to report: no stall, no GPU past a threshold")
        out.append("")
        out.append(
            f"Stalls (utilization.gpu < {self.stall_utilization:g}% for at least "
            f"{format_duration(self.min_stall)}, with memory held):"
        )
        if self.stalls:
            out += _table(
                ["GPU", "start", "length", "mean util"],
                self._stall_rows(),
                indent=2,
            )
        else:
            out.append("  none")
        out.append("")
        head, rows = self._threshold_table()
        out.append("Time past thresholds:")
        out += _table(head, rows, indent=2) if rows else ["  none"]
        if self.alerts:
            out.append("")
            out.append("Alerts the rules would have fired:")
            out += _table(
                ["GPU", "rule", "fired", "held", "peak"],
                [
                    [
                        str(a.gpu),
                        a.rule,
                        _stamp(a.fired),
                        format_duration(a.seconds) + ("" if a.cleared else " (still firing at the end)"),
                        _peak_text(a.peak, a.rule),
                    ]
                    for a in self.alerts
                ],
                indent=2,
            )
        if self.energy_wh:
            out.append("")
            out.append(self._energy_line())
        out.append("")
        out.append("Statistics over all GPUs (per GPU: --format json or markdown):")
        out += _table(*self._overall_rows(), indent=2)
        if self.constants:
            out.append("")
            out.append("Constant during the run: " + "; ".join(_constant_text(n, v) for n, v in self.constants.items()))
        return "\n".join(out) + "\n"

    def _energy_line(self) -> str:
        total = sum(self.energy_wh.values())
        per = ", ".join(f"GPU {g}: {wh:.1f}" for g, wh in sorted(self.energy_wh.items()))
        return f"Energy (power.draw over the run): {total:.1f} Wh in all ({per} Wh)"

    def to_markdown(self) -> str:
        """A Markdown report (GitHub tables), for a pull request, an issue or a notebook."""
        out = [f"# GPU report: {self.source}", "", self._headline().split(": ", 1)[1], *self._notes(), ""]
        if self.energy_wh:
            out += [self._energy_line(), ""]
        out += ["## Findings", ""]
        if self.findings:
            out += [f"- **{f.severity}**: {f.verdict}" for f in self.findings]
        else:
            out.append("Nothing to report: no stall, no GPU past a threshold.")
        out += [
            "",
            f"## Stalls (utilization < {self.stall_utilization:g}% for at least {format_duration(self.min_stall)})",
            "",
        ]
        if self.stalls:
            out += _md_table(
                ["GPU", "start", "length", "mean util"],
                self._stall_rows(),
            )
        else:
            out.append("None.")
        out += ["", "## Time past thresholds", ""]
        head, rows = self._threshold_table()
        out += _md_table(head, rows) if rows else ["None."]
        if self.alerts:
            out += ["", "## Alerts the rules would have fired", ""]
            out += _md_table(
                ["GPU", "rule", "fired", "held", "peak"],
                [
                    [
                        str(a.gpu),
                        f"`{a.rule}`",
                        _stamp(a.fired),
                        format_duration(a.seconds) + ("" if a.cleared else " (still firing)"),
                        _peak_text(a.peak, a.rule),
                    ]
                    for a in self.alerts
                ],
            )
        out += ["", "## Statistics (mean / p95 / max)", ""]
        gpus = list(self.gpus)
        by_key = {(s.field, s.gpu): s for s in self.stats}
        names = list(dict.fromkeys(s.field for s in self.stats))
        rows = []
        for name in names:
            unit = next(s.unit for s in self.stats if s.field == name)
            cells = [f"{name} [{unit}]" if unit else name]
            for g in gpus:
                st = by_key.get((name, g))
                fld = _stat_field(name, unit)
                cells.append(
                    "n/a" if st is None else f"{_stat(st.mean, fld)} / {_stat(st.p95, fld)} / {_stat(st.max, fld)}"
                )
            rows.append(cells)
        out += _md_table(["field", *[f"GPU {g}" for g in gpus]], rows)
        if self.constants:
            out += [
                "",
                "Constant during the run: " + "; ".join(_constant_text(n, v) for n, v in self.constants.items()),
            ]
        return "\n".join(out) + "\n"


def _constant_text(name: str, per_gpu: dict[int, Any]) -> str:
    values = list(dict.fromkeys(per_gpu.values()))
    fld = _BY_ATTR.get(name.replace(".", "_"))
    unit = f" {fld.unit}" if fld is not None and fld.unit and fld.unit != "%" else (fld.unit if fld else "")
    num = _num if fld is None else functools.partial(_stat, fld=fld)
    if len(values) == 1:
        return f"{name} {num(values[0])}{unit}"
    return f"{name} " + ", ".join(f"GPU {g}: {num(v)}{unit}" for g, v in per_gpu.items())


def _table(head: list[str], rows: list[list[str]], indent: int = 0) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    pad = " " * indent

    def line(cells: list[str]) -> str:
        return pad + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(head).rstrip(), *(line(r).rstrip() for r in rows)]


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [line(head), "|" + "|".join("---" for _ in head) + "|", *(line(r) for r in rows)]


# ------------------------------------------------------------------------------------------------ analysis


class _Columns:
    """Numeric columns of the whole frame as float64 arrays, converted once and shared by every GPU."""

    def __init__(self, df: pd.DataFrame) -> None:
        self.df = df
        self.columns = df.columns
        self._floats: dict[str, np.ndarray] = {}

    def floats(self, column: str) -> np.ndarray:
        got = self._floats.get(column)
        if got is None:
            got = self._floats[column] = _as_float(self.df[column])
        return got


class _Gpu:
    """One GPU's samples: their row positions in the frame, times (s from the run's start) and durations.

    The frame is not split or copied: columns are read through the row positions. Timestamps become
    ``datetime`` objects only where a stretch starts or ends.
    """

    def __init__(self, index: int, data: _Columns, rows: Any, times: np.ndarray, stamps: np.ndarray, zone: Any):
        import numpy as np

        self.index = index
        self.data = data
        self.rows = rows  # a slice (the frame holds this GPU's rows together) or an array of positions
        self.columns = data.columns
        self.times = times
        self._stamps = stamps  # datetime64[ns] wall-clock (naive) or UTC (aware, with ``zone``)
        self._zone = zone
        self.dur: np.ndarray = np.array([])
        self.gap_limit = 0.0

    def stamp(self, i: int) -> datetime:
        """The time of sample ``i`` as a ``datetime`` (aware when the recording names its zone)."""
        import pandas as pd

        ts = pd.Timestamp(self._stamps[i])
        if self._zone is not None:
            ts = ts.tz_localize("UTC").tz_convert(self._zone)
        return cast(datetime, ts.to_pydatetime())

    def floats(self, column: str) -> np.ndarray:
        """A numeric column as float64, NaN where missing."""
        picked: np.ndarray = self.data.floats(column)[self.rows]
        return picked

    def values(self, column: str) -> list[Any]:
        """A column's values as Python objects (for text comparisons)."""
        series = self.data.df[column]
        picked = series.iloc[self.rows] if isinstance(self.rows, slice) else series.take(self.rows)
        return picked.tolist()


def _energy(df: pd.DataFrame, gpus: Sequence[_Gpu]) -> dict[int, float]:
    """Watt-hours per GPU: each sample's power.draw times its duration (gaps count one interval, as elsewhere)."""
    if "power_draw" not in df.columns:
        return {}
    import numpy as np

    out: dict[int, float] = {}
    for g in gpus:
        watts = g.floats("power_draw")
        ok = ~np.isnan(watts)
        if ok.any() and len(g.dur) == len(watts):
            out[g.index] = float(np.sum(watts[ok] * g.dur[ok])) / 3600.0
    return out


def _as_float(series: pd.Series) -> np.ndarray:
    import numpy as np

    if series.dtype.kind == "b" or str(series.dtype) == "boolean":
        series = series.astype("Float64")
    try:
        return np.asarray(series.to_numpy(dtype="float64", na_value=np.nan), dtype="float64")
    except (TypeError, ValueError):
        return np.asarray(series.astype("Float64").to_numpy(dtype="float64", na_value=np.nan), dtype="float64")


_NUMPY_OPS = {">": "greater", ">=": "greater_equal", "<": "less", "<=": "less_equal", "==": "equal", "!=": "not_equal"}


def _condition_values(rule: Rule, g: _Gpu) -> np.ndarray:
    """1.0 where the rule's condition holds, 0.0 where not, NaN where a value is missing (decides nothing)."""
    import numpy as np

    parts: list[np.ndarray] = []
    for cond in (rule, *rule.when):
        col = cond.field.attr
        if col not in g.columns:
            return np.full(len(g.times), np.nan)
        threshold = cond.threshold
        op = _NUMPY_OPS.get(cond.op)
        if (
            op is not None
            and isinstance(threshold, (int, float))
            and (cond.field.kind.is_numeric or cond.field.kind.is_bool)
        ):
            values = g.floats(col)
            with np.errstate(invalid="ignore"):
                out = getattr(np, op)(values, float(threshold)).astype("float64")
            out[np.isnan(values)] = np.nan
        else:
            # text and other thresholds: the rule's own comparison, value by value
            verdicts = [None if v is None or _isna(v) else cond.holds(v) for v in g.values(col)]
            out = np.array([np.nan if h is None else float(h) for h in verdicts], dtype="float64")
        parts.append(out)
    result = parts[0]
    for p in parts[1:]:
        result = np.where((result == 0) | (p == 0), 0.0, np.where(np.isnan(result) | np.isnan(p), np.nan, 1.0))
    return result


def _isna(v: object) -> bool:
    try:
        import pandas as pd

        return bool(pd.isna(cast(Any, v)))
    except (TypeError, ValueError):
        return False


def _runs(g: _Gpu, cond: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(firsts, lasts): sample positions of the stretches where ``cond`` holds, as two int arrays.

    A missing value keeps the state it follows (as the live evaluator does); a gap in time longer than the
    gap limit (the stream was stopped) ends a stretch.
    """
    import numpy as np

    n = len(cond)
    none = np.zeros(0, dtype=np.int64)
    if n == 0:
        return none, none
    gap = np.zeros(n, dtype=bool)
    gap[1:] = np.diff(g.times) > g.gap_limit
    gap[0] = True
    state = cond.copy()
    # a missing value at the start of a segment (after a gap) holds nothing
    state[gap & np.isnan(state)] = 0.0
    known = ~np.isnan(state)
    last_known = np.maximum.accumulate(np.where(known, np.arange(n), 0))
    held = state[last_known] > 0  # NaNs take the state they follow
    if not held.any():
        return none, none
    starts = held & (gap | ~np.concatenate(([False], held[:-1])))
    ends = held & np.concatenate((gap[1:] | ~held[1:], [True]))
    return np.flatnonzero(starts), np.flatnonzero(ends)


def _run_seconds(g: _Gpu, firsts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
    """The length of each stretch: from its first sample to the end of its last."""
    import numpy as np

    return np.asarray(g.times[lasts] - g.times[firsts] + g.dur[lasts], dtype="float64")


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


def _stretch(g: _Gpu, first: int, last: int, values: np.ndarray | None, pick_max: bool) -> Stretch:
    import numpy as np

    seconds = float(g.times[last] - g.times[first] + g.dur[last])
    from datetime import timedelta

    end = g.stamp(last) + timedelta(seconds=float(g.dur[last]))
    peak = mean = None
    if values is not None:
        window = values[first : last + 1]
        window = window[~np.isnan(window)]
        if len(window):
            peak = float(window.max() if pick_max else window.min())
            mean = float(window.mean())
    return Stretch(g.index, g.stamp(first), end, seconds, last - first + 1, peak, mean)


def _fired_at(rule: Rule, g: _Gpu, first: int, last: int, cond: np.ndarray) -> int | None:
    """The sample at which a live evaluator would have fired within the stretch, or None."""
    import numpy as np

    counted = first + np.flatnonzero(~np.isnan(cond[first : last + 1]))
    if rule.hold_seconds is not None:
        ok = counted[g.times[counted] - g.times[first] >= rule.hold_seconds]
        return int(ok[0]) if len(ok) else None
    need = rule.hold_samples or 1
    return int(counted[need - 1]) if len(counted) >= need else None


def _gpu_rows(index: np.ndarray) -> list[tuple[int, Any]]:
    """(GPU index, its row positions) per GPU in index order: slices when the frame holds each GPU's rows together."""
    import numpy as np

    if len(index) > 1 and not bool((index[1:] >= index[:-1]).all()):
        order = np.argsort(index, kind="stable")  # file order within each GPU
        ordered = index[order]
        bounds = np.flatnonzero(np.diff(ordered)) + 1
        parts = np.split(order, bounds)
        return [(int(index[p[0]]), p) for p in parts]
    edges = [0, *(np.flatnonzero(np.diff(index)) + 1).tolist(), len(index)]
    return [(int(index[a]), slice(a, b)) for a, b in pairwise(edges)]


def _build_gpus(df: pd.DataFrame) -> tuple[list[_Gpu], float]:
    import numpy as np

    stamps_col = df["timestamp"]
    zone = getattr(stamps_col.dt, "tz", None)
    # wall-clock (naive) or UTC nanoseconds
    stamps = np.asarray(stamps_col.dt.tz_convert("UTC").dt.tz_localize(None) if zone is not None else stamps_col)
    stamps = stamps.astype("datetime64[ns]")
    t0 = stamps.min()
    seconds = (stamps - t0).astype("int64") / 1e9
    data = _Columns(df)
    gpus: list[_Gpu] = []
    intervals: list[float] = []
    for idx, rows in _gpu_rows(df["index"].to_numpy(dtype="int64")):
        # along the GPU's rows in file order, a step back of the clock counts 0: no duration is ever negative
        own = stamps[rows]
        times = seconds[rows][0] + timeline(own) if len(own) else seconds[rows]
        diffs = np.diff(times)
        if len(diffs):
            intervals.append(float(np.median(diffs)))
        gpus.append(_Gpu(idx, data, rows, times, stamps[rows], zone))
    interval = float(np.median(intervals)) if intervals else 1.0
    if not interval > 0:
        interval = 1.0
    gap_limit = max(3 * interval, 5.0)
    for g in gpus:
        nxt = np.diff(g.times, append=g.times[-1] + interval) if len(g.times) else np.array([])
        # a sample stands for the time to the next one, except across a gap (the stream was stopped)
        g.dur = np.where(nxt > gap_limit, interval, nxt)
        g.gap_limit = gap_limit
    return gpus, interval


def _parse_rules(rules: Iterable[Rule | str] | None) -> tuple[Rule, ...]:
    chosen = DEFAULT_RULES if rules is None else rules
    return tuple(r if isinstance(r, Rule) else Rule.parse(r) for r in chosen)


def _stats(df: pd.DataFrame, gpus: list[_Gpu]) -> tuple[list[FieldStats], dict[str, dict[int, Any]], list[FieldStats]]:
    import numpy as np

    stats: list[FieldStats] = []
    overall: list[FieldStats] = []
    constants: dict[str, dict[int, Any]] = {}
    for fld in _numeric_fields(df):
        per: list[FieldStats] = []
        for g in gpus:
            values = g.floats(fld.attr)
            present = values[~np.isnan(values)]
            if not len(present):
                continue
            per.append(
                FieldStats(
                    fld.name,
                    fld.unit,
                    g.index,
                    float(present.mean()),
                    float(np.percentile(present, 95)),
                    float(present.max()),
                    float(present.min()),
                    len(present),
                    len(values) - len(present),
                )
            )
        if not per:
            continue
        if all(s.min == s.max for s in per):
            constants[fld.name] = {s.gpu: s.max for s in per}
            continue
        stats += per
        every = np.concatenate([g.floats(fld.attr) for g in gpus])
        present = every[~np.isnan(every)]
        overall.append(
            FieldStats(
                fld.name,
                fld.unit,
                -1,
                float(present.mean()),
                float(np.percentile(present, 95)),
                float(present.max()),
                float(present.min()),
                len(present),
                len(every) - len(present),
            )
        )
    return stats, constants, overall


def analyze(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    rules: Iterable[Rule | str] | None = None,
    stall_utilization: float = STALL_UTILIZATION,
    min_stall: float = MIN_STALL_SECONDS,
    busy_memory: float = BUSY_MEMORY_MIB,
    name: str | None = None,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> Report:
    """Analyse a recorded run.

    A *stall* is a stretch of at least ``min_stall`` seconds during which a GPU's ``utilization.gpu`` stayed under
    ``stall_utilization`` percent while its ``memory.used`` was at least ``busy_memory`` MiB (a job held the GPU
    but gave it no work). Without ``memory.used`` in the recording, utilization alone decides. Stalls that
    overlap on several GPUs are reported together as well, since they point at a shared cause.

    Time past a threshold counts every sample for which a rule's condition held (ignoring its hold); the alerts
    are those the rules would have fired live (honouring the hold). Missing values keep the state they follow.

    Args:
        source: a recording path (CSV, JSONL, Parquet) or a DataFrame in the shape of
            :func:`smiquery.recordings.read_csv`.
        rules: rules (or ``--alert`` expressions) whose thresholds are checked; default :data:`DEFAULT_RULES`.
        stall_utilization: utilization (percent) under which a GPU is stalled.
        min_stall: shortest stall reported, in seconds.
        busy_memory: memory used (MiB) from which a GPU counts as held by a job.
        name: what to call the recording in the report (default: the file name).
        fields: the columns of a headerless CSV log (ignored when the file has a header).
        tz: the zone the recording was made in; default: timestamps as recorded (naive for CSV).

    Returns:
        The :class:`Report`.

    Raises:
        ReportError: the recording cannot be read or holds no samples.
        InvalidRuleError: a rule cannot be parsed.
    """
    df = load_recording(source, fields=fields, tz=tz)
    if df.empty:
        raise ReportError("the recording holds no samples")
    skipped = df.attrs.get("skipped")
    label = name or (os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "recording")
    parsed = _parse_rules(rules)
    gpus, interval = _build_gpus(df)
    stats, constants, overall = _stats(df, gpus)
    report = Report(
        source=label,
        gpus=tuple(g.index for g in gpus),
        start=min(g.stamp(0) for g in gpus),
        end=max(g.stamp(len(g.times) - 1) for g in gpus),
        sweeps=max(len(g.times) for g in gpus),
        interval=round(interval, 3),
        stats=stats,
        overall=overall,
        constants=constants,
        rules=tuple(str(r) for r in parsed),
        stall_utilization=stall_utilization,
        min_stall=min_stall,
        units={f.name: f.unit for f in _numeric_fields(df)},
        skipped=skipped,
        health=_health(df, gpus),
        energy_wh=_energy(df, gpus),
        elapsed=max(float(g.times[-1]) for g in gpus) - min(float(g.times[0]) for g in gpus),
    )
    report.clock_steps, report.zone_changes = _clock_changes(gpus)
    # time past thresholds and the alerts the rules would have fired; then stalls (as stalls_and_alerts finds them)
    report.alerts = _alerts(parsed, gpus, report.thresholds)
    report.stalls = _stalls(gpus, StallRule(stall_utilization, busy_memory, min_stall))
    report.findings = _findings(report, parsed, gpus)
    return report


def _clock_changes(gpus: list[_Gpu]) -> tuple[list[ClockStep], list[tuple[datetime, str, str]]]:
    """The recorded clock's steps back and a zone's offset changes, from the GPU with the most samples.

    Every GPU's rows carry the same host clock, so one GPU tells them; each change is reported once.
    """
    import numpy as np

    g = max(gpus, key=lambda g: len(g.times))
    ns = np.asarray(g._stamps, dtype="datetime64[ns]").astype("int64")
    steps: list[ClockStep] = []
    if len(ns) > 1:
        for i in np.flatnonzero(np.diff(ns) < -REPORTED_STEP_BACK * 1e9).tolist():
            steps.append(ClockStep(g.stamp(i), g.stamp(i + 1), (int(ns[i]) - int(ns[i + 1])) / 1e9))
    changes: list[tuple[datetime, str, str]] = []
    if g._zone is not None and len(ns) > 1:
        import pandas as pd

        local = pd.DatetimeIndex(ns.astype("datetime64[ns]")).tz_localize("UTC").tz_convert(g._zone)
        wall = local.tz_localize(None).asi8
        # where the wall clock moved otherwise than the instants, the zone's offset changed
        for i in np.flatnonzero(np.diff(wall) != np.diff(ns)).tolist():
            changes.append((g.stamp(i + 1), _offset_text(g.stamp(i)), _offset_text(g.stamp(i + 1))))
    return steps, changes


def _offset_text(ts: datetime) -> str:
    off = ts.utcoffset()
    if off is None:
        return "no zone"
    minutes = int(off.total_seconds() // 60)
    sign = "+" if minutes >= 0 else "-"
    return f"UTC{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def _alerts(rules: Sequence[Rule], gpus: list[_Gpu], thresholds: list[ThresholdTime] | None = None) -> list[AlertSpan]:
    """The alerts the rules would have fired, per rule and GPU.

    With ``thresholds``, the time past each rule's threshold is added to it as well (from the same stretches).
    """
    alerts: list[AlertSpan] = []
    for rule in rules:
        for g in gpus:
            cond = _condition_values(rule, g)
            firsts, lasts = _runs(g, cond)
            if not len(firsts):
                continue
            col = rule.field.attr
            values = g.floats(col) if rule.field.kind.is_quantity else None
            pick_max = rule.op in (">", ">=")
            if thresholds is not None:
                seconds = _run_seconds(g, firsts, lasts)
                thresholds.append(
                    ThresholdTime(
                        str(rule),
                        g.index,
                        float(seconds.sum()),
                        len(firsts),
                        float(seconds.max()),
                        None if values is None else _peak(values, firsts, lasts, pick_max),
                    )
                )
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
                still = b == len(g.times) - 1
                alerts.append(AlertSpan(str(rule), g.index, s.start, g.stamp(at), s.end, s.seconds, s.peak, not still))
    return alerts


def _stalls(gpus: list[_Gpu], stall: StallRule) -> list[Stretch]:
    """Stretches of at least ``stall.min_seconds`` under the stall utilization (while memory was held), per GPU."""
    found: list[Stretch] = []
    for g in gpus:
        if "utilization_gpu" not in g.columns:
            break
        util = g.floats("utilization_gpu")
        cond = stall.mask(util, g.floats("memory_used") if "memory_used" in g.columns else None)
        firsts, lasts = _runs(g, cond)
        long_enough = _run_seconds(g, firsts, lasts) >= stall.min_seconds
        for a, b in zip(firsts[long_enough].tolist(), lasts[long_enough].tolist(), strict=True):
            found.append(_stretch(g, a, b, util, pick_max=False))
    return found


@dataclass(frozen=True)
class Periods:
    """The stalls and alerts of a recording, as :func:`analyze` finds them, without its statistics and findings.

    Attributes:
        stalls: as :attr:`Report.stalls`.
        alerts: as :attr:`Report.alerts`.
    """

    stalls: list[Stretch]
    alerts: list[AlertSpan]


def stalls_and_alerts(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    rules: Iterable[Rule | str] | None = None,
    stall_utilization: float = STALL_UTILIZATION,
    min_stall: float = MIN_STALL_SECONDS,
    busy_memory: float = BUSY_MEMORY_MIB,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> Periods:
    """Only the stalls and alerts of a recording: the same periods as :func:`analyze` finds, for less.

    No statistics, thresholds, health counters or findings are worked out. :mod:`smiquery.plot` shades these.

    Args:
        source: a recording path (CSV, JSONL, Parquet) or a DataFrame, as for :func:`analyze`.
        rules: rules whose alerts are found; default :data:`DEFAULT_RULES`.
        stall_utilization: utilization (percent) under which a GPU is stalled.
        min_stall: shortest stall reported, in seconds.
        busy_memory: memory used (MiB) from which a GPU counts as held by a job.
        fields: the columns of a headerless CSV log (ignored when the file has a header).
        tz: the zone the recording was made in; default: timestamps as recorded (naive for CSV).

    Returns:
        The :class:`Periods`: stalls and alerts in the order :func:`analyze` lists them.

    Raises:
        ReportError: the recording cannot be read or holds no samples.
        InvalidRuleError: a rule cannot be parsed.
    """
    df = load_recording(source, fields=fields, tz=tz)
    if df.empty:
        raise ReportError("the recording holds no samples")
    gpus, _ = _build_gpus(df)
    return Periods(
        _stalls(gpus, StallRule(stall_utilization, busy_memory, min_stall)), _alerts(_parse_rules(rules), gpus)
    )


# ------------------------------------------------------------------------------------------------ findings

# Advice by the field a rule watches: (kind, severity, what to check).
_ADVICE: dict[str, tuple[str, Severity, str]] = {
    "temperature.gpu": (
        "hot",
        "critical",
        "check its cooling (airflow, blocked inlet, fan or cold plate); sustained heat throttles its clocks",
    ),
    "clocks_event_reasons.hw_thermal_slowdown": (
        "throttle",
        "critical",
        "the hardware slowed its clocks to cool down; check its cooling",
    ),
    "clocks_event_reasons.sw_thermal_slowdown": (
        "throttle",
        "warning",
        "the driver lowered its clocks for heat; check its cooling and the room temperature",
    ),
    "clocks_event_reasons.hw_power_brake_slowdown": (
        "throttle",
        "critical",
        "the power brake engaged (power supply or external signal); check the PSU and the rack's power",
    ),
}


_OP_WORDS = {">": "over", ">=": "at or over", "<": "under", "<=": "at or under", "==": "at", "!=": "not at"}


def _findings(report: Report, rules: Sequence[Rule], gpus: list[_Gpu]) -> list[Finding]:
    out: list[Finding] = []
    n_gpus = len(gpus)

    # stalls: those several GPUs share point upstream of the GPUs; the rest are per GPU
    alone: dict[int, list[Stretch]] = {}
    for group in _overlapping(report.stalls):
        gpus_in = sorted({s.gpu for s in group})
        if len(gpus_in) < 2:
            alone.setdefault(gpus_in[0], []).extend(group)
            continue
        start = min(s.start for s in group)
        end = max(s.end for s in group)
        length = (end - start).total_seconds()
        who = f"All {n_gpus} GPUs" if len(gpus_in) == n_gpus else _gpu_list(gpus_in)
        out.append(
            Finding(
                "stall_together",
                "warning",
                tuple(gpus_in),
                f"{who} stalled together from {_clock(start)} for {format_duration(length)} (utilization under "
                f"{report.stall_utilization:g}%): a cause they share; check the input pipeline, e.g. prefetching "
                "and TFRecord, or a checkpoint or evaluation pass",
                length,
                start,
            )
        )
    for gpu, st in sorted(alone.items()):
        total = sum(s.seconds for s in st)
        n = len(st)
        longest = max(st, key=lambda s: s.seconds)
        out.append(
            Finding(
                "stall",
                "warning",
                (gpu,),
                f"GPU {gpu} spent {format_duration(total)} under {report.stall_utilization:g}% utilization in "
                f"{n} stretch{'es' if n != 1 else ''} (longest {format_duration(longest.seconds)} from "
                f"{_clock(longest.start)}): check the input pipeline, e.g. prefetching and TFRecord",
                total,
                st[0].start,
            )
        )

    # rules that would have fired
    seen: set[tuple[str, int]] = set()
    for span in report.alerts:
        rule = next((r for r in rules if str(r) == span.rule), None)
        if rule is None or (span.rule, span.gpu) in seen:
            continue
        seen.add((span.rule, span.gpu))
        spans = [a for a in report.alerts if a.rule == span.rule and a.gpu == span.gpu]
        total = sum(a.seconds for a in spans)
        peak = max((a.peak for a in spans if a.peak is not None), default=None)
        fld = rule.field
        if fld.name == "utilization.gpu":
            continue  # stalls above say it with more detail
        kind, severity, advice = _ADVICE.get(fld.name, ("alert", "warning", "check the GPU"))
        if fld.name == "temperature.gpu" and rule.op in (">", ">=") and isinstance(rule.threshold, (int, float)):
            kind, severity = ("hot", "critical") if rule.threshold >= 85 else ("warm", "warning")
        if fld.kind.is_bool:
            state = "active" if rule.threshold else "inactive"
            text = f"GPU {span.gpu} had {fld.name.split('.')[-1]} {state} for {format_duration(total)}"
        else:
            limit = _value_text(float(rule.threshold), fld) if isinstance(rule.threshold, (int, float)) else "?"
            words = _OP_WORDS.get(rule.op, rule.op)
            text = f"GPU {span.gpu} was {words} {limit} ({fld.name}) for {format_duration(total)}"
        n = len(spans)
        text += f" in {n} stretch{'es' if n != 1 else ''}"
        if peak is not None and not fld.kind.is_bool:
            text += f" (peak {_value_text(peak, fld)})"
        text += f", firing `{span.rule}`: {advice}"
        out.append(Finding(kind, severity, (span.gpu,), text, total, spans[0].since))

    # memory nearly full
    if "memory_used" in gpus[0].columns and "memory_total" in gpus[0].columns:
        for g in gpus:
            used = g.floats("memory_used")
            total_mem = g.floats("memory_total")
            with _quiet():
                ratio = used / total_mem
            if len(ratio) and (ratio >= 0.97).any():
                peak_ratio = float(ratio[ratio == ratio].max())
                out.append(
                    Finding(
                        "memory_full",
                        "warning",
                        (g.index,),
                        f"GPU {g.index} peaked at {peak_ratio:.0%} of its memory: an out-of-memory error is one batch "
                        "away; lower the batch size or check for tensors kept across steps",
                    )
                )

    # one GPU much less busy than the others (a straggler or an unbalanced split)
    means = {s.gpu: s.mean for s in report.stats if s.field == "utilization.gpu"}
    if len(means) >= 2:
        ordered = sorted(means.values())
        median = ordered[len(ordered) // 2]
        for gpu, m in sorted(means.items()):
            if median >= 40 and m < median - 25:
                out.append(
                    Finding(
                        "imbalance",
                        "info",
                        (gpu,),
                        f"GPU {gpu} averaged {m:.0f}% utilization against {median:.0f}% on the others: "
                        "unbalanced work or a straggler; check its share of the data and its PCIe/NVLink link",
                    )
                )

    # memory health: ECC errors, retired pages, remapped rows that are non-zero or grew
    for h in report.health:
        out.append(Finding(_health_kind(h.field), h.severity, (h.gpu,), _health_verdict(h)))

    # the recorded clock: a step back (reported once, however many GPUs saw it) and a zone's offset changes
    if report.clock_steps:
        first = report.clock_steps[0]
        n = len(report.clock_steps)
        text = (
            f"The recorded clock went back {format_duration(first.seconds)} at {_clock(first.at)}"
            + (f" ({n} times in all)" if n > 1 else "")
            + ": a DST change, an NTP step or a VM resume (nvidia-smi stamps local time with no zone); durations "
            "and energy skip the step"
            + ("; name the zone (--tz) to place a DST change" if first.at.tzinfo is None else "")
        )
        out.append(Finding("clock", "info", report.gpus, text, first.seconds, first.at))
    for at, before, after in report.zone_changes:
        out.append(
            Finding(
                "clock",
                "info",
                report.gpus,
                f"The clocks changed from {before} to {after} at {_clock(at)} (daylight saving): times are local "
                "wall-clock times, durations run on across the change",
                0.0,
                at,
            )
        )

    out.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], f.start or report.start, f.gpus))
    return out


# Counters and flags of memory health (nvidia-smi names, by prefix or exact name).
_HEALTH_PREFIXES = ("ecc.errors.", "retired_pages.", "remapped_rows.")


def _health(df: pd.DataFrame, gpus: list[_Gpu]) -> list[HealthCount]:
    """The memory-health counters and flags that were non-zero (or set) at some point, per GPU."""
    import numpy as np

    found: list[HealthCount] = []
    for col in df.columns:
        fld = _BY_ATTR.get(str(col))
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


def _health_kind(name: str) -> str:
    return "ecc" if name.startswith("ecc.") else "retired_pages" if name.startswith("retired_") else "remapped_rows"


def _health_verdict(h: HealthCount) -> str:
    fld = _BY_ATTR.get(h.field.replace(".", "_"))
    is_flag = fld is not None and fld.kind.is_bool
    where = f"GPU {h.gpu}"
    if is_flag:
        if h.field.endswith(".failure"):
            return f"{where} reported {h.field}: row remapping failed; drain it and have it checked (RMA)"
        return (
            f"{where} has {h.field} = yes: reset the GPU (or reboot) so the pending retirement/remapping takes effect"
        )
    count = int(h.max)
    what = h.field
    if h.grew:
        text = f"{where}'s {what} grew from {int(h.first)} to {count} during the run"
    else:
        text = f"{where} has {what} = {count}" + (" (lifetime count)" if ".aggregate." in what else "")
    if h.severity == "critical":
        advice = "uncorrectable memory errors: results may be wrong; drain it and have it checked"
    else:
        advice = "corrected errors: watch whether the count keeps rising"
    return f"{text}: {advice} (nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER)"


class _quiet:
    """numpy's divide warnings off for a block (a missing memory.total is NaN, not an error)."""

    def __enter__(self) -> None:
        import numpy as np

        self._saved = np.seterr(divide="ignore", invalid="ignore")

    def __exit__(self, *exc: object) -> None:
        import numpy as np

        np.seterr(**self._saved)


def _overlapping(stalls: Sequence[Stretch]) -> list[list[Stretch]]:
    """Groups of stalls that overlap in time (transitively)."""
    groups: list[list[Stretch]] = []
    for s in sorted(stalls, key=lambda s: s.start):
        if groups and s.start < max(x.end for x in groups[-1]):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups
