"""Attribution: which workload holds each GPU, and which workload a GPU process belongs to.

A :class:`Backend` (:mod:`.kubernetes`, :mod:`.slurm`) asks one scheduler; :class:`Attribution` polls it in the
background and says each GPU's state and holders (failures counted by kind; each change logged once).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from smiquery._log import RateLimiter, get_logger
from smiquery.printable import printable
from smiquery.retry import one_line
from smiquery.runner import default_runner, find_nvidia_smi
from smiquery.sources.details import parse_list
from smiquery.sources.latest import FailureLog, Latest

__all__ = [
    "STATES",
    "Attribution",
    "Backend",
    "Grant",
    "Resolved",
    "View",
    "Words",
    "Workload",
    "cgroup_paths",
    "check_labels",
    "failure_log",
    "read_cgroup",
    "resolve_device",
]

log = get_logger("smiquery.exporter")

#: Every attribution state of a GPU.
STATES: tuple[str, ...] = ("exclusive", "shared", "partitioned", "unallocated", "unreachable")

_REPLICA_RE = re.compile(r"^(.*)::(\d+)$")
_OLD_MIG_RE = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)$")
_MIG_LISTING_EVERY = 60.0  # seconds between nvidia-smi -L runs while a MIG id stays unknown


@dataclass(frozen=True, order=True)
class Workload:
    """One workload that holds (part of) a GPU: its label values, in the order of its backend's ``labels``."""

    values: tuple[str, ...]

    def labels(self, names: Sequence[str]) -> dict[str, str]:
        """Label name -> value."""
        return dict(zip(names, self.values, strict=True))


@dataclass(frozen=True)
class Grant:
    """One device a backend allocated to a workload.

    ``resource``: ``nvidia.com/gpu``, ``nvidia.com/mig-1g.5gb``, ``gres/gpu``...; ``device_id``: a GPU UUID, a MIG
    UUID, ``UUID::N`` for a time-sliced replica.
    """

    workload: Workload
    resource: str
    device_id: str


@dataclass(frozen=True)
class Words:
    """What a backend's log lines and series say, in its own words (``{...}``: filled in when said).

    ``failed`` (``{why}``), ``again`` and ``unknown`` (``{resource}``, ``{device}``: a device id that names no GPU of
    this node) are log lines; ``allocated``, ``unknown_help``, ``up``, ``took`` and ``errors`` the HELP texts of
    ``smiquery_gpu_allocation_info`` and ``smiquery_<name>_{unknown_device_info, attribution_up,
    attribution_refresh_seconds, attribution_errors_total}``; ``holder`` names a workload (``container``) and
    ``other`` the bucket of use no workload is found for, in the per-workload use series' HELP.
    """

    failed: str
    again: str
    unknown: str
    allocated: str
    unknown_help: str
    up: str
    took: str
    errors: str
    holder: str
    other: str


class Backend(Protocol):
    """One scheduler's answers: what it allocated and, where it knows (``processes``), whose a process is.

    ``name`` and ``workload`` are its words in series names (``smiquery_kubernetes_attribution_up``,
    ``smiquery_pod_gpu_*``); ``labels`` name a :class:`Workload`'s values; use no workload is found for counts
    under ``other``; ``polls`` are its own background polls (started and closed with the attribution).
    """

    name: str
    workload: str
    labels: tuple[str, ...]
    other: Workload
    words: Words
    processes: bool
    polls: tuple[Latest[Any], ...]

    def refresh(self) -> Sequence[Grant]:
        """Ask once what is allocated now (devices of the resources read). Raises on failure."""

    def failure(self, exc: Exception) -> tuple[str, str]:
        """A failed :meth:`refresh` as (kind, one line of why), for the error counts and the log."""

    def owner(self, pid: int) -> Workload | None:
        """The workload a process belongs to (the host's pid); None when it is none or not known (yet)."""


def check_labels(backend: Backend, labels: Iterable[str]) -> None:
    """Refuse (ValueError) constant labels that a workload's labels (``pod``, ``slurm_job_id``...) would overwrite."""
    taken = sorted(set(labels) & set(backend.labels))
    if taken:
        raise ValueError(f"label name {taken[0]!r} is set by the exporter itself with --{backend.name}; pick another")


def failure_log(failed: str, again: str) -> FailureLog:
    """Failures said as the exporter's warnings: ``failed`` (with ``{why}``) at each change, ``again`` on recovery."""
    return FailureLog(
        lambda why: log.warning("smiquery exporter: %s", failed.format(why=why)),
        lambda: log.warning("smiquery exporter: %s", again),
    )


@dataclass(frozen=True)
class Resolved:
    """A device id read: its GPU (``gpu_uuid``, None when none of this node's) and, for a MIG device, the instance.

    ``mig_profile`` is set when ``nvidia-smi -L`` listed it; ``replica`` is the time-slicing replica, or None.
    """

    gpu_uuid: str | None
    mig_uuid: str = ""
    mig_profile: str = ""
    replica: int | None = None


def resolve_device(device_id: str, migs: Mapping[str, tuple[str, str]], gpus: Iterable[str]) -> Resolved:
    """Read one device-plugin id: a GPU UUID, a MIG UUID, the old ``MIG-GPU-<uuid>/<gi>/<ci>``, ``<id>::<n>``.

    ``migs``: MIG UUID -> (parent GPU UUID, profile), from ``nvidia-smi -L``; ``gpus``: this node's GPU UUIDs.
    """
    replica = None
    m = _REPLICA_RE.match(device_id)
    if m:
        device_id, replica = m.group(1), int(m.group(2))
    if device_id.startswith("MIG-"):
        hit = migs.get(device_id)
        if hit is not None:
            return Resolved(hit[0], device_id, hit[1], replica)
        old = _OLD_MIG_RE.match(device_id)
        if old and old.group(1) in set(gpus):
            return Resolved(old.group(1), device_id, "", replica)
        return Resolved(None, device_id, "", replica)
    if device_id in set(gpus):
        return Resolved(device_id, "", "", replica)
    return Resolved(None, "", "", replica)


def cgroup_paths(text: str) -> list[str]:
    """The paths in the text of ``/proc/<pid>/cgroup`` (v1: one line per controller; v2: ``0::<path>``)."""
    return [parts[2] for parts in (line.split(":", 2) for line in text.splitlines()) if len(parts) == 3]


def read_cgroup(pid: int, proc: str = "/proc") -> str | None:
    """The text of ``/proc/<pid>/cgroup`` (``proc``: the mount to read), or None for a process gone or not visible."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


@dataclass(frozen=True)
class _Listing:
    grants: tuple[Grant, ...]
    error: str | None  # None: the listing worked


_NOT_YET = _Listing((), "not listed yet")


@dataclass(frozen=True)
class View:
    """What is served for a set of GPUs.

    By GPU UUID: its state (one of :data:`STATES`), the workloads holding (part of) it, the one holding it whole;
    each distinct (GPU UUID, workload, resource, MIG UUID, MIG profile); the grants naming no GPU of this node.
    """

    states: dict[str, str]
    holders: dict[str, tuple[Workload, ...]]
    exclusive: dict[str, Workload]
    allocations: tuple[tuple[str, Workload, str, str, str], ...]
    unknown: tuple[Grant, ...]


class Attribution:
    """Keeps a backend's allocations fresh (every ``interval`` s, in the background); says which workload holds a GPU.

    ``mig_listing`` returns ``nvidia-smi -L`` output (default: runs ``nvidia_smi -L``).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        interval: float = 5.0,
        mig_listing: Callable[[], str] | None = None,
        nvidia_smi: str | None = None,
    ) -> None:
        self.backend = backend
        self.last_duration = 0.0
        self.failures = failure_log(backend.words.failed, backend.words.again)
        self._latest = Latest(self._list, interval, name=f"{backend.name}-attribution")
        self._mig_listing = mig_listing or self._list_migs
        self._nvidia_smi = nvidia_smi
        self._migs: dict[str, tuple[str, str]] = {}
        self._mig_listings = RateLimiter(1, _MIG_LISTING_EVERY)
        self._state: dict[str, str] = {}  # uuid -> last logged state
        self._unknown_logged: frozenset[tuple[str, str]] = frozenset()
        self._lock = threading.Lock()
        self._view_key: tuple[object, frozenset[tuple[str, int | None]]] | None = None
        self._view: View | None = None

    def _list(self) -> _Listing:
        t0 = time.perf_counter()
        try:
            new = _Listing(tuple(self.backend.refresh()), None)
            self.failures.worked()
        except Exception as exc:  # whatever the backend's call raises: attribution is off, never silent
            kind, why = self.backend.failure(exc)
            self.failures.failed(kind, why)
            new = _Listing((), f"{kind}: {why}")
        self.last_duration = time.perf_counter() - t0
        old = self._listing()
        return old if new == old else new  # the same object while nothing changed: see token

    def _listing(self) -> _Listing:
        return self._latest.get().value or _NOT_YET

    @property
    def token(self) -> tuple[object, ...]:
        """What is served comes from: the same objects (compared by identity) while nothing changed."""
        return (self._listing(), *(p.get().value for p in self.backend.polls))

    @property
    def up(self) -> bool:
        """Whether the newest listing worked."""
        return self._listing().error is None

    @property
    def errors(self) -> Counter[str]:
        """Failed listings by kind."""
        return self.failures.errors

    def refresh(self) -> bool:
        """List once now, in the caller's thread; whether it worked (errors are counted and logged, never raised)."""
        self._latest.poll()
        return self.up

    def start(self) -> Attribution:
        """Refresh in the background until :meth:`close` (the backend's own polls too). Returns self."""
        for poll in (self._latest, *self.backend.polls):
            poll.start()
        return self

    def close(self) -> None:
        """Stop refreshing (a call in progress ends by its deadline)."""
        for poll in (self._latest, *self.backend.polls):
            poll.close()

    def _list_migs(self) -> str:
        runner = default_runner()
        done = runner.run([find_nvidia_smi(self._nvidia_smi, runner=runner), "-L"], 10.0)
        return done.stdout if done.returncode == 0 else ""

    def _migs_for(self, ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        wanted = {(_REPLICA_RE.sub(r"\1", i)) for i in ids if i.startswith("MIG-")} - set(self._migs)
        if wanted and self._mig_listings.take(None) is not None:
            try:
                listing = parse_list(self._mig_listing())
            except Exception as exc:  # no listing: MIG ids stay unknown and say so
                log.warning("smiquery exporter: nvidia-smi -L for MIG device ids failed: %s", one_line(exc))
                listing = {}
            for parent, devices in listing.items():
                for _, profile, mig in devices:
                    self._migs[mig] = (parent, profile)
        return self._migs

    def view(self, gpus: Mapping[str, int | None]) -> View:
        """What is served for these GPUs (UUID -> index) now; recomputed only when either changed."""
        listing = self._listing()
        key = (listing, frozenset(gpus.items()))
        with self._lock:
            if self._view is not None and self._view_key == key:
                return self._view
            view = _build_view(listing, gpus, self._migs_for(g.device_id for g in listing.grants))
            self._log_changes(view, gpus)
            self._view, self._view_key = view, key
            return view

    def _log_changes(self, view: View, gpus: Mapping[str, int | None]) -> None:
        for uuid, state in sorted(view.states.items()):
            if self._state.get(uuid) != state:
                holders = printable(", ".join("/".join(h.values) for h in view.holders.get(uuid, ())))
                msg = "smiquery exporter: GPU %s (%s) attribution: %s%s"
                log.info(msg, gpus.get(uuid, "?"), uuid, state, f" ({holders})" if holders else "")
                self._state[uuid] = state
        unknown = frozenset((g.resource, g.device_id) for g in view.unknown)
        for res, dev in sorted(unknown - self._unknown_logged):
            log.warning("smiquery exporter: %s", self.backend.words.unknown.format(resource=res, device=dev))
        self._unknown_logged = unknown

    def gpu_labels(self, uuid: str | None, gpus: Mapping[str, int | None]) -> dict[str, str]:
        """The workload's labels for a GPU one workload holds whole; empty otherwise."""
        holder = self.view(gpus).exclusive.get(uuid) if uuid else None
        return {} if holder is None else holder.labels(self.backend.labels)


def _build_view(listing: _Listing, gpus: Mapping[str, int | None], migs: Mapping[str, tuple[str, str]]) -> View:
    holders: dict[str, set[Workload]] = {}
    whole: dict[str, set[Workload]] = {}
    partitioned: set[str] = set()
    allocations: dict[tuple[str, Workload, str, str, str], None] = {}
    unknown: list[Grant] = []
    for g in listing.grants:
        r = resolve_device(g.device_id, migs, gpus)
        if r.gpu_uuid is None:
            unknown.append(g)
            continue
        holders.setdefault(r.gpu_uuid, set()).add(g.workload)
        if r.mig_uuid:
            partitioned.add(r.gpu_uuid)
        else:
            whole.setdefault(r.gpu_uuid, set()).add(g.workload)
        allocations[(r.gpu_uuid, g.workload, g.resource, r.mig_uuid, r.mig_profile)] = None
    states: dict[str, str] = {}
    exclusive: dict[str, Workload] = {}
    for uuid in gpus:
        if listing.error is not None:
            states[uuid] = "unreachable"
        elif uuid in partitioned:
            states[uuid] = "partitioned"
        elif uuid not in holders:
            states[uuid] = "unallocated"
        elif len(holders[uuid]) == 1 and uuid in whole:
            states[uuid] = "exclusive"
            exclusive[uuid] = next(iter(holders[uuid]))
        else:
            states[uuid] = "shared"
    return View(
        states, {u: tuple(sorted(hs)) for u, hs in holders.items()}, exclusive, tuple(allocations), tuple(unknown)
    )
