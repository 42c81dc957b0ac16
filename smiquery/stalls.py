"""What a stall is: one definition shared by ``smiquery report``, ``smiquery plot`` and the training monitor.

A GPU is *stalled* while a job holds it (``memory.used`` at least :attr:`StallRule.busy_memory_mib`) but gives
it no work (``utilization.gpu`` under :attr:`StallRule.utilization`). A stretch of that lasting at least
:attr:`StallRule.min_seconds` is reported as a stall. Without ``memory.used``, utilization alone decides.
Imports nothing heavy, so live code can use it per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["STALL", "StallRule"]


@dataclass(frozen=True)
class StallRule:
    """The stall definition.

    Attributes:
        utilization: utilization (percent) under which a GPU does no useful work.
        busy_memory_mib: memory used (MiB) from which a GPU counts as held by a job (an idle GPU without a job
            is not stalled).
        min_seconds: the shortest stretch reported as a stall.
    """

    utilization: float = 20.0
    busy_memory_mib: float = 1024.0
    min_seconds: float = 30.0

    def is_stalled(self, utilization: float | None, memory_used: float | None = None) -> bool | None:
        """Whether one sample shows a stalled GPU.

        Args:
            utilization: the sample's ``utilization.gpu`` (percent), None when missing.
            memory_used: its ``memory.used`` (MiB); None when missing or not recorded (utilization decides).

        Returns:
            True or False; None when the utilization is missing (the sample decides nothing).
        """
        if utilization is None:
            return None
        if utilization >= self.utilization:
            return False
        return memory_used is None or memory_used >= self.busy_memory_mib

    def mask(self, utilization: np.ndarray, memory_used: np.ndarray | None = None) -> np.ndarray:
        """:meth:`is_stalled` over arrays: 1.0 stalled, 0.0 not, NaN where a deciding value is missing.

        Args:
            utilization: ``utilization.gpu`` per sample as float64, NaN where missing.
            memory_used: ``memory.used`` per sample as float64 (NaN where missing), or None.

        Returns:
            A float64 array of the same length.
        """
        import numpy as np

        with np.errstate(invalid="ignore"):
            out = np.where(np.isnan(utilization), np.nan, (utilization < self.utilization).astype("float64"))
            if memory_used is not None:
                held = np.where(np.isnan(memory_used), np.nan, (memory_used >= self.busy_memory_mib).astype("float64"))
                out = np.where((out == 0) | (held == 0), 0.0, np.where(np.isnan(out) | np.isnan(held), np.nan, 1.0))
        return np.asarray(out, dtype="float64")


#: The default stall definition (20% utilization, 1 GiB held, 30 s).
STALL = StallRule()
