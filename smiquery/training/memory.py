"""The framework's own view of its GPU memory (TensorFlow, PyTorch) beside the driver's ``memory.used``, per epoch."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from smiquery.alerts import AlertEvent, Rule

__all__ = [
    "GROWTH_RULE_TEXT",
    "FrameworkMemory",
    "MemoryView",
    "TensorFlowMemory",
    "TorchMemory",
    "gap_event",
    "gap_grew",
    "torch_memory",
]

# the gap between driver-used and framework memory must grow this much (MiB) over _GAP_EPOCHS epochs in a row
_GAP_GROWTH_MIB = 256.0
_GAP_EPOCHS = 3
_MIB = 2.0**20
_NO_GAP = "the driver-vs-framework memory gap is not reported"
#: The ``text`` of the rule a growing memory gap is reported under (the alert's name for handlers).
GROWTH_RULE_TEXT = "memory gap grew epoch over epoch"


@dataclass(frozen=True)
class MemoryView:
    """What a framework says about its memory on CUDA device ``ordinal``, in bytes (None where it does not say).

    ``current``: held by live tensors; ``peak``: the most that has been; ``reserved``: its caching allocator's pool.
    """

    ordinal: int
    current: float | None
    peak: float | None = None
    reserved: float | None = None

    def values(self, idx: int, used_mib: float | None) -> dict[str, float]:
        """GPU ``idx``'s epoch keys: this view in MiB and ``gpuN_mem_gap_mib``, the driver's ``used_mib`` beyond it."""
        mine = {"": self.current, "_peak": self.peak, "_reserved": self.reserved}
        out = {f"gpu{idx}_mem_framework{k}_mib": v / _MIB for k, v in mine.items() if v is not None}
        top = max((v for v in mine.values() if v is not None), default=None)
        out[f"gpu{idx}_mem_gap_mib"] = math.nan if used_mib is None or top is None else used_mib - top / _MIB
        return out


class FrameworkMemory(Protocol):
    """A framework's view of its GPU memory (TensorFlow, PyTorch), read at each epoch's end."""

    name: str

    def available(self) -> str | None:
        """None when the view can be read; otherwise why not, in one line."""

    def read(self) -> list[MemoryView]:
        """The view of every device the framework uses."""


def gap_event(
    idx: int, uuid: str | None, framework: str, view: MemoryView, history: Sequence[float], at: datetime
) -> tuple[str, AlertEvent]:
    """The warning and the alert event (``at`` a time) for GPU ``idx``'s gap that grew over ``history`` (MiB)."""
    rule = replace(Rule.parse(f"memory.used > {max(0, int(history[0]))}"), text=GROWTH_RULE_TEXT)
    event = AlertEvent(rule, idx, uuid, round(history[-1], 1), "firing", at, at, 0.0)
    said = (
        f"by {history[-1]:.0f} MiB, and the difference grew for {len(history) - 1} epochs in a row "
        f"(+{history[-1] - history[0]:.0f} MiB)."
    )
    if view.reserved is not None:
        note = (
            f"the memory the driver reports used on GPU {idx} exceeds what {framework}'s allocator reserves {said} "
            f"That memory is outside {framework}'s pool: another process, a leaked CUDA context or a library "
            "allocating on its own; check `smiquery ps`"
        )
    else:
        note = (
            f"the memory the driver reports used on GPU {idx} exceeds {framework}'s "
            f"{'peak allocation' if view.peak else 'allocation'} {said} {framework} does not report its allocator's "
            "reserved pool, so part of this may be its own pool growing; the rest is another process, a leaked "
            "context or a library allocating on its own; check `smiquery ps`"
        )
    return note, event


def gap_grew(gaps: dict[int, deque[float]], idx: int, gap: float) -> list[float] | None:
    """Add GPU ``idx``'s gap this epoch (MiB, NaN ignored) to ``gaps``; its history when it grew every epoch, enough."""
    if math.isnan(gap):
        return None
    history = gaps.setdefault(idx, deque(maxlen=_GAP_EPOCHS + 1))
    history.append(gap)
    grew = len(history) > _GAP_EPOCHS and all(b > a for a, b in itertools.pairwise(history))
    return list(history) if grew and history[-1] - history[0] >= _GAP_GROWTH_MIB else None


class TorchMemory:
    """PyTorch's view of its GPU memory: allocated (current), peak and reserved (its caching allocator's pool)."""

    name = "PyTorch"

    def available(self) -> str | None:
        """None when ``torch.cuda`` can be asked; else why not."""
        try:
            import torch
        except Exception as exc:
            return f"cannot import torch ({exc}): {_NO_GAP}"
        if not torch.cuda.is_available():
            build = "a CPU-only build" if not torch.version.cuda else "unable to use CUDA here"
            return f"PyTorch is {build} while nvidia-smi sees GPUs: training runs on the CPU and {_NO_GAP}"
        return None

    def read(self) -> list[MemoryView]:
        """Every CUDA device PyTorch sees."""
        import torch

        return [
            MemoryView(
                k,
                float(torch.cuda.memory_allocated(k)),
                float(torch.cuda.max_memory_allocated(k)),
                float(torch.cuda.memory_reserved(k)),
            )
            for k in range(torch.cuda.device_count())
        ]


#: PyTorch's memory view, for ``framework=`` of :func:`~smiquery.training.watch.watch` (imports torch when read).
torch_memory = TorchMemory


class TensorFlowMemory:
    """TensorFlow's view of its GPU memory (``tf.config.experimental.get_memory_info``: current and peak)."""

    name = "TensorFlow"

    def available(self) -> str | None:
        """None when TensorFlow can report memory for its GPUs; else why not (a CPU-only build is named)."""
        try:
            import keras
        except Exception as exc:
            return f"cannot import keras ({exc}): {_NO_GAP}"
        backend = keras.backend.backend()
        if backend != "tensorflow":
            return (
                f"the Keras backend is {backend}: the framework's memory view is read only with TensorFlow; {_NO_GAP}"
            )
        try:
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
            cuda = bool(tf.test.is_built_with_cuda())
        except Exception as exc:
            return f"cannot ask TensorFlow for its GPUs ({exc}): the memory gap is not reported"
        if gpus:
            return None
        if not cuda:
            return (
                "TensorFlow is a CPU-only build (tf.test.is_built_with_cuda() is False) while nvidia-smi sees GPUs: "
                f"this training runs on the CPU (install the CUDA build, e.g. tensorflow[and-cuda]); {_NO_GAP}"
            )
        return (
            "TensorFlow sees no GPU although nvidia-smi does (CUDA_VISIBLE_DEVICES, or CUDA libraries that do not "
            f"match the driver; see TensorFlow's start-up log): {_NO_GAP}"
        )

    def read(self) -> list[MemoryView]:
        """Current and peak bytes of each GPU TensorFlow sees."""
        import tensorflow as tf

        out: list[MemoryView] = []
        for k in range(len(tf.config.list_physical_devices("GPU"))):
            info = tf.config.experimental.get_memory_info(f"GPU:{k}")
            peak = info.get("peak")
            out.append(MemoryView(k, float(info.get("current", 0)), float(peak) if peak else None, None))
        return out
