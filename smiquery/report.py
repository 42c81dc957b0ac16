"""A recorded run, summarised: per-GPU statistics, time over thresholds, stalls, alerts and one-line verdicts.

:func:`analyze` reads a recording (CSV, JSONL or Parquet, as ``smiquery stream --output`` writes them, or a
DataFrame from :func:`smiquery.frames.read_csv`) and returns a :class:`Report` that renders as text, JSON or
Markdown. pandas and numpy are imported inside the functions, so ``import smiquery`` stays light.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, cast

from smiquery.alerts import BUILTIN_RULES, Rule
from smiquery.errors import ReportError, SmiqueryError
from smiquery.fields import CATALOGUE, Field, Kind

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = [
    "DEFAULT_RULES",
    "AlertSpan",
    "FieldStats",
    "Finding",
    "Report",
    "ReportError",
    "Stretch",
    "ThresholdTime",
    "analyze",
    "format_duration",
    "load_recording",
]

#: Thresholds the report (and :mod:`smiquery.plot`) use when no rules are given: the built-in health rules.
DEFAULT_RULES: tuple[str, ...] = BUILTIN_RULES

#: Utilization (percent) under which a GPU counts as stalled.
STALL_UTILIZATION = 20.0
#: Shortest stretch under :data:`STALL_UTILIZATION` that the report calls a stall, in seconds.
MIN_STALL_SECONDS = 30.0
#: Memory used (MiB) from which a GPU counts as held by a job; an idle GPU without a job is not stalled.
BUSY_MEMORY_MIB = 1024

_BY_ATTR: dict[str, Field] = {f.attr: f for f in CATALOGUE}
_SKIP_STATS = frozenset({"index", "count", "timestamp"})
_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}

Severity = Literal["critical", "warning", "info"]


# ------------------------------------------------------------------------------------------------- loading


def load_recording(source: str | os.PathLike[str] | pd.DataFrame) -> pd.DataFrame:
    """A recording as a DataFrame with the columns of :func:`smiquery.frames.to_dataframe`.

    CSV goes through :func:`smiquery.frames.read_csv`, JSONL through :func:`smiquery.playback.replay`, Parquet
    through ``pandas.read_parquet`` (the writer keeps the same columns and attrs).

    Args:
        source: a path (``.csv``, ``.jsonl``, ``.parquet``; other names are sniffed) or a DataFrame.

    Returns:
        One row per sample, sorted by GPU index and time.

    Raises:
        ReportError: the file is missing or unreadable, or it lacks ``timestamp`` or ``index``.
    """
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        df = source
    else:
        from smiquery.playback import ReplayError, detect_format

        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ReportError(f"recording {path} not found; record one with `smiquery stream --output FILE`")
        try:
            fmt = detect_format(path)
            if fmt == "csv":
                from smiquery.frames import read_csv

                df = read_csv(path)
            elif fmt == "parquet":
                df = pd.read_parquet(path)
            else:
                from smiquery.frames import to_dataframe
                from smiquery.playback import replay

                with replay(path, speed=0) as rec:
                    df = to_dataframe(rec)
        except ReplayError as exc:
            raise ReportError(str(exc)) from exc
        except (SmiqueryError, OSError, ValueError, ImportError) as exc:
            raise ReportError(f"cannot read recording {path}: {exc}") from exc
    missing = [c for c in ("timestamp", "index") if c not in df.columns]
    if missing:
        raise ReportError(
            f"the recording has no {' or '.join(missing)} column; record with fields that include timestamp and index"
        )
    df = df[df["index"].notna() & df["timestamp"].notna()]
    return cast("pd.DataFrame", df.sort_values(["index", "timestamp"], kind="stable").reset_index(drop=True))


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
        if fld is None or fld.attr in _SKIP_STATS or fld.kind not in (Kind.INT, Kind.FLOAT):
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


def _clock(ts: datetime) -> str:
    return ts.strftime("%H:%M:%S")


def _stamp(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S")


def _num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


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
    text = _num(value)
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
class Finding:
    """Something worth acting on, with a one-line verdict.

    Attributes:
        kind: ``stall``, ``stall_together``, ``hot``, ``warm``, ``throttle``, ``memory_full``, ``imbalance``,
            ``ecc`` or ``alert``.
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
        constants: fields that never changed, with their value per GPU.
        thresholds: time past each rule's threshold, per GPU (only GPUs that got past it).
        stalls: stretches of at least ``min_stall`` seconds under the stall utilization while memory was held.
        alerts: alerts the rules would have fired during the run.
        findings: what to act on, most severe first.
        rules: the rules' texts.
        stall_utilization: the stall threshold in percent.
        min_stall: the shortest stall reported, in seconds.
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

    @property
    def duration(self) -> float:
        """Seconds from the first sample to the last."""
        return (self.end - self.start).total_seconds()

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
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON document (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    # -- text

    def _headline(self) -> str:
        return (
            f"{self.source}: {len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}, {self.sweeps} samples each, "
            f"{_stamp(self.start)} to {_clock(self.end)} ({format_duration(self.duration)}), "
            f"every {self.interval:g} s"
        )

    def _stats_rows(self) -> list[tuple[str, list[list[str]]]]:
        blocks: list[tuple[str, list[list[str]]]] = []
        by_field: dict[str, list[FieldStats]] = {}
        for s in self.stats:
            by_field.setdefault(s.field, []).append(s)
        for name, rows in by_field.items():
            unit = rows[0].unit
            title = f"{name} [{unit}]" if unit else name
            blocks.append(
                (
                    title,
                    [
                        [f"GPU {s.gpu}", _num(s.mean), _num(s.p95), _num(s.max)]
                        + ([str(s.missing)] if any(r.missing for r in rows) else [])
                        for s in rows
                    ],
                )
            )
        return blocks

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
        out = [self._headline(), ""]
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
                [[str(s.gpu), _stamp(s.start), format_duration(s.seconds), f"{_num(s.mean)}%"] for s in self.stalls],
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
                        _num(a.peak),
                    ]
                    for a in self.alerts
                ],
                indent=2,
            )
        out.append("")
        out.append("Statistics (mean / p95 / max):")
        for title, rows in self._stats_rows():
            out.append(f"  {title}")
            head = ["", "mean", "p95", "max"] + (["missing"] if rows and len(rows[0]) > 4 else [])
            out += _table(head, rows, indent=4)
        if self.constants:
            out.append("")
            out.append("Constant during the run: " + "; ".join(_constant_text(n, v) for n, v in self.constants.items()))
        return "\n".join(out) + "\n"

    def to_markdown(self) -> str:
        """A Markdown report (GitHub tables), for a pull request, an issue or a notebook."""
        out = [f"# GPU report: {self.source}", "", self._headline().split(": ", 1)[1], "", "## Findings", ""]
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
                [[str(s.gpu), _stamp(s.start), format_duration(s.seconds), f"{_num(s.mean)}%"] for s in self.stalls],
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
                        _num(a.peak),
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
                cells.append("n/a" if st is None else f"{_num(st.mean)} / {_num(st.p95)} / {_num(st.max)}")
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
    if len(values) == 1:
        return f"{name} {_num(values[0])}{unit}"
    return f"{name} " + ", ".join(f"GPU {g}: {_num(v)}{unit}" for g, v in per_gpu.items())


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


@dataclass
class _Gpu:
    """One GPU's samples as arrays: times (s from the run's start), per-sample durations, columns."""

    index: int
    times: np.ndarray
    stamps: list[datetime]
    dur: np.ndarray
    gap_limit: float
    frame: pd.DataFrame


def _as_float(series: pd.Series) -> np.ndarray:
    import numpy as np

    return np.asarray(series.astype("Float64").to_numpy(dtype="float64", na_value=np.nan), dtype="float64")


def _condition_values(rule: Rule, g: _Gpu) -> np.ndarray:
    """1.0 where the rule's condition holds, 0.0 where not, NaN where a value is missing (decides nothing)."""
    import numpy as np

    parts: list[np.ndarray] = []
    for cond in (rule, *rule.when):
        col = cond.field.attr
        if col not in g.frame.columns:
            return np.full(len(g.times), np.nan)
        series = g.frame[col]
        values = series.tolist()
        out = np.empty(len(values), dtype="float64")
        for i, v in enumerate(values):
            if v is None or v is getattr(series.dtype, "na_value", None) or _isna(v):
                out[i] = np.nan
            else:
                verdict = cond.holds(v.item() if hasattr(v, "item") else v)
                out[i] = np.nan if verdict is None else float(verdict)
        parts.append(out)
    result = parts[0]
    for p in parts[1:]:
        both = np.where((result == 0) | (p == 0), 0.0, np.where(np.isnan(result) | np.isnan(p), np.nan, 1.0))
        result = both
    return result


def _isna(v: object) -> bool:
    try:
        import pandas as pd

        return bool(pd.isna(cast(Any, v)))
    except (TypeError, ValueError):
        return False


def _runs(g: _Gpu, cond: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) sample positions of the stretches where ``cond`` holds.

    A missing value keeps the state it follows (as the live evaluator does); a gap in time longer than the
    gap limit (the stream was stopped) ends a stretch.
    """
    runs: list[tuple[int, int]] = []
    start: int | None = None
    last = -1
    state = False
    n = len(cond)
    for i in range(n):
        c = cond[i]
        if start is not None and i > 0 and g.times[i] - g.times[i - 1] > g.gap_limit:
            runs.append((start, last))
            start, state = None, False
        if c != c:  # NaN: keeps the state
            if state:
                last = i
            continue
        if c:
            if start is None:
                start = i
            last = i
            state = True
        else:
            if start is not None:
                runs.append((start, last))
            start, state = None, False
    if start is not None:
        runs.append((start, last))
    return runs


def _stretch(g: _Gpu, first: int, last: int, values: np.ndarray | None, pick_max: bool) -> Stretch:
    import numpy as np

    seconds = float(g.times[last] - g.times[first] + g.dur[last])
    from datetime import timedelta

    end = g.stamps[last] + timedelta(seconds=float(g.dur[last]))
    peak = mean = None
    if values is not None:
        window = values[first : last + 1]
        window = window[~np.isnan(window)]
        if len(window):
            peak = float(window.max() if pick_max else window.min())
            mean = float(window.mean())
    return Stretch(g.index, g.stamps[first], end, seconds, last - first + 1, peak, mean)


def _fired_at(rule: Rule, g: _Gpu, first: int, last: int, cond: np.ndarray) -> int | None:
    """The sample at which a live evaluator would have fired within the stretch, or None."""
    count = 0
    for i in range(first, last + 1):
        if cond[i] != cond[i]:
            continue
        count += 1
        if rule.hold_seconds is not None:
            if g.times[i] - g.times[first] >= rule.hold_seconds:
                return i
        elif count >= (rule.hold_samples or 1):
            return i
    return None


def _build_gpus(df: pd.DataFrame) -> tuple[list[_Gpu], float]:
    import numpy as np

    t0 = df["timestamp"].min()
    gpus: list[_Gpu] = []
    intervals: list[float] = []
    for idx, frame in df.groupby("index", sort=True):
        frame = frame.reset_index(drop=True)
        times = np.asarray((frame["timestamp"] - t0).dt.total_seconds().to_numpy(dtype="float64"))
        diffs = np.diff(times)
        if len(diffs):
            intervals.append(float(np.median(diffs)))
        gpus.append(
            _Gpu(int(cast(Any, idx)), times, list(frame["timestamp"].dt.to_pydatetime()), np.array([]), 0.0, frame)
        )
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


def _stats(df: pd.DataFrame, gpus: list[_Gpu]) -> tuple[list[FieldStats], dict[str, dict[int, Any]]]:
    import numpy as np

    stats: list[FieldStats] = []
    constants: dict[str, dict[int, Any]] = {}
    for fld in _numeric_fields(df):
        per: list[FieldStats] = []
        for g in gpus:
            values = _as_float(g.frame[fld.attr])
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
        else:
            stats += per
    return stats, constants


def analyze(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    rules: Iterable[Rule | str] | None = None,
    stall_utilization: float = STALL_UTILIZATION,
    min_stall: float = MIN_STALL_SECONDS,
    busy_memory: float = BUSY_MEMORY_MIB,
    name: str | None = None,
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
            :func:`smiquery.frames.read_csv`.
        rules: rules (or ``--alert`` expressions) whose thresholds are checked; default :data:`DEFAULT_RULES`.
        stall_utilization: utilization (percent) under which a GPU is stalled.
        min_stall: shortest stall reported, in seconds.
        busy_memory: memory used (MiB) from which a GPU counts as held by a job.
        name: what to call the recording in the report (default: the file name).

    Returns:
        The :class:`Report`.

    Raises:
        ReportError: the recording cannot be read or holds no samples.
        InvalidRuleError: a rule cannot be parsed.
    """
    import numpy as np

    df = load_recording(source)
    if df.empty:
        raise ReportError("the recording holds no samples")
    label = name or (os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "recording")
    parsed = _parse_rules(rules)
    gpus, interval = _build_gpus(df)
    stats, constants = _stats(df, gpus)
    report = Report(
        source=label,
        gpus=tuple(g.index for g in gpus),
        start=min(g.stamps[0] for g in gpus),
        end=max(g.stamps[-1] for g in gpus),
        sweeps=max(len(g.times) for g in gpus),
        interval=round(interval, 3),
        stats=stats,
        constants=constants,
        rules=tuple(str(r) for r in parsed),
        stall_utilization=stall_utilization,
        min_stall=min_stall,
        units={f.name: f.unit for f in _numeric_fields(df)},
    )

    # time past thresholds, and the alerts the rules would have fired
    for rule in parsed:
        for g in gpus:
            cond = _condition_values(rule, g)
            runs = _runs(g, cond)
            if not runs:
                continue
            col = rule.field.attr
            values = _as_float(g.frame[col]) if rule.field.kind in (Kind.INT, Kind.FLOAT) else None
            pick_max = rule.op in (">", ">=")
            stretches = [_stretch(g, a, b, values, pick_max) for a, b in runs]
            peaks = [s.peak for s in stretches if s.peak is not None]
            report.thresholds.append(
                ThresholdTime(
                    str(rule),
                    g.index,
                    sum(s.seconds for s in stretches),
                    len(stretches),
                    max(s.seconds for s in stretches),
                    (max(peaks) if pick_max else min(peaks)) if peaks else None,
                )
            )
            for (a, b), s in zip(runs, stretches):
                at = _fired_at(rule, g, a, b, cond)
                if at is None:
                    continue
                still = b == len(g.times) - 1
                report.alerts.append(
                    AlertSpan(str(rule), g.index, s.start, g.stamps[at], s.end, s.seconds, s.peak, not still)
                )

    # stalls
    for g in gpus:
        if "utilization_gpu" not in g.frame.columns:
            break
        util = _as_float(g.frame["utilization_gpu"])
        cond = np.where(np.isnan(util), np.nan, (util < stall_utilization).astype("float64"))
        if "memory_used" in g.frame.columns:
            mem = _as_float(g.frame["memory_used"])
            held = np.where(np.isnan(mem), np.nan, (mem >= busy_memory).astype("float64"))
            cond = np.where((cond == 0) | (held == 0), 0.0, np.where(np.isnan(cond) | np.isnan(held), np.nan, 1.0))
        for a, b in _runs(g, cond):
            s = _stretch(g, a, b, util, pick_max=False)
            if s.seconds >= min_stall:
                report.stalls.append(s)

    report.findings = _findings(report, parsed, gpus)
    return report


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
    if "memory_used" in gpus[0].frame.columns and "memory_total" in gpus[0].frame.columns:
        for g in gpus:
            used = _as_float(g.frame["memory_used"])
            total_mem = _as_float(g.frame["memory_total"])
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

    # uncorrectable memory errors during the run
    col = "ecc_errors_uncorrected_volatile_total"
    if col in gpus[0].frame.columns:
        for g in gpus:
            vals = _as_float(g.frame[col])
            vals = vals[vals == vals]
            if len(vals) and vals.max() > 0:
                out.append(
                    Finding(
                        "ecc",
                        "critical",
                        (g.index,),
                        f"GPU {g.index} reported {int(vals.max())} uncorrectable ECC error(s): results may be wrong; "
                        "drain it and have it checked (nvidia-smi -q -d ECC,PAGE_RETIREMENT)",
                    )
                )

    out.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], f.start or report.start, f.gpus))
    return out


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
