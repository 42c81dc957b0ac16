"""The exporter's process poll: the compute processes listed on their own interval, in a background ``Latest``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from smiquery.errors import SmiqueryError
from smiquery.sources.apps import GpuProcess, processes
from smiquery.sources.latest import Latest
from smiquery.streams.argv import normalize_gpus

if TYPE_CHECKING:
    import os

    from smiquery.streams.argv import GpusArg

__all__ = ["process_poller"]


def process_poller(
    interval: float = 15.0,
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
) -> Latest[tuple[GpuProcess, ...]]:
    """:func:`smiquery.processes` every ``interval`` seconds in a background :class:`Latest`; scrapes read the newest.

    Each poll runs nvidia-smi twice (GPU list and compute apps, ``timeout`` seconds each); a failure is counted
    and logged, never raised.

    Raises:
        ValueError: an interval that is not positive.
        InvalidGpuIdError: a malformed GPU id.
    """
    ids = normalize_gpus(gpus) or None
    return Latest(
        lambda: tuple(processes(gpus=ids, nvidia_smi=nvidia_smi, timeout=timeout)),
        interval,
        name="listing processes",
        errors=(SmiqueryError,),
    )
