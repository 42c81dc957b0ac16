"""A Keras callback that watches the GPUs during ``model.fit``: :class:`GpuMonitor` (``pip install 'smiquery[keras]'``).

It maps Keras's hooks onto :class:`smiquery.training.monitor.RunMonitor`; ``import smiquery`` never imports it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Sequence
from types import CodeType, FrameType
from typing import Any

import keras

from smiquery._log import get_logger
from smiquery.training.memory import TensorFlowMemory
from smiquery.training.monitor import MonitorView
from smiquery.training.outputs import run_monitor

__all__ = ["GpuMonitor"]

log = get_logger("smiquery.training.keras")

_WATCH_PERIOD = 0.2
# frames of these packages are library code: the watchdog follows the first frame outside them
_LIBRARY = ("keras", "tensorflow", "tf_keras", "smiquery.", "absl", "threading")
# Keras's own callbacks that need no GPU columns (added by Keras itself, after the user's)
_DEFAULT_CALLBACKS = ("History", "ProgbarLogger")


def _scalar(value: Any) -> float | None:
    """A float from a Keras variable, tensor or number; None when it cannot be read."""
    if value is None:
        return None
    try:
        return float(keras.ops.convert_to_numpy(value))
    except Exception:
        try:
            return float(value)
        except Exception:
            return None


class GpuMonitor(keras.callbacks.Callback, MonitorView):  # type: ignore[misc]
    """Watches the GPUs while ``model.fit`` runs and writes what it saw into the epoch logs.

    ``on_train_begin`` starts ONE background nvidia-smi, ``on_train_end`` stops and reaps it; when ``fit`` (or a
    custom loop driving a ``CallbackList``) raises, Keras skips ``on_train_end``, so a watchdog notices the loop
    leaving the stack and stops it within 0.2 s. The batch hooks only count steps and time the data wait.

    Each epoch's logs get the keys of :class:`~smiquery.training.monitor.RunMonitor` (so ``History``, ``CSVLogger``
    and ``TensorBoard`` record them), with TensorFlow's memory view; list ``GpuMonitor`` before the callbacks that
    read logs (it warns once otherwise). With ``log_every="batch"`` each batch's logs also get the newest sample.

    ``fields``, ``interval`` and ``**options`` are :func:`~smiquery.training.outputs.run_monitor`'s;
    ``framework_memory``: read TensorFlow's per-GPU allocation and report the gap to the driver's figure;
    ``batch_size``: samples per step (default: ``fit``'s ``batch_size`` when it was given).
    """

    # the batch hooks only touch memory, so Keras may dispatch them asynchronously
    async_safe = True

    def __init__(
        self,
        fields: str | Sequence[str] | None = None,
        interval: float = 1.0,
        *,
        framework_memory: bool = True,
        batch_size: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        framework = TensorFlowMemory() if framework_memory else None
        self.monitor = run_monitor(fields, interval, framework=framework, **options)
        self.monitor.context_extra = self._context
        self.batch_size = batch_size
        self._batch_size: int | None = batch_size
        self._steps0: int | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Start the background nvidia-smi and the threads that read and watch it."""
        self.close()
        caller = sys._getframe(1)
        self._check_order(caller)
        self.monitor.start()
        steps = _scalar(getattr(self._optimizer(), "iterations", None))
        self._steps0 = None if steps is None else int(steps)
        if self.monitor.running:
            self._watch_loop(caller)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Samples from now on belong to ``epoch``."""
        self.monitor.begin_epoch(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """A step starts: the time since the previous one ended is data wait."""
        self.monitor.step_begin()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """A step is done: count it (and its samples)."""
        self.monitor.step(None, batch, samples=self._batch_size)
        if logs is not None and self.monitor.log_every == "batch":
            logs.update(self.monitor.batch_values())

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Validation inside ``fit`` starts (alerts now say phase ``validation``)."""
        if self.monitor.position.phase == "train":
            self.monitor.phase("validation")

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Validation inside ``fit`` ends."""
        if self.monitor.position.phase == "validation":
            self.monitor.phase("train")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Add the epoch's GPU summary (and the framework's memory view) to ``logs``."""
        self.monitor.phase("train")
        values = self.monitor.end_epoch(epoch)
        if logs is not None and values:
            logs.update(values)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Stop the background nvidia-smi (reaped) and the threads."""
        self.close()

    def _optimizer(self) -> Any:
        try:
            return getattr(self.model, "optimizer", None)
        except Exception:
            return None

    def _learning_rate(self) -> float | None:
        opt = self._optimizer()
        if opt is None:
            return None
        try:
            lr = opt.learning_rate
        except Exception:
            lr = getattr(opt, "lr", None)
        if callable(lr) and not hasattr(lr, "numpy"):
            try:
                lr = lr(opt.iterations)  # a schedule given as a function of the step
            except Exception:
                return None
        return _scalar(lr)

    def _context(self) -> dict[str, Any]:
        """The learning rate and global step, read on the monitor's thread when an alert happens."""
        out: dict[str, Any] = {"learning_rate": self._learning_rate()}
        if self._steps0 is not None:
            out["step"] = self._steps0 + self.monitor.position.step
        return out

    def _check_order(self, caller: FrameType) -> None:
        """Warn once when callbacks that read the logs run before this one (they would get no GPU columns)."""
        try:
            owner = caller.f_locals.get("self")
            callbacks = list(getattr(owner, "callbacks", None) or [])
        except Exception:
            return
        if self not in callbacks:
            return
        before = [
            type(cb).__name__
            for cb in callbacks[: callbacks.index(self)]
            if type(cb).__name__ not in _DEFAULT_CALLBACKS
        ]
        if before:
            self.monitor.say(
                f"GpuMonitor comes after {', '.join(before)} in callbacks: those get no GPU columns in their epoch "
                "logs; list GpuMonitor first",
                key="order",
            )

    def _watch_loop(self, caller: FrameType) -> None:
        """Remember the frame of the loop that drives us, and stop monitoring when it leaves the stack."""
        try:
            model = self.model
        except Exception:
            model = None
        fit: FrameType | None = None
        first_user: FrameType | None = None
        frame: FrameType | None = caller
        while frame is not None:
            if frame.f_code.co_name == "fit":
                with contextlib.suppress(Exception):
                    if frame.f_locals.get("self") is model:
                        fit = frame  # keep going: the outermost fit of this model wins
                        size = frame.f_locals.get("batch_size")
                        if self.batch_size is None and isinstance(size, int):
                            self._batch_size = size
            module = str(frame.f_globals.get("__name__", ""))
            if first_user is None and not module.startswith(_LIBRARY) and frame.f_code.co_name != "<module>":
                first_user = frame  # a custom loop calling CallbackList.on_train_begin itself
            frame = frame.f_back
        found = fit or first_user
        if found is None:
            return  # driven from module level: the interpreter's exit closes it
        # ids only: holding the frame would keep the training data alive after the loop returns
        watched = (threading.get_ident(), id(found), found.f_code)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, args=watched, name="smiquery-keras-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self, tid: int, fid: int, code: CodeType) -> None:
        try:
            while not self._stop.wait(_WATCH_PERIOD):
                frame = sys._current_frames().get(tid)
                while frame is not None and not (id(frame) == fid and frame.f_code is code):
                    frame = frame.f_back
                if frame is None:
                    log.debug("smiquery: the training loop ended without on_train_end (an exception); stopping it")
                    self.monitor.close()
                    return
        finally:
            self.monitor.cost["watchdog_cpu"] = time.thread_time()

    def close(self) -> None:
        """Stop monitoring: the nvidia-smi child is terminated and reaped, the threads end. Idempotent."""
        self._stop.set()
        self.monitor.close()
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(2.0)
        self._watchdog = None

    def __enter__(self) -> GpuMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
