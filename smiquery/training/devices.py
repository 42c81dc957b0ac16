"""Which GPUs a training process sees: ``CUDA_VISIBLE_DEVICES`` read the way CUDA reads it, mapped to nvidia-smi."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smiquery.sources.latest import Latest

__all__ = ["VisibleDevices", "order_check", "visible_devices"]

_UUID_PREFIX_RE = re.compile(r"GPU-[0-9a-fA-F-]+")
_FULL_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")


@dataclass(frozen=True)
class VisibleDevices:
    """The GPUs a CUDA process can see, as ``CUDA_VISIBLE_DEVICES`` names them, in CUDA's order.

    ``ids``: indices (``"1"``) or UUIDs (prefixes allowed), ``cuda:0`` first; None when the variable is unset (all
    GPUs). ``note``: why something could not be honoured, or ``""``. ``pci_order``: ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """

    ids: tuple[str, ...] | None
    note: str = ""
    pci_order: bool = False

    @property
    def order_unsure(self) -> bool:
        """Indices in CUDA's default order (fastest first): nvidia-smi's only if the GPUs are all one model."""
        return bool(self.ids) and not self.pci_order and any(i.isdigit() for i in self.ids or ())

    @property
    def none(self) -> bool:
        """True when the process sees no GPU at all (``""`` or ``-1``)."""
        return self.ids is not None and not self.ids

    def stream_gpus(self) -> tuple[str, ...] | None:
        """The ``-i`` ids for nvidia-smi, or None to query all GPUs and filter with :meth:`selects` (UUID prefixes)."""
        return self.ids if self.ids and all(i.isdigit() or _FULL_UUID_RE.fullmatch(i) for i in self.ids) else None

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
    """Read ``CUDA_VISIBLE_DEVICES`` of ``env`` (default ``os.environ``) the way CUDA does.

    CUDA stops at the first invalid entry (``"0,2,-1,3"`` means 0 and 2); ``""`` or ``-1`` hides every GPU. MIG
    instances do not tell their parent GPU: then every GPU is watched and :attr:`VisibleDevices.note` says why.
    """
    environ = os.environ if env is None else env
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    pci = environ.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID"
    if raw is None:
        return VisibleDevices(None, pci_order=pci)
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
    return VisibleDevices(tuple(dict.fromkeys(ids)), note, pci)


def order_check(
    cuda: VisibleDevices,
    nvidia_smi: str | os.PathLike[str] | None,
    decided: Callable[[VisibleDevices | None, str, bool], None],
    interval: float = 2.0,
) -> Latest[tuple[VisibleDevices | None, str, bool]]:
    """A poller (not started), every ``interval`` s, of the GPUs a job whose ``cuda`` names indices really uses.

    On a host that mixes models it looks for the job's compute processes. ``decided(watch, message, final)`` gets
    each answer on the poller's thread: the GPUs to watch instead (None: keep the indices), what to say (``""``:
    nothing) and whether it is settled.
    """
    from smiquery.sources.apps import processes
    from smiquery.sources.latest import Latest
    from smiquery.sources.query_gpu import query
    from smiquery.training.epochs import own_pids

    def look() -> tuple[VisibleDevices | None, str, bool]:
        rows = query(["index", "uuid", "name"], nvidia_smi=nvidia_smi)
        gpus = {s.index: (s.uuid or "", str(s.get("name") or "")) for s in rows if s.index is not None}
        names = sorted({name for _uuid, name in gpus.values()})
        if len(names) <= 1:
            return None, "", True
        apps = processes(nvidia_smi=nvidia_smi)
        mine = own_pids(p.pid for p in apps)
        uuids = {p.gpu_uuid.lower() for p in apps if p.pid in mine and p.gpu_uuid}
        found = [idx for idx, (uuid, _name) in sorted(gpus.items()) if uuid.lower() in uuids]
        said = (
            f"CUDA_VISIBLE_DEVICES={','.join(cuda.ids or ())} counts GPUs fastest first (CUDA_DEVICE_ORDER is not "
            f"PCI_BUS_ID) and nvidia-smi by PCI bus, and this host mixes {' and '.join(names)}"
        )
        if found:
            which = ", ".join(f"{idx} ({gpus[idx][1]})" for idx in found)
            return (
                VisibleDevices(tuple(gpus[i][0] for i in found)),
                f"{said}: watching GPU {which}, where this job runs",
                True,
            )
        return (
            None,
            f"{said}: watching nvidia-smi's GPU {','.join(cuda.ids or ())}, which may not be the job's; set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID (or name the GPUs by UUID) so that the watched GPUs are the job's",
            False,
        )

    def answer(got: tuple[VisibleDevices | None, str, bool]) -> None:
        decided(*got)
        if got[2]:
            poller.close()

    poller: Latest[tuple[VisibleDevices | None, str, bool]] = Latest(look, interval, name="gpu-order", on_value=answer)
    return poller
