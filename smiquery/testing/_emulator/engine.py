"""The fake's engine, shared by the executable and the in-process runner: argv in, output and exit status out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from smiquery.testing._emulator.args import parse_args
from smiquery.testing._emulator.faults import Faults, parse_faults, startup
from smiquery.testing._emulator.info import help_query_apps, help_query_gpu, list_gpus, table, usage, version
from smiquery.testing._emulator.output import HELP_HINT, FakeExit, Output
from smiquery.testing._emulator.query import query_apps, query_gpu, select_gpus
from smiquery.testing._emulator.recording import load_recording
from smiquery.testing._emulator.reload import Reload, relayout, reloads_struck
from smiquery.testing._emulator.rows import flood
from smiquery.testing._emulator.settings import FakeUsageError, Settings

_EX_SOFTWARE = 70  # misuse of the fake itself (bad fault spec, unreadable recording), never an nvidia-smi code


def _dispatch(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    delay = faults.start_delay if faults.start_delay is not None else settings.start_delay
    if delay > 0:
        out.sleep(delay)
    if faults.flood:
        return flood(argv, faults.flood_bytes, out)
    if {"-q", "--query", "-x", "--xml-format"} & set(argv) or (settings.xml and {"-L", "--list-gpus"} & set(argv)):
        from smiquery.testing._emulator.details import run_details  # -q -x, and -L from an XML capture

        return run_details(argv, settings, faults, out)
    if tuple(argv[:1]) == ("pmon",):  # a tuple from the in-process runner, a list from the executable
        from smiquery.testing._emulator.pmon import run_pmon

        return run_pmon(argv[1:], settings, faults, out)
    opts = parse_args(argv, out)
    rec = load_recording(settings.recording)
    reload = None
    if faults.reloads:
        struck = reloads_struck(settings.state)
        rec = relayout(rec, [mode for _, mode in faults.reloads[:struck]])
        if struck < len(faults.reloads):
            reload = Reload(settings.state, struck, faults.reloads[struck][0])
    if opts.action == "help":
        return usage(out)
    if opts.action == "help-query-gpu":
        return help_query_gpu(rec, out)
    if opts.action == "help-query-compute-apps":
        return help_query_apps(out)
    if opts.query_gpu is not None and opts.query_apps is not None:
        out.line(f"Invalid combination of input arguments. {HELP_HINT}")
        return 2
    if opts.query_gpu is not None:
        return query_gpu(opts, rec, settings, faults, out, reload)
    if opts.query_apps is not None:
        return query_apps(opts, rec, settings, faults, out, reload)
    if opts.fmt is not None:
        out.line(f"Invalid combination of input arguments. {HELP_HINT}")
        return 2
    startup(faults, rec, out)
    if opts.action == "version":
        return version(rec, out)
    selected = select_gpus(rec, opts.ids, out)
    if opts.action == "list":
        return list_gpus(rec, selected, out)
    return table(rec, selected, out)


def execute(argv: Sequence[str], settings: Settings, env: Mapping[str, str], out: Output) -> int:
    """The fake's engine, shared by the executable and :class:`InProcessRunner`: argv in, exit status out."""
    try:
        try:
            settings = settings.with_env(env)
            faults = parse_faults(settings.fault)
            out.begin(argv, settings.log, grandchild=faults.grandchild, ignore_term=faults.ignore_term)
            code = _dispatch(argv, settings, faults, out)
        except FakeExit as exc:
            code = exc.code
        out.flush()
    except FakeUsageError as exc:
        out.flush()
        out.error(f"smiquery-fake-nvidia-smi: {exc}")
        return _EX_SOFTWARE
    return code
