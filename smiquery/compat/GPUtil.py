"""GPUtil 1.4.0's public surface on smiquery: ``from smiquery.compat import GPUtil`` instead of ``import GPUtil``.

Same names, arguments, defaults and return shapes, and the same results on the same nvidia-smi output, quirks
included (``load`` is a fraction, unreadable numbers are ``nan``...). Unlike GPUtil, nvidia-smi runs under
:data:`TIMEOUT` and every failure raises a typed :class:`~smiquery.errors.SmiqueryError`; ``docs/adoption.md``
lists the quirks and the differences.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

from smiquery.errors import ParseError, failure_from_exit
from smiquery.fields import resolve_fields
from smiquery.runner import default_runner, find_nvidia_smi
from smiquery.streams.argv import build_argv

__all__ = [
    "GPU",
    "TIMEOUT",
    "__version__",
    "getAvailability",
    "getAvailable",
    "getFirstAvailable",
    "getGPUs",
    "showUtilization",
]

#: The GPUtil release whose behaviour this module reproduces.
__version__ = "1.4.0"

#: Seconds nvidia-smi may take before it is killed and :class:`~smiquery.errors.NvidiaSmiTimeoutError` is raised
#: (GPUtil has no timeout). Assign to change it.
TIMEOUT = 10.0

# GPUtil's query in GPUtil's column order, spelled with names every driver accepts (`serial`, not the input
# alias `gpu_serial`: NVIDIA-SMI.md 1.3 lists both on 465..610, and the header prints `serial` either way).
_FIELDS = (
    "index,uuid,utilization.gpu,memory.total,memory.used,memory.free,driver_version,name,serial,display_active,"
    "display_mode,temperature.gpu"
)


def _number(cell: str) -> float:
    """A cell as GPUtil reads numbers: ``float()`` of the text, ``nan`` when that fails (``[N/A]`` and friends)."""
    try:
        return float(cell)
    except ValueError:
        return math.nan


class GPU:
    """One GPU as GPUtil describes it, built from GPUtil's twelve values in GPUtil's order.

    Its attributes: ``id`` (the index), ``uuid``, ``load`` (``utilization.gpu`` as a fraction 0..1), ``memoryUtil``
    (``memoryUsed / memoryTotal``; ``nan`` when unknown or the total is 0), ``memoryTotal``, ``memoryUsed``,
    ``memoryFree`` (MiB), ``driver``, ``name``, ``serial``, ``display_mode``, ``display_active`` (strings as
    printed) and ``temperature`` (degrees C). Unknown numbers are ``nan``.
    """

    def __init__(
        self,
        ID: int,
        uuid: str,
        load: float,
        memoryTotal: float,
        memoryUsed: float,
        memoryFree: float,
        driver: str,
        gpu_name: str,
        serial: str,
        display_mode: str,
        display_active: str,
        temp_gpu: float,
    ) -> None:
        self.id = ID
        self.uuid = uuid
        self.load = load
        total = float(memoryTotal)
        # GPUtil divides and raises ZeroDivisionError on a 0 MiB total; an unknown ratio is nan here
        self.memoryUtil = float(memoryUsed) / total if total else math.nan
        self.memoryTotal = memoryTotal
        self.memoryUsed = memoryUsed
        self.memoryFree = memoryFree
        self.driver = driver
        self.name = gpu_name
        self.serial = serial
        self.display_mode = display_mode
        self.display_active = display_active
        self.temperature = temp_gpu

    def __repr__(self) -> str:
        return f"GPU(id={self.id!r}, name={self.name!r}, load={self.load!r}, memoryUtil={self.memoryUtil!r})"


def getGPUs() -> list[GPU]:
    """Query every GPU once: one :class:`GPU` each, in nvidia-smi's order.

    Raises NvidiaSmiNotFoundError (GPUtil returns ``[]``), NvidiaSmiTimeoutError after :data:`TIMEOUT` seconds
    (GPUtil waits forever), NvidiaSmiFailedError as its typed subclass (GPUtil raises ``ValueError``), and
    ParseError for output that does not fit the twelve columns.
    """
    argv = build_argv(find_nvidia_smi(), resolve_fields(_FIELDS))
    done = default_runner().run(argv, TIMEOUT)
    if done.returncode not in (0, 14):  # 14: infoROM warning after valid rows
        raise failure_from_exit(argv, done.returncode, done.output)
    gpus = []
    # GPUtil's own reading of the rows (split on ", ", twelve cells, numbers through float()), checked: a line
    # that is not such a row raises ParseError instead of shifting values or crashing in int()
    for lineno, line in enumerate(done.stdout.splitlines(), 1):
        if not line.strip() or (done.returncode == 14 and line.startswith("WARNING")):
            continue
        cells = line.split(", ")
        if len(cells) != 12 or not cells[0].strip().isdigit():
            raise ParseError("expected 12 cells starting with a GPU index", lineno=lineno, line=line)
        index, uuid, util, total, used, free, driver, name, serial, active, mode, temp = cells
        memory = (_number(total), _number(used), _number(free))
        gpus.append(
            GPU(int(index), uuid, _number(util) / 100, *memory, driver, name, serial, mode, active, _number(temp))
        )
    return gpus


def getAvailability(
    GPUs: Sequence[GPU],
    maxLoad: float = 0.5,
    maxMemory: float = 0.5,
    memoryFree: float = 0,
    includeNan: bool = False,
    excludeID: Sequence[int] = [],
    excludeUUID: Sequence[str] = [],
) -> list[int]:
    """Mark each GPU available (1) or not (0), in order.

    A GPU is available when it has at least ``memoryFree`` MiB free (NaN never has), its load is below
    ``maxLoad`` and its memory utilisation below ``maxMemory`` (both 0..1; NaN passes these two only with
    ``includeNan``), and neither its id (``excludeID``) nor its UUID (``excludeUUID``) is excluded.
    """

    def low(value: float, limit: float) -> bool:
        return value < limit or (includeNan and math.isnan(value))

    return [
        1
        if gpu.memoryFree >= memoryFree
        and low(gpu.load, maxLoad)
        and low(gpu.memoryUtil, maxMemory)
        and gpu.id not in excludeID
        and gpu.uuid not in excludeUUID
        else 0
        for gpu in GPUs
    ]


def getAvailable(
    order: str = "first",
    limit: int = 1,
    maxLoad: float = 0.5,
    maxMemory: float = 0.5,
    memoryFree: float = 0,
    includeNan: bool = False,
    excludeID: Sequence[int] = [],
    excludeUUID: Sequence[str] = [],
) -> list[int]:
    """The ids of at most ``limit`` available GPUs (the other arguments as in :func:`getAvailability`).

    ``order`` is ``first`` (lowest id), ``last`` (highest id), ``random``, ``load`` (lowest load) or ``memory``
    (lowest memory *utilisation*), NaN last; any other value keeps nvidia-smi's order. Raises as :func:`getGPUs`.
    """
    gpus = getGPUs()
    marks = getAvailability(gpus, maxLoad, maxMemory, memoryFree, includeNan, excludeID, excludeUUID)
    chosen = [gpu for gpu, mark in zip(gpus, marks) if mark == 1]
    if order in ("first", "last"):
        chosen.sort(key=lambda gpu: gpu.id, reverse=order == "last")
    elif order == "random":
        # the same call on the global generator as GPUtil, so that a seeded run picks the same GPUs
        chosen = [chosen[i] for i in random.sample(range(len(chosen)), len(chosen))]
    elif order in ("load", "memory"):
        attr = "load" if order == "load" else "memoryUtil"
        chosen.sort(key=lambda gpu: math.inf if math.isnan(getattr(gpu, attr)) else getattr(gpu, attr))
    return [gpu.id for gpu in chosen[:limit]]


def getFirstAvailable(
    order: str = "first",
    maxLoad: float = 0.5,
    maxMemory: float = 0.5,
    attempts: int = 1,
    interval: float = 900,
    verbose: bool = False,
    includeNan: bool = False,
    excludeID: Sequence[int] = [],
    excludeUUID: Sequence[str] = [],
) -> list[int]:
    """A list of the one id :func:`getAvailable` finds, looking up to ``attempts`` times ``interval`` s apart.

    ``verbose`` prints each attempt and the result, as GPUtil does. Raises RuntimeError (GPUtil's message) when no
    GPU was available in any attempt, and as :func:`getGPUs`.
    """
    for i in range(attempts):
        if verbose:
            print(f"Attempting ({i + 1}/{attempts}) to locate available GPU.")
        available = getAvailable(order, 1, maxLoad, maxMemory, 0, includeNan, excludeID, excludeUUID)
        if available:
            if verbose:
                print(f"GPU {available} located!")
            return available
        if i != attempts - 1:
            time.sleep(interval)
    raise RuntimeError(f"Could not find an available GPU after {attempts} attempts with {interval} seconds interval.")


# showUtilization's columns, group by group: (attribute, title, suffix, precision); load and memoryUtil in percent
_Column = tuple[str, str, str, "int | None"]
_PERCENT = ("load", "memoryUtil")
_SHORT: list[list[_Column]] = [[("id", "ID", "", None), ("load", "GPU", "%", 0), ("memoryUtil", "MEM", "%", 0)]]
_ALL: list[list[_Column]] = [
    [("id", "ID", "", None), ("name", "Name", "", None), ("serial", "Serial", "", None), ("uuid", "UUID", "", None)],
    [("temperature", "GPU temp.", "C", 0), ("load", "GPU util.", "%", 0), ("memoryUtil", "Memory util.", "%", 0)],
    [
        ("memoryTotal", "Memory total", "MB", 0),
        ("memoryUsed", "Memory used", "MB", 0),
        ("memoryFree", "Memory free", "MB", 0),
    ],
    [("display_mode", "Display mode", "", None), ("display_active", "Display active", "", None)],
]


def _cell(value: Any, width: object, precision: int | None) -> str:
    # the floats (every column with a precision) as GPUtil's `{:W.Pf}`, ints and strings as `{:W}`
    return format(value, f"{width}" if precision is None else f"{width}.{precision}f")


def _table(gpus: Sequence[GPU], groups: list[list[_Column]]) -> list[str]:
    header = ""
    rows = [""] * len(gpus)
    for group in groups:
        for attr, name, suffix, precision in group:
            values = [getattr(gpu, attr) for gpu in gpus]
            if attr in _PERCENT:
                values = [value * 100 for value in values]
            width = max([len(name)] + [len(_cell(v, "", precision) + suffix) for v in values])
            header += f"| {name} " + " " * (width - len(name))
            for i, value in enumerate(values):
                rows[i] += "| " + _cell(value, width - len(suffix), precision) + suffix + " "
        header += "|"
        rows = [row + "|" for row in rows]
    return [header, "-" * len(header), *rows]


def showUtilization(all: bool = False, attrList: Any = None, useOldCode: bool = False) -> None:
    """Print a table of the GPUs exactly as GPUtil does: id, GPU % and memory % (``all``: every attribute).

    ``attrList`` is ignored, as in GPUtil 1.4.0; ``useOldCode`` is GPUtil's older fixed-width layout. Raises as
    :func:`getGPUs`.
    """
    del attrList  # GPUtil 1.4.0 overwrites it in every branch
    gpus = getGPUs()
    if not useOldCode:
        print("\n".join(_table(gpus, _ALL if all else _SHORT)))
    elif all:
        print(
            " ID | Name | Serial | UUID || GPU util. | Memory util. || Memory total | Memory used | Memory free "
            "|| Display mode | Display active |"
        )
        print("-" * 126)
        for g in gpus:
            print(
                f" {g.id:2d} | {g.name:s}  | {g.serial:s} | {g.uuid:s} || {g.load * 100:3.0f}% "
                f"| {g.memoryUtil * 100:3.0f}% || {g.memoryTotal:.0f}MB | {g.memoryUsed:.0f}MB "
                f"| {g.memoryFree:.0f}MB || {g.display_mode:s} | {g.display_active:s}"
            )
    else:
        print(" ID  GPU  MEM")
        print("-" * 14)
        for g in gpus:
            print(f" {g.id:2d} {g.load * 100:3.0f}% {g.memoryUtil * 100:3.0f}%")
