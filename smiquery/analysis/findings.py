"""The findings of a report: what to act on, one verdict a line for people with what to check, most severe first."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from smiquery.analysis.model import (
    SEVERITY_ORDER,
    AlertSpan,
    Finding,
    GpuName,
    HealthCount,
    Report,
    Severity,
    Stretch,
)
from smiquery.analysis.render import format_duration, gpu_list, gpu_name, time_text, value_text
from smiquery.analysis.series import catalogue_field
from smiquery.clock import seconds_between
from smiquery.printable import printable

if TYPE_CHECKING:
    from smiquery.alerts import Rule
    from smiquery.analysis.series import GpuSeries

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
    """What to act on in a report (all but its findings filled in), most severe first (then by start and GPU).

    ``rules`` are those its alerts come from; ``gpus`` the samples (for memory nearly full).
    """
    out = [
        *_stall_findings(report, len(gpus)),
        *_alert_findings(report, rules),
        *_memory_findings(gpus, report),
        *_imbalance_findings(report),
        *_same_words(
            [Finding(_health_kind(h.field), h.severity, (h.gpu,), _health_verdict(h, report)) for h in report.health],
            report,
        ),
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
        length = seconds_between(start, end)
        who = f"All {n_gpus} GPUs" if len(gpus_in) == n_gpus else gpu_list(gpus_in, report.names)
        # what was measured: how long all of them were stalled at once, not the span from the first to the last
        together, at, most = _all_at_once(group)
        if at is not None and length - together < 1.0:  # the same stretch, but for rows a few ms apart
            when = f"stalled together from {time_text(report, start)} for {format_duration(length)}"
        elif at is not None:
            when = (
                f"stalled together from {time_text(report, at)} for {format_duration(together)}, all at once (their "
                f"stalls spanned {format_duration(length)} from {time_text(report, start)})"
            )
        else:
            when = (
                f"stalled in overlapping stretches from {time_text(report, start)} over {format_duration(length)}, "
                f"never all at once (at most {most} at a time)"
            )
        verdict = (
            f"{who} {when} (utilization under {report.stall_utilization:g}%): a cause they share; check the input "
            "pipeline, e.g. prefetching and TFRecord, or a checkpoint or evaluation pass"
        )
        out.append(Finding("stall_together", "warning", tuple(gpus_in), verdict, length, start))
    if alone:
        out.append(_alone_stalls(report, alone))
    return out


def _alone_stalls(report: Report, alone: dict[int, list[Stretch]]) -> Finding:
    """The stalls no other GPU shared, as one finding naming every GPU that had one."""
    every = [s for st in alone.values() for s in st]
    longest = max(every, key=lambda s: s.seconds)
    totals = sorted(sum(s.seconds for s in st) for st in alone.values())
    n = len(every)
    if len(alone) == 1:
        spent = f"{gpu_list(list(alone), report.names)} spent {format_duration(totals[0])}"
    else:
        spent = f"{gpu_list(sorted(alone), report.names)} each spent {_durations(totals)}"
    where = "" if len(alone) == 1 else f" on {gpu_name(longest.gpu, report.names)}"
    verdict = (
        f"{spent} under {report.stall_utilization:g}% utilization in {n} stretch{'es' if n != 1 else ''} "
        f"(longest {format_duration(longest.seconds)}{where} from {time_text(report, longest.start)}): check the "
        "input pipeline, e.g. prefetching and TFRecord"
    )
    return Finding("stall", "warning", tuple(sorted(alone)), verdict, sum(totals), min(s.start for s in every))


def _alert_findings(report: Report, rules: Sequence[Rule]) -> list[Finding]:
    """One finding per rule that would have fired, naming its GPUs (utilization rules aside: stalls say it better)."""
    out: list[Finding] = []
    for text in dict.fromkeys(a.rule for a in report.alerts):
        rule = next((r for r in rules if str(r) == text), None)
        if rule is None or rule.field.name == "utilization.gpu":
            continue
        spans = [a for a in report.alerts if a.rule == text]
        per: dict[int, float] = {}
        for a in spans:
            per[a.gpu] = per.get(a.gpu, 0.0) + a.seconds
        peaks = [a for a in spans if a.peak is not None]
        top = (max if rule.op in (">", ">=") else min)(peaks, key=lambda a: a.peak or 0.0) if peaks else None
        kind, severity, advice = _advice(rule)
        verdict = _alert_verdict(rule, sorted(per), len(spans), sorted(per.values()), top, advice, report)
        out.append(Finding(kind, severity, tuple(sorted(per)), verdict, max(per.values()), min(a.since for a in spans)))
    return out


def _advice(rule: Rule) -> tuple[str, Severity, str]:
    """(kind, severity, what to check) for alerts of a rule: a temperature from 85 C is hot, under it warm."""
    kind, severity, advice = _ADVICE.get(rule.field.name, ("alert", "warning", "check the GPU"))
    if rule.field.name == "temperature.gpu" and rule.op in (">", ">=") and isinstance(rule.threshold, (int, float)):
        kind, severity = ("hot", "critical") if rule.threshold >= 85 else ("warm", "warning")
    return kind, severity, advice


def _alert_verdict(
    rule: Rule, gpus: list[int], n: int, totals: list[float], top: AlertSpan | None, advice: str, report: Report
) -> str:
    fld = rule.field
    many = len(gpus) > 1
    who = gpu_list(gpus, report.names)
    length = _durations(totals) + " each" if many else format_duration(totals[-1])
    if fld.kind.is_bool:
        state = "active" if rule.threshold else "inactive"
        text = f"{who} had {fld.name.split('.')[-1]} {state} for {length}"
    else:
        limit = value_text(float(rule.threshold), fld) if isinstance(rule.threshold, (int, float)) else "?"
        words = _OP_WORDS.get(rule.op, rule.op)
        text = f"{who} {'were' if many else 'was'} {words} {limit} ({fld.name}) for {length}"
    text += f" in {n} stretch{'es' if n != 1 else ''}"
    if top is not None and not fld.kind.is_bool:
        text += f" (peak {value_text(top.peak, fld)}" + (f" on {gpu_name(top.gpu, report.names)})" if many else ")")
    return text + f", firing `{rule}`: {advice}"


def _durations(totals: list[float]) -> str:
    """The shortest to the longest of ``totals`` (sorted), or the one length they all have."""
    return format_duration(totals[0]) + ("" if totals[0] == totals[-1] else f" to {format_duration(totals[-1])}")


def _memory_findings(gpus: list[GpuSeries], report: Report) -> list[Finding]:
    """GPUs whose memory was at least 97% full at some point: an out-of-memory error is one batch away."""
    import numpy as np

    if "memory_used" not in gpus[0].df.columns or "memory_total" not in gpus[0].df.columns:
        return []
    full: dict[int, float] = {}
    for g in gpus:
        with np.errstate(divide="ignore", invalid="ignore"):  # a missing memory.total is NaN, not an error
            ratio = g.floats("memory_used") / g.floats("memory_total")
        if len(ratio) and (ratio >= 0.97).any():
            full[g.index] = float(ratio[ratio == ratio].max())
    if not full:
        return []
    lo, hi = min(full.values()), max(full.values())
    peak = f"{hi:.0%}" if f"{lo:.0%}" == f"{hi:.0%}" else f"{lo:.0%} to {hi:.0%}"
    many = len(full) > 1
    verdict = (
        f"{gpu_list(sorted(full), report.names)} peaked at {peak} of {'their' if many else 'its'} memory: an "
        "out-of-memory error is one batch away; lower the batch size or check for tensors kept across steps"
    )
    return [Finding("memory_full", "warning", tuple(sorted(full)), verdict)]


def _imbalance_findings(report: Report) -> list[Finding]:
    """GPUs much less busy than those they work with: stragglers or an unbalanced split.

    A fleet's GPUs are compared within their Slurm job, else their pod, else their node (never across unrelated
    nodes); a recording's GPUs all together. One finding per group names all its stragglers.
    """
    groups: dict[str, dict[int, float]] = {}
    for s in report.stats:
        if s.field == "utilization.gpu" and s.gpu >= 0:
            groups.setdefault(_peers(report.names.get(s.gpu)), {})[s.gpu] = s.mean
    out: list[Finding] = []
    for peers, means in sorted(groups.items()):
        ordered = sorted(means.values())
        median = ordered[len(ordered) // 2]
        slow = sorted(g for g, m in means.items() if median >= 40 and m < median - 25)
        if len(means) < 2 or not slow:
            continue
        averaged = ", ".join(f"{means[g]:.0f}%" for g in slow)
        others = f"the other GPUs of {printable(peers)}" if peers else "the others"
        verdict = (
            f"{gpu_list(slow, report.names)} averaged {averaged} utilization against {median:.0f}% on {others}: "
            f"unbalanced work or a straggler; check {'their' if len(slow) > 1 else 'its'} share of the data and "
            "PCIe/NVLink link"
        )
        out.append(Finding("imbalance", "info", tuple(slow), verdict))
    return out


def _peers(name: GpuName | None) -> str:
    """Whom a GPU works with: its Slurm job, else its pod, else its node ("": a recording's GPUs, all together)."""
    if name is None:
        return ""
    if name.job:
        return f"Slurm job {name.job}"
    return f"pod {name.pod}" if name.pod else name.node


def _clock_findings(report: Report) -> list[Finding]:
    """A step back of the recorded clock (once, however many GPUs saw it) and each change of the zone's offset."""
    out: list[Finding] = []
    if report.clock_steps:
        first = report.clock_steps[0]
        n = len(report.clock_steps)
        text = (
            f"The recorded clock went back {format_duration(first.seconds)} at {time_text(report, first.at)}"
            + (f" ({n} times in all)" if n > 1 else "")
            + ": a DST change, an NTP step or a VM resume (nvidia-smi stamps local time with no zone); durations "
            "and energy skip the step"
            + ("; name the zone (--tz) to place a DST change" if first.at.tzinfo is None else "")
        )
        out.append(Finding("clock", "info", report.gpus, text, first.seconds, first.at))
    for at, before, after in report.zone_changes:
        text = (
            f"The clocks changed from {before} to {after} at {time_text(report, at)} (daylight saving): times are "
            "local wall-clock times, durations run on across the change"
        )
        out.append(Finding("clock", "info", report.gpus, text, 0.0, at))
    return out


def _same_words(found: list[Finding], report: Report) -> list[Finding]:
    """Findings that say the same of several GPUs, as one naming them all (``GPUs 2, 6 have ...``)."""
    groups: dict[tuple[str, Severity, str], list[Finding]] = {}
    for f in found:
        (gpu,) = f.gpus
        name = gpu_name(gpu, report.names)
        key = (f.kind, f.severity, f.verdict.replace(f"{name}'s ", "\0").replace(f"{name} ", "\1"))
        groups.setdefault(key, []).append(f)
    out: list[Finding] = []
    for (kind, severity, words), same in groups.items():
        if len(same) == 1:
            out.append(same[0])
            continue
        gpus = sorted(g for f in same for g in f.gpus)
        who = gpu_list(gpus, report.names)
        verdict = words.replace("\0", f"{who}' ").replace("\1", f"{who} ").replace(f"{who} has ", f"{who} have ")
        out.append(Finding(kind, severity, tuple(gpus), verdict, same[0].seconds, same[0].start))
    return out


def _health_kind(name: str) -> str:
    return "ecc" if name.startswith("ecc.") else "retired_pages" if name.startswith("retired_") else "remapped_rows"


def _health_verdict(h: HealthCount, report: Report) -> str:
    fld = catalogue_field(h.field)
    is_flag = fld is not None and fld.kind.is_bool
    where = gpu_name(h.gpu, report.names)
    if is_flag:
        if h.field.endswith(".failure"):
            return f"{where} reported {h.field}: row remapping failed; drain it and have it checked (RMA)"
        return (
            f"{where} has {h.field} = yes: reset the GPU (or reboot) so the pending retirement/remapping takes effect"
        )
    count = int(h.max)
    if h.grew:
        text = f"{where}'s {h.field} grew from {int(h.first)} to {count} during the run"
    else:
        text = f"{where} has {h.field} = {count}" + (" (lifetime count)" if ".aggregate." in h.field else "")
    if h.severity == "critical":
        advice = "uncorrectable memory errors: results may be wrong; drain it and have it checked"
    else:
        advice = "corrected errors: watch whether the count keeps rising"
    return f"{text}: {advice} (nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER)"


def _all_at_once(group: Sequence[Stretch]) -> tuple[float, datetime | None, int]:
    """(seconds during which every GPU of ``group`` was stalled at once, when that first began, most GPUs at once)."""
    events = sorted([(s.start, 1, s.gpu) for s in group] + [(s.end, -1, s.gpu) for s in group], key=lambda e: e[:2])
    wanted = len({s.gpu for s in group})
    open_: dict[int, int] = {}
    together = 0.0
    first: datetime | None = None
    since: datetime | None = None
    most = 0
    for at, step, gpu in events:
        if since is not None:
            together += seconds_between(since, at)
            since = None
        open_[gpu] = open_.get(gpu, 0) + step
        stalled = sum(1 for n in open_.values() if n > 0)
        most = max(most, stalled)
        if stalled == wanted:
            since = at
            first = first or at
    return together, first if together > 0 else None, most


def _overlapping(stalls: Sequence[Stretch]) -> list[list[Stretch]]:
    """Groups of stalls that overlap in time (transitively)."""
    groups: list[list[Stretch]] = []
    for s in sorted(stalls, key=lambda s: s.start):
        if groups and s.start < max(x.end for x in groups[-1]):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups
