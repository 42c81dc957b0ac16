"""A hand-written training loop (any framework) under one nvidia-smi: :func:`watch` and its :class:`Watch`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from smiquery._log import get_logger
from smiquery.training.monitor import MonitorView, RunMonitor
from smiquery.training.outputs import run_monitor

__all__ = ["Watch", "watch"]

log = get_logger("smiquery.training.watch")


class Watch(MonitorView):
    """A started :class:`RunMonitor` (``monitor``) for a hand-written loop, as :func:`watch` returns it."""

    def __init__(self, monitor: RunMonitor, on_epoch: Callable[[int, dict[str, float]], object] | None) -> None:
        self.monitor = monitor
        self.on_epoch = on_epoch
        self._epoch: int | None = None

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield the items of a data loader (any iterable), timing each fetch as data wait."""
        it = iter(iterable)
        began = time.perf_counter()
        for item in it:
            self.monitor.add_data_wait(time.perf_counter() - began)
            yield item
            began = time.perf_counter()

    def step(self, epoch: int | None = None, batch: int | None = None, *, samples: int | None = None) -> None:
        """One step is done (see :meth:`RunMonitor.step`); a new ``epoch`` summarises the previous one."""
        if epoch is not None and epoch != self._epoch:
            self.end_epoch()  # the previous one, if any
            self._epoch = epoch
            self.monitor.begin_epoch(epoch)
        self.monitor.step(None, batch, samples=samples)

    def end_epoch(self) -> dict[str, float]:
        """Summarise the current epoch now and return its keys (else done by the next epoch's first step or the end)."""
        if self._epoch is None:
            return {}
        epoch, self._epoch = self._epoch, None
        values = self.monitor.end_epoch(epoch)
        if self.on_epoch is not None:
            try:
                self.on_epoch(epoch, values)
            except Exception:
                log.exception("smiquery: the on_epoch function failed")
        return values

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.end_epoch()
        finally:
            self.monitor.close()


def watch(
    fields: str | Sequence[str] | None = None,
    interval: float = 1.0,
    *,
    on_epoch: Callable[[int, dict[str, float]], object] | None = None,
    **options: Any,
) -> Watch:
    """Monitor a hand-written training loop (any framework) with one nvidia-smi; started at once.

    Use it as ``with watch(...) as w:``, fetch batches through ``w.batches(loader)`` (that time is data wait) and call
    ``w.step(epoch=, batch=, samples=)`` after each step (the Training page of the docs has an example).
    ``on_epoch(epoch, values)`` is called when an epoch is summarised; the other arguments are
    :func:`~smiquery.training.outputs.run_monitor`'s. Leaving the context summarises the last epoch and reaps
    nvidia-smi.
    """
    return Watch(run_monitor(fields, interval, **options).start(), on_epoch)
