"""asyncio API: ``await query(...)`` and ``async with stream(...) as s: async for sweep in s.sweeps(): ...``.

The sync API's guarantees without blocking the event loop (cancellation included): a stream runs the sync stream's
engine through its asyncio driver (:mod:`smiquery.streams.aio`).
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

    The arguments, the records and the errors are :func:`smiquery.query`'s (without ``runner``).
    """
    flds = resolve_fields(fields)
    argv = build_argv(find_nvidia_smi(nvidia_smi), flds, normalize_gpus(gpus))
    return check_and_parse(argv, await run(argv, timeout), CsvParser(flds, tz=tz), flds)
