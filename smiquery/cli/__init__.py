"""The ``smiquery`` command line: ``stream``, ``query``, ``ps``, ``fields`` and ``doctor``.

Commands stay thin: they validate options, call the library and render. Errors are caught only at the command
boundary and printed as one line on stderr (``smiquery: error: ...``) that says what to do; ``--debug`` adds
the traceback. Exit codes:

====  ===========================================================================================
0     ok
1     any other error
2     usage: a bad option, field, GPU id, interval, duration or alert expression
3     nvidia-smi not found (or not executable)
4     driver problem: not loaded, NVML library missing, driver/library mismatch, no GPU, GPU lost,
      insufficient permissions
5     nvidia-smi timed out (hung)
6     an alert fired and ``--exit-on-alert`` was given
130   interrupted by Ctrl-C (SIGINT); 143 for SIGTERM
====  ===========================================================================================

``doctor`` exits 0 when no check fails, else with the code of the first failing check (3, 4 or 5 as above)
or 1. A closed output pipe (``smiquery stream | head``) ends a stream quietly with 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from smiquery import __version__
from smiquery.cli.analysis import register as _register_analysis
from smiquery.cli_export import register as _register_export
from smiquery.errors import (
    DriverNotLoadedError,
    DriverVersionMismatchError,
    GpuLostError,
    InsufficientPermissionsError,
    InvalidFieldError,
    InvalidGpuIdError,
    NoDevicesFoundError,
    NvidiaSmiFailedError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    NvmlNotFoundError,
    ParseError,
    SmiqueryError,
)
from smiquery.fields import PRESETS, Field, get_field, resolve_fields

if TYPE_CHECKING:
    from smiquery.alerts import AlertEvaluator, AlertEvent
    from smiquery.display import LiveTable, SampleWriter
    from smiquery.playback import Replay
    from smiquery.records import GpuSample
    from smiquery.supervisor import Stream

__all__ = ["EXIT_CODES", "app", "exit_code_for", "main"]

#: The documented exit codes.
EXIT_CODES: dict[str, int] = {
    "ok": 0,
    "error": 1,
    "usage": 2,
    "nvidia_smi_not_found": 3,
    "driver": 4,
    "timeout": 5,
    "alert": 6,
    "interrupted": 130,
    "terminated": 143,
}

_DRIVER_ERRORS: tuple[type[Exception], ...] = (
    DriverNotLoadedError,
    NvmlNotFoundError,
    DriverVersionMismatchError,
    NoDevicesFoundError,
    GpuLostError,
    InsufficientPermissionsError,
)

_EPILOG = """\b
Exit codes:
  0    ok
  1    other error
  2    usage error (bad option, field, GPU id, interval, duration or alert)
  3    nvidia-smi not found
  4    driver problem (not loaded, NVML missing, version mismatch, no GPU,
       GPU lost, insufficient permissions)
  5    nvidia-smi timed out
  6    an alert fired with --exit-on-alert (report: a finding with --fail-on)
  130  Ctrl-C (143: SIGTERM)

\b
Examples:
  smiquery stream                          live table (CSV when piped)
  smiquery stream --fields health -l 250ms --output run.csv
  smiquery stream --alert 'temperature.gpu > 85 for 3' --exit-on-alert
  smiquery query --format json
  smiquery doctor
  smiquery export --interval 5             Prometheus metrics on 127.0.0.1:9835
  smiquery plot run.csv -o trace.png
  smiquery report run.csv --format markdown
"""

app = typer.Typer(
    name="smiquery",
    help="Typed, trustworthy NVIDIA GPU monitoring through nvidia-smi.",
    epilog=_EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Format(str, Enum):
    """Output formats."""

    table = "table"
    csv = "csv"
    jsonl = "jsonl"
    json = "json"


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


class _UsageError(Exception):
    """A bad option value found by a command (exit 2)."""


# ------------------------------------------------------------------------------------------------- errors


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for an error.

    Args:
        exc: the error that ended a command.

    Returns:
        3 nvidia-smi missing, 4 driver problem, 5 timeout, 2 invalid field/GPU id/alert, 130 Ctrl-C, else 1.
    """
    from smiquery.alerts import InvalidRuleError

    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, NvidiaSmiNotFoundError):
        return 3
    if isinstance(exc, _DRIVER_ERRORS):
        return 4
    if isinstance(exc, NvidiaSmiTimeoutError):
        return 5
    if isinstance(exc, (InvalidFieldError, InvalidGpuIdError, InvalidRuleError, _UsageError)):
        return 2
    return 1


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)


def _fail(exc: BaseException, debug: bool) -> NoReturn:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    code = exit_code_for(exc)
    kind = "usage error" if code == 2 else "error"
    message = _one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, ParseError):
        message += "; nvidia-smi printed output that does not fit the fields: run `smiquery doctor`"
    if not isinstance(exc, SmiqueryError) and not isinstance(exc, _UsageError):
        message = f"unexpected {type(exc).__name__}: {message} (run with --debug for the traceback)"
    _say(f"smiquery: {kind}: {message}")
    raise typer.Exit(code)


@contextlib.contextmanager
def _boundary(settings: Settings) -> Iterator[None]:
    """The one place where errors become one line on stderr and an exit code."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            yield
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BrokenPipeError:
        _quiet_stdout()
        raise typer.Exit(0) from None
    except (SmiqueryError, _UsageError) as exc:
        _fail(exc, settings.debug)
    except Exception as exc:
        _fail(exc, settings.debug)


def _quiet_stdout() -> None:
    # The reader went away (`| head`): point stdout at /dev/null so the flush at exit cannot fail again.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Settings) else Settings()


def _warn_lines(caught: Sequence[warnings.WarningMessage]) -> None:
    for w in caught:
        if not issubclass(w.category, ResourceWarning):
            _say(f"smiquery: warning: {_one_line(str(w.message))}")


# ------------------------------------------------------------------------------------------------ options


def parse_seconds(text: str, what: str) -> float:
    """Seconds from ``1``, ``0.5``, ``250ms``, ``2s``, ``10m``, ``1h`` (a usage error otherwise).

    Raises:
        _UsageError: not a positive duration.
    """
    from smiquery.alerts import parse_duration

    try:
        return parse_duration(text, what=what)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _fields(spec: str | None, extra: Sequence[Field] = ()) -> tuple[Field, ...]:
    try:
        flds = resolve_fields(spec or "default")
    except InvalidFieldError as exc:
        raise _UsageError(f"--fields: {exc}; presets: {', '.join(PRESETS)}") from None
    names = {f.name for f in flds}
    return (*flds, *(f for f in extra if f.name not in names))


def _gpus(spec: str | None) -> tuple[str, ...] | None:
    from smiquery.oneshot import normalize_gpus

    if spec is None:
        return None
    try:
        return normalize_gpus(spec)
    except InvalidGpuIdError as exc:
        raise _UsageError(f"--gpus: {exc}") from None


def _format(fmt: Format | None, allowed: Sequence[Format], out: IO[str]) -> Format:
    if fmt is None:
        isatty = getattr(out, "isatty", None)
        return Format.table if isatty is not None and isatty() else Format.csv
    if fmt not in allowed:
        raise _UsageError(
            f"--format {fmt.value} is not available here; use one of {', '.join(a.value for a in allowed)}"
        )
    return fmt


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"smiquery {__version__}")
        raise typer.Exit(0)


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
    _configure_logging(debug)


def _configure_logging(debug: bool) -> None:
    """Library log lines (restarts and the like) go to stderr only with --debug.

    Without it the live table's footer shows restarts and the last error, and stderr keeps to one line per
    error and per alert.
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


# -------------------------------------------------------------------------------------------------- query


def _print_lines(lines: Sequence[str]) -> None:
    out = sys.stdout
    out.write("".join(line + "\n" for line in lines))
    out.flush()


@app.command(
    epilog="""\b
Examples:
  smiquery query
  smiquery query --fields memory --gpus 0,1 --format json
  smiquery query --fields temperature.gpu,power.draw --format csv
"""
)
def query(
    ctx: typer.Context,
    fields: FieldsOpt = None,
    gpus: GpusOpt = None,
    fmt: FormatOpt = None,
) -> None:
    """Print one snapshot: one row per GPU.

    CSV is nvidia-smi's own format (header with units), so `smiquery.read_csv` reads it back. JSON and JSONL
    use field names as keys, ISO 8601 times, and null for missing values (reasons under "_missing").
    """
    _run_query(_settings(ctx), fields, gpus, fmt)


def _run_query(settings: Settings, fields: str | None, gpus: str | None, fmt: Format | None) -> None:
    with _boundary(settings):
        flds = _fields(fields)
        ids = _gpus(gpus)
        form = _format(fmt, list(Format), sys.stdout)
        from smiquery.oneshot import query as run_query

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = [f.name for f in flds]
            samples = run_query(names, gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        _warn_lines(caught)
        _emit_samples(samples, flds, form)


def _emit_samples(samples: Sequence[GpuSample], flds: Sequence[Field], form: Format) -> None:
    out = sys.stdout
    if form is Format.csv:
        from smiquery.display import CsvWriter

        w = CsvWriter(out, flds, flush=False)
        w.header()
        for s in samples:
            w.write(s)
        w.close()
    elif form is Format.jsonl:
        from smiquery.display import JsonlWriter

        j = JsonlWriter(out, flush=False)
        for s in samples:
            j.write(s)
        j.close()
    elif form is Format.json:
        from smiquery.display import sample_to_json

        out.write(json.dumps([sample_to_json(s) for s in samples], indent=2) + "\n")
        out.flush()
    else:
        from smiquery.display import sample_table, use_color

        _print_lines(sample_table(samples, flds, color=use_color(out)))


# ----------------------------------------------------------------------------------------------------- ps


@app.command(
    epilog="""\b
Examples:
  smiquery ps
  smiquery ps --gpus 0 --format json
"""
)
def ps(ctx: typer.Context, gpus: GpusOpt = None, fmt: FormatOpt = None) -> None:
    """List compute processes per GPU with their memory.

    One row per process holding GPU memory, sorted by GPU index, then pid.
    """
    settings = _settings(ctx)
    with _boundary(settings):
        ids = _gpus(gpus)
        form = _format(fmt, list(Format), sys.stdout)
        from smiquery.oneshot import processes

        procs = processes(gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        keys = ("gpu_index", "gpu_uuid", "pid", "process_name", "used_memory")
        records = [{k: getattr(p, k) for k in keys} for p in procs]
        for rec, p in zip(records, procs, strict=True):
            if p.missing:
                rec["_missing"] = dict(p.missing)
        out = sys.stdout
        if form is Format.json:
            out.write(json.dumps(records, indent=2) + "\n")
        elif form is Format.jsonl:
            out.write("".join(json.dumps(r) + "\n" for r in records))
        elif form is Format.csv:
            lines = ["gpu_index, gpu_uuid, pid, process_name, used_memory [MiB]"]
            for p in procs:
                mem = f"{p.used_memory} MiB" if p.used_memory is not None else "[N/A]"
                idx = str(p.gpu_index) if p.gpu_index is not None else "[N/A]"
                lines.append(f"{idx}, {p.gpu_uuid}, {p.pid}, {p.process_name}, {mem}")
            out.write("".join(line + "\n" for line in lines))
        else:
            from smiquery.display import render_table, use_color

            if not procs:
                out.write("no compute processes\n")
            else:
                rows = [
                    [
                        "n/a" if p.gpu_index is None else str(p.gpu_index),
                        p.gpu_uuid,
                        str(p.pid),
                        "n/a" if p.used_memory is None else str(p.used_memory),
                        p.process_name,
                    ]
                    for p in procs
                ]
                titles = ["gpu", "gpu_uuid", "pid", "used_memory [MiB]", "process_name"]
                lines = render_table(rows, titles, right=[True, False, True, True, False], color=use_color(out))
                out.write("".join(line + "\n" for line in lines))
        out.flush()


# ------------------------------------------------------------------------------------------------- fields


@app.command(
    name="fields",
    epilog="""\b
Examples:
  smiquery fields --preset health
  smiquery fields --search power
  smiquery fields --supported          asks this machine's driver
""",
)
def fields_cmd(
    ctx: typer.Context,
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", metavar="NAME", help=f"Only this preset ({', '.join(PRESETS)}).")
    ] = None,
    supported: Annotated[
        bool,
        typer.Option("--supported", help="Ask this machine's nvidia-smi (--help-query-gpu) and mark what it lacks."),
    ] = False,
    search: Annotated[
        str | None, typer.Option("--search", "-s", metavar="WORD", help="Only fields whose name or help has WORD.")
    ] = None,
    fmt: FormatOpt = None,
) -> None:
    """List the fields: names, units, kinds and help.

    `--supported` asks this machine's nvidia-smi (`--help-query-gpu`) and marks the fields its driver lacks.
    """
    settings = _settings(ctx)
    with _boundary(settings):
        from smiquery.fields import CATALOGUE

        form = _format(fmt, list(Format), sys.stdout)
        if preset is not None:
            if preset not in PRESETS:
                raise _UsageError(f"--preset: unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
            chosen: list[Field] = list(resolve_fields(preset))
        else:
            chosen = list(CATALOGUE)
        driver: dict[str, str] | None = None
        if supported:
            driver = _driver_fields(settings)
        records: list[dict[str, Any]] = []
        for f in chosen:
            rec: dict[str, Any] = {
                "name": f.name,
                "kind": f.kind.value,
                "unit": f.unit,
                "aliases": list(f.aliases),
                "help": f.help,
            }
            if driver is not None:
                rec["supported"] = any(n in driver for n in (f.name, *f.aliases))
            records.append(rec)
        if driver is not None and preset is None:
            known = {n for f in CATALOGUE for n in (f.name, *f.aliases)}
            for name, desc in driver.items():
                if name not in known and name not in {r["name"] for r in records}:
                    records.append(
                        {"name": name, "kind": "string", "unit": "", "aliases": [], "help": desc, "supported": True}
                    )
        if search:
            word = search.lower()
            records = [r for r in records if word in r["name"].lower() or word in r["help"].lower()]
        out = sys.stdout
        if form is Format.json:
            out.write(json.dumps(records, indent=2) + "\n")
        elif form is Format.jsonl:
            out.write("".join(json.dumps(r) + "\n" for r in records))
        elif form is Format.csv:
            cols = ["name", "kind", "unit", "aliases", *(["supported"] if driver is not None else []), "help"]
            lines = [", ".join(cols)]
            for r in records:
                cells = {**r, "aliases": " ".join(r["aliases"]), "supported": "yes" if r.get("supported") else "no"}
                lines.append(", ".join(str(cells[c]).replace(",", ";") for c in cols))
            out.write("".join(line + "\n" for line in lines))
        else:
            from smiquery.display import render_table, use_color

            color = use_color(out)
            titles = ["name", "kind", "unit", *(["supported"] if driver is not None else []), "help"]
            rows = []
            styles: list[list[str | None]] = []
            for r in records:
                row = [r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else ""), r["kind"], r["unit"]]
                style: list[str | None] = [None, None, None]
                if driver is not None:
                    row.append("yes" if r["supported"] else "NO")
                    style.append(None if r["supported"] else "firing")
                row.append(r["help"])
                style.append(None)
                rows.append(row)
                styles.append(style)
            lines = render_table(rows, titles, styles=styles, color=color)
            if driver is not None:
                lacking = sum(1 for r in records if not r.get("supported"))
                lines.append("")
                lines.append(f"{lacking} of {len(records)} listed fields are not supported by this driver")
            out.write("".join(line + "\n" for line in lines))
        out.flush()


def _driver_fields(settings: Settings) -> dict[str, str]:
    """Names (and aliases) this machine's nvidia-smi lists in ``--help-query-gpu``, with their descriptions."""
    from smiquery.errors import failure_from_exit
    from smiquery.fields import parse_help_query_gpu
    from smiquery.runner import SubprocessRunner, find_nvidia_smi

    binary = find_nvidia_smi(settings.nvidia_smi)
    argv = [binary, "--help-query-gpu"]
    done = SubprocessRunner().run(argv, settings.timeout)
    if done.returncode != 0:
        raise failure_from_exit(argv, done.returncode, done.output)
    names: dict[str, str] = {}
    for entry in parse_help_query_gpu(done.stdout):
        for n in (entry.name, *entry.aliases):
            names.setdefault(n, entry.description)
    if not names:
        raise NvidiaSmiFailedError(argv, 0, done.output, "nvidia-smi --help-query-gpu listed no fields")
    return names


# ------------------------------------------------------------------------------------------------- doctor


@dataclass
class Check:
    """One doctor check.

    Attributes:
        name: what was checked.
        verdict: ``"ok"``, ``"FAIL"`` or ``"skip"`` (not applicable, or impossible after an earlier failure).
        detail: what was found.
        fix: what to do, for a failure.
        code: the exit code this failure stands for.
    """

    name: str
    verdict: str
    detail: str
    fix: str = ""
    code: int = 1

    @property
    def failed(self) -> bool:
        """True for a failed check."""
        return self.verdict == "FAIL"


def _in_container() -> str | None:
    """Why this looks like a container, or None."""
    if os.path.exists("/.dockerenv"):
        return "/.dockerenv exists"
    if os.path.exists("/run/.containerenv"):
        return "/run/.containerenv exists"
    try:
        text = Path("/proc/1/cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for word in ("docker", "kubepods", "containerd", "libpod"):
        if word in text:
            return f"/proc/1/cgroup mentions {word}"
    return None


def _parse_version(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        value = value.strip()
        if key.startswith("nvidia-smi version"):
            out["nvidia-smi"] = value
        elif key.startswith(("driver version", "kmd version")) and "deprecated" not in value.lower():
            out.setdefault("driver", value)
        elif key.startswith("nvml version"):
            out["nvml"] = value
        elif key.startswith(("cuda version", "cuda umd version")) and "deprecated" not in value.lower():
            out.setdefault("cuda", value)
    return out


def _error_check(name: str, exc: BaseException) -> Check:
    hint = getattr(exc, "hint", "") or "run with --debug for details"
    if isinstance(exc, ParseError):
        hint = "nvidia-smi printed output that does not fit the fields; look at plain `nvidia-smi` output"
    elif "smiquery doctor" in hint:
        hint = "run plain `nvidia-smi` to see the whole message, and check `dmesg` for Xid errors"
    first = _one_line(str(exc))
    output = getattr(exc, "output", None)
    if isinstance(output, str) and output.strip():
        # nvidia-smi may print rows before failing: its message is the first line that is no CSV row
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        first = next((ln for ln in lines if ", " not in ln or ln.endswith(".")), lines[0])
    if isinstance(exc, NvidiaSmiTimeoutError):
        return Check(name, "FAIL", _one_line(str(exc)), "check `dmesg` for Xid errors; try `nvidia-smi` by hand", 5)
    return Check(name, "FAIL", first, hint, exit_code_for(exc) if exit_code_for(exc) in (3, 4, 5) else 1)


def doctor_checks(settings: Settings) -> list[Check]:
    """Run every doctor check against the nvidia-smi that ``settings`` selects.

    Returns:
        The checks, in order; none raises.
    """
    from smiquery.errors import failure_from_exit
    from smiquery.oneshot import query as run_query
    from smiquery.runner import SubprocessRunner, find_nvidia_smi

    checks: list[Check] = []
    runner = SubprocessRunner()
    timeout = settings.timeout
    binary: str | None = None
    broken: str | None = None  # why later nvidia-smi checks are skipped

    # 1. the binary, and its version
    try:
        binary = find_nvidia_smi(settings.nvidia_smi)
    except NvidiaSmiNotFoundError as exc:
        checks.append(
            Check(
                "nvidia-smi found",
                "FAIL",
                _one_line(str(exc).split(";")[0]),
                "install the NVIDIA driver, pass --nvidia-smi PATH or set SMIQUERY_NVIDIA_SMI; in a container start "
                "it with --gpus all (NVIDIA_DRIVER_CAPABILITIES must include utility)",
                3,
            )
        )
        broken = "nvidia-smi not found"
    version: dict[str, str] = {}
    version_error: BaseException | None = None
    if binary is not None:
        argv = [binary, "--version"]
        try:
            done = runner.run(argv, timeout)
            if done.returncode == 0:
                version = _parse_version(done.stdout)
            else:
                version_error = failure_from_exit(argv, done.returncode, done.output)
        except SmiqueryError as exc:
            version_error = exc
        labels = {"nvidia-smi": "nvidia-smi", "driver": "driver", "cuda": "CUDA"}
        parts = [f"{labels[k]} {v}" for k, v in version.items() if k in labels]
        detail = binary + (f" ({', '.join(parts)})" if parts else " (version unknown: `nvidia-smi --version` failed)")
        checks.append(Check("nvidia-smi found", "ok", detail))
        if isinstance(version_error, (NvidiaSmiTimeoutError, NvidiaSmiNotFoundError)):
            checks.append(_error_check("driver reachable", version_error))
            broken = "nvidia-smi did not answer" if isinstance(version_error, NvidiaSmiTimeoutError) else "no binary"

    # 2-6. driver, library match, GPUs, persistence, MIG: one query
    samples: list[GpuSample] | None = None
    failure: BaseException | None = version_error
    caught: list[warnings.WarningMessage] = []
    if broken is None and binary is not None:
        names = ["index", "name", "driver_version", "persistence_mode", "mig.mode.current"]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    samples = run_query(names, nvidia_smi=binary, timeout=timeout)
                except NvidiaSmiFailedError as exc:
                    if type(exc).__name__ != "InvalidArgumentError":
                        raise
                    samples = run_query(names[:3], nvidia_smi=binary, timeout=timeout)
        except DriverVersionMismatchError as exc:
            failure = exc
            checks.append(Check("driver reachable", "ok", "the kernel module is loaded"))
            checks.append(_error_check("driver/library match", exc))
            broken = "driver/library mismatch"
        except NoDevicesFoundError as exc:
            failure = exc
            checks.append(Check("driver reachable", "ok", "the driver answers"))
            checks.append(Check("driver/library match", "ok", version.get("driver", "driver answers")))
            checks.append(_error_check("GPU count", exc))
            broken = "no GPU"
        except SmiqueryError as exc:
            failure = exc
            checks.append(_error_check("driver reachable", exc))
            broken = "the driver is not reachable"
    if samples is not None:
        drivers = sorted({str(s.get("driver_version")) for s in samples if s.get("driver_version") is not None})
        checks.append(Check("driver reachable", "ok", f"driver {', '.join(drivers) or version.get('driver', '?')}"))
        nvml = version.get("nvml", "")
        drv = version.get("driver") or (drivers[0] if drivers else "")
        if nvml and drv and not drv.startswith(nvml.split(".")[0]):
            checks.append(
                Check(
                    "driver/library match",
                    "FAIL",
                    f"NVML {nvml} but driver {drv}",
                    "reboot (or reload the nvidia modules) so the driver matches the library",
                    4,
                )
            )
        else:
            checks.append(Check("driver/library match", "ok", f"NVML {nvml or '?'} matches driver {drv or '?'}"))
        lost = [s.index for s in samples if s.gpu_lost]
        gpu_names = sorted({str(s.get("name")) for s in samples if s.get("name")})
        if not samples:
            checks.append(Check("GPU count", "FAIL", "0 GPUs", "check `nvidia-smi -L` and NVIDIA_VISIBLE_DEVICES", 4))
        elif lost:
            checks.append(
                Check(
                    "GPU count",
                    "FAIL",
                    f"{len(samples)} GPUs; GPU {', '.join(map(str, lost))} is lost (fell off the bus)",
                    "check `dmesg` for Xid 79; the GPU needs a reset or the machine a reboot",
                    4,
                )
            )
        else:
            checks.append(
                Check(
                    "GPU count", "ok", f"{len(samples)} GPU{'s' if len(samples) != 1 else ''}: {', '.join(gpu_names)}"
                )
            )
        rom = [str(w.message) for w in caught if "infoROM" in str(w.message) or "exited 14" in str(w.message)]
        if rom:
            checks.append(
                Check(
                    "infoROM",
                    "FAIL",
                    _one_line(rom[0]),
                    "the GPU's infoROM is corrupted; values still read, but report it to the vendor (RMA)",
                )
            )
        pm = [(s.index, s.get("persistence_mode")) for s in samples]
        off = [str(i) for i, v in pm if v is False]
        if all(v is None for _, v in pm):
            checks.append(Check("persistence mode", "skip", "not reported by this driver (n/a)"))
        elif off:
            checks.append(
                Check(
                    "persistence mode",
                    "FAIL",
                    f"disabled on GPU {', '.join(off)}: every nvidia-smi call re-initialises the driver (slow)",
                    "run `sudo nvidia-smi -pm 1` or enable the nvidia-persistenced service",
                )
            )
        else:
            checks.append(Check("persistence mode", "ok", "enabled"))
        mig = [(s.index, s.get("mig.mode.current")) for s in samples]
        on = [str(i) for i, v in mig if v is True]
        if all(v is None for _, v in mig):
            checks.append(Check("MIG mode", "ok", "not supported or not reported (n/a)"))
        elif on:
            checks.append(
                Check(
                    "MIG mode", "ok", f"enabled on GPU {', '.join(on)}: GPU utilization is n/a there; use MIG devices"
                )
            )
        else:
            checks.append(Check("MIG mode", "ok", "disabled"))
    else:
        present = {c.name for c in checks}
        for name in ("driver reachable", "driver/library match", "GPU count", "persistence mode", "MIG mode"):
            if name not in present:
                checks.append(Check(name, "skip", broken or "nvidia-smi is not working"))

    # 7. containers
    checks.extend(_container_checks(found=binary is not None, failure=None if samples is not None else failure))

    # 8. the default preset's fields
    if samples is not None and binary is not None:
        try:
            have = _driver_fields(Settings(binary, timeout, settings.debug))
            lacking = [n for n in PRESETS["default"] if n not in have]
            if lacking:
                checks.append(
                    Check(
                        "default fields supported",
                        "FAIL",
                        f"this driver lacks {', '.join(lacking)}",
                        "pass --fields without them (see `smiquery fields --supported`) or upgrade the driver",
                    )
                )
            else:
                checks.append(Check("default fields supported", "ok", f"all {len(PRESETS['default'])} supported"))
        except SmiqueryError as exc:
            checks.append(_error_check("default fields supported", exc))
    else:
        checks.append(Check("default fields supported", "skip", broken or "nvidia-smi is not working"))
    order = {name: i for i, name in enumerate(_CHECK_ORDER)}
    checks.sort(key=lambda c: order.get(c.name, len(order)))
    return checks


_CHECK_ORDER = (
    "nvidia-smi found",
    "driver reachable",
    "driver/library match",
    "GPU count",
    "infoROM",
    "persistence mode",
    "MIG mode",
    "container",
    "NVIDIA_DRIVER_CAPABILITIES",
    "NVIDIA_VISIBLE_DEVICES",
    "default fields supported",
)


def _container_checks(*, found: bool, failure: BaseException | None) -> list[Check]:
    """The container set-up; a variable only fails when it explains what went wrong."""
    why = _in_container()
    if why is None:
        return [Check("container", "ok", "not in a container")]
    out = [Check("container", "ok", f"in a container ({why})")]
    working = found and failure is None
    # nvidia-smi and libnvidia-ml come from the host only with the `utility` capability (NVIDIA-SMI.md section 7)
    no_utility = not found or isinstance(failure, NvmlNotFoundError)
    caps = os.environ.get("NVIDIA_DRIVER_CAPABILITIES")
    fix_caps = "start the container with --gpus all, or set NVIDIA_DRIVER_CAPABILITIES=compute,utility"
    if caps is None:
        if no_utility:
            out.append(Check("NVIDIA_DRIVER_CAPABILITIES", "FAIL", "unset: nvidia-smi is not mounted", fix_caps, 4))
        else:
            out.append(Check("NVIDIA_DRIVER_CAPABILITIES", "ok", "unset (nvidia-smi is mounted anyway)"))
    else:
        words = {w.strip().lower() for w in caps.split(",")}
        if words & {"utility", "all"}:
            out.append(Check("NVIDIA_DRIVER_CAPABILITIES", "ok", f"{caps} (includes utility)"))
        elif working:
            out.append(Check("NVIDIA_DRIVER_CAPABILITIES", "ok", f"{caps} (lacks utility, but nvidia-smi works)"))
        else:
            out.append(Check("NVIDIA_DRIVER_CAPABILITIES", "FAIL", f"{caps!r} lacks utility", fix_caps, 4))
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    fix_vis = "set NVIDIA_VISIBLE_DEVICES=all (or GPU indices/UUIDs), or start with --gpus all"
    no_gpu = no_utility or isinstance(failure, (NoDevicesFoundError, DriverNotLoadedError))
    value = (visible or "").strip().lower()
    if value in ("", "void", "none"):
        shown = "unset" if visible is None else repr(visible)
        if no_gpu:
            out.append(Check("NVIDIA_VISIBLE_DEVICES", "FAIL", f"{shown}: no GPU is passed in", fix_vis, 4))
        else:
            out.append(Check("NVIDIA_VISIBLE_DEVICES", "ok", f"{shown} (GPUs are reachable anyway)"))
    else:
        out.append(Check("NVIDIA_VISIBLE_DEVICES", "ok", visible or ""))
    return out


@app.command(
    epilog="""\b
Exit status: 0 when no check fails; else the code of the first failure
(3 nvidia-smi missing, 4 driver problem, 5 timeout) or 1.

\b
Examples:
  smiquery doctor
  smiquery --timeout 3 doctor --json
"""
)
def doctor(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object for machines.")] = False,
) -> None:
    """Diagnose nvidia-smi, the driver and the GPUs, with a fix for each failure.

    Checks: nvidia-smi found (where, which version), driver reachable, driver/library match, GPU count,
    persistence mode, MIG mode, container set-up (NVIDIA_DRIVER_CAPABILITIES, NVIDIA_VISIBLE_DEVICES), and
    whether the driver supports the default fields.
    """
    settings = _settings(ctx)
    with _boundary(settings):
        checks = doctor_checks(settings)
        failed = [c for c in checks if c.failed]
        code = 0 if not failed else failed[0].code
        out = sys.stdout
        if as_json:
            doc = {
                "ok": not failed,
                "exit_code": code,
                "checks": [
                    {"name": c.name, "verdict": c.verdict.lower(), "detail": c.detail, "fix": c.fix or None}
                    for c in checks
                ],
            }
            out.write(json.dumps(doc, indent=2) + "\n")
        else:
            from smiquery.display import use_color

            color = use_color(out)
            marks = {"ok": ("ok", "\x1b[32m"), "FAIL": ("FAIL", "\x1b[1;31m"), "skip": ("skip", "\x1b[2m")}
            lines = []
            for c in checks:
                word, style = marks.get(c.verdict, (c.verdict, ""))
                mark = f"{style}{word:<4}\x1b[0m" if color else f"{word:<4}"
                fix = f" -> fix: {c.fix}" if c.failed and c.fix else ""
                lines.append(f"{mark}  {c.name}: {c.detail}{fix}")
            n = len(failed)
            lines.append(f"{n} check{'s' if n != 1 else ''} failed" if n else "all checks passed")
            out.write("".join(line + "\n" for line in lines))
        out.flush()
        if code:
            raise typer.Exit(code)


# ------------------------------------------------------------------------------------------------- stream


class _Failure:
    """A source error, passed from the pump thread to the main thread."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class _Pump:
    """Reads a source (a Stream or a Replay) in a thread and hands the samples over through a queue.

    The main thread keeps control: it can redraw while no sample arrives, honour ``--duration`` and react to
    Ctrl-C at once, whatever the source is doing.
    """

    def __init__(self, source: Stream | Replay, stop: threading.Event | None = None) -> None:
        self.source = source
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.stop = stop if stop is not None else threading.Event()  # also ends the source's restart backoff
        self.thread = threading.Thread(target=self._run, name="smiquery-pump", daemon=True)

    def _run(self) -> None:
        it = iter(self.source)
        try:
            for sample in it:
                if self.stop.is_set():
                    break
                self.queue.put(sample)
        except BaseException as exc:  # handed to the main thread, which reports it
            self.queue.put(_Failure(exc))
        else:
            self.queue.put(_END)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def start(self) -> None:
        self.thread.start()

    def halt(self, timeout: float) -> None:
        """Stop the source (reaping nvidia-smi) and wait for the thread."""
        self.stop.set()
        with contextlib.suppress(Exception):
            self.source.close()
        self.thread.join(timeout)


class _Signals:
    """Turns SIGINT/SIGTERM into a flag the loop checks; a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.closing = False
        self._saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.closing:
            self.signum = self.signum or signum
            return
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ValueError, OSError):
                    self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)


@dataclass
class _Run:
    """Everything one ``smiquery stream`` run writes to."""

    writers: list[SampleWriter]
    live: LiveTable | None
    static_table: bool
    fields: tuple[Field, ...]
    evaluator: AlertEvaluator | None
    exit_on_alert: bool
    alert_fired: bool = False
    sweeps: int = 0
    last_draw: float = 0.0


@app.command(
    epilog="""\b
--count N stops after N sweeps (one row per GPU each). --duration and
alert holds take 30s, 10m, 1h or plain seconds; --interval takes 1, 0.5,
250ms or 2s. Alerts: FIELD OP VALUE [for N | for DURATION] with OP one of
> >= < <= == != ; one line goes to stderr when an alert fires and when it
clears. --output records while displaying: .csv (nvidia-smi's format,
read back by --replay and smiquery.read_csv), .jsonl, or .parquet
(rewritten every 10,000 rows or 60 s, and at the end, so a crash loses at
most that). Ctrl-C stops cleanly (exit 130) and every file ends on a
whole row.

\b
Examples:
  smiquery stream
  smiquery stream --fields health --interval 250ms --output run.csv
  smiquery stream --format jsonl | jq '."temperature.gpu"'
  smiquery stream --alert 'temperature.gpu > 85 for 3' --alert 'utilization.gpu < 20 for 5m'
  smiquery stream --replay run.csv --speed 10
  smiquery stream --count 10 --format csv > snapshot.csv
"""
)
def stream(
    ctx: typer.Context,
    fields: FieldsOpt = None,
    interval: Annotated[
        str,
        typer.Option("--interval", "-l", metavar="SECONDS", help="Time between samples: 1, 0.5, 250ms, 2s."),
    ] = "1",
    gpus: GpusOpt = None,
    fmt: FormatOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", metavar="FILE", help="Also record to FILE (.csv, .jsonl or .parquet).", dir_okay=False
        ),
    ] = None,
    count: Annotated[int | None, typer.Option("--count", "-n", min=1, metavar="N", help="Stop after N sweeps.")] = None,
    duration: Annotated[
        str | None, typer.Option("--duration", "-d", metavar="DURATION", help="Stop after this long: 30s, 10m, 1h.")
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            metavar="FILE",
            help="Play a recording (.csv, .jsonl, .parquet) instead of running nvidia-smi.",
            dir_okay=False,
        ),
    ] = None,
    speed: Annotated[
        float,
        typer.Option("--speed", min=0.0, metavar="X", help="Replay speed: 2 is twice as fast, 0 as fast as possible."),
    ] = 1.0,
    loop: Annotated[bool, typer.Option("--loop", help="Replay: start again at the end.")] = False,
    alert: Annotated[
        list[str] | None,
        typer.Option(
            "--alert", "-a", metavar="EXPR", help="Alert rule, e.g. 'temperature.gpu > 85 for 3'; repeatable."
        ),
    ] = None,
    exit_on_alert: Annotated[
        bool, typer.Option("--exit-on-alert", help="Exit with code 6 as soon as an alert fires.")
    ] = False,
) -> None:
    """Watch the GPUs live: one long-lived nvidia-smi (or a recording).

    On a terminal: a live table, one row per GPU, redrawn in place (units in the header, missing values as
    n/a, values past an alert threshold in colour, sample age and restarts in the footer). Piped: CSV in
    nvidia-smi's format, each row flushed as it arrives (so `| tail -f`, `| grep`, `| jq` work live).
    """
    settings = _settings(ctx)
    with _boundary(settings):
        _stream(
            settings,
            fields=fields,
            interval=interval,
            gpus=gpus,
            fmt=fmt,
            output=output,
            count=count,
            duration=duration,
            replay_path=replay,
            speed=speed,
            loop=loop,
            alerts=alert or [],
            exit_on_alert=exit_on_alert,
        )


def _stream(
    settings: Settings,
    *,
    fields: str | None,
    interval: str,
    gpus: str | None,
    fmt: Format | None,
    output: Path | None,
    count: int | None,
    duration: str | None,
    replay_path: Path | None,
    speed: float,
    loop: bool,
    alerts: Sequence[str],
    exit_on_alert: bool,
) -> None:
    from smiquery.alerts import AlertEvaluator, InvalidRuleError, Rule
    from smiquery.display import CsvWriter, JsonlWriter, LiveTable, open_recorder, use_color

    seconds = parse_seconds(interval, "--interval")
    stop_after = parse_seconds(duration, "--duration") if duration is not None else None
    try:
        rules = [Rule.parse(a) for a in alerts]
    except InvalidRuleError as exc:
        raise _UsageError(f"--alert: {exc}") from None
    needed = [f for r in rules for f in r.fields]  # `while` fields too
    if any(r.hold_seconds is not None for r in rules):
        needed.insert(0, get_field("timestamp"))  # `for 5m` is measured by the samples' own timestamps
    rule_fields = tuple({f.name: f for f in needed}.values())
    ids = _gpus(gpus)
    out = sys.stdout
    form = _format(fmt, (Format.table, Format.csv, Format.jsonl), out)
    isatty = getattr(out, "isatty", None)
    tty = bool(isatty and isatty())

    source: Stream | Replay
    flds: tuple[Field, ...]
    pump_stop = threading.Event()
    if replay_path is not None:
        from smiquery.playback import Replay, ReplayError

        wanted: tuple[Field, ...] | None = _fields(fields, rule_fields) if fields is not None else None
        if wanted is None:
            # The default preset when the recording has it, else every recorded column.
            probe = Replay(replay_path, speed=speed, gpus=ids, loop=loop)
            have = {f.name for f in probe.recorded_fields}
            default = _fields("default", rule_fields)
            if all(f.name in have for f in default):
                wanted = default
            else:
                lacking = [f.name for f in rule_fields if f.name not in have]
                if lacking:
                    raise ReplayError(f"recording {replay_path} has no {', '.join(lacking)} for --alert")
        try:
            source = Replay(
                replay_path,
                speed=speed,
                fields=[f.name for f in wanted] if wanted is not None else None,
                gpus=ids,
                loop=loop,
            )
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
        flds = source.fields
        title = f"smiquery stream · replay {replay_path.name} at {speed:g}x" if speed else f"replay {replay_path.name}"
    else:
        from smiquery.supervisor import Stream

        flds = _fields(fields, rule_fields)

        def nap(seconds: float) -> None:
            pump_stop.wait(seconds)

        source = Stream(
            [f.name for f in flds],
            interval=seconds,
            gpus=ids,
            nvidia_smi=settings.nvidia_smi,
            stall_timeout=max(settings.timeout, 3 * seconds),
            sleep=nap,
        )
        flds = source.fields
        title = f"smiquery stream · every {seconds:g} s · {source.argv[0]}"

    writers: list[SampleWriter] = []
    recorder: SampleWriter | None = None
    if output is not None:
        try:
            recorder = open_recorder(output, flds)
        except ValueError as exc:
            raise _UsageError(f"--output: {exc}") from None
        except OSError as exc:
            raise SmiqueryError(f"cannot write {output}: {exc.strerror or exc}; choose another --output") from None
        except RuntimeError as exc:
            raise SmiqueryError(str(exc)) from None
    live: LiveTable | None = None
    evaluator = AlertEvaluator(rules) if rules else None
    if recorder is not None:
        writers.append(recorder)
    if form is Format.csv:
        writers.append(CsvWriter(out, flds, flush=True))
    elif form is Format.jsonl:
        writers.append(JsonlWriter(out, flush=True))
    elif tty:
        live = LiveTable(out, flds, title=title, color=use_color(out), evaluator=evaluator)
    run = _Run(writers, live, form is Format.table and live is None, flds, evaluator, exit_on_alert)
    code = _pump_loop(source, run, count=count, stop_after=stop_after, interval=seconds, stop_event=pump_stop)
    if code:
        raise typer.Exit(code)


def _stats_of(source: Stream | Replay, run: _Run) -> dict[str, object]:
    st = source.stats
    return {
        "rows": st.rows,
        "sweeps": run.sweeps,
        "restarts": st.restarts,
        "dropped_rows": st.dropped_rows,
        "lost_gpus": set(st.lost_gpus),
        "last_error": st.last_error,
    }


def _pump_loop(
    source: Stream | Replay,
    run: _Run,
    *,
    count: int | None,
    stop_after: float | None,
    interval: float,
    stop_event: threading.Event | None = None,
) -> int:
    """Consume the source until it ends, ``--count``/``--duration`` is reached, an alert exits, or a signal.

    Returns:
        The exit code (0, 6, 130 or 143); a source failure is raised after the outputs are closed.
    """
    from smiquery.playback import SweepGrouper

    grouper = SweepGrouper(getattr(source, "gpu_count", 0) or 0)
    pump = _Pump(source, stop_event)
    failure: BaseException | None = None
    code = 0
    deadline = time.monotonic() + stop_after if stop_after is not None else None
    tick = 0.1
    live = run.live
    with _Signals() as sigs:
        try:
            for w in run.writers:
                header = getattr(w, "header", None)
                if header is not None:
                    header()  # CSV headers now: a recording has one even if it ends before the first row
            pump.start()
            if live is not None:
                live.redraw(_stats_of(source, run))
            while True:
                if sigs.signum is not None:
                    code = 130 if sigs.signum == signal.SIGINT else 143
                    break
                wait = tick
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = min(wait, left)
                try:
                    item = pump.queue.get(timeout=wait)
                except queue.Empty:
                    if live is not None and time.monotonic() - run.last_draw >= 0.5:
                        _draw(live, source, run)
                    continue
                if item is _END:
                    last = grouper.flush()
                    if last is not None:
                        _on_sweep(last, source, run, final=True)
                    break
                if isinstance(item, _Failure):
                    failure = item.exc
                    break
                sample: GpuSample = item  # type: ignore[assignment]
                done = grouper.feed(sample)
                stop = False
                for sweep in done:
                    if any(s is sample for s in sweep):
                        continue
                    _on_sweep(sweep, source, run)
                    if count is not None and run.sweeps >= count:
                        stop = True  # the sweep before this sample was the last one wanted
                        break
                if stop:
                    break
                fired = _take_sample(sample, run)
                for sweep in done:
                    if any(s is sample for s in sweep):
                        _on_sweep(sweep, source, run)
                        if count is not None and run.sweeps >= count:
                            stop = True
                if fired and run.exit_on_alert:
                    code = 6
                    break
                if stop:
                    break
        except BrokenPipeError:
            _quiet_stdout()
            code = 0
        finally:
            sigs.closing = True  # from here on a signal changes nothing: the outputs are finished first
            pump.halt(max(5.0, 2 * interval))
            for w in run.writers:
                try:
                    w.close()
                except BrokenPipeError:
                    _quiet_stdout()
                except Exception as exc:
                    if failure is None:
                        failure = exc
            if live is not None:
                with contextlib.suppress(OSError, ValueError):
                    if code == 0 and failure is None:
                        _draw(live, source, run)
                live.close()
            if sigs.signum is not None and code == 0 and failure is None:
                code = 130 if sigs.signum == signal.SIGINT else 143
    if failure is not None:
        raise failure
    return code


def _take_sample(sample: GpuSample, run: _Run) -> bool:
    """Write one sample everywhere and evaluate the alerts; True when an alert fired."""
    for w in run.writers:
        w.write(sample)
    if run.live is not None:
        run.live.update((sample,))
    fired = False
    if run.evaluator is not None:
        events: list[AlertEvent] = run.evaluator.update(sample)
        for ev in events:
            _say(f"smiquery: {ev.message()}")
            if run.live is not None:
                run.live.note(ev)
            if ev.state == "firing":
                run.alert_fired = True
                fired = True
    return fired


def _on_sweep(sweep: Sequence[GpuSample], source: Stream | Replay, run: _Run, *, final: bool = False) -> None:
    run.sweeps += 1
    if run.live is not None:
        if final or time.monotonic() - run.last_draw >= 0.1:
            _draw(run.live, source, run)
    elif run.static_table:
        from smiquery.display import sample_table, use_color

        _print_lines([*sample_table(list(sweep), run.fields, color=use_color(sys.stdout)), ""])


def _draw(live: LiveTable, source: Stream | Replay, run: _Run) -> None:
    live.redraw(_stats_of(source, run))
    run.last_draw = time.monotonic()


_ORDER = ("stream", "query", "ps", "fields", "doctor", "export", "plot", "report")


def _command_rank(info: Any) -> int:
    name = info.name or getattr(info.callback, "__name__", "")
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


_register_export(app)
_register_analysis(app)
app.registered_commands.sort(key=_command_rank)  # the headline command first in --help


# ------------------------------------------------------------------------------------------------ entry


_FAST_GLOBAL = {"--nvidia-smi": "nvidia_smi", "--timeout": "timeout"}
_FAST_QUERY = {
    "--fields": "fields",
    "-f": "fields",
    "--gpus": "gpus",
    "--id": "gpus",
    "-i": "gpus",
    "--format": "fmt",
    "-F": "fmt",
}


def _fast_query(argv: Sequence[str]) -> dict[str, str | bool] | None:
    """The options of a plain ``[global options] query [options]`` command line, or None for anything else.

    Typer (0.2x and later) builds a pydantic TypeAdapter for every option it parses, which costs about 90 ms of
    imports per run: more than the query itself. The one-shot query is what scripts run in a loop, so a valid
    invocation of it is parsed here and goes straight to the same implementation; anything else (help, an
    unknown or malformed option, any other command) goes through Typer, which validates and reports it.
    """
    opts: dict[str, str | bool] = {}
    table = _FAST_GLOBAL
    i = 0
    seen_command = False
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not seen_command and arg == "query":
            seen_command, table = True, _FAST_QUERY
            continue
        if not seen_command and arg == "--debug":
            opts["debug"] = True
            continue
        name, eq, value = arg.partition("=")
        key = table.get(name)
        if key is None or key in opts:
            return None
        if not eq:
            if i >= len(argv) or argv[i].startswith("-"):
                return None
            value = argv[i]
            i += 1
        opts[key] = value
    if not seen_command:
        return None
    fmt = opts.get("fmt")
    if isinstance(fmt, str) and fmt.lower() not in Format.__members__:
        return None
    timeout = opts.get("timeout")
    if isinstance(timeout, str):
        try:
            if not float(timeout) >= 0.1:
                return None
        except ValueError:
            return None
    return opts


def _run_fast_query(opts: dict[str, str | bool]) -> int:
    def text(key: str) -> str | None:
        value = opts.get(key)
        return value if isinstance(value, str) else None

    timeout = text("timeout")
    settings = Settings(text("nvidia_smi"), float(timeout) if timeout else 10.0, bool(opts.get("debug")))
    fmt = text("fmt")
    try:
        _run_query(settings, text("fields"), text("gpus"), Format(fmt.lower()) if fmt else None)
    except typer.Exit as exc:
        return exc.exit_code
    return 0


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the command line (the ``smiquery`` console script and ``python -m smiquery``).

    Typer's own usage errors are printed as one line too, and exit with 2.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    args = list(argv) if argv is not None else sys.argv[1:]
    fast = _fast_query(args)
    if fast is not None:
        try:
            sys.exit(_run_fast_query(fast))
        except BrokenPipeError:
            _quiet_stdout()
            sys.exit(0)
    try:
        rc = app(args=args, prog_name="smiquery", standalone_mode=False)
    except typer.Abort:
        _say("smiquery: interrupted")
        sys.exit(130)
    except typer.TyperException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                typer.echo(ctx.get_help())
            sys.exit(0)
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else " (see `smiquery --help`)"
        _say(f"smiquery: usage error: {_one_line(exc.format_message())}{where}")
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(0)
    sys.exit(rc if isinstance(rc, int) else 0)
