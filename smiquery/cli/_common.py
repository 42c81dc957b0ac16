"""The typer app, the global options, and the option types and parsers every command shares."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import IO, Annotated

import typer

from smiquery import __version__
from smiquery.cli._boundary import ExitCode, UsageError
from smiquery.errors import InvalidFieldError, InvalidGpuIdError
from smiquery.fields import PRESETS, Field, resolve_fields

__all__ = [
    "FieldsOpt",
    "Format",
    "FormatOpt",
    "GpusOpt",
    "Settings",
    "StreamFormat",
    "app",
    "choose_format",
    "parse_fields",
    "parse_gpus",
    "parse_seconds",
    "settings_of",
]

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
  smiquery export --interval 5             Prometheus metrics on 127.0.0.1:9835
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


class Format(str, Enum):
    """Output formats of one-shot commands (query, ps, fields)."""

    table = "table"
    csv = "csv"
    jsonl = "jsonl"
    json = "json"


class StreamFormat(str, Enum):
    """Output formats of ``stream`` (a stream has no end, so no JSON array)."""

    table = "table"
    csv = "csv"
    jsonl = "jsonl"


@dataclass(frozen=True)
class Settings:
    """The global options, kept on ``ctx.obj``.

    Attributes:
        nvidia_smi: the binary to run (None: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        timeout: seconds before an nvidia-smi call counts as hung.
        debug: print tracebacks.
    """

    nvidia_smi: str | None = None
    timeout: float = 10.0
    debug: bool = False


def settings_of(ctx: typer.Context) -> Settings:
    """The global options of this invocation.

    Args:
        ctx: any command's context.

    Returns:
        The settings (defaults when the root callback did not run).
    """
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Settings) else Settings()


# ------------------------------------------------------------------------------------------------ parsers


def parse_seconds(text: str, what: str) -> float:
    """Seconds from ``1``, ``0.5``, ``250ms``, ``2s``, ``10m``, ``1h`` (what every duration option accepts).

    Args:
        text: the option value.
        what: the option name, for the message.

    Returns:
        The seconds (positive).

    Raises:
        UsageError: not a positive duration.
    """
    from smiquery.alerts import parse_duration

    try:
        return parse_duration(text, what=what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def seconds_option(what: str) -> typer.models.OptionInfo:
    """A typer option parser for durations (shared by ``export`` and friends), as an ``Option(parser=...)``.

    Args:
        what: the option name, for messages.

    Returns:
        The option info to put in ``Annotated``.
    """

    def parse(text: str | float) -> float:
        if isinstance(text, (int, float)):
            return float(text)
        try:
            return parse_seconds(text, what)
        except UsageError as exc:
            raise typer.BadParameter(str(exc)) from None

    option: typer.models.OptionInfo = typer.Option(parser=parse, metavar="DURATION")
    return option


def parse_fields(spec: str | None, extra: Sequence[Field] = ()) -> tuple[Field, ...]:
    """The fields of ``--fields`` (a preset or a comma list), plus ``extra`` ones not already named.

    Args:
        spec: the option value (None: the default preset).
        extra: fields needed besides (alert rules).

    Returns:
        The fields, in order.

    Raises:
        UsageError: an unknown field or preset.
    """
    try:
        flds = resolve_fields(spec or "default")
    except InvalidFieldError as exc:
        raise UsageError(f"--fields: {exc}; presets: {', '.join(PRESETS)}") from None
    names = {f.name for f in flds}
    return (*flds, *(f for f in extra if f.name not in names))


def parse_gpus(spec: str | None, what: str = "--gpus") -> tuple[str, ...] | None:
    """GPU ids of ``--gpus``: indices, UUIDs or PCI bus ids, comma separated (what every GPU option accepts).

    Args:
        spec: the option value (None: all GPUs).
        what: the option name, for the message.

    Returns:
        The ids as strings, or None for all.

    Raises:
        UsageError: an id that is none of the three forms.
    """
    from smiquery.oneshot import normalize_gpus

    if spec is None:
        return None
    try:
        return normalize_gpus(spec)
    except InvalidGpuIdError as exc:
        raise UsageError(f"{what}: {exc}") from None


def choose_format(fmt: Enum | None, out: IO[str]) -> str:
    """The output format: the one asked for, else a table on a terminal and CSV otherwise.

    Args:
        fmt: the ``--format`` value.
        out: the output stream.

    Returns:
        ``"table"``, ``"csv"``, ``"jsonl"`` or ``"json"``.
    """
    if fmt is not None:
        return str(fmt.value)
    isatty = getattr(out, "isatty", None)
    return "table" if isatty is not None and isatty() else "csv"


# -------------------------------------------------------------------------------------------------- options

NvidiaSmiOpt = Annotated[
    str | None,
    typer.Option(
        "--nvidia-smi",
        metavar="PATH",
        help="The nvidia-smi to run (default: $SMIQUERY_NVIDIA_SMI, then PATH, then the usual places).",
        show_default=False,
    ),
]
FieldsOpt = Annotated[
    str | None,
    typer.Option(
        "--fields",
        "-f",
        metavar="PRESET|a,b,c",
        help=f"A preset ({', '.join(PRESETS)}) or a comma list of nvidia-smi field names. [default: default]",
        show_default=False,
    ),
]
GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        "--id",
        "-i",
        metavar="0,1|UUID|BUS_ID",
        help="Only these GPUs: indices, UUIDs or PCI bus ids, comma separated. [default: all]",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    Format | None,
    typer.Option(
        "--format",
        "-F",
        help="Output format. [default: table on a terminal, csv otherwise]",
        show_default=False,
        case_sensitive=False,
    ),
]
StreamFormatOpt = Annotated[
    StreamFormat | None,
    typer.Option(
        "--format",
        "-F",
        help="Output format. [default: table on a terminal, csv otherwise]",
        show_default=False,
        case_sensitive=False,
    ),
]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"smiquery {__version__}")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _root(
    ctx: typer.Context,
    nvidia_smi: NvidiaSmiOpt = None,
    timeout: Annotated[
        float,
        typer.Option("--timeout", metavar="SECONDS", min=0.1, help="Seconds before an nvidia-smi call counts as hung."),
    ] = 10.0,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Typed, trustworthy NVIDIA GPU monitoring through nvidia-smi.

    Runs `nvidia-smi --query-gpu=... --format=csv` once or as one long-lived loop, and parses it into typed
    records: units known, missing values kept missing (never 0).
    """
    ctx.obj = Settings(nvidia_smi=nvidia_smi, timeout=timeout, debug=debug)
    configure_logging(debug)


def configure_logging(debug: bool) -> None:
    """Library log lines go to stderr only with --debug (commands print their own one-line events).

    Args:
        debug: send the library's debug log to stderr.
    """
    import logging

    logger = logging.getLogger("smiquery")
    logger.propagate = False
    logger.handlers.clear()
    if debug:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("smiquery: debug: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    else:
        logger.addHandler(logging.NullHandler())


def _ranges(indices: Sequence[int]) -> str:
    """``0-3,5`` for [0, 1, 2, 3, 5]."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def unknown_gpus(ids: Sequence[str] | None, settings: Settings) -> UsageError | None:
    """A usage error naming the requested GPUs this machine lacks, or None when they all exist.

    Called after nvidia-smi said "No devices were found" for an ``-i`` list: one cheap listing of the GPUs
    (``--query-gpu=index,uuid``) tells a wrong id (a usage error) from a machine without GPUs.

    Args:
        ids: the ids of ``--gpus``.
        settings: the global options.

    Returns:
        The error to raise, or None (the ids exist, or the listing failed too).
    """
    from smiquery.errors import SmiqueryError
    from smiquery.oneshot import query

    if not ids:
        return None
    try:
        gpus = query(["index", "uuid"], nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
    except SmiqueryError:
        return None
    if not gpus:
        return None
    known = {str(g.index) for g in gpus} | {str(g.get("uuid")).lower() for g in gpus}
    if not all(i.isdigit() or i.lower().startswith(("gpu-", "mig-")) for i in ids):
        return None  # PCI bus ids have several spellings: leave those to nvidia-smi's own message
    absent = [i for i in ids if i.lower() not in known]
    if not absent:
        return None
    have = _ranges([g.index for g in gpus if g.index is not None])
    plural = "s" if len(absent) > 1 else ""
    return UsageError(f"no GPU{plural} {', '.join(absent)}; this machine has {have}")
