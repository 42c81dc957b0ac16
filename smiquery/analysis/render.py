"""A report as text for a terminal, Markdown for a pull request or notebook, JSON, or one self-contained HTML page.

Numbers are rounded to what their field's unit resolves, times shown in the recording's zone.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape
from typing import TYPE_CHECKING

from smiquery.analysis.series import catalogue_field
from smiquery.clock import seconds_between
from smiquery.fields import Field, Kind
from smiquery.printable import printable, text_table

if TYPE_CHECKING:
    from smiquery.analysis.model import FieldStats, GpuName, Report, Stretch, ThresholdTime

__all__ = [
    "format_duration",
    "gpu_list",
    "gpu_name",
    "report_html",
    "report_json",
    "report_markdown",
    "report_text",
    "time_text",
    "value_text",
]


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"1 min 30 s"``, ``"14 min"``, ``"2 h 5 min"``: how long, to the second (from an hour, minute)."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        m, rest = divmod(s, 60)
        return f"{m} min {rest} s" if rest else f"{m} min"
    h, rest = divmod(round(s / 60), 60)
    return f"{h} h {rest} min" if rest else f"{h} h"


def _zone_name(ts: datetime) -> str:
    return "recorder's local time" if ts.tzinfo is None else str(ts.tzinfo)


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


def gpu_name(gpu: int, names: Mapping[int, GpuName] | None = None) -> str:
    """How a report names one GPU: ``GPU 3`` in a recording's, ``gpu-node-2 GPU 1 (team-a/train-0)`` in a fleet's.

    In a fleet's report (``names``: :attr:`Report.names`) a GPU is its node and its index there, with the pod or
    Slurm job that held it where known.
    """
    name = names.get(gpu) if names else None
    if name is None:
        return f"GPU {gpu}"
    return f"{printable(name.node)} GPU {printable(name.gpu or '?')}{_held(name)}"


def _held(name: GpuName) -> str:
    if name.pod:
        return f" ({printable(name.pod)})"
    return f" (Slurm job {printable(name.job)})" if name.job else ""


def _numbers(g: Sequence[int]) -> str:
    if len(g) == 1:
        return f"GPU {g[0]}"
    if list(g) == list(range(g[0], g[-1] + 1)):
        return f"GPUs {g[0]}-{g[-1]}"
    return "GPUs " + ", ".join(str(x) for x in g)


def gpu_list(gpus: Sequence[int], names: Mapping[int, GpuName] | None = None) -> str:
    """``"GPU 3"``, ``"GPUs 0-7"``, ``"GPUs 1, 3"``; in a fleet's report per node: ``"node-1 GPUs 0-7; node-4 GPU 2"``.

    With ``names`` each node's GPUs go by their index on the node, with the pod or job where one held them all.
    """
    g = sorted(gpus)
    if not names or any(x not in names for x in g):
        return _numbers(g)
    if len(g) == 1:
        return gpu_name(g[0], names)
    by_node: dict[str, list[GpuName]] = {}
    for x in g:
        by_node.setdefault(names[x].node, []).append(names[x])
    parts = []
    for node, on in by_node.items():
        local = sorted(on, key=lambda n: (not n.gpu.isdigit(), int(n.gpu) if n.gpu.isdigit() else 0, n.gpu))
        if all(n.gpu.isdigit() for n in on):
            which = _numbers([int(n.gpu) for n in local])
        else:
            which = ("GPU " if len(on) == 1 else "GPUs ") + ", ".join(printable(n.gpu or "?") for n in local)
        held = {_held(n) for n in on}
        parts.append(f"{printable(node)} {which}{held.pop() if len(held) == 1 else ''}")
    return "; ".join(parts)


def value_text(value: float | None, fld: Field) -> str:
    """A value rounded to its field's unit, with the unit (``"87 C"``, ``"95%"``); ``"n/a"`` when missing."""
    u = fld.unit
    text = _stat(value, fld)
    if not u or text == "n/a":
        return text
    return f"{text}{u}" if u == "%" else f"{text} {u}"


def report_json(report: Report, indent: int | None = 2) -> str:
    """The report as a JSON document (see :meth:`~smiquery.analysis.Report.to_dict`)."""
    return json.dumps(report.to_dict(), indent=indent, default=str)


def _headline(report: Report) -> str:
    """The first line: the recording, its GPUs, its span (both dates when it crosses midnight), zone and interval."""
    n = len(report.gpus)
    gpus = f"{n} GPU{'s' if n != 1 else ''}"
    if report.sweeps <= 1:
        return (
            f"{report.source}: {gpus}, one sample each at {_stamp(report.start)} ({_zone_name(report.start)}): "
            "a single snapshot, so no durations, stalls or energy"
        )
    return (
        f"{report.source}: {gpus}, {report.sweeps} samples each, {_stamp(report.start)} to "
        f"{time_text(report, report.end)} ({format_duration(report.duration)}, {_zone_name(report.start)}), every "
        f"{report.interval:g} s"
    )


def time_text(report: Report, ts: datetime) -> str:
    """A time in a report's words: the time of day, with the date too when the report spans more than one day."""
    return _stamp(ts) if report.start.date() != report.end.date() else ts.strftime("%H:%M:%S")


def _notes(report: Report) -> list[str]:
    """Lines under the headline: files and lines skipped, fields the report needed but the recording lacks."""
    out = list(report.skipped_files)
    if report.skipped is not None:
        out.append(report.skipped.message(report.source))
    if report.not_recorded:
        them = "it" if len(report.not_recorded) == 1 else "them"
        out.append(
            f"Not recorded: {', '.join(report.not_recorded)}; what needs {them} is not known (record with --fields "
            f"including {them})"
        )
    return out


def _stall_note(report: Report) -> str:
    """What the stall section says when it found none: none, or that it could not look."""
    if "utilization.gpu" in report.not_recorded:
        return "not known: utilization.gpu was not recorded"
    if report.sweeps <= 1:
        return "not known: a single snapshot has no durations"
    return "none"


def _threshold_note(report: Report) -> str:
    """What the thresholds section says when no GPU got past one: none, and which rules could not be checked."""
    unchecked = report.unchecked_rules
    if not unchecked:
        return "none"
    checked = len(report.rules) - len(unchecked)
    return ("none; " if checked else "") + "not checked (field not recorded): " + ", ".join(unchecked)


def _nothing_found(report: Report) -> str:
    """The findings section when there are none: what was checked and found clean, and what could not be checked."""
    clean = []
    if "utilization.gpu" not in report.not_recorded and report.sweeps > 1:
        clean.append("no stall")
    if len(report.unchecked_rules) < len(report.rules):
        clean.append("no GPU past a threshold")
    text = "nothing to report: " + ", ".join(clean) if clean else "nothing could be checked"
    if report.not_recorded:
        text += "; what the fields not recorded would tell is not known"
    return text


def _alert_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """(header, rows): GPU, rule, when it fired, how long it held, peak: a row per alert the rules would have fired."""
    rows = [
        [
            str(a.gpu) if not report.names else gpu_name(a.gpu, report.names),
            a.rule,
            _stamp(a.fired),
            format_duration(a.seconds) + (_ONGOING if a.ongoing else ""),
            _peak_text(a.peak, a.rule),
        ]
        for a in report.alerts
    ]
    return ["GPU", "rule", "fired", "held", "peak"], rows


def _gpu_stat_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Per field a row, per GPU a cell of mean / p95 / max."""
    by_key = {(s.field, s.gpu): s for s in report.stats}
    rows = []
    for o in report.overall:  # the fields of report.stats, in their order
        fld = _stat_field(o.field, o.unit)
        cells = [by_key.get((o.field, g)) for g in report.gpus]
        rows.append([_field_head(o), *("n/a" if s is None else " / ".join(_mean_p95_max(s, fld)) for s in cells)])
    return ["field", *[gpu_name(g, report.names) for g in report.gpus]], rows


def _field_head(stats: FieldStats) -> str:
    return f"{stats.field} [{stats.unit}]" if stats.unit else stats.field


def _mean_p95_max(stats: FieldStats, fld: Field) -> list[str]:
    return [_stat(v, fld) for v in (stats.mean, stats.p95, stats.max)]


def _stall_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a row per stall, except that GPUs which stalled together (same start and length) share one."""
    rows: list[list[str]] = []
    groups: list[list[Stretch]] = []
    for st in sorted(report.stalls, key=lambda x: (x.start, x.gpu)):
        first = groups[-1][0] if groups else st
        together = abs(seconds_between(first.start, st.start)) <= 2 * report.interval
        if groups and together and abs(st.seconds - first.seconds) <= 2 * report.interval:
            groups[-1].append(st)
        else:
            groups.append([st])
    for group in groups:
        means = [x.mean for x in group if x.mean is not None]
        mean = sum(means) / len(means) if means else None
        who = gpu_list([x.gpu for x in group], report.names)
        if not report.names:
            who = who.removeprefix("GPUs ").removeprefix("GPU ")
        length = format_duration(group[0].seconds) + (_ONGOING if any(x.ongoing for x in group) else "")
        rows.append([who, _stamp(group[0].start), length, f"{_num(mean)}%"])
    return ["GPU", "start", "length", "mean util"], rows


def _overall_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per varying field its mean, p95, max over all GPUs, and the GPUs of highest and lowest mean."""
    any_missing = any(o.missing for o in report.overall)
    head = ["field", "mean", "p95", "max", "highest mean", "lowest mean"] + (["missing"] if any_missing else [])
    rows = []
    for o in report.overall:
        fld = _stat_field(o.field, o.unit)
        gpus = [s for s in report.stats if s.field == o.field]
        ends = (max(gpus, key=lambda s: s.mean), min(gpus, key=lambda s: s.mean))
        row = [_field_head(o), *_mean_p95_max(o, fld)]
        row += [f"{gpu_name(s.gpu, report.names)}: {_stat(s.mean, fld)}" for s in ends]
        rows.append(row + ([str(o.missing)] if any_missing else []))
    return head, rows


def _threshold_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per GPU that got past a threshold, the time past each rule's, and how often the rule fired.

    A column is headed by the rule's condition without its hold (the whole rule where two rules share a condition).
    """
    rules = list(dict.fromkeys(t.rule for t in report.thresholds))
    conditions = [_threshold_of(r) for r in rules]
    # two rules of one threshold (other holds) keep their whole text, so their "fired" cells are told apart
    head = ["GPU", *(c if conditions.count(c) == 1 else r for c, r in zip(conditions, rules, strict=True))]
    past = {(t.gpu, t.rule): t for t in reversed(report.thresholds)}  # one per GPU and rule (the first, if more)

    def cell(t: ThresholdTime | None, fired: int) -> str:
        if t is None:
            return "-"
        done = f"fired {fired}x" if fired else "not fired"
        return f"{format_duration(t.seconds)} in {t.stretches} stretch{'es' if t.stretches != 1 else ''}, {done}"

    rows = [
        [gpu_name(g, report.names), *(cell(past.get((g, r)), report.alerts_fired(r, g)) for r in rules)]
        for g in report.gpus
        if any((g, r) in past for r in rules)
    ]
    return head, rows


def _threshold_of(rule: str) -> str:
    """A rule's condition without its hold: what time past a threshold counts.

    ``"utilization.gpu < 20 for 30m while memory.used > 1024"`` -> ``"utilization.gpu < 20 while memory.used > 1024"``.
    """
    return re.sub(r"\s+for\s+\S+(?:\s+samples?)?(?=\s+while\s|$)", "", rule.strip())


#: The heading of the time-past-thresholds section, and the line that says what it counts.
_THRESHOLDS_TITLE = "Time past thresholds"
_THRESHOLDS_NOTE = "how long each rule's condition held, long enough to fire or not; the firings are the alerts"
#: What a stall's or alert's length says when the recording ended while it still held.
_ONGOING = " (ongoing at the end)"


def _sections(report: Report, fmt: str) -> list[tuple[str, str, tuple[list[str], list[list[str]]], str]]:
    """The tables a renderer shows, in order: (title, intro, (header, rows), what to say when there are no rows).

    Text shows the statistics over all GPUs itself, after the energy line.
    """
    least = format_duration(report.min_stall)
    stalls = f"Stalls (utilization.gpu < {report.stall_utilization:g}% for at least {least}, with memory held)"
    if fmt == "markdown":
        stalls = f"Stalls (utilization < {report.stall_utilization:g}% for at least {least})"
    out = [
        (stalls, "", _stall_table(report), _stall_note(report)),
        (_THRESHOLDS_TITLE, _THRESHOLDS_NOTE, _threshold_table(report), _threshold_note(report)),
    ]
    if report.alerts:
        head, rows = _alert_table(report)
        if fmt == "markdown":
            rows = [[g, f"`{r}`", *rest] for g, r, *rest in rows]
        out.append(("Alerts the rules would have fired", "", (head, rows), ""))
    if report.overall and fmt == "html":
        out.append(("Statistics over all GPUs", "", _overall_rows(report), ""))
    if report.overall and fmt != "text":
        per_gpu = "Statistics per GPU" if fmt == "html" else "Statistics"
        out.append((f"{per_gpu} (mean / p95 / max)", "", _gpu_stat_table(report), ""))
    return out


def report_text(report: Report) -> str:
    """The report as plain text for a terminal."""
    out = [_headline(report), *_notes(report), "", "Findings:"]
    out += [f"  [{f.severity}] {f.verdict}" for f in report.findings] or [f"  {_nothing_found(report)}"]

    for title, intro, (head, rows), note in _sections(report, "text"):
        title += f" ({intro})" if intro else ""
        out.extend(["", f"{title}:", *(_table(head, rows) if rows else [f"  {note}"])])
    if report.energy_wh:
        out += ["", _energy_line(report)]
    if report.overall:
        head, rows = _overall_rows(report)
        out += ["", "Statistics over all GPUs (per GPU: --format json or markdown):", *_table(head, rows)]
    if report.constants:
        out += ["", f"Constant during the run: {_constants_text(report)}"]
    return "\n".join(out) + "\n"


def _energy_line(report: Report) -> str:
    """The energy the GPUs drew over the run, in all and per GPU."""
    total = sum(report.energy_wh.values())
    per = ", ".join(f"{gpu_name(g, report.names)}: {wh:.1f}" for g, wh in sorted(report.energy_wh.items()))
    return f"Energy (power.draw over the run): {total:.1f} Wh in all ({per} Wh)"


def _sentence(text: str) -> str:
    """``text`` as a sentence: its first letter capital, a full stop at the end."""
    return text[:1].upper() + text[1:] + "."


def report_markdown(report: Report) -> str:
    """The report in Markdown (GitHub tables), for a pull request, an issue or a notebook."""
    out = [f"# GPU report: {report.source}", "", _headline(report).split(": ", 1)[1], *_notes(report), ""]
    if report.energy_wh:
        out += [_energy_line(report), ""]
    out += ["## Findings", ""]
    out += [f"- **{f.severity}**: {f.verdict}" for f in report.findings] or [_sentence(_nothing_found(report))]

    for title, intro, (head, rows), note in _sections(report, "markdown"):
        out.extend(["", f"## {title}", "", *([_sentence(intro), ""] if intro else [])])
        out.extend(_md_table(head, rows) if rows else [_sentence(note)])
    if report.constants:
        out += ["", f"Constant during the run: {_constants_text(report)}"]
    return "\n".join(out) + "\n"


def _constants_text(report: Report) -> str:
    """The fields that never changed during the run, with their values."""
    texts = []
    for name, per_gpu in report.constants.items():
        fld = catalogue_field(name)
        shown = {g: _num(v) if fld is None else value_text(v, fld) for g, v in per_gpu.items()}
        if len(set(per_gpu.values())) == 1:
            texts.append(f"{name} {next(iter(shown.values()))}")
        else:
            texts.append(f"{name} " + ", ".join(f"{gpu_name(g, report.names)}: {t}" for g, t in shown.items()))
    return "; ".join(texts)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Indented by two, the first column left-aligned and the others right."""
    return ["  " + line for line in text_table(head, rows, [i > 0 for i in range(len(head))])]


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [line(head), "|" + "|".join("---" for _ in head) + "|", *(line(r) for r in rows)]


# No script, no outside request: images only as data: URIs, style only inline.
_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #1d1d1f;
       margin: 0 auto; max-width: 1280px; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 20px; margin: 8px 0 4px; }
h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.head { color: #444; margin: 0 0 4px; }
p.note { color: #8a4b00; margin: 2px 0; }
ul.findings { list-style: none; padding: 0; margin: 0; }
ul.findings li { margin: 6px 0; padding: 6px 10px; border-left: 4px solid #999; background: #f7f7f7; }
ul.findings li.critical { border-color: #c62828; background: #fdecea; }
ul.findings li.warning { border-color: #ef6c00; background: #fff4e5; }
ul.findings li.info { border-color: #1565c0; background: #e8f1fb; }
.sev { font-weight: 600; text-transform: uppercase; font-size: 11px; margin-right: 6px; }
table { border-collapse: collapse; margin: 4px 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; }
td:first-child, th:first-child { text-align: left; }
div.wide { overflow-x: auto; }
figure { margin: 8px 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
"""


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="wide"><table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table></div>'


def _para(text: str) -> str:
    return f"<p>{escape(_sentence(text))}</p>"


def report_html(report: Report, plot_png: bytes | None = None, plot_note: str | None = None) -> str:
    """The report as one HTML page that needs nothing else: no network, no script, no file beside it.

    ``plot_png``: the plot as PNG bytes (None: ``plot_note`` says why there is none, e.g. matplotlib is missing).
    """
    title = f"GPU report: {report.source}"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="head">{escape(_headline(report).split(": ", 1)[1])}</p>',
        *(f'<p class="note">{escape(n)}</p>' for n in _notes(report)),
    ]
    if report.energy_wh:
        out.append(f'<p class="head">{escape(_energy_line(report))}</p>')
    out.append("<h2>Findings</h2>")
    if report.findings:
        items = "".join(
            f'<li class="{f.severity}"><span class="sev">{f.severity}</span>{escape(f.verdict)}</li>'
            for f in report.findings
        )
        out.append(f'<ul class="findings">{items}</ul>')
    else:
        out.append(_para(_nothing_found(report)))
    out.append("<h2>Plot</h2>")
    if plot_png is not None:
        data = base64.b64encode(plot_png).decode("ascii")
        out.append(
            f'<figure id="plot"><img alt="{escape(report.source)}: the recording over time" '
            f'src="data:image/png;base64,{data}"></figure>'
        )
    else:
        out.append(_para(plot_note or "no plot"))

    for title, intro, (head, rows), note in _sections(report, "html"):
        out.extend([f"<h2>{escape(title)}</h2>", *([_para(intro)] if intro else [])])
        out.append(_html_table(head, rows) if rows else _para(note))
    if report.constants:
        out += ["<h2>Constant during the run</h2>", _para(_constants_text(report))]
    out.append("</body></html>")
    return "\n".join(out) + "\n"
