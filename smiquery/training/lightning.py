"""A PyTorch Lightning callback that watches the GPUs during ``trainer.fit``: :class:`GpuMonitor`.

``pip install 'smiquery[lightning]'``. It maps Lightning's hooks onto :class:`smiquery.training.monitor.RunMonitor`;
``import smiquery`` never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError(
            "smiquery.training.lightning needs PyTorch Lightning: pip install 'smiquery[lightning]'"
        ) from exc

from smiquery.training.memory import TorchMemory
from smiquery.training.monitor import MonitorView
from smiquery.training.outputs import run_monitor

__all__ = ["GpuMonitor"]


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch: the length of a tensor, or of the first tensor of a tuple, list or dict."""
    first = batch
    for _ in range(3):
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        elif isinstance(first, Mapping) and first:
            first = next(iter(first.values()))
        else:
            break
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return None


class GpuMonitor(Callback, MonitorView):  # type: ignore[misc]
    """Watches the GPUs while ``trainer.fit`` runs and logs what it saw per epoch through the trainer's loggers.

    The keys of :class:`~smiquery.training.monitor.RunMonitor` (with PyTorch's memory view), prefixed with
    ``prefix``, are logged at the epoch's last global step; :attr:`epochs` keeps them too. Data wait is the time
    from one ``on_train_batch_end`` to the next ``on_train_batch_start``. nvidia-smi is stopped and reaped at the
    end of fit, on an exception and at teardown. Under DDP one monitor per host (local rank 0) watches every GPU of
    the host and counts the samples of all its ranks (each takes a batch of the same size per step).

    ``fields``, ``interval`` and ``**options`` are :func:`~smiquery.training.outputs.run_monitor`'s
    (``log_every="batch"`` also logs the newest sample at every step); ``prefix`` goes before every logged key
    (``"gpu/"`` groups them in TensorBoard); ``framework_memory``: read PyTorch's memory view per device.
    """

    def __init__(
        self,
        fields: str | Sequence[str] | None = None,
        interval: float = 1.0,
        *,
        prefix: str = "",
        framework_memory: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        framework = TorchMemory() if framework_memory else None
        self.monitor = run_monitor(fields, interval, framework=framework, **options)
        self.prefix = prefix
        self._trainer: Any = None
        self._ranks_here = 1
        self.monitor.context_extra = self._context

    def _context(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:
            return {}
        out: dict[str, Any] = {"step": int(trainer.global_step)}
        with contextlib.suppress(Exception):
            out["learning_rate"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        return out

    def _log(self, trainer: Any, values: Mapping[str, float]) -> None:
        if not values:
            return
        metrics = {f"{self.prefix}{k}": v for k, v in values.items()}
        for logger in getattr(trainer, "loggers", None) or []:
            try:
                logger.log_metrics(metrics, step=int(trainer.global_step))
            except Exception as exc:
                self.monitor.say(f"logging GPU numbers to {type(logger).__name__} failed: {exc}", key="log-failed")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the background nvidia-smi (on local rank 0 only: one per host)."""
        self._trainer = trainer
        if getattr(trainer, "local_rank", 0) != 0:
            return
        # the host's monitor sums the energy of all its ranks' GPUs, so it counts the samples of all of them
        world = int(getattr(trainer, "world_size", 1) or 1)
        nodes = int(getattr(trainer, "num_nodes", 1) or 1)
        self._ranks_here = max(1, world // max(1, nodes))
        self.monitor.start()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Samples from now on belong to this epoch."""
        self.monitor.begin_epoch(int(trainer.current_epoch))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A step starts: the time since the previous step ended is data wait."""
        self.monitor.step_begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A step is done: count it and its samples."""
        n = _batch_size(batch)
        samples = n * self._ranks_here if n is not None else None
        self.monitor.step(None, batch_idx, samples=samples, step=int(trainer.global_step))
        self._log(trainer, self.monitor.batch_values())  # empty unless log_every="batch"

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Validation starts (alerts say phase ``validation``)."""
        if not getattr(trainer, "sanity_checking", False):
            self.monitor.phase("validation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Validation ends."""
        self.monitor.phase("train")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Summarise the epoch and log it."""
        self.monitor.phase("train")
        self._log(trainer, self.monitor.end_epoch(int(trainer.current_epoch)))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Stop nvidia-smi (reaped) and the threads."""
        self.monitor.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fit raised: stop nvidia-smi at once."""
        self.monitor.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The trainer is done with this stage: make sure nothing is left running."""
        if stage == "fit":
            self.monitor.close()
