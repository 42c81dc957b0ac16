"""GPUtil 1.4.0's public surface on smiquery: ``from smiquery.compat import GPUtil`` instead of ``import GPUtil``.

Same names, arguments, defaults and return shapes, and the same results on the same nvidia-smi output, quirks
included: ``load`` is ``utilization.gpu`` as a fraction (0..1); unreadable numbers are ``nan``; ``order="memory"``
sorts by memory *utilisation*, not by free memory; NaN sorts last; a GPU whose ``memoryFree`` is NaN is never
available (not even with ``includeNan``); :func:`getFirstAvailable` returns a one-element list; ``attrList`` of
:func:`showUtilization` is ignored, as in GPUtil.

Where GPUtil hangs or hides a driver error, this module does not: nvidia-smi runs under :data:`TIMEOUT` and every
failure raises a typed :class:`~smiquery.errors.SmiqueryError` that says what is wrong (GPUtil returns ``[]`` when
nvidia-smi is missing, waits forever on a hung driver, and turns a driver message into ``ValueError: invalid
literal for int()``). The differences are listed in ``docs/adoption.md``.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from smiquery.errors import ParseError, failure_from_exit
from smiquery.fields import Field, resolve_fields
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
    "index",
    "uuid",
    "utilization.gpu",
    "memory.total",
    "memory.used",
    "memory.free",
    "driver_version",
    "name",
    "serial",
    "display_active",
    "display_mode",
    "temperature.gpu",
)


def _number(cell: str) -> float:
    """A cell as GPUtil reads numbers: ``float()`` of the text, ``nan`` when that fails (``[N/A]`` and friends)."""
    try:
        return float(cell)
    except ValueError:
        return math.nan


class GPU:
    """One GPU as GPUtil describes it.

    Attributes:
        id: the GPU index (int).
        uuid: the GPU UUID.
        load: ``utilization.gpu`` as a fraction 0..1 (``nan`` when nvidia-smi has no value).
        memoryUtil: ``memoryUsed / memoryTotal`` (``nan`` when either is unknown, or the total is 0).
        memoryTotal: total memory in MiB (float).
        memoryUsed: used memory in MiB (float).
        memoryFree: free memory in MiB (float).
        driver: the driver version string.
        name: the product name.
        serial: the board serial, as printed (``[N/A]`` on GeForce).
        display_mode: as printed (``[Requested functionality has been deprecated]`` on drivers 590+).
        display_active: as printed (``Enabled``/``Disabled``).
        temperature: GPU temperature in degrees C (float).
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
        """Build a GPU from GPUtil's twelve values (positional order as in GPUtil)."""
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
    """Query every GPU once.

    Returns:
        One :class:`GPU` per GPU, in nvidia-smi's order (``[]`` when nvidia-smi lists none).

    Raises:
        NvidiaSmiNotFoundError: no nvidia-smi (GPUtil returns ``[]``).
        NvidiaSmiTimeoutError: no answer within :data:`TIMEOUT` seconds (GPUtil waits forever).
        NvidiaSmiFailedError: nvidia-smi failed, as its typed subclass with the driver's message (GPUtil raises
            ``ValueError`` from parsing the message as a GPU index).
        ParseError: output that does not fit the twelve columns.
    """
    argv = build_argv(find_nvidia_smi(), _resolved())
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
        if len(cells) != len(_FIELDS) or not cells[0].strip().isdigit():
            raise ParseError(f"expected {len(_FIELDS)} cells starting with a GPU index", lineno=lineno, line=line)
        index, uuid, util, total, used, free, driver, name, serial, active, mode, temp = cells
        gpus.append(
            GPU(
                int(index),
                uuid,
                _number(util) / 100,
                _number(total),
                _number(used),
                _number(free),
                driver,
                name,
                serial,
                mode,
                active,
                _number(temp),
            )
        )
    return gpus


@functools.cache
def _resolved() -> tuple[Field, ...]:
    return resolve_fields(_FIELDS)


def getAvailability(
    GPUs: Sequence[GPU],
    maxLoad: float = 0.5,
    maxMemory: float = 0.5,
    memoryFree: float = 0,
    includeNan: bool = False,
    excludeID: Sequence[int] = [],
    excludeUUID: Sequence[str] = [],
) -> list[int]:
    """Mark each GPU available (1) or not (0).

    A GPU is available when it has at least ``memoryFree`` MiB free (NaN never has), its load is below
    ``maxLoad`` and its memory utilisation below ``maxMemory`` (NaN passes these two only with ``includeNan``),
    and neither its id nor its UUID is excluded.

    Args:
        GPUs: the GPUs to judge.
        maxLoad: load limit, exclusive (0..1).
        maxMemory: memory utilisation limit, exclusive (0..1).
        memoryFree: minimum free memory in MiB, inclusive.
        includeNan: count an unknown load or memory utilisation as low enough.
        excludeID: GPU indices never to report.
        excludeUUID: GPU UUIDs never to report.

    Returns:
        One 1 or 0 per GPU, in order.
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


def _nan_last(attr: str, worst: float) -> Callable[[GPU], float]:
    def key(gpu: GPU) -> float:
        value = getattr(gpu, attr)
        return worst if math.isnan(value) else value

    return key


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
    """The ids of available GPUs (see :func:`getAvailability`), ordered and cut to ``limit``.

    Args:
        order: ``first`` (lowest id), ``last`` (highest id), ``random``, ``load`` (lowest load) or ``memory``
            (lowest memory *utilisation*); NaN sorts last. Any other value keeps nvidia-smi's order.
        limit: at most this many ids.
        maxLoad: see :func:`getAvailability`.
        maxMemory: see :func:`getAvailability`.
        memoryFree: see :func:`getAvailability`.
        includeNan: see :func:`getAvailability`.
        excludeID: see :func:`getAvailability`.
        excludeUUID: see :func:`getAvailability`.

    Returns:
        GPU indices.

    Raises:
        SmiqueryError: as :func:`getGPUs`.
    """
    gpus = getGPUs()
    marks = getAvailability(
        gpus,
        maxLoad=maxLoad,
        maxMemory=maxMemory,
        memoryFree=memoryFree,
        includeNan=includeNan,
        excludeID=excludeID,
        excludeUUID=excludeUUID,
    )
    chosen = [gpu for gpu, mark in zip(gpus, marks) if mark == 1]
    if order == "first":
        chosen.sort(key=_nan_last("id", math.inf))
    elif order == "last":
        chosen.sort(key=_nan_last("id", -math.inf), reverse=True)
    elif order == "random":
        # the same call on the global generator as GPUtil, so that a seeded run picks the same GPUs
        chosen = [chosen[i] for i in random.sample(range(len(chosen)), len(chosen))]
    elif order == "load":
        chosen.sort(key=_nan_last("load", math.inf))
    elif order == "memory":
        chosen.sort(key=_nan_last("memoryUtil", math.inf))
    return [gpu.id for gpu in chosen[0 : min(limit, len(chosen))]]


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
    """Look for an available GPU up to ``attempts`` times, ``interval`` seconds apart.

    Args:
        order: see :func:`getAvailable`.
        maxLoad: see :func:`getAvailability`.
        maxMemory: see :func:`getAvailability`.
        attempts: how many times to look.
        interval: seconds to sleep between attempts.
        verbose: print each attempt and the result, as GPUtil does.
        includeNan: see :func:`getAvailability`.
        excludeID: see :func:`getAvailability`.
        excludeUUID: see :func:`getAvailability`.

    Returns:
        A list holding the one id found (a list, as in GPUtil).

    Raises:
        RuntimeError: no GPU was available in any attempt (GPUtil's message).
        SmiqueryError: as :func:`getGPUs`.
    """
    available: list[int] = []
    for i in range(attempts):
        if verbose:
            print(f"Attempting ({i + 1}/{attempts}) to locate available GPU.")
        available = getAvailable(
            order=order,
            limit=1,
            maxLoad=maxLoad,
            maxMemory=maxMemory,
            includeNan=includeNan,
            excludeID=excludeID,
            excludeUUID=excludeUUID,
        )
        if available:
            if verbose:
                print(f"GPU {available} located!")
            break
        if i != attempts - 1:
            time.sleep(interval)
    if not available:
        raise RuntimeError(
            f"Could not find an available GPU after {attempts} attempts with {interval} seconds interval."
        )
    return available


# ------------------------------------------------------------------------------------------- showUtilization

_Column = dict[str, Any]


def _percent(x: float) -> float:
    return x * 100


def _same(x: Any) -> Any:
    return x


_SHORT: list[list[_Column]] = [
    [
        {"attr": "id", "name": "ID"},
        {"attr": "load", "name": "GPU", "suffix": "%", "transform": _percent, "precision": 0},
        {"attr": "memoryUtil", "name": "MEM", "suffix": "%", "transform": _percent, "precision": 0},
    ]
]
_ALL: list[list[_Column]] = [
    [
        {"attr": "id", "name": "ID"},
        {"attr": "name", "name": "Name"},
        {"attr": "serial", "name": "Serial"},
        {"attr": "uuid", "name": "UUID"},
    ],
    [
        {"attr": "temperature", "name": "GPU temp.", "suffix": "C", "transform": _same, "precision": 0},
        {"attr": "load", "name": "GPU util.", "suffix": "%", "transform": _percent, "precision": 0},
        {"attr": "memoryUtil", "name": "Memory util.", "suffix": "%", "transform": _percent, "precision": 0},
    ],
    [
        {"attr": "memoryTotal", "name": "Memory total", "suffix": "MB", "precision": 0},
        {"attr": "memoryUsed", "name": "Memory used", "suffix": "MB", "precision": 0},
        {"attr": "memoryFree", "name": "Memory free", "suffix": "MB", "precision": 0},
    ],
    [
        {"attr": "display_mode", "name": "Display mode"},
        {"attr": "display_active", "name": "Display active"},
    ],
]


def _render(value: Any, width: str, precision: str, name: str) -> str:
    # bool before int would differ from GPUtil, which formats True as an int; keep its isinstance order
    if isinstance(value, float):
        return format(value, f"{width}{precision}f")
    if isinstance(value, int):
        return format(value, f"{width}d")
    if isinstance(value, str):
        return format(value, f"{width}s")
    raise TypeError(f"Unhandled object type ({type(value)}) for attribute '{name}'")


def _table(gpus: Sequence[GPU], groups: list[list[_Column]]) -> list[str]:
    header = ""
    rows = [""] * len(gpus)
    for group in groups:
        for col in group:
            name = col["name"]
            precision = f".{col['precision']}" if "precision" in col else ""
            suffix = str(col.get("suffix", ""))
            transform = col.get("transform", _same)
            values = [transform(getattr(gpu, col["attr"])) for gpu in gpus]
            width = max([len(name)] + [len(_render(v, "", precision, name) + suffix) for v in values])
            header += f"| {name} " + " " * (width - len(name))
            for i, value in enumerate(values):
                rows[i] += "| " + _render(value, str(width - len(suffix)), precision, name) + suffix + " "
        header += "|"
        rows = [row + "|" for row in rows]
    return [header, "-" * len(header), *rows]


def showUtilization(all: bool = False, attrList: Any = None, useOldCode: bool = False) -> None:
    """Print a table of the GPUs, exactly as GPUtil does.

    Args:
        all: every attribute (id, name, serial, UUID, temperature, loads, memory, display) instead of id, GPU %
            and memory %.
        attrList: ignored, as in GPUtil 1.4.0 (which always replaces it with its own columns).
        useOldCode: GPUtil's older fixed-width layout.

    Raises:
        SmiqueryError: as :func:`getGPUs`.
    """
    del attrList  # GPUtil 1.4.0 overwrites it in every branch
    gpus = getGPUs()
    out = sys.stdout
    if useOldCode:
        if all:
            print(
                " ID | Name | Serial | UUID || GPU util. | Memory util. || Memory total | Memory used | Memory free "
                "|| Display mode | Display active |",
                file=out,
            )
            print("-" * 126, file=out)
            for g in gpus:
                print(
                    f" {g.id:2d} | {g.name:s}  | {g.serial:s} | {g.uuid:s} || {g.load * 100:3.0f}% "
                    f"| {g.memoryUtil * 100:3.0f}% || {g.memoryTotal:.0f}MB | {g.memoryUsed:.0f}MB "
                    f"| {g.memoryFree:.0f}MB || {g.display_mode:s} | {g.display_active:s}",
                    file=out,
                )
        else:
            print(" ID  GPU  MEM", file=out)
            print("-" * 14, file=out)
            for g in gpus:
                print(f" {g.id:2d} {g.load * 100:3.0f}% {g.memoryUtil * 100:3.0f}%", file=out)
        return
    for line in _table(gpus, _ALL if all else _SHORT):
        print(line, file=out)
