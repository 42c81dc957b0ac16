"""Argument lists: GPU ids and fields checked before anything runs, and the nvidia-smi command lines built from them.

Every caller (one-shot calls, the CSV, pmon and asyncio streams, replays, the exporter) validates ids here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from smiquery.errors import InvalidGpuIdError

if TYPE_CHECKING:
    from smiquery.fields import Field

__all__ = ["GpusArg", "build_argv", "normalize_gpus"]

GpusArg = int | str | Sequence[int | str] | None

_UUID_RE = re.compile(r"(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_BUS_RE = re.compile(r"([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def normalize_gpus(gpus: GpusArg) -> tuple[str, ...]:
    """Validate GPU ids (one, a comma list or a sequence of indices, UUIDs or PCI bus ids; None: all) for ``-i``.

    Raises InvalidGpuIdError for an id that is none of the three forms.
    """
    if gpus is None:
        return ()
    out: list[str] = []
    for item in [gpus] if isinstance(gpus, (int, str)) else list(gpus):
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            item = str(item)
        if not isinstance(item, str):
            raise InvalidGpuIdError(item)
        for part in item.split(","):
            part = part.strip()
            if part.isdigit() and part.isascii():
                out.append(str(int(part)))
            elif _UUID_RE.fullmatch(part) or _BUS_RE.fullmatch(part):
                out.append(part)
            else:
                raise InvalidGpuIdError(part)
    if not out:
        raise InvalidGpuIdError(gpus)
    return tuple(dict.fromkeys(out))


def build_argv(
    binary: str, fields: Sequence[Field], gpus: Sequence[str] = (), *, interval: float | None = None
) -> list[str]:
    """The nvidia-smi argument list for a query (one-shot, or loop mode when ``interval`` is given).

    Whole seconds use ``-l N``; anything else uses ``-lms N`` (milliseconds, at least 1).
    """
    argv = [binary, "--query-gpu=" + ",".join(f.argv_name for f in fields), "--format=csv,noheader,nounits"]
    if gpus:
        argv += ["-i", ",".join(gpus)]
    if interval is not None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        if interval >= 1 and float(interval).is_integer():
            argv += ["-l", str(int(interval))]
        else:
            argv += ["-lms", str(max(1, round(interval * 1000)))]
    return argv
