"""asyncio API: ``await query(...)`` and ``async with stream(...) as s: async for sweep in s.sweeps(): ...``.

The same guarantees as the sync API, without blocking the event loop: one child per stream, a deadline on every
read, the one :class:`~smiquery.retry.RetryPolicy`, typed errors, every child reaped on every path (cancellation
included) and, on Linux, dying with this process (:mod:`smiquery.runner.aio`). A stream runs the sync stream's
engine (:mod:`smiquery.streams.engine`) through its asyncio driver (:mod:`smiquery.streams.aio`), so sweeps, GPU
identity, counters and events are the same code.
"""

from __future__ import annotations

import os
from datetime import tzinfo

from smiquery.fields import FieldsArg, resolve_fields
from smiquery.runner import find_nvidia_smi
from smiquery.runner.aio import live_children, run
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser, check_and_parse
from smiquery.streams.aio import AsyncStream, stream
from smiquery.streams.argv import GpusArg, build_argv, normalize_gpus

__all__ = ["AsyncStream", "live_children", "query", "stream"]


async def query(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Take one snapshot without blocking the event loop: one record per GPU.

    Args:
        fields: a preset, ``"a,b,c"`` or a sequence of names.
        gpus: indices, UUIDs or PCI bus ids; None for all.
        nvidia_smi: path of the binary.
        timeout: seconds before the child is killed.
        tz: time zone of the timestamps.

    Returns:
        One record per GPU, as :func:`smiquery.query` returns them.

    Raises:
        InvalidFieldError: an unknown field (before anything runs).
        InvalidGpuIdError: a malformed GPU id (before anything runs).
        NvidiaSmiNotFoundError: no usable binary.
        NvidiaSmiTimeoutError: no answer within ``timeout`` (the child was killed and reaped).
        NvidiaSmiFailedError: a non-zero exit, as its typed subclass.
        ParseError: output that does not fit the fields.
    """
    flds = resolve_fields(fields)
    argv = build_argv(find_nvidia_smi(nvidia_smi), flds, normalize_gpus(gpus))
    return check_and_parse(argv, await run(argv, timeout), CsvParser(flds, tz=tz), flds)
