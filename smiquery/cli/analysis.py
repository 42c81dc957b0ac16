"""The ``plot`` and ``report`` commands: looking at a recorded run afterwards.

:func:`register` adds them to the ``smiquery`` typer app. Both read CSV, JSONL and Parquet recordings made by
``smiquery stream --output``. Errors become one line on stderr and the documented exit codes (2 for a bad
option, field or alert; 1 for an unreadable recording or a missing extra).
"""

from __future__ import annotations

import contextlib
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["FailOn", "ReportFormat", "register"]


class ReportFormat(str, Enum):
    """Output formats of ``smiquery report``."""

    text = "text"
    json = "json"
    markdown = "markdown"


class FailOn(str, Enum):
    """Which findings make ``smiquery report`` exit with code 6."""

    never = "never"
    warning = "warning"
    critical = "critical"


_PLOT_EPILOG = """\b
Examples:
  smiquery plot run.csv
  smiquery plot run.parquet -o trace.png --fields utilization.gpu,temperature.gpu
  smiquery plot run.jsonl -o trace.svg --alert 'temperature.gpu > 83 for 10' --gpus 0,5
"""

_REPORT_EPILOG = """\b
Exit codes: 0 ok, 1 unreadable recording, 2 bad option or alert,
6 a finding at --fail-on severity or worse.

\b
Examples:
  smiquery report run.csv
  smiquery report run.parquet --format markdown > report.md
  smiquery report run.jsonl --format json --min-stall 2m --fail-on critical
"""

RecordingArg = Annotated[
    Path,
    typer.Argument(
        metavar="REC",
        help="A recording from `smiquery stream --output`: .csv, .jsonl or .parquet.",
        dir_okay=False,
    ),
]
AlertOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--alert",
        "-a",
        metavar="EXPR",
        help="Rule whose threshold to use (repeatable; default: the built-in health rules), "
        "e.g. 'temperature.gpu > 85 for 3' (3 samples) or '... for 30s' (30 seconds).",
    ),
]


def _debug(ctx: typer.Context) -> bool:
    return bool(getattr(ctx.find_root().obj, "debug", False))


def _boundary(ctx: typer.Context) -> contextlib.AbstractContextManager[None]:
    from smiquery.cli._boundary import boundary

    return boundary(_debug(ctx))


def _gpu_list(spec: str | None, recording: Path) -> list[int] | None:
    """GPU indices for ``--gpus``: what ``stream`` accepts (indices, UUIDs, bus ids), looked up in the recording."""
    from smiquery.cli._common import parse_gpus

    ids = parse_gpus(spec)
    if ids is None:
        return None
    if all(i.isdigit() for i in ids):
        return [int(i) for i in ids]
    from smiquery.report import load_recording

    df = load_recording(recording)
    found: dict[str, int] = {}
    for col in ("uuid", "pci.bus_id"):
        if col in df.columns:
            for key, idx in zip(df[col].astype(str).str.lower(), df["index"], strict=False):
                found.setdefault(key, int(idx))
    out: list[int] = []
    for i in ids:
        if i.isdigit():
            out.append(int(i))
        elif i.lower() in found:
            out.append(found[i.lower()])
        else:
            raise typer.BadParameter(f"--gpus: the recording has no GPU {i}")
    return out


def plot(
    ctx: typer.Context,
    recording: RecordingArg,
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
            help="Fields to draw, one panel each (default: utilization.gpu, temperature.gpu, memory.used, power.draw).",
        ),
    ] = None,
    alert: AlertOpt = None,
    gpus: Annotated[
        str | None,
        typer.Option("--gpus", "--id", "-i", metavar="0,5|UUID", help="Only these GPUs: indices, UUIDs, bus ids."),
    ] = None,
    width: Annotated[float, typer.Option("--width", min=4.0, help="Width in inches.")] = 12.0,
    dpi: Annotated[int, typer.Option("--dpi", min=50, max=600, help="Resolution.")] = 100,
) -> None:
    """Draw a recording: one panel per field, one line per GPU, alert thresholds dashed, gaps where data is missing.

    Needs matplotlib: pip install 'smiquery[plot]'.
    """
    with _boundary(ctx):
        from smiquery.plot import save_plot

        target = output if output is not None else recording.with_suffix(".png")
        path = save_plot(
            recording,
            target,
            fields,
            rules=alert or None,
            gpus=_gpu_list(gpus, recording),
            width=width,
            dpi=dpi,
        )
        typer.echo(f"wrote {path}")


def report(
    ctx: typer.Context,
    recording: RecordingArg,
    fmt: Annotated[
        ReportFormat, typer.Option("--format", "-F", help="Output format.", case_sensitive=False)
    ] = ReportFormat.text,
    alert: AlertOpt = None,
    min_stall: Annotated[
        str,
        typer.Option("--min-stall", metavar="DURATION", help="Shortest stretch under 20% utilization called a stall."),
    ] = "30s",
    stall_utilization: Annotated[
        float, typer.Option("--stall-utilization", min=0, max=100, help="Utilization (%) under which a GPU stalls.")
    ] = 20.0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="FILE", help="Write the report here, not stdout.")
    ] = None,
    fail_on: Annotated[
        FailOn, typer.Option("--fail-on", help="Exit 6 when a finding of this severity (or worse) is found.")
    ] = FailOn.never,
) -> None:
    """Summarise a recording: per-GPU mean/p95/max, time over thresholds, stalls, and a verdict per finding."""
    with _boundary(ctx):
        from smiquery.alerts import parse_duration
        from smiquery.report import analyze

        try:
            stall_seconds = parse_duration(min_stall, what="--min-stall")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        result = analyze(recording, rules=alert or None, min_stall=stall_seconds, stall_utilization=stall_utilization)
        if fmt is ReportFormat.json:
            text = result.to_json() + "\n"
        elif fmt is ReportFormat.markdown:
            text = result.to_markdown()
        else:
            text = result.to_text()
        if output is not None:
            output.write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
        worst = {"critical": 0, "warning": 1, "info": 2}
        limit = {FailOn.warning: 1, FailOn.critical: 0}.get(fail_on)
        if limit is not None and any(worst[f.severity] <= limit for f in result.findings):
            from smiquery.cli._boundary import ExitCode

            raise typer.Exit(ExitCode.ALERT)


def register(app: typer.Typer) -> None:
    """Add the ``plot`` and ``report`` commands to a typer app.

    Args:
        app: the ``smiquery`` app (or any typer app).
    """
    app.command("plot", epilog=_PLOT_EPILOG)(plot)
    app.command("report", epilog=_REPORT_EPILOG)(report)
