"""A report as one self-contained HTML page: findings, tables and the plot, for a ticket or a browser.

The page loads nothing (inline style, the plot a ``data:`` URI, a content security policy forbidding the rest), so
a shared page works offline and leaks no request.
"""

from __future__ import annotations

import base64
from html import escape
from typing import TYPE_CHECKING

from smiquery.analysis.render import (
    THRESHOLDS_NOTE,
    THRESHOLDS_TITLE,
    alert_table,
    constants_text,
    energy_line,
    format_duration,
    gpu_stat_table,
    headline,
    notes,
    nothing_found,
    overall_rows,
    sentence,
    stall_note,
    stall_table,
    threshold_note,
    threshold_table,
)

if TYPE_CHECKING:
    from smiquery.analysis.model import Report

__all__ = ["report_html"]

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


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="wide"><table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table></div>'


def _para(text: str) -> str:
    return f"<p>{escape(sentence(text))}</p>"


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
        f'<p class="head">{escape(headline(report).split(": ", 1)[1])}</p>',
        *(f'<p class="note">{escape(n)}</p>' for n in notes(report)),
    ]
    if report.energy_wh:
        out.append(f'<p class="head">{escape(energy_line(report))}</p>')
    out.append("<h2>Findings</h2>")
    if report.findings:
        items = "".join(
            f'<li class="{f.severity}"><span class="sev">{f.severity}</span>{escape(f.verdict)}</li>'
            for f in report.findings
        )
        out.append(f'<ul class="findings">{items}</ul>')
    else:
        out.append(_para(nothing_found(report)))
    out.append("<h2>Plot</h2>")
    if plot_png is not None:
        data = base64.b64encode(plot_png).decode("ascii")
        out.append(
            f'<figure id="plot"><img alt="{escape(report.source)}: the recording over time" '
            f'src="data:image/png;base64,{data}"></figure>'
        )
    else:
        out.append(_para(plot_note or "no plot"))

    def section(title: str, table: tuple[list[str], list[list[str]]], note: str = "") -> None:
        head, rows = table
        out.extend([f"<h2>{title}</h2>", _table(head, rows) if rows else _para(note)])

    section(
        f"Stalls (utilization.gpu &lt; {report.stall_utilization:g}% for at least "
        f"{escape(format_duration(report.min_stall))}, with memory held)",
        stall_table(report),
        stall_note(report),
    )
    out += [f"<h2>{THRESHOLDS_TITLE}</h2>", _para(THRESHOLDS_NOTE)]
    head, rows = threshold_table(report)
    out.append(_table(head, rows) if rows else _para(threshold_note(report)))
    if report.alerts:
        section("Alerts the rules would have fired", alert_table(report))
    if report.overall:
        section("Statistics over all GPUs", overall_rows(report))
        section("Statistics per GPU (mean / p95 / max)", gpu_stat_table(report))
    if report.constants:
        out += ["<h2>Constant during the run</h2>", _para(constants_text(report))]
    out.append("</body></html>")
    return "\n".join(out) + "\n"
