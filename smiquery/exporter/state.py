"""What the collector tracks: its source's state, the GPUs it has seen, and the labels it sets."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smiquery.source import SampleSource

__all__ = [
    "PMON_LABELS",
    "RESERVED_LABELS",
    "SourceHealth",
    "TrackedGpu",
    "bare_uuid",
    "parse_labels",
    "source_health",
]

_LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SourceHealth:
    """What the collector needs to know about its source's state, read in one place.

    The attributes are :class:`~smiquery.source.StreamStats`' (``lost`` is ``lost_gpus``, ``known`` is
    ``known_gpus``), plus ``running``: whether the source's background thread is alive.
    """

    running: bool
    state: str
    last_error: str | None
    last_error_type: str | None
    next_retry_at: float | None
    permanent: bool
    lost: frozenset[int]
    known: dict[int, str | None]
    lost_uuids: dict[str, int | None] = dataclasses.field(default_factory=dict)


def source_health(source: SampleSource) -> SourceHealth:
    """A source's state now; a source whose thread ended with an error reads as ``failed``."""
    st = source.stats
    running, error = bool(source.running), source.error
    state: str = st.state
    if not running:
        state = "failed" if error is not None else (state if state in ("ended", "closed", "failed") else "closed")
    elif state == "starting" and st.rows > 0:
        state = "running"  # a source that does not keep state: rows flow, so it runs
    last_type, last = st.last_error_type, st.last_error
    if error is not None and not running:
        last_type = type(error).__name__
        last = str(error).splitlines()[0] if str(error) else last_type
    if last_type is None and last is not None and st.errors:
        last_type = max(st.errors, key=lambda k: st.errors[k])
    return SourceHealth(
        running=running,
        state=state,
        last_error=last,
        last_error_type=last_type,
        next_retry_at=st.next_retry_at,
        permanent=st.permanent,
        lost=frozenset(st.lost_gpus),
        known=dict(st.known_gpus),
        lost_uuids=dict(st.lost_uuids),
    )


@dataclass
class TrackedGpu:
    """A GPU the collector has seen, remembered until the exporter restarts."""

    index: int | None
    uuid: str | None
    labels: dict[str, str]  # the naming's labels of its series
    lost: bool = False
    absent: int = 0  # sweeps in a row without this GPU


def parse_labels(items: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Constant labels given as ``key=value`` strings (``["site=lab"]``) or a mapping, checked, as a dict.

    Raises:
        ValueError: a malformed item, an invalid or reserved label name, or a name given twice.
    """
    if items is None:
        return {}
    pairs: list[tuple[str, str]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"label {item!r} is not key=value")
            pairs.append((key.strip(), value))
    out: dict[str, str] = {}
    for key, value in pairs:
        if not _LABEL_NAME_RE.fullmatch(key) or key.startswith("__"):
            raise ValueError(
                f"label name {key!r} is invalid: letters, digits and '_', not starting with a digit or '__'"
            )
        if key in RESERVED_LABELS:
            raise ValueError(f"label name {key!r} is set by the exporter itself; pick another name")
        if key in out:
            raise ValueError(f"label {key!r} is given twice")
        out[key] = value
    return out


#: Labels of the per-process series from nvidia-smi pmon (constant labels may not reuse them).
PMON_LABELS: tuple[str, ...] = ("gpu", "uuid", "pid", "command", "user")

# Labels the exporter sets itself (Hostname is not here: --label Hostname=... overrides the DCGM label).
RESERVED_LABELS = frozenset(
    {"gpu", "uuid", "name", "pci_bus_id", "value", "pid", "process_name", "type", "source"}
    | {"UUID", "device", "modelName", "DCGM_FI_DRIVER_VERSION"}
    # MIG instances (--details-interval) and Xid errors (--kernel-log)
    | {"mig_uuid", "gpu_instance_id", "compute_instance_id", "profile", "GPU_I_ID", "GPU_I_PROFILE"}
    | {"xid", "action", "path", "reason"}
)


def bare_uuid(uuid: str | None) -> str:
    """The UUID without nvidia-smi's ``GPU-`` prefix ("" for None)."""
    # nvidia_gpu_exporter labels GPUs by the UUID without nvidia-smi's "GPU-" prefix (its dashboard matches on it)
    text = uuid or ""
    return text[4:] if text.startswith("GPU-") else text
