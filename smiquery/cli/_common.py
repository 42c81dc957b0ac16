"""The typer app, the global options, and the typer option types every command shares."""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any

import typer

from smiquery import __version__
from smiquery.cli._boundary import ExitCode
from smiquery.cli._options import Format, Settings, StreamFormat, parse_seconds
from smiquery.errors import UsageError
from smiquery.fields import PRESETS

__all__ = ["FieldsOpt", "FormatOpt", "GpusOpt", "StreamFormatOpt", "app", "seconds_option", "settings_of"]

EPILOG = """\b
Exit codes:
  0    ok
  1    other error
  2    usage error (bad option, field, GPU id, interval, duration or alert)
  3    nvidia-smi not found
  4    driver problem (not loaded, NVML missing, version mismatch, no GPU,
       GPU lost, insufficient permissions)
  5    nvidia-smi timed out
  6    an alert fired with --exit-on-alert (report: a finding with --fail-on)
  130  Ctrl-C (SIGINT)
  143  SIGTERM

\b
doctor exits 0, 1 (a warning), or the code of its first failure;
doctor --gate fails only on what stops monitoring (3, 4, 5, 1).

\b
Examples:
  smiquery stream                          live table (CSV when piped)
  smiquery stream --fields health -l 250ms --output run.csv
  smiquery stream --alert 'temperature.gpu > 85 for 3' --exit-on-alert
  smiquery query --format json
  smiquery doctor --gate                   health check: exit 0 unless monitoring is impossible
  smiquery export --interval 5             Prometheus metrics on 127.0.0.1:9849
  smiquery plot run.csv -o trace.png
  smiquery report run.csv --format markdown
"""

app = typer.Typer(
    name="smiquery",
    help="Typed, trustworthy NVIDIA GPU monitoring through nvidia-smi.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def settings_of(ctx: typer.Context) -> Settings:
    """The global options of this invocation (defaults when the root callback did not run)."""
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Settings) else Settings()


def seconds_option(what: str, help_text: str, *, off: bool = False) -> typer.models.OptionInfo:
    """A typer option (for ``Annotated``) taking a duration: 5, 0.5, 250ms, 2s, 1m (``off``: 0 and off are 0.0)."""

    def parse(text: str | float) -> float:
        if isinstance(text, (int, float)):
            return float(text)
        if off and text.strip().lower() in ("0", "off"):
            return 0.0
        try:
            return parse_seconds(text, what)
        except UsageError as exc:
            raise typer.BadParameter(str(exc)) from None

    option: typer.models.OptionInfo = typer.Option(
        parser=parse, metavar="DURATION", help=f"{help_text} Takes 5, 0.5, 250ms, 2s, 1m."
    )
    return option


def fields_option(more: str = "") -> Any:
    """``--fields``, its help text followed by ``more``."""
    return typer.Option(
        "--fields",
        "-f",
        metavar="PRESET|a,b,c",
        help=f"A preset ({', '.join(PRESETS)}) or a comma list of nvidia-smi field names. [default: default]{more}",
    )


FieldsOpt = Annotated[str | None, fields_option()]
GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        "--id",
        "-i",
        metavar="0,1|UUID|BUS_ID",
        help="Only these GPUs: indices, UUIDs or PCI bus ids, comma separated. [default: all]",
    ),
]
_FORMAT = typer.Option(
    "--format", "-F", help="Output format. [default: table on a terminal, csv otherwise]", case_sensitive=False
)
FormatOpt = Annotated[Format | None, _FORMAT]
StreamFormatOpt = Annotated[StreamFormat | None, _FORMAT]


def version_callback(value: bool) -> None:
    """``--version``: print the version and exit."""
    if value:
        typer.echo(f"smiquery {__version__}")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _root(
    ctx: typer.Context,
    nvidia_smi: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="The nvidia-smi to run (default: $SMIQUERY_NVIDIA_SMI, then PATH, then the usual places).",
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option(metavar="SECONDS", min=0.1, help="Seconds before an nvidia-smi call counts as hung.")
    ] = 10.0,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Typed, trustworthy NVIDIA GPU monitoring through nvidia-smi.

    Runs `nvidia-smi --query-gpu=... --format=csv` once or as one long-lived loop, and parses it into typed
    records: units known, missing values kept missing (never 0).
    """
    ctx.obj = Settings(nvidia_smi=nvidia_smi, timeout=timeout, debug=debug)
    # library log lines go to stderr only with --debug (commands print their own one-line events)
    handler = logging.StreamHandler(sys.stderr) if debug else logging.NullHandler()
    handler.setFormatter(logging.Formatter("smiquery: debug: %(message)s"))
    logger = logging.getLogger("smiquery")
    logger.propagate = False
    logger.handlers[:] = [handler]
    if debug:
        logger.setLevel(logging.DEBUG)
