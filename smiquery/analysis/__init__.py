"""A recorded run, analysed and drawn: :func:`report` summarises it, :func:`plot_recording` draws it.

A :class:`Report` (statistics, time past thresholds, stalls, the alerts the rules would have fired, findings) is
rendered by :func:`report_text`, :func:`report_json`, :func:`report_markdown` and :func:`report_html`; a notebook
shows it as that page. Plotting needs matplotlib; pandas, numpy and matplotlib are imported on first use.
"""

from __future__ import annotations

from smiquery.analysis.analyze import DEFAULT_RULES, report, stalls_and_alerts
from smiquery.analysis.model import (
    AlertSpan,
    FieldStats,
    Finding,
    HealthCount,
    Periods,
    Report,
    Stretch,
    ThresholdTime,
)
from smiquery.analysis.plot import (
    DEFAULT_PLOT_FIELDS,
    LAYOUTS,
    MULTIPLES_MAX_GPUS,
    OVERLAY_MAX_GPUS,
    Layout,
    plot_png,
    plot_recording,
    save_plot,
)
from smiquery.analysis.render import format_duration, report_html, report_json, report_markdown, report_text
from smiquery.analysis.series import load_recording

Report.html_renderer = report_html  # a Report shows itself in a notebook as this page (model cannot import it)

__all__ = [
    "DEFAULT_PLOT_FIELDS",
    "DEFAULT_RULES",
    "LAYOUTS",
    "MULTIPLES_MAX_GPUS",
    "OVERLAY_MAX_GPUS",
    "AlertSpan",
    "FieldStats",
    "Finding",
    "HealthCount",
    "Layout",
    "Periods",
    "Report",
    "Stretch",
    "ThresholdTime",
    "format_duration",
    "load_recording",
    "plot_png",
    "plot_recording",
    "report",
    "report_html",
    "report_json",
    "report_markdown",
    "report_text",
    "save_plot",
    "stalls_and_alerts",
]
