"""What the callbacks (Keras, Lightning) and a plain loop's ``Watch`` show of their ``RunMonitor``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smiquery.sample import GpuSample
    from smiquery.training.events import TrainingAlert
    from smiquery.training.monitor import RunMonitor


class MonitorView:
    """Read-only views of ``self.monitor``, the same in every framework's callback and in a plain loop's watch."""

    monitor: RunMonitor

    @property
    def alerts(self) -> list[TrainingAlert]:
        """The alerts of the current (or last) run, with their training position."""
        return self.monitor.alerts

    @property
    def epochs(self) -> list[dict[str, float]]:
        """Per epoch, the numbers added to the framework's logs (or handed to ``on_epoch``)."""
        return self.monitor.epochs

    @property
    def notes(self) -> list[str]:
        """Messages said once (monitoring unavailable, rules dropped, framework view missing, growing gap)."""
        return self.monitor.notes

    @property
    def cost(self) -> dict[str, float]:
        """What monitoring cost in the last run (see :attr:`smiquery.training.monitor.RunMonitor.cost`)."""
        return self.monitor.cost

    @property
    def running(self) -> bool:
        """True while the background nvidia-smi is being read."""
        return self.monitor.running

    def latest(self) -> dict[int, GpuSample]:
        """The newest sample of each watched GPU (by nvidia-smi index)."""
        return self.monitor.latest()
