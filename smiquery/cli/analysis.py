"""The ``plot`` and ``report`` commands: a recorded run (CSV, JSONL, Parquet), or a range of the fleet, afterwards.

:func:`register` adds them to the ``smiquery`` typer app. With ``--prometheus`` they read a time range of the fleet
instead of a recording (the work is :mod:`smiquery.fleet`'s; :func:`read_source` picks the source).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from smiquery.cli._boundary import ExitCode, as_usage, boundary, say
from smiquery.cli._common import settings_of

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FailOn", "PlotLayout", "ReportFormat", "check_zone", "read_source", "register"]

#: Output formats of ``smiquery report``.
ReportFormat = Literal["text", "json", "markdown", "summary"]
#: How ``smiquery plot`` puts GPUs in panels (see :func:`smiquery.analysis.plot_recording`).
PlotLayout = Literal["auto", "overlay", "multiples", "heatmap"]
#: Which findings make ``smiquery report`` exit with code 6.
FailOn = Literal["never", "warning", "critical"]


_PLOT_EPILOG = """\b
Examples:
  smiquery plot run.csv
  smiquery plot run.parquet -o trace.png --fields utilization.gpu,temperature.gpu
  smiquery plot run.jsonl -o trace.svg --alert 'temperature.gpu > 83 for 10' --gpus 0,5
  smiquery plot noheader.csv --fields timestamp,index,utilization.gpu --tz Europe/Berlin
  smiquery plot sixteen-gpus.csv --layout overlay
  smiquery plot sixty-four-gpus.csv --layout heatmap
"""

_REPORT_EPILOG = """\b
Exit codes: 0 ok, 1 unreadable recording, 2 bad option or alert,
6 a finding at --fail-on severity or worse.

\b
Examples:
  smiquery report run.csv
  smiquery report run.parquet --format markdown > report.md
  smiquery report run.csv --html run.html
  smiquery report run.jsonl --format json --min-stall 2m --fail-on critical
  smiquery report log.csv --tz Europe/Berlin
  smiquery report noheader.csv --fields timestamp,index,utilization.gpu,temperature.gpu
  smiquery report --prometheus http://prom:9090 --slurm-job 4242 --format summary
"""

RecordingArg = Annotated[
    list[Path] | None,
    typer.Argument(
        metavar="REC...",
        help="A recording from `smiquery stream --output` (.csv, .jsonl, .parquet) or a plain nvidia-smi CSV log; "
        "several files or a quoted glob ('run*.csv') are read as one recording, in time order.",
    ),
]
AlertOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--alert",
        "-a",
        metavar="EXPR",
        help="Rule whose threshold to use (repeatable; default: the built-in health rules and the --alert rules "
        "the recording was made with), "
        "e.g. 'temperature.gpu > 85 for 3' (3 samples) or '... for 30s' (30 seconds).",
    ),
]


TzOpt = Annotated[
    str | None,
    typer.Option(
        metavar="ZONE",
        help="Time zone the recording was made in, an IANA name (Europe/Berlin, UTC). nvidia-smi writes local "
        "time without a zone: by default times are shown as recorded, marked as having no zone (never as UTC); "
        "times recorded with a zone are converted to ZONE.",
    ),
]


# The fleet instead of a recording (top takes --namespace and --max-answer too).
PrometheusOpt = Annotated[
    str | None,
    typer.Option(
        "--prometheus",
        "-p",
        metavar="URL",
        help="Read a time range of the fleet from this Prometheus server instead of a recording (with --start).",
    ),
]
StartOpt = Annotated[str | None, typer.Option(metavar="TIME", help="Start: Unix seconds, RFC 3339 or now-6h.")]
EndOpt = Annotated[str | None, typer.Option("--end", metavar="TIME", help="End (default now).")]
NodeOpt = Annotated[str | None, typer.Option("--node", metavar="REGEX", help="Only instances matching (anchored).")]
NamespaceOpt = Annotated[str | None, typer.Option(metavar="REGEX", help="Only GPUs of pods in these namespaces.")]
PodOpt = Annotated[str | None, typer.Option("--pod", metavar="REGEX", help="Only GPUs of these pods (a job).")]
HttpConfigOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE", dir_okay=False, help="Credentials and TLS for --prometheus, as promtool's --http.config.file."
    ),
]
MaxAnswerOpt = Annotated[
    int | None,
    typer.Option(
        metavar="MIB",
        min=1,
        help="Largest answer to read from --prometheus, in MiB (default 512, room for a range of thousands of GPUs); "
        "a larger one is an error, read no further.",
    ),
]


def check_zone(tz: str | None) -> None:
    """Fail at once, as a usage error (exit 2), on a ``--tz`` that names no IANA zone (UsageError)."""
    from smiquery.errors import InvalidTimeZoneError
    from smiquery.recordings import resolve_zone

    with as_usage("--tz: {}", InvalidTimeZoneError):
        resolve_zone(tz)


def _gpu_list(spec: str | None) -> list[int | str] | None:
    """GPU ids as ``stream --id`` takes them: indices, UUIDs or PCI bus ids, comma-separated."""
    if spec is None:
        return None
    from smiquery.streams.argv import normalize_gpus

    return list(normalize_gpus(spec))


def plot(
    ctx: typer.Context,
    recording: RecordingArg = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", metavar="FILE", help="Image to write (.png, .svg, .pdf); default REC with .png."
        ),
    ] = None,
    fields: Annotated[
        str | None,
        typer.Option(
            "--fields",
            "-f",
            metavar="LIST",
            help="Fields to draw, one panel each (default: utilization.gpu, temperature.gpu, memory.used, "
            "power.draw); each must be recorded. For a headerless (noheader) log: its columns, in order.",
        ),
    ] = None,
    alert: AlertOpt = None,
    gpus: Annotated[
        str | None,
        typer.Option("--gpus", "--id", "-i", metavar="0,5", help="Only these GPUs: indices, UUIDs or PCI bus ids."),
    ] = None,
    width: Annotated[float, typer.Option(min=4.0, help="Width in inches.")] = 12.0,
    dpi: Annotated[int, typer.Option(min=50, max=600, help="Resolution.")] = 100,
    tz: TzOpt = None,
    layout: Annotated[
        PlotLayout,
        typer.Option(
            case_sensitive=False,
            help="overlay: every GPU a line in one panel per field (mean per pixel, min-max band); multiples: one "
            "small panel per GPU per field (same scales); heatmap: one panel per field, a row per GPU; auto: overlay "
            "up to 8 GPUs, multiples up to 16, heatmap past that.",
        ),
    ] = "auto",
    prometheus: PrometheusOpt = None,
    start: StartOpt = None,
    end: EndOpt = None,
    node: NodeOpt = None,
    namespace: NamespaceOpt = None,
    pod: PodOpt = None,
    http_config: HttpConfigOpt = None,
    max_answer: MaxAnswerOpt = None,
) -> None:
    """Draw a recording: one panel per field, one line per GPU, alert thresholds dashed, gaps where data is missing.

    Past 8 GPUs each field gets one small panel per GPU instead, past 16 a heatmap with a row per GPU (--layout).
    Stalls are shaded grey and firing alerts orange (outlined on a heatmap). For a headerless (noheader) log,
    --fields names its columns in order. The time axis is the recording's clock (no zone unless --tz names one).
    Needs matplotlib: pip install 'smiquery[plot]'.
    """
    with boundary(settings_of(ctx).debug):
        from smiquery.analysis import save_plot

        df, name = read_source(recording or [], fields, ctx.params)
        target = output or Path("fleet.png")
        if output is None and recording:  # the (first) recording's name with .png, without glob characters
            stem = recording[0].stem.split("*")[0].split("?")[0].split("[")[0].rstrip(".-_") or "recording"
            target = recording[0].with_name(stem + ".png")
        path = save_plot(
            df,
            target,
            fields,
            rules=alert or None,
            gpus=_gpu_list(gpus),
            width=width,
            dpi=dpi,
            name=name,
            layout=layout,
        )
        typer.echo(f"wrote {path}")


def report(
    ctx: typer.Context,
    recording: RecordingArg = None,
    fmt: Annotated[
        ReportFormat,
        typer.Option(
            "--format",
            "-F",
            help="Output format; summary: a line per GPU (utilization, memory, energy, stalls) and one line of "
            "advice, as the Slurm epilog appends to a job's output.",
            case_sensitive=False,
        ),
    ] = "text",
    alert: AlertOpt = None,
    min_stall: Annotated[
        str, typer.Option(metavar="DURATION", help="Shortest stretch under 20% utilization called a stall.")
    ] = "30s",
    stall_utilization: Annotated[
        float, typer.Option(min=0, max=100, help="Utilization (%) under which a GPU stalls.")
    ] = 20.0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="FILE", help="Write the report here, not stdout.")
    ] = None,
    fail_on: Annotated[
        FailOn, typer.Option(help="Exit 6 when a finding of this severity (or worse) is found.")
    ] = "never",
    fields: Annotated[
        str | None,
        typer.Option(
            "--fields",
            "-f",
            metavar="LIST",
            help="Columns of a headerless (noheader) CSV log, in order, e.g. timestamp,index,utilization.gpu "
            "(names as for `stream --fields`). With a header, each must be one of its columns.",
        ),
    ] = None,
    tz: TzOpt = None,
    prometheus: PrometheusOpt = None,
    start: StartOpt = None,
    end: EndOpt = None,
    node: NodeOpt = None,
    namespace: NamespaceOpt = None,
    pod: PodOpt = None,
    slurm_job: Annotated[
        str | None,
        typer.Option(
            metavar="ID",
            help="Only the GPUs this Slurm job held, over the job's own time range (from `export --slurm`'s series; "
            "--start then only bounds the search, default 30 days back).",
        ),
    ] = None,
    http_config: HttpConfigOpt = None,
    max_answer: MaxAnswerOpt = None,
    html: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Also write one self-contained HTML page (findings, tables and the plot inlined; loads nothing "
            "from the network) to share in a ticket or a browser. The plot needs matplotlib.",
        ),
    ] = None,
) -> None:
    """Summarise a recording: stalls, time over thresholds, memory-health counters, statistics, one verdict each.

    Lines that cannot be read (the torn last line of a killed recorder, garbage) are skipped with one warning.
    Times are shown as recorded (nvidia-smi's local time, no zone) unless --tz names the zone. --html FILE writes
    the report and the plot as one page as well.
    """
    with boundary(settings_of(ctx).debug):
        from smiquery.analysis import report as analyze
        from smiquery.analysis import report_json, report_markdown, report_text
        from smiquery.analysis.model import SEVERITY_ORDER
        from smiquery.cli._options import parse_seconds

        stall_seconds = parse_seconds(min_stall, "--min-stall")
        df, name = read_source(recording or [], fields, ctx.params)
        result = analyze(
            df, rules=alert or None, min_stall=stall_seconds, stall_utilization=stall_utilization, name=name
        )
        if fmt == "summary":
            from smiquery.fleet.slurm import job_summary

            text = job_summary(result, df)
        else:
            renderers = {"json": lambda r: report_json(r) + "\n", "markdown": report_markdown, "text": report_text}
            text = renderers[fmt](result)
        if prometheus is not None and fmt != "summary":
            from smiquery.fleet.report import name_gpus

            text = name_gpus(text, fmt, df)
        if html is not None:  # the report's page with the plot inlined; without matplotlib it says how to get one
            from smiquery.analysis import plot_png, report_html

            try:
                png: bytes | None = plot_png(df, rules=alert or None, name=result.source)
                note = None
            except ImportError as exc:
                png, note = None, str(exc)
                say(f"smiquery: warning: the page has no plot: {exc}")
            html.write_text(report_html(result, png, note), encoding="utf-8")
        if output is not None:
            output.write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
        limit = {"warning": 1, "critical": 0}.get(fail_on)
        if limit is not None and any(SEVERITY_ORDER[f.severity] <= limit for f in result.findings):
            raise typer.Exit(ExitCode.ALERT)


#: The fleet options that go with --prometheus alone (by parameter name; --tz goes with either).
_FLEET_ONLY = ("start", "end", "node", "namespace", "pod", "slurm_job", "http_config", "max_answer")


def read_source(recording: list[Path], fields: str | None, params: Mapping[str, Any]) -> tuple[pd.DataFrame, str]:
    """The frame to analyse and its name: the recording, or the range from Prometheus.

    ``params``: the command's parameters (``ctx.params``): ``--prometheus``, ``--tz`` and the fleet options.
    Raises UsageError for neither or both of REC and --prometheus, and for fleet options without --prometheus.
    """
    from smiquery.errors import UsageError

    prometheus, tz = params["prometheus"], params["tz"]
    if prometheus is None:
        if not recording:
            raise UsageError("give a recording (REC) or --prometheus URL with --start")
        given = ["--" + name.replace("_", "-") for name in _FLEET_ONLY if params.get(name) is not None]
        if given:
            raise UsageError(f"{given[0]} goes with --prometheus; a recording is read whole")
        from smiquery.analysis import load_recording
        from smiquery.cli._options import parse_fields
        from smiquery.printable import printable
        from smiquery.recordings import SkippedLines

        check_zone(tz)
        names = ",".join(f.name for f in parse_fields(fields)) if fields is not None else None
        df = load_recording(recording, fields=names, tz=tz)
        for note in df.attrs.get("skipped_files") or ():  # a rotated set's member without rows, or gone
            say(f"smiquery: warning: {printable(note)}")
        # how the report and the plot name it: run.csv, run*.csv, a.csv (+2 more)
        name = recording[0].name + (f" (+{len(recording) - 1} more)" if len(recording) > 1 else "")
        skipped = df.attrs.get("skipped")  # lines that could not be read: one warning
        if isinstance(skipped, SkippedLines):
            say(f"smiquery: warning: {skipped.message(str(recording[0]) if len(recording) == 1 else name)}")
        return df, name
    if recording:
        raise UsageError("give a recording (REC) or --prometheus, not both")
    from smiquery.fleet.report import load_range, range_name

    # the analysis (and pandas) is imported after the queries are sent: the import overlaps the server's answers
    max_answer = params["max_answer"]
    df = load_range(
        prometheus,
        params["start"],
        params["end"],
        node=params["node"],
        namespace=params["namespace"],
        pod=params["pod"],
        slurm_job=params.get("slurm_job"),
        http_config=params["http_config"],
        max_answer_bytes=None if max_answer is None else max_answer * 2**20,
    )
    from smiquery.analysis import load_recording

    return load_recording(df, tz=tz), range_name(prometheus, df)


def register(app: typer.Typer) -> None:
    """Add the ``plot`` and ``report`` commands to a typer app (the ``smiquery`` app, or any)."""
    app.command("plot", epilog=_PLOT_EPILOG)(plot)
    app.command("report", epilog=_REPORT_EPILOG)(report)
