"""The fake's human-readable answers: ``-h``, ``--help-query-*``, ``--version``, ``-L`` and the default table."""

from __future__ import annotations

import time
from collections.abc import Sequence

from smiquery.fields import CATALOGUE
from smiquery.testing._emulator.apps import APP_ALIASES, APP_HELP
from smiquery.testing._emulator.faults import FAULT_HELP
from smiquery.testing._emulator.output import Output
from smiquery.testing._emulator.recording import Recording, is_token
from smiquery.testing._emulator.settings import ENV_VARS

# CUDA version reported by `nvidia-smi --version`, by driver branch (the newest CUDA each branch supports).
_CUDA_BY_BRANCH = {470: "11.4", 535: "12.2", 550: "12.4", 560: "12.6", 570: "12.8", 580: "13.0", 590: "13.1"}


def help_query_gpu(rec: Recording, out: Output) -> int:
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


def help_query_apps(out: Output) -> int:
    out.line('List of valid properties to query for the switch "--query-compute-apps":')
    out.line()
    out.line("Section about Active Compute Processes properties")
    out.line("List of processes having compute context on the device.")
    aliases = {v: k for k, v in APP_ALIASES.items()}
    for name, text in APP_HELP.items():
        out.line()
        out.line(f'"{name}"' + (f' or "{aliases[name]}"' if name in aliases else ""))
        out.line(text)
    out.line()
    return 0


def _cuda_version(driver: str) -> str:
    try:
        branch = int(driver.split(".")[0])
    except ValueError:
        return "13.1"
    best = max((b for b in _CUDA_BY_BRANCH if b <= branch), default=470)
    return _CUDA_BY_BRANCH[best]


def version(rec: Recording, out: Output) -> int:
    driver = rec.driver_version
    out.line(f"NVIDIA-SMI version  : {driver}")
    out.line(f"NVML version        : {'.'.join(driver.split('.')[:2])}")
    out.line(f"DRIVER version      : {driver}")
    out.line(f"CUDA Version        : {_cuda_version(driver)}")
    out.line()
    return 0


def list_gpus(rec: Recording, selected: set[str], out: Output) -> int:
    for gpu in rec.gpus:
        if gpu["index"] in selected:
            out.line(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
    return 0


def table(rec: Recording, selected: set[str], out: Output) -> int:
    """A short version of the default human-readable table."""

    def get(row: Sequence[str], name: str, suffix: str = "") -> str:
        value = rec.cell(row, name)
        if value is None or is_token(value):
            return "N/A"
        return value + suffix

    def watts(row: Sequence[str], name: str) -> str:
        value = get(row, name)
        return value if value == "N/A" else f"{float(value):.0f}W"

    driver = rec.driver_version
    rule = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
    out.line(time.asctime())
    out.line("+" + "-" * 89 + "+")
    title = f" NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}CUDA Version: {_cuda_version(driver):<9}"
    out.line(f"|{title:<89}|")
    out.line("|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    out.line("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.line("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.line("|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|")
    for pos, row in enumerate(rec.sweeps[0]):
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
        out.line(rule)
    return 0


def usage(out: Output) -> int:
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
