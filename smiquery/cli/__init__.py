"""The ``smiquery`` command line: stream, query, ps, fields, doctor, export, plot and report.

One module per command; commands stay thin (validate options, call the library, render). Errors are caught only at
the one boundary (:mod:`smiquery.cli._boundary`) and printed as one line on stderr that says what to do
(``--debug`` adds the traceback); the exit codes are :class:`ExitCode`, listed in ``smiquery --help``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from smiquery.cli._boundary import ExitCode, cli_text, exit_code_for, quiet_stdout, say

if TYPE_CHECKING:
    from smiquery.cli._common import app

__all__ = ["ExitCode", "app", "exit_code_for", "main"]

_ORDER = ("stream", "query", "ps", "fields", "doctor", "export", "plot", "report")


def _command_rank(info: Any) -> int:
    name = info.name or getattr(info.callback, "__name__", "")
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


@functools.cache
def _load_app() -> Any:
    """The typer app with every command registered (imported on first use: the fast path needs none of it)."""
    from smiquery.cli import details, doctor, export, fields, ps, stream, top  # noqa: F401  (@app.command registers them)
    from smiquery.cli._common import app
    from smiquery.cli.analysis import register as register_analysis
    from smiquery.cli.query import register as register_query

    register_query(app)
    register_analysis(app)
    app.registered_commands.sort(key=_command_rank)  # the headline command first in --help
    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return _load_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the command line (the ``smiquery`` console script and ``python -m smiquery``).

    ``argv`` defaults to ``sys.argv[1:]``. Typer's own usage errors are printed as one line too, and exit with 2.
    """
    from smiquery.cli.query import parse_fast_query, run_fast_query

    args = list(argv) if argv is not None else sys.argv[1:]
    if argv is None and "export" in args:
        # the whole process: `export` may replace its image with the lean server; `main(args)` from a program never
        from smiquery.cli import _export_run

        _export_run.process_entry = True
    fast = parse_fast_query(args)
    if fast is not None:  # its boundary ends a closed pipe (`| head`) quietly
        sys.exit(run_fast_query(fast))
    import typer

    try:
        rc = _load_app()(args=args, prog_name="smiquery", standalone_mode=False)
    except typer.Abort:
        say("smiquery: interrupted")
        sys.exit(ExitCode.INTERRUPTED)
    except typer.TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":
            if ctx is not None:
                typer.echo(ctx.get_help())
            sys.exit(ExitCode.OK)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else " (see `smiquery --help`)"
        say(f"smiquery: usage error: {cli_text(exc.format_message())}{where}")
        sys.exit(getattr(exc, "exit_code", ExitCode.USAGE))
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        quiet_stdout()
        sys.exit(ExitCode.OK)
    sys.exit(rc if isinstance(rc, int) else 0)
