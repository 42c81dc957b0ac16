"""Which GPUs a training process sees: ``CUDA_VISIBLE_DEVICES`` read the way CUDA reads it, mapped to nvidia-smi."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["VisibleDevices", "visible_devices"]

_UUID_PREFIX_RE = re.compile(r"GPU-[0-9a-fA-F-]+")
_FULL_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")


@dataclass(frozen=True)
class VisibleDevices:
    """The GPUs a CUDA process can see, as ``CUDA_VISIBLE_DEVICES`` names them, in CUDA's order.

    Attributes:
        ids: indices (``"1"``) or UUIDs (``"GPU-8932f937-..."``, prefixes allowed as CUDA allows them), in the
            order CUDA numbers them (``cuda:0`` is ``ids[0]``); None when the variable is unset (all GPUs).
        note: why something could not be honoured (MIG instances, an invalid entry), or ``""``.
    """

    ids: tuple[str, ...] | None
    note: str = ""

    @property
    def none(self) -> bool:
        """True when the process sees no GPU at all (``""`` or ``-1``)."""
        return self.ids is not None and not self.ids

    def stream_gpus(self) -> tuple[str, ...] | None:
        """The ``-i`` ids for nvidia-smi, or None to query all GPUs (and filter with :meth:`selects`)."""
        if self.ids is None or not self.ids:
            return None
        if all(i.isdigit() or _FULL_UUID_RE.fullmatch(i) for i in self.ids):
            return self.ids
        return None  # UUID prefixes: nvidia-smi wants whole UUIDs, so filter the rows instead

    def selects(self, index: int | None, uuid: str | None) -> bool:
        """Whether an nvidia-smi GPU (by index and UUID) is one of the visible ones."""
        return self.position(index, uuid) is not None if self.ids else self.ids is None

    def position(self, index: int | None, uuid: str | None) -> int | None:
        """The CUDA ordinal (``cuda:k``) of an nvidia-smi GPU, or None when it is not visible."""
        if self.ids is None:
            return index
        u = (uuid or "").lower()
        for k, item in enumerate(self.ids):
            if item.isdigit():
                if index is not None and int(item) == index:
                    return k
            elif u and u.startswith(item.lower()):
                return k
        return None

    def nvsmi_index(self, ordinal: int, known: Mapping[int, str | None]) -> int | None:
        """The nvidia-smi index of CUDA device ``ordinal``, given the known GPUs (index -> UUID)."""
        if self.ids is None:
            return ordinal
        if ordinal >= len(self.ids):
            return None
        item = self.ids[ordinal]
        if item.isdigit():
            return int(item)
        for idx, uuid in known.items():
            if (uuid or "").lower().startswith(item.lower()):
                return idx
        return None


def visible_devices(env: Mapping[str, str] | None = None) -> VisibleDevices:
    """Read ``CUDA_VISIBLE_DEVICES`` the way CUDA does.

    Entries are indices or UUIDs (whole or a unique prefix such as ``GPU-8932f937``); CUDA stops at the first
    invalid entry (``"0,2,-1,3"`` means 0 and 2), and ``""`` or ``-1`` hides every GPU. Indices follow
    nvidia-smi's (PCI bus) order only when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are all the same model;
    CUDA's default order puts the fastest GPU first. MIG instances (``MIG-...``) cannot be mapped to their
    parent GPU from the variable alone; then every GPU is watched and :attr:`VisibleDevices.note` says why.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The visible devices.
    """
    environ = os.environ if env is None else env
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return VisibleDevices(None)
    ids: list[str] = []
    note = ""
    for part in raw.split(","):
        item = part.strip()
        if item.isdigit() and item.isascii():
            ids.append(str(int(item)))
        elif _UUID_PREFIX_RE.fullmatch(item):
            ids.append(item)
        elif item.startswith("MIG-"):
            return VisibleDevices(
                None,
                f"CUDA_VISIBLE_DEVICES={raw!r} names MIG instances, whose parent GPUs it does not tell; "
                "watching every GPU",
            )
        else:
            if item and item != "-1":
                note = (
                    f"CUDA_VISIBLE_DEVICES={raw!r}: {item!r} is not a GPU index or UUID; CUDA ignores it and the rest"
                )
            break  # CUDA stops at the first invalid entry
    return VisibleDevices(tuple(dict.fromkeys(ids)), note)
