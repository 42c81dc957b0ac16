"""The fake's compute apps (``--query-compute-apps``): their columns and the CSV they are read from."""

from __future__ import annotations

import pathlib

from smiquery.kinds import strip_unit
from smiquery.testing._emulator.recording import Recording, split_header_cell
from smiquery.testing._emulator.settings import FakeUsageError, read_bundled

# Compute apps: canonical names, input aliases and header units (NVIDIA-SMI.md section 4).
APP_FIELDS: dict[str, str] = {
    "timestamp": "",
    "gpu_name": "",
    "gpu_bus_id": "",
    "gpu_serial": "",
    "gpu_uuid": "",
    "pid": "",
    "process_name": "",
    "used_gpu_memory": "MiB",
}
APP_ALIASES = {"name": "process_name", "used_memory": "used_gpu_memory"}
APP_HELP = {
    "timestamp": 'The timestamp of when the query was made in format "YYYY/MM/DD HH:MM:SS.msec".',
    "gpu_name": "Product name of the GPU the process runs on.",
    "gpu_bus_id": 'PCI bus id of the GPU, as "domain:bus:device.function" in hex.',
    "gpu_serial": "Board serial number of the GPU.",
    "gpu_uuid": "Globally unique identifier of the GPU.",
    "pid": "Process ID of the compute application",
    "process_name": "Process name",
    "used_gpu_memory": "GPU memory used by the process's context.",
}


def load_apps(setting: str | None, rec: Recording) -> list[dict[str, str]]:
    if setting == "":
        return []
    if setting is None:
        text = read_bundled("demo-8gpu-apps.csv")
    else:
        try:
            text = pathlib.Path(setting).read_text(encoding="utf-8")
        except OSError as exc:
            raise FakeUsageError(f"cannot read compute-apps file {setting}: {exc}") from exc
    lines = [ln.rstrip("\r") for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    names = []
    units = []
    for cell in lines[0].split(","):
        name, unit = split_header_cell(cell)
        names.append(APP_ALIASES.get(name, name))
        units.append(unit or APP_FIELDS.get(name, ""))
    by_uuid = {g["uuid"].lower(): g for g in rec.gpus}
    apps: list[dict[str, str]] = []
    for line in lines[1:]:
        cells = line.split(", ")
        if len(cells) > len(names) and "process_name" in names:
            # a process name containing ", " : the surplus cells belong to it
            at = names.index("process_name")
            extra = len(cells) - len(names)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        if len(cells) != len(names):
            continue
        app = {n: strip_unit(c, u) for n, c, u in zip(names, cells, units)}
        gpu = by_uuid.get(app.get("gpu_uuid", "").lower())
        if gpu is not None:
            app.setdefault("gpu_name", gpu["name"])
            app.setdefault("gpu_bus_id", gpu["pci.bus_id"])
            app.setdefault("gpu_serial", gpu["serial"])
        apps.append(app)
    return apps


# ------------------------------------------------------------------------------------------------ arguments
