"""A report as text for a terminal, Markdown for a pull request or notebook, or JSON; and the words it uses.

Numbers are rounded to what their field's unit resolves, times shown in the recording's zone (or said to have
none), durations for people (:func:`format_duration`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from smiquery.analysis.series import catalogue_field
from smiquery.fields import Field, Kind

if TYPE_CHECKING:
    from smiquery.analysis.model import FieldStats, Report, Stretch

__all__ = [
    "clock_text",
    "format_duration",
    "gpu_list",
    "report_dict",
    "report_json",
    "report_markdown",
    "report_text",
    "value_text",
]


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


def clock_text(ts: datetime) -> str:
    """``"14:05:09"``: a time of day, in the recording's zone."""
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
    return catalogue_field(name) or Field(name, Kind.FLOAT, unit=unit)


def _peak_text(peak: float | None, rule: str) -> str:
    """An alert's peak, rounded to the unit of the field its rule watches (the rule's first word)."""
    m = re.match(r"[A-Za-z_][\w.]*", rule.strip())
    fld = catalogue_field(m.group(0)) if m else None
    return _num(peak) if fld is None else _stat(peak, fld)


def gpu_list(gpus: Sequence[int]) -> str:
    """``"GPU 3"``, ``"GPUs 0-7"``, ``"GPUs 1, 3"``."""
    g = sorted(gpus)
    if len(g) == 1:
        return f"GPU {g[0]}"
    if g == list(range(g[0], g[-1] + 1)):
        return f"GPUs {g[0]}-{g[-1]}"
    return "GPUs " + ", ".join(str(x) for x in g)


def _unit(fld: Field) -> str:
    return fld.unit if fld.unit else ""


def value_text(value: float | None, fld: Field) -> str:
    """A value rounded to its field's unit, with the unit (``"87 C"``, ``"95%"``); ``"n/a"`` when missing."""
    u = _unit(fld)
    text = _stat(value, fld)
    if not u or text == "n/a":
        return text
    return f"{text}{u}" if u == "%" else f"{text} {u}"


def report_dict(report: Report) -> dict[str, Any]:
    """The report as JSON-ready dicts and lists."""
    return {
        "source": report.source,
        "gpus": list(report.gpus),
        "start": report.start.isoformat(),
        "end": report.end.isoformat(),
        "duration_seconds": round(report.duration, 3),
        "samples_per_gpu": report.sweeps,
        "interval_seconds": round(report.interval, 3),
        "energy_wh": {str(g): round(wh, 3) for g, wh in report.energy_wh.items()},
        "rules": list(report.rules),
        "stall_utilization": report.stall_utilization,
        "min_stall_seconds": report.min_stall,
        "findings": [f.to_dict() for f in report.findings],
        "stalls": [s.to_dict() for s in report.stalls],
        "thresholds": [
            {
                "rule": t.rule,
                "gpu": t.gpu,
                "seconds": round(t.seconds, 3),
                "stretches": t.stretches,
                "longest_seconds": round(t.longest, 3),
                "peak": t.peak,
            }
            for t in report.thresholds
        ],
        "alerts": [a.to_dict() for a in report.alerts],
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
            for s in report.stats
        ],
        "constants": {name: {str(g): v for g, v in per.items()} for name, per in report.constants.items()},
        "health": [h.to_dict() for h in report.health],
        "skipped_lines": None
        if report.skipped is None
        else {"count": report.skipped.count, "first_line": report.skipped.first_lineno},
    }


def report_json(report: Report, indent: int | None = 2) -> str:
    """The report as a JSON document (see :func:`report_dict`)."""
    return json.dumps(report_dict(report), indent=indent, default=str)


def _headline(report: Report) -> str:
    return (
        f"{report.source}: {len(report.gpus)} GPU{'s' if len(report.gpus) != 1 else ''}, {report.sweeps} samples each, "
        f"{_stamp(report.start)} to {clock_text(report.end)} ({format_duration(report.duration)}, "
        f"{_zone_name(report.start)}), every {report.interval:g} s"
    )


def _notes(report: Report) -> list[str]:
    return [] if report.skipped is None else [report.skipped.message(report.source)]


def _stall_rows(report: Report) -> list[list[str]]:
    """One row per stall, except that GPUs which stalled together (same start and length) share a row."""
    rows: list[list[str]] = []
    groups: list[list[Stretch]] = []
    for st in sorted(report.stalls, key=lambda x: (x.start, x.gpu)):
        last = groups[-1][0] if groups else None
        if (
            last is not None
            and abs((st.start - last.start).total_seconds()) <= 2 * report.interval
            and abs(st.seconds - last.seconds) <= 2 * report.interval
        ):
            groups[-1].append(st)
        else:
            groups.append([st])
    for group in groups:
        means = [x.mean for x in group if x.mean is not None]
        mean = sum(means) / len(means) if means else None
        who = gpu_list([x.gpu for x in group]).removeprefix("GPUs ").removeprefix("GPU ")
        rows.append([who, _stamp(group[0].start), format_duration(group[0].seconds), f"{_num(mean)}%"])
    return rows


def _overall_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    per: dict[str, list[FieldStats]] = {}
    for s in report.stats:
        per.setdefault(s.field, []).append(s)
    any_missing = any(o.missing for o in report.overall)
    head = ["field", "mean", "p95", "max", "highest mean", "lowest mean"] + (["missing"] if any_missing else [])
    rows = []
    for o in report.overall:
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


def _threshold_table(report: Report) -> tuple[list[str], list[list[str]]]:
    rules = list(dict.fromkeys(t.rule for t in report.thresholds))
    head = ["GPU", *rules]
    rows = []
    for g in report.gpus:
        cells = [f"GPU {g}"]
        any_time = False
        for r in rules:
            got = [t for t in report.thresholds if t.gpu == g and t.rule == r]
            if got:
                any_time = True
                t = got[0]
                cells.append(f"{format_duration(t.seconds)} ({t.stretches}x)")
            else:
                cells.append("-")
        if any_time:
            rows.append(cells)
    return head, rows


def report_text(report: Report) -> str:
    """The report as plain text for a terminal."""
    out = [_headline(report), *_notes(report), ""]
    out.append("Findings:")
    if report.findings:
        out += [f"  [{f.severity}] {f.verdict}" for f in report.findings]
    else:
        out.append("  nothing to report: no stall, no GPU past a threshold")
    out.append("")
    out.append(
        f"Stalls (utilization.gpu < {report.stall_utilization:g}% for at least "
        f"{format_duration(report.min_stall)}, with memory held):"
    )
    if report.stalls:
        out += _table(
            ["GPU", "start", "length", "mean util"],
            _stall_rows(report),
            indent=2,
        )
    else:
        out.append("  none")
    out.append("")
    head, rows = _threshold_table(report)
    out.append("Time past thresholds:")
    out += _table(head, rows, indent=2) if rows else ["  none"]
    if report.alerts:
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
                for a in report.alerts
            ],
            indent=2,
        )
    if report.energy_wh:
        out.append("")
        out.append(_energy_line(report))
    out.append("")
    out.append("Statistics over all GPUs (per GPU: --format json or markdown):")
    out += _table(*_overall_rows(report), indent=2)
    if report.constants:
        out.append("")
        out.append("Constant during the run: " + "; ".join(_constant_text(n, v) for n, v in report.constants.items()))
    return "\n".join(out) + "\n"


def _energy_line(report: Report) -> str:
    total = sum(report.energy_wh.values())
    per = ", ".join(f"GPU {g}: {wh:.1f}" for g, wh in sorted(report.energy_wh.items()))
    return f"Energy (power.draw over the run): {total:.1f} Wh in all ({per} Wh)"


def report_markdown(report: Report) -> str:
    """The report in Markdown (GitHub tables), for a pull request, an issue or a notebook."""
    out = [f"# GPU report: {report.source}", "", _headline(report).split(": ", 1)[1], *_notes(report), ""]
    if report.energy_wh:
        out += [_energy_line(report), ""]
    out += ["## Findings", ""]
    if report.findings:
        out += [f"- **{f.severity}**: {f.verdict}" for f in report.findings]
    else:
        out.append("Nothing to report: no stall, no GPU past a threshold.")
    out += [
        "",
        f"## Stalls (utilization < {report.stall_utilization:g}% for at least {format_duration(report.min_stall)})",
        "",
    ]
    if report.stalls:
        out += _md_table(
            ["GPU", "start", "length", "mean util"],
            _stall_rows(report),
        )
    else:
        out.append("None.")
    out += ["", "## Time past thresholds", ""]
    head, rows = _threshold_table(report)
    out += _md_table(head, rows) if rows else ["None."]
    if report.alerts:
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
                for a in report.alerts
            ],
        )
    out += ["", "## Statistics (mean / p95 / max)", ""]
    gpus = list(report.gpus)
    by_key = {(s.field, s.gpu): s for s in report.stats}
    names = list(dict.fromkeys(s.field for s in report.stats))
    rows = []
    for name in names:
        unit = next(s.unit for s in report.stats if s.field == name)
        cells = [f"{name} [{unit}]" if unit else name]
        for g in gpus:
            st = by_key.get((name, g))
            fld = _stat_field(name, unit)
            cells.append(
                "n/a" if st is None else f"{_stat(st.mean, fld)} / {_stat(st.p95, fld)} / {_stat(st.max, fld)}"
            )
        rows.append(cells)
    out += _md_table(["field", *[f"GPU {g}" for g in gpus]], rows)
    if report.constants:
        out += [
            "",
            "Constant during the run: " + "; ".join(_constant_text(n, v) for n, v in report.constants.items()),
        ]
    return "\n".join(out) + "\n"


def _constant_text(name: str, per_gpu: dict[int, Any]) -> str:
    values = list(dict.fromkeys(per_gpu.values()))
    fld = catalogue_field(name)
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
