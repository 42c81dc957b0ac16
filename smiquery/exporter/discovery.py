"""Field discovery for ``--fields supported``: what this driver lists in ``--help-query-gpu`` and really supplies.

Asked once, when the exporter starts: one ``--help-query-gpu`` and one query of every listed field. Fields that are
``[Not Supported]`` on every GPU are left out, so the loop does not carry columns that can never have a value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.errors import InvalidFieldError, NvidiaSmiFailedError
from smiquery.fields import help_query_gpu, resolve_fields
from smiquery.runner import default_runner, find_nvidia_smi
from smiquery.sources.query_gpu import query

if TYPE_CHECKING:
    import os

    from smiquery.streams.argv import GpusArg

__all__ = ["supported_fields"]

log = get_logger("smiquery.exporter")


def supported_fields(
    *, nvidia_smi: str | os.PathLike[str] | None = None, gpus: GpusArg = None, timeout: float = 30.0
) -> list[str]:
    """The catalogue fields this driver lists and supplies on at least one GPU: canonical names, in its order.

    Raises:
        NvidiaSmiNotFoundError: no usable binary.
        NvidiaSmiFailedError: nvidia-smi failed, or listed no field smiquery knows.
        NvidiaSmiTimeoutError: it did not answer in time.
    """
    binary = find_nvidia_smi(nvidia_smi)
    listed: list[str] = []
    unknown = 0
    for entry in help_query_gpu(default_runner().run, binary, timeout):
        try:
            listed.append(resolve_fields([entry.name])[0].name)
        except InvalidFieldError:
            unknown += 1  # a field newer than smiquery's catalogue: no unit or type to export it with
    listed = list(dict.fromkeys(listed))
    if not listed:
        argv = [binary, "--help-query-gpu"]
        raise NvidiaSmiFailedError(argv, 0, "", "nvidia-smi --help-query-gpu listed no field smiquery knows")
    samples = query(listed, gpus=gpus, nvidia_smi=binary, timeout=timeout)
    keep = [name for name in listed if not samples or any(s.missing.get(name) != "not_supported" for s in samples)]
    log.info(
        "smiquery exporter: --fields supported: %d fields (%d listed, %d not supported on any GPU, %d unknown)",
        len(keep),
        len(listed),
        len(listed) - len(keep),
        unknown,
    )
    return keep
