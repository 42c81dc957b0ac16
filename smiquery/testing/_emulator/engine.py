"""The fake's engine, shared by the executable and the in-process runner, and its human-readable answers."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence

from smiquery.fields import CATALOGUE
from smiquery.testing._emulator.core import ENV_VARS, HELP_HINT, FakeExit, FakeUsageError, Output, Settings
from smiquery.testing._emulator.faults import FAULT_HELP, Faults, parse_faults, startup
from smiquery.testing._emulator.query import parse_args, query_apps, query_gpu, select_gpus
from smiquery.testing._emulator.recording import (
    APP_ALIASES,
    APP_FIELDS,
    Recording,
    Reload,
    is_token,
    load_recording,
    relayout,
    reloads_struck,
)

_EX_SOFTWARE = 70  # misuse of the fake itself (bad fault spec, unreadable recording), never an nvidia-smi code
# CUDA version reported by `nvidia-smi --version`, by driver branch (the newest CUDA each branch supports).
_CUDA_BY_BRANCH = {470: "11.4", 535: "12.2", 550: "12.4", 560: "12.6", 570: "12.8", 580: "13.0", 590: "13.1"}
_FLOOD_LINE = 1 << 20  # a loop's flood: lines of 1 MiB, far past any sane row


def execute(argv: Sequence[str], settings: Settings, env: Mapping[str, str], out: Output) -> int:
    """The fake's engine, shared by the executable and :class:`InProcessRunner`: argv in, exit status out."""
    try:
        settings = settings.with_env(env)
        faults = parse_faults(settings.fault)
        out.begin(argv, settings.log, grandchild=faults.grandchild, ignore_term=faults.ignore_term)
        code = _dispatch(argv, settings, faults, out)
    except FakeExit as exc:
        code = exc.code
    except FakeUsageError as exc:
        out.flush()
        out.error(f"smiquery-fake-nvidia-smi: {exc}")
        return _EX_SOFTWARE
    out.flush()
    return code


def _dispatch(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    delay = faults.start_delay if faults.start_delay is not None else settings.start_delay
    if delay > 0:
        out.sleep(delay)
    if faults.flood:
        return _flood(argv, faults.flood_bytes, out)
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
        return _usage(out)
    if opts.action == "help-query-gpu":
        return _help_query_gpu(rec, out)
    if opts.action == "help-query-compute-apps":
        return _help_query_apps(out)
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
        return _version(rec, out)
    selected = select_gpus(rec, opts.ids, out)
    if opts.action == "list":
        for gpu in rec.gpus:
            if gpu["index"] in selected:
                out.line(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
        return 0
    return _table(rec, selected, out)


@functools.cache
def _flood_block() -> bytes:
    """64 KiB of noise with no line break, comma or NUL: what a wrong binary could print."""
    import random

    alphabet = bytes(b for b in range(1, 256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    rng = random.Random(20261025)
    return bytes(rng.choice(alphabet) for _ in range(1 << 16))


def _flood(argv: Sequence[str], total: int | None, out: Output) -> int:
    """``flood``: noise on stdout without end (or ``total`` bytes), in a loop as over-long lines."""
    loop = tuple(argv[:1]) == ("pmon",) or any(
        a.partition("=")[0] in ("-l", "--loop", "-lms", "--loop-ms") for a in argv
    )
    block = _flood_block()
    unit = block * (_FLOOD_LINE // len(block)) + b"\n" if loop else block
    left = total
    while left is None or left > 0:
        data = unit if left is None else unit[:left]
        out.raw(data)
        out.flush()
        if left is not None:
            left -= len(data)
    return 0


def _help_query_gpu(rec: Recording, out: Output) -> int:
    out.line('List of valid properties to query for the switch "--query-gpu":')
    present = set(rec.col) | {"timestamp"}
    family = ""
    for fld in CATALOGUE:
        if fld.name not in present:
            continue
        group = fld.name.split(".")[0]
        if group in ("clocks_event_reasons", "ecc", "power", "clocks") and group != family:
            out.line()
            out.line(f"Section about {group} properties")
            out.line(f"Properties of the {group} group.")
        family = group
        out.line()
        out.line(" or ".join(f'"{n}"' for n in (fld.name, *fld.aliases)))
        out.line(fld.help or "No description.")
    for fld in rec.extra.values():
        out.line()
        out.line(f'"{fld.name}"')
        out.line("Listed by the driver this recording comes from.")
    out.line()
    return 0


def _help_query_apps(out: Output) -> int:
    out.line('List of valid properties to query for the switch "--query-compute-apps":')
    out.line()
    out.line("Section about Active Compute Processes properties")
    out.line("List of processes having compute context on the device.")
    aliases = {v: k for k, v in APP_ALIASES.items()}
    for name, text in APP_FIELDS.items():
        out.line()
        out.line(f'"{name}"' + (f' or "{aliases[name]}"' if name in aliases else ""))
        out.line(text)
    out.line()
    return 0


def _cuda_version(rec: Recording) -> str:
    return _CUDA_BY_BRANCH[max((b for b in _CUDA_BY_BRANCH if b <= rec.driver_branch), default=470)]


def _version(rec: Recording, out: Output) -> int:
    driver = rec.driver_version
    out.line(f"NVIDIA-SMI version  : {driver}")
    out.line(f"NVML version        : {'.'.join(driver.split('.')[:2])}")
    out.line(f"DRIVER version      : {driver}")
    out.line(f"CUDA Version        : {_cuda_version(rec)}")
    out.line()
    return 0


def _table(rec: Recording, selected: set[str], out: Output) -> int:
    """A short version of the default human-readable table."""

    def get(row: Sequence[str], name: str, suffix: str = "") -> str:
        value = rec.cell(row, name)
        return "N/A" if value is None or is_token(value) else value + suffix

    def watts(row: Sequence[str], name: str) -> str:
        value = get(row, name)
        return value if value == "N/A" else f"{float(value):.0f}W"

    driver = rec.driver_version
    out.line(time.asctime())
    out.line("+" + "-" * 89 + "+")
    title = f" NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}CUDA Version: {_cuda_version(rec):<9}"
    out.line(f"|{title:<89}|")
    out.line("|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    out.line("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.line("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.line("|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|")
    for pos, row in enumerate(rec.sweep(0)):
        key = rec.key_of(row, pos)
        if key not in selected:
            continue
        pers = {"Enabled": "On", "Disabled": "Off"}.get(get(row, "persistence_mode"), "On")
        ecc = get(row, "ecc.errors.uncorrected.volatile.total")
        name = get(row, "name")
        out.line(f"| {key:>3}  {name:<30.30}{pers:>3}  |{get(row, 'pci.bus_id'):>19} Off |{ecc:>21} |")
        temp = get(row, "temperature.gpu", "C")
        power = f"{watts(row, 'power.draw')} / {watts(row, 'power.limit'):>5}"
        left = f" {get(row, 'fan.speed', '%'):>3} {temp:>5}    {get(row, 'pstate'):>2}{power:>24} "
        memory = f"{get(row, 'memory.used', 'MiB')} / {get(row, 'memory.total', 'MiB'):>9}"
        util = get(row, "utilization.gpu", "%")
        out.line(f"|{left:<41}|{memory:>23} |{util:>8}{'Default':>13} |")
        out.line("+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    return 0


def _usage(out: Output) -> int:
    out.line("smiquery fake nvidia-smi: replays a recorded CSV like NVIDIA's System Management Interface.")
    out.line()
    out.line("    nvidia-smi [-i ID] --query-gpu=LIST --format=csv[,noheader][,nounits] [-l SEC | -lms MS]")
    out.line("    nvidia-smi [-i ID] --query-compute-apps=LIST --format=csv[,noheader][,nounits]")
    out.line("    nvidia-smi --help-query-gpu | --help-query-compute-apps | -L | --version | -h | --help")
    out.line()
    out.line("Faults (SMIQUERY_FAKE_FAULT or fault=; combine with commas; N counts data rows, across loop sweeps):")
    width = max(len(spec) for spec in FAULT_HELP) + 2
    for spec, text in FAULT_HELP.items():
        out.line(f"  {spec:<{width}}{text}")
    out.line()
    out.line("Environment variables (read at every start; they override the settings baked into the script):")
    width = max(len(name) for name in ENV_VARS) + 2
    for name, text in ENV_VARS.items():
        out.line(f"  {name:<{width}}{text}")
    return 0
