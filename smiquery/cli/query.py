"""``smiquery query``: one snapshot, one row per GPU.

Scripts run it in a loop, and importing typer costs more than the query: a command line :func:`parse_fast_query`
fully understands goes straight to :func:`run_query`; anything else goes through typer (:func:`register`).
``tests/cli/test_cli.py`` checks that both paths read every option of ``query`` and of the root alike.
"""

# No `from __future__ import annotations`: typer reads the command's annotations from the function itself, and the
# command defined in register() names option types that only register() imports (typer stays off the fast path).

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast, get_args

from smiquery.cli._boundary import boundary, warnings_as_lines
from smiquery.cli._options import Format, Settings, choose_format, gpu_ids_checked, parse_fields, parse_gpus

if TYPE_CHECKING:
    import typer

__all__ = ["FAST_GLOBAL", "FAST_GLOBAL_FLAGS", "FAST_QUERY", "parse_fast_query", "register", "run_fast_query"]

#: Value options of the root, by every spelling, to the parameter they set.
FAST_GLOBAL = {"--nvidia-smi": "nvidia_smi", "--timeout": "timeout"}
#: Flags of the root.
FAST_GLOBAL_FLAGS = {"--debug": "debug"}
#: Value options of ``query``.
FAST_QUERY = {
    **dict.fromkeys(("--fields", "-f"), "fields"),
    **dict.fromkeys(("--gpus", "--id", "-i"), "gpus"),
    **dict.fromkeys(("--format", "-F"), "fmt"),
}
_FORMATS = get_args(Format)


def run_query(settings: Settings, fields: str | None, gpus: str | None, fmt: Format | None) -> None:
    """Print one snapshot (``smiquery query``); on any error, one line on stderr and its exit code."""
    with boundary(settings.debug):
        flds = parse_fields(fields)
        ids = parse_gpus(gpus)
        form = choose_format(fmt, sys.stdout)
        from smiquery.cli.display import render, terminal_size, use_color
        from smiquery.sources.query_gpu import query

        with warnings_as_lines(), gpu_ids_checked(ids, settings):
            samples = query(flds, gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        text = render(samples, form, fields=flds, color=use_color(sys.stdout), width=terminal_size(sys.stdout)[0])
        sys.stdout.write(text)
        sys.stdout.flush()


def parse_fast_query(argv: Sequence[str]) -> dict[str, str | bool] | None:
    """Parameter -> value of a plain ``[global options] query [options]`` line (``fmt`` lower-cased, ``debug`` True).

    None for anything else: typer parses it.
    """
    opts: dict[str, str | bool] = {}
    table = FAST_GLOBAL
    i = 0
    seen_command = False
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not seen_command and arg == "query":
            seen_command, table = True, FAST_QUERY
            continue
        if not seen_command and arg in FAST_GLOBAL_FLAGS:
            opts[FAST_GLOBAL_FLAGS[arg]] = True
            continue
        # `--format=json` is one argument; click reads `-F=json` as the value "=json", so short ones never split
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
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
    if isinstance(fmt, str):
        if fmt.lower() not in _FORMATS:
            return None
        opts["fmt"] = fmt.lower()
    timeout = opts.get("timeout")
    if isinstance(timeout, str):
        try:
            if not float(timeout) >= 0.1:
                return None
        except ValueError:
            return None
    return opts


def run_fast_query(opts: dict[str, str | bool]) -> int:
    """Run what :func:`parse_fast_query` read, without typer; returns 0 (an error exits with its code)."""

    def text(key: str) -> str | None:
        value = opts.get(key)
        return value if isinstance(value, str) else None

    timeout = text("timeout")
    settings = Settings(text("nvidia_smi"), float(timeout) if timeout else Settings().timeout, bool(opts.get("debug")))
    run_query(settings, text("fields"), text("gpus"), cast("Format | None", text("fmt")))  # one of _FORMATS
    return 0


def register(app: "typer.Typer") -> None:
    """Add the ``query`` command to the ``smiquery`` typer app."""
    import typer

    from smiquery.cli._common import FieldsOpt, FormatOpt, GpusOpt, settings_of

    def query(ctx: typer.Context, fields: FieldsOpt = None, gpus: GpusOpt = None, fmt: FormatOpt = None) -> None:
        """Print one snapshot: one row per GPU.

        CSV is nvidia-smi's own format (header with units), so `smiquery.read_csv` reads it back. JSON and JSONL
        use field names as keys, ISO 8601 times, and null for missing values (reasons under "_missing").
        """
        run_query(settings_of(ctx), fields, gpus, fmt)

    epilog = """\b
Examples:
  smiquery query
  smiquery query --fields memory --gpus 0,1 --format json
  smiquery query --fields temperature.gpu,power.draw --format csv
"""
    app.command(epilog=epilog)(query)
