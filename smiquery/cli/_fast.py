"""The fast path of ``smiquery query``: plain command lines parsed without typer.

Importing typer and building its click command cost more than the query itself, and the one-shot query is what
scripts run in a loop. A command line this parser fully understands goes straight to
:func:`smiquery.cli._query_body.run_query` without importing typer at all; anything else (help, an unknown or
malformed option, any other command) goes through typer, which validates and reports it. ``tests/cli/test_cli.py``
checks, from typer's own parameters, that every option of ``query`` and of the root is read identically by both
paths.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FAST_GLOBAL", "FAST_QUERY", "parse_fast_query"]

#: Value options of the root, by every spelling, to the parameter they set.
FAST_GLOBAL = {"--nvidia-smi": "nvidia_smi", "--timeout": "timeout"}
#: Flags of the root.
FAST_GLOBAL_FLAGS = {"--debug": "debug"}
#: Value options of ``query``.
FAST_QUERY = {
    "--fields": "fields",
    "-f": "fields",
    "--gpus": "gpus",
    "--id": "gpus",
    "-i": "gpus",
    "--format": "fmt",
    "-F": "fmt",
}
_FORMATS = ("table", "csv", "jsonl", "json")


def parse_fast_query(argv: Sequence[str]) -> dict[str, str | bool] | None:
    """The options of a plain ``[global options] query [options]`` command line, or None for anything else.

    Args:
        argv: the arguments after the program name.

    Returns:
        Parameter name -> value (``fmt`` lower-cased, ``debug`` True), or None to let typer parse it.
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
