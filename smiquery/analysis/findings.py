"""The findings of a report: what to act on, one verdict a line, most severe first.

Each step reads what :mod:`smiquery.analysis.analyze` found (stalls, alerts, health counters, clock steps) or the
GPUs' samples (memory nearly full), and words it for people with what to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from smiquery.analysis.model import SEVERITY_ORDER, Finding, HealthCount, Report, Severity, Stretch
from smiquery.analysis.render import clock_text, format_duration, gpu_list, value_text
from smiquery.analysis.series import catalogue_field

if TYPE_CHECKING:
    from smiquery.alerts import Rule
    from smiquery.analysis.load import GpuSeries

__all__ = ["findings"]

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


def findings(report: Report, rules: Sequence[Rule], gpus: list[GpuSeries]) -> list[Finding]:
    """What to act on in a report, most severe first (then by start and GPU).

    Args:
        report: the report, with its stalls, alerts, statistics, health counters and clock steps filled in.
        rules: the rules its alerts come from.
        gpus: the GPUs' samples (for memory nearly full).

    Returns:
        The findings.
    """
    out = [
        *_stall_findings(report, len(gpus)),
        *_alert_findings(report, rules),
        *_memory_findings(gpus),
        *_imbalance_findings(report),
        *(Finding(_health_kind(h.field), h.severity, (h.gpu,), _health_verdict(h)) for h in report.health),
        *_clock_findings(report),
    ]
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.start or report.start, f.gpus))
    return out


def _stall_findings(report: Report, n_gpus: int) -> list[Finding]:
    """Stalls several GPUs share point upstream of the GPUs (one finding); the rest, one finding per GPU."""
    out: list[Finding] = []
    alone: dict[int, list[Stretch]] = {}
    for group in _overlapping(report.stalls):
        gpus_in = sorted({s.gpu for s in group})
        if len(gpus_in) < 2:
            alone.setdefault(gpus_in[0], []).extend(group)
            continue
        start = min(s.start for s in group)
        end = max(s.end for s in group)
        length = (end - start).total_seconds()
        who = f"All {n_gpus} GPUs" if len(gpus_in) == n_gpus else gpu_list(gpus_in)
        out.append(
            Finding(
                "stall_together",
                "warning",
                tuple(gpus_in),
                f"{who} stalled together from {clock_text(start)} for {format_duration(length)} (utilization "
                f"under {report.stall_utilization:g}%): a cause they share; check the input pipeline, e.g. "
                "prefetching and TFRecord, or a checkpoint or evaluation pass",
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
                f"{clock_text(longest.start)}): check the input pipeline, e.g. prefetching and TFRecord",
                total,
                st[0].start,
            )
        )
    return out


def _alert_findings(report: Report, rules: Sequence[Rule]) -> list[Finding]:
    """One finding per rule and GPU that would have fired (utilization rules aside: the stalls say it better)."""
    out: list[Finding] = []
    seen: set[tuple[str, int]] = set()
    for span in report.alerts:
        rule = next((r for r in rules if str(r) == span.rule), None)
        if rule is None or (span.rule, span.gpu) in seen:
            continue
        seen.add((span.rule, span.gpu))
        if rule.field.name == "utilization.gpu":
            continue
        spans = [a for a in report.alerts if a.rule == span.rule and a.gpu == span.gpu]
        total = sum(a.seconds for a in spans)
        peak = max((a.peak for a in spans if a.peak is not None), default=None)
        kind, severity, advice = _advice(rule)
        out.append(Finding(kind, severity, (span.gpu,), _alert_verdict(rule, span.gpu, len(spans), total, peak, advice),
                           total, spans[0].since))  # fmt: skip
    return out


def _advice(rule: Rule) -> tuple[str, Severity, str]:
    """(kind, severity, what to check) for alerts of a rule: a temperature from 85 C is hot, under it warm."""
    kind, severity, advice = _ADVICE.get(rule.field.name, ("alert", "warning", "check the GPU"))
    if rule.field.name == "temperature.gpu" and rule.op in (">", ">=") and isinstance(rule.threshold, (int, float)):
        kind, severity = ("hot", "critical") if rule.threshold >= 85 else ("warm", "warning")
    return kind, severity, advice


def _alert_verdict(rule: Rule, gpu: int, n: int, total: float, peak: float | None, advice: str) -> str:
    fld = rule.field
    if fld.kind.is_bool:
        state = "active" if rule.threshold else "inactive"
        text = f"GPU {gpu} had {fld.name.split('.')[-1]} {state} for {format_duration(total)}"
    else:
        limit = value_text(float(rule.threshold), fld) if isinstance(rule.threshold, (int, float)) else "?"
        words = _OP_WORDS.get(rule.op, rule.op)
        text = f"GPU {gpu} was {words} {limit} ({fld.name}) for {format_duration(total)}"
    text += f" in {n} stretch{'es' if n != 1 else ''}"
    if peak is not None and not fld.kind.is_bool:
        text += f" (peak {value_text(peak, fld)})"
    return text + f", firing `{rule}`: {advice}"


def _memory_findings(gpus: list[GpuSeries]) -> list[Finding]:
    """GPUs whose memory was at least 97% full at some point: an out-of-memory error is one batch away."""
    import numpy as np

    if "memory_used" not in gpus[0].columns or "memory_total" not in gpus[0].columns:
        return []
    out: list[Finding] = []
    for g in gpus:
        with np.errstate(divide="ignore", invalid="ignore"):  # a missing memory.total is NaN, not an error
            ratio = g.floats("memory_used") / g.floats("memory_total")
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
    return out


def _imbalance_findings(report: Report) -> list[Finding]:
    """A GPU much less busy than the others: a straggler or an unbalanced split."""
    means = {s.gpu: s.mean for s in report.stats if s.field == "utilization.gpu"}
    if len(means) < 2:
        return []
    ordered = sorted(means.values())
    median = ordered[len(ordered) // 2]
    return [
        Finding(
            "imbalance",
            "info",
            (gpu,),
            f"GPU {gpu} averaged {m:.0f}% utilization against {median:.0f}% on the others: "
            "unbalanced work or a straggler; check its share of the data and its PCIe/NVLink link",
        )
        for gpu, m in sorted(means.items())
        if median >= 40 and m < median - 25
    ]


def _clock_findings(report: Report) -> list[Finding]:
    """A step back of the recorded clock (once, however many GPUs saw it) and each change of the zone's offset."""
    out: list[Finding] = []
    if report.clock_steps:
        first = report.clock_steps[0]
        n = len(report.clock_steps)
        text = (
            f"The recorded clock went back {format_duration(first.seconds)} at {clock_text(first.at)}"
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
                f"The clocks changed from {before} to {after} at {clock_text(at)} (daylight saving): times are "
                "local wall-clock times, durations run on across the change",
                0.0,
                at,
            )
        )
    return out


def _health_kind(name: str) -> str:
    return "ecc" if name.startswith("ecc.") else "retired_pages" if name.startswith("retired_") else "remapped_rows"


def _health_verdict(h: HealthCount) -> str:
    fld = catalogue_field(h.field)
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


def _overlapping(stalls: Sequence[Stretch]) -> list[list[Stretch]]:
    """Groups of stalls that overlap in time (transitively)."""
    groups: list[list[Stretch]] = []
    for s in sorted(stalls, key=lambda s: s.start):
        if groups and s.start < max(x.end for x in groups[-1]):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups
