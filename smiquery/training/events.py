"""The alerts of a training run: the default rules, the training position each alert carries, the handler thread."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from smiquery.alerts import BUILTIN_RULES, AlertEvent

if TYPE_CHECKING:
    from smiquery.alerts import Notifier

__all__ = ["TRAINING_RULES", "TRAINING_STALL_SECONDS", "HandlerWorker", "Position", "TrainingAlert", "stall_rule"]

_EVENT_QUEUE = 1000


#: Seconds of ``smiquery report``'s stall condition after which the training monitor alerts: long enough to ignore a
#: checkpoint or an evaluation pass, short enough to be useful during a run.
TRAINING_STALL_SECONDS = 60.0


def stall_rule(seconds: float = TRAINING_STALL_SECONDS) -> str:
    """The stall alert: ``smiquery report``'s stall condition held for ``seconds``, as an expression."""
    from smiquery.alerts.rules import STALL

    return f"utilization.gpu < {STALL.utilization:g} for {seconds:g}s while memory.used >= {STALL.busy_memory_mib:g}"


#: The default rules of a training monitor: the built-in health rules, the fleet's 30-minute idle rule replaced by
#: :func:`stall_rule`.
TRAINING_RULES: tuple[str, ...] = (
    *(r for r in BUILTIN_RULES if not r.startswith("utilization.gpu <")),
    stall_rule(),
)


class Position(NamedTuple):
    """Where training was at one moment.

    Attributes:
        epoch: the epoch (0-based) or None before the first.
        batch: steps taken in this epoch (the batch in progress), or None.
        step: steps taken since training began.
        phase: ``"setup"``, ``"train"``, ``"validation"`` or ``"done"``.
    """

    epoch: int | None
    batch: int | None
    step: int
    phase: str


@dataclass(frozen=True)
class TrainingAlert:
    """An alert ``event`` with where training was when its sample arrived.

    The fields of :class:`Position` (``step``: the framework's count where it has one) and the ``learning_rate``
    then, if the adapter can read it.
    """

    event: AlertEvent
    epoch: int | None
    batch: int | None
    step: int | None
    learning_rate: float | None
    phase: str

    @classmethod
    def at(
        cls, event: AlertEvent, pos: Position, extra: Callable[[], Mapping[str, Any]] | None = None
    ) -> TrainingAlert:
        """The event where training was at ``pos``; ``extra`` may add the learning rate and the framework's step."""
        lr: float | None = None
        step: int | None = pos.step
        if extra is not None:
            try:
                got = extra()
                lr = got.get("learning_rate")
                step = got.get("step", step)
            except Exception:  # a half-built or torn-down model: context without these
                pass
        return cls(event, pos.epoch, pos.batch, step, lr, pos.phase)

    def context(self) -> dict[str, Any]:
        """The context as handlers receive it."""
        return {name: getattr(self, name) for name in ("epoch", "batch", "step", "learning_rate", "phase")}

    def to_dict(self) -> dict[str, Any]:
        """The event and its context as one JSON-ready dict."""
        return {**self.event.to_dict(), **self.context()}


class HandlerWorker:
    """Alert handlers on their own thread behind a bounded queue, so that a slow webhook delays nothing.

    ``notifier()`` gives the notifier whose handlers get each event (read at dispatch: a monitor may replace it).
    """

    def __init__(self, notifier: Callable[[], Notifier | None]) -> None:
        self._notifier = notifier
        self._events: queue.Queue[tuple[AlertEvent, dict[str, Any]] | None] = queue.Queue(_EVENT_QUEUE)
        self._thread = threading.Thread(target=self._work, name="smiquery-monitor-handlers", daemon=True)
        #: CPU seconds of the handler thread, once it ended
        self.cpu = 0.0
        self._thread.start()

    def put(self, event: AlertEvent, context: dict[str, Any]) -> bool:
        """Queue one event for the handlers; False when the queue is full and the event is dropped."""
        try:
            self._events.put_nowait((event, context))
        except queue.Full:
            return False
        return True

    def _work(self) -> None:
        try:
            while True:
                item = self._events.get()
                if item is None:
                    return
                notifier = self._notifier()
                if notifier is not None:
                    notifier.dispatch(*item)
        finally:
            self.cpu = time.thread_time()

    def close(self) -> None:
        """End the thread after the queued events (waiting at most about three seconds)."""
        try:
            self._events.put(None, timeout=1.0)
        except queue.Full:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)
