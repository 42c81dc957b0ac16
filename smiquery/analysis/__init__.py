"""A recorded run, analysed and drawn: :func:`report` summarises it, :func:`plot_recording` draws it.

:func:`report` reads a recording (CSV, JSONL or Parquet, as ``smiquery stream --output`` writes them, or a
DataFrame from :func:`smiquery.recordings.read_csv`) and returns a :class:`Report` of per-GPU statistics, time
over thresholds, stalls, the alerts the rules would have fired and one-line findings; :func:`report_text`,
:func:`report_json`, :func:`report_markdown` and :func:`report_html` (one self-contained page with the plot
inlined, :func:`plot_png`) render it, and in a notebook a :class:`Report` shows itself as that page (no plot).
:func:`stalls_and_alerts` finds only the stall and alert periods (what the plot shades), for less.
:func:`plot_recording`, :func:`save_plot` and :func:`plot_png` need matplotlib (``pip install 'smiquery[plot]'``).
pandas, numpy and matplotlib are imported on first use, so importing this package stays light.

The modules, in the order data flows through them: ``load`` (the recording, one view per GPU), ``analyze`` (what
happened), ``findings`` (what to act on), ``model`` (the records), ``render`` (text, Markdown, JSON), ``htmlpage``
(the page), ``plot``; ``series`` holds the column helpers the report and the plot share.
"""

from __future__ import annotations

from smiquery.analysis.analyze import DEFAULT_RULES, report, stalls_and_alerts
from smiquery.analysis.htmlpage import report_html
from smiquery.analysis.load import load_recording
from smiquery.analysis.model import (
    AlertSpan,
    FieldStats,
    Finding,
    HealthCount,
    Periods,
    Report,
    Stretch,
    ThresholdTime,
    use_html_renderer,
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
from smiquery.analysis.render import format_duration, report_json, report_markdown, report_text

use_html_renderer(report_html)  # a Report shows itself in a notebook as this page (model cannot import it)

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
