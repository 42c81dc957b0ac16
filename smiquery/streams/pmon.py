"""The pmon stream: the thread driver of :mod:`smiquery.sources.pmon`, as :mod:`.sync` is the CSV stream's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterator
from itertools import islice

from smiquery.retry import RetryPolicy
from smiquery.runner import Runner, default_runner, find_nvidia_smi
from smiquery.source import StreamEvent, StreamStats
from smiquery.sources.pmon import InstantGrouper, PmonRow, PmonRows, build_pmon_argv
from smiquery.streams.argv import GpusArg, normalize_gpus
from smiquery.streams.engine import Engine
from smiquery.streams.sync import ThreadDriver

__all__ = ["PmonStream", "stream"]


class PmonStream(ThreadDriver[PmonRow]):
    """Watch per-process GPU use with one supervised ``nvidia-smi pmon`` child; ``stream`` is this class.

    Example::

        with smiquery.streams.pmon.stream(interval=1) as p:
            for instant in p.samples(count=5):
                for row in top_processes(instant, 3)[0]:
                    print(row.pid, row.command, row.sm)

    Iterate it for rows, :meth:`samples` for instants. ``gpus``: at most 4 (a pmon limit; None: the first 4);
    ``interval``: seconds, 1..10; ``count``: stop after this many samples (the child exits by itself); ``select``:
    ``u`` utilisation and/or ``m`` framebuffer memory; ``options``: ``D`` and/or ``T`` to stamp each line with the
    date and time. The other arguments, the engine and its guarantees are the CSV stream's
    (:class:`smiquery.Stream`); counters in :attr:`stats`. Nothing runs until it is iterated. Raises
    InvalidGpuIdError, NvidiaSmiNotFoundError (no usable binary), or ValueError for an interval, count, select or
    options value pmon would reject, or a bad retry setting.
    """

    def __init__(
        self,
        *,
        gpus: GpusArg = None,
        interval: int = 1,
        count: int | None = None,
        select: str = "um",
        options: str = "DT",
        nvidia_smi: str | os.PathLike[str] | None = None,
        stall_timeout: float | None = None,
        startup_timeout: float = 45.0,
        retry: RetryPolicy | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        runner: Runner | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        ids = normalize_gpus(gpus)
        runner = runner or default_runner()
        binary = find_nvidia_smi(nvidia_smi, runner=runner)
        self.argv = tuple(build_pmon_argv(binary, ids, interval=interval, count=count, select=select, options=options))
        #: The :class:`~smiquery.retry.RetryPolicy` this stream runs under.
        self.retry_policy = retry if retry is not None else RetryPolicy()
        self.on_event = on_event
        self.stats = StreamStats()
        events: list[StreamEvent] = []
        self._engine: Engine[PmonRow] = Engine(
            PmonRows(self.stats, events.append),
            self.argv,
            self.retry_policy,
            startup_timeout=startup_timeout,
            stall_timeout=stall_timeout if stall_timeout is not None else max(3.0 * interval, 10.0),
            stats=self.stats,
            events=events,
        )
        super().__init__(runner, sleep, finite=count is not None)

    def __iter__(self) -> Generator[PmonRow, None, None]:
        return self._items()

    def samples(self, count: int | None = None) -> Iterator[tuple[PmonRow, ...]]:
        """Yield one tuple of rows per instant (see :class:`InstantGrouper`), at most ``count``.

        Each is yielded when the next begins (the last at the end); an instant cut by a restart is dropped.
        """
        return islice(self._instants(), count)

    def _instants(self) -> Generator[tuple[PmonRow, ...], None, None]:
        grouper = InstantGrouper()
        child = self.stats.starts
        with contextlib.closing(self._items()) as rows:
            for row in rows:
                if self.stats.starts != child:
                    grouper.discard()  # cut short by a restart: possibly incomplete, so not an instant
                    child = self.stats.starts
                sample = grouper.feed(row)
                if sample is not None:
                    yield sample
        last = grouper.flush()
        if last is not None:
            yield last


#: ``smiquery.streams.pmon.stream(...)`` is ``PmonStream(...)``.
stream = PmonStream
