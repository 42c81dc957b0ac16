"""asyncio API: ``await query(...)`` and ``async with stream(...) as s: async for sweep in s.sweeps(): ...``.

The sync API's guarantees without blocking the event loop (cancellation included): the stream engine driven on the
event loop over :mod:`smiquery.runner.aio`'s children.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import tzinfo
from typing import TypeVar

from smiquery.errors import SmiqueryError, StreamEndedError
from smiquery.fields import FieldsArg, resolve_fields
from smiquery.retry import RetryPolicy
from smiquery.runner import find_nvidia_smi
from smiquery.runner.aio import AsyncLines, live_children, run, start_loop_child
from smiquery.sample import GpuSample
from smiquery.source import StreamEvent, Sweep
from smiquery.sources.query_gpu import CsvParser, check_and_parse
from smiquery.streams.argv import GpusArg, build_argv, normalize_gpus
from smiquery.streams.sweeps import CsvSource

__all__ = ["AsyncStream", "live_children", "query", "stream"]

T = TypeVar("T")


async def query(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """:func:`smiquery.query` (its arguments but ``runner``, its records and errors) without blocking the event loop."""
    flds = resolve_fields(fields)
    argv = build_argv(find_nvidia_smi(nvidia_smi), flds, normalize_gpus(gpus))
    return check_and_parse(argv, await run(argv, timeout), CsvParser(flds, tz=tz), flds)


class AsyncStream(CsvSource):
    """One long-lived nvidia-smi in loop mode, read without blocking the event loop; ``stream`` is this class.

    Example::

        async with smiquery.aio.stream("health", interval=0.5) as s:
            async for sweep in s.sweeps(count=10):
                print(max(x.temperature_gpu or 0 for x in sweep))

    The arguments, the attributes and the errors raised before anything runs are :class:`smiquery.Stream`'s;
    ``sleep`` waits between restarts (tests inject one). Nothing runs until ``async for sample in s`` or
    :meth:`sweeps` iterates it, one iteration at a time (one child per stream); leaving ``async with``,
    :meth:`aclose` or cancelling the iterating task reaps the child.
    """

    def __init__(
        self,
        fields: FieldsArg = "default",
        *,
        interval: float = 1.0,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        stall_timeout: float | None = None,
        startup_timeout: float = 45.0,
        retry: RetryPolicy | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tz: tzinfo | None = None,
    ) -> None:
        super().__init__(
            fields,
            interval=interval,
            gpus=gpus,
            binary=find_nvidia_smi(nvidia_smi),
            startup_timeout=startup_timeout,
            stall_timeout=stall_timeout,
            retry=retry,
            on_event=on_event,
            tz=tz,
        )
        self._sleep = sleep
        self._child: AsyncLines | None = None
        self._busy = False

    async def _batches(self) -> AsyncIterator[list[GpuSample | Sweep]]:
        """The engine's items in the batches they arrive in (one read of output): one generator step per read."""
        if self._busy:
            raise RuntimeError("this stream is already being iterated (one child per stream)")
        self._busy = True
        engine = self._engine
        clock = time.monotonic
        engine.begin(clock())
        try:
            while not engine.done and engine.starting(clock()):
                got: tuple[list[GpuSample | Sweep], float] | None = ([], 0.0)
                child: AsyncLines | None = None
                try:
                    child = AsyncLines(await start_loop_child(self.argv), self.argv)
                    self._child = child
                    engine.started(clock())
                    while not engine.done and not engine.stopped(0.0):
                        lines = await child.readlines(engine.deadline())
                        if lines is None:
                            if child.timed_out:
                                hung = engine.expired(clock())
                                if hung is None:
                                    return
                                raise hung
                            await child.finish(self.stall_timeout)  # a non-zero exit raises its typed error
                            raise StreamEndedError(self.argv, 0, "", "nvidia-smi ended its loop; restarting")
                        items = engine.feed(lines, clock(), child.idle)
                        self._emit(engine.take_events())
                        if items:
                            yield items
                except SmiqueryError as exc:
                    got = engine.failed(exc, clock(), time.time())
                finally:
                    self._emit(engine.take_events())
                    self._child = None
                    if child is not None:
                        await child.close()
                if got is None:
                    return
                cut, delay = got
                if cut and not engine.closed:
                    yield cut
                if delay > 0:
                    await self._sleep(delay)
        except BaseException as exc:
            if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
                self.stats.state = "failed"
                self.error = exc
            raise
        finally:
            engine.finish()
            self._busy = False

    def __aiter__(self) -> AsyncIterator[GpuSample]:
        return self._only(GpuSample, None)

    def sweeps(self, count: int | None = None) -> AsyncIterator[Sweep]:
        """Yield whole sweeps (one sample per GPU for one instant), as the sync stream does; ``count``: stop after."""
        return self._only(Sweep, count)

    async def _only(self, kind: type[T], count: int | None) -> AsyncIterator[T]:
        done = 0
        batches = self._batches()
        try:
            async for batch in batches:
                for item in batch:
                    if isinstance(item, kind):
                        yield item
                        done += 1
                        if done == count:
                            return
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        """Stop: terminate and reap the child. Idempotent."""
        self._engine.close()
        if self.stats.state != "failed":
            self.stats.state = "closed"
        if self._child is not None:  # no await between the check and the call: the reader cannot clear it
            await self._child.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


#: ``smiquery.aio.stream(...)`` is ``AsyncStream(...)``.
stream = AsyncStream
