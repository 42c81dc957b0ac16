"""asyncio API: ``await query(...)`` and ``async with stream(...) as s: async for sweep in s.sweeps(): ...``.

The same guarantees as the sync API, without blocking the event loop: one child per stream, a deadline on every
read, the one :class:`~smiquery.retry.RetryPolicy`, typed errors, every child reaped on every path (cancellation
included) and, on Linux, dying with this process. A stream runs the sync stream's engine
(:mod:`smiquery.streams.engine`) through its asyncio driver (:mod:`smiquery.streams.aio`), so sweeps, GPU identity,
counters and events are the same code.
"""

from __future__ import annotations

from smiquery.streams.aio import AsyncStream, live_children, query, stream

__all__ = ["AsyncStream", "live_children", "query", "stream"]
