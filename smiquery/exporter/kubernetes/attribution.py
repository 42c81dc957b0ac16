"""Which pod holds each GPU: the kubelet's pod-resources ``List``, refreshed on a thread of its own.

:class:`Attribution` calls ``List`` once per interval (with a deadline; after a failure it waits as the shared
:class:`~smiquery.retry.RetryPolicy` says, never longer than the interval) and keeps the newest answer; a scrape only
reads it. Device ids are read as NVIDIA's device plugin writes them: a GPU UUID, a MIG device UUID (mapped to its
parent GPU through ``nvidia-smi -L``, or read from the old ``MIG-GPU-<uuid>/<gi>/<ci>`` form), and ``<id>::<n>`` for
a time-sliced replica. Nothing is silent: ``smiquery_kubernetes_attribution_up`` says whether the last call worked,
each GPU has one attribution state, and every change of state is logged once.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from smiquery._log import get_logger
from smiquery.details import parse_list
from smiquery.exporter.kubernetes.podresources import DEFAULT_SOCKET, DeviceGrant, list_devices
from smiquery.retry import RetryPolicy, one_line

__all__ = [
    "DEFAULT_RESOURCES",
    "POD_LABELS",
    "STATES",
    "Attribution",
    "Holder",
    "Resolved",
    "resolve_device",
]

log = get_logger("smiquery.exporter")

#: The extended resources read by default (``fnmatch`` patterns).
DEFAULT_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/mig-*")
#: The labels attribution adds (dcgm-exporter's names, so its dashboards work).
POD_LABELS: tuple[str, ...] = ("pod", "namespace", "container")
#: Every attribution state of a GPU.
STATES: tuple[str, ...] = ("exclusive", "shared", "partitioned", "unallocated", "unreachable")

_REPLICA_RE = re.compile(r"^(.*)::(\d+)$")
_OLD_MIG_RE = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)$")
_MIG_LISTING_EVERY = 60.0  # seconds between nvidia-smi -L runs while a MIG id stays unknown


@dataclass(frozen=True, order=True)
class Holder:
    """One container that holds (part of) a GPU."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class Resolved:
    """A device id read: its GPU and, for a MIG device, the instance.

    Attributes:
        gpu_uuid: the parent GPU's UUID (None: an id this node's GPUs do not explain).
        mig_uuid: the MIG device's UUID (empty for a whole GPU or a replica of one).
        mig_profile: the MIG profile (``1g.5gb``...) when ``nvidia-smi -L`` listed it.
        replica: the time-slicing replica number, or None.
    """

    gpu_uuid: str | None
    mig_uuid: str = ""
    mig_profile: str = ""
    replica: int | None = None


def resolve_device(device_id: str, migs: Mapping[str, tuple[str, str]], gpus: Iterable[str]) -> Resolved:
    """Read one device-plugin id.

    Args:
        device_id: as the kubelet lists it.
        migs: MIG UUID -> (parent GPU UUID, profile), from ``nvidia-smi -L``.
        gpus: the UUIDs of this node's GPUs.

    Returns:
        What the id names; ``gpu_uuid`` is None when it names nothing on this node.
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


def _mig_listing(nvidia_smi: str | None) -> Callable[[], str]:
    def run() -> str:
        from smiquery.runner import default_runner, find_nvidia_smi

        runner = default_runner()
        argv = [find_nvidia_smi(nvidia_smi, runner=runner), "-L"]
        done = runner.run(argv, 10.0)
        return done.stdout if done.returncode == 0 else ""

    return run


@dataclass(frozen=True)
class _Snapshot:
    up: bool
    grants: tuple[DeviceGrant, ...]
    error: str | None
    token: object


class Attribution:
    """Keeps the kubelet's device allocations fresh and turns them into series.

    Args:
        socket_path: the kubelet's pod-resources socket.
        interval: seconds between ``List`` calls (the exporter passes its sample interval).
        resources: extended-resource patterns read (``fnmatch``; others are ignored).
        timeout: each call's deadline in seconds.
        retry: the waits after failures (capped to ``interval``).
        naming: the exporter's naming; ``dcgm`` names the UUID label ``UUID`` as its device series do.
        labels: the exporter's constant labels, added to every series.
        lister: ``(socket, timeout) -> grants`` (tests inject one); default: the gRPC call.
        mig_listing: returns ``nvidia-smi -L`` output (tests inject one).
        nvidia_smi: the binary for ``-L``.
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        *,
        interval: float = 5.0,
        resources: Sequence[str] = DEFAULT_RESOURCES,
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        naming: str = "smiquery",
        labels: Mapping[str, str] | None = None,
        lister: Callable[[str, float], list[DeviceGrant]] = list_devices,
        mig_listing: Callable[[], str] | None = None,
        nvidia_smi: str | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("the attribution interval and timeout must be positive")
        taken = sorted(set(labels or {}) & set(POD_LABELS))
        if taken:
            raise ValueError(f"label name {taken[0]!r} is set by the exporter itself with --kubernetes; pick another")
        self.socket_path = socket_path
        self.interval = float(interval)
        self.resources = tuple(resources)
        self.timeout = float(timeout)
        self.retry = retry or RetryPolicy(backoff_max=interval)
        self.uuid_label = "UUID" if naming == "dcgm" else "uuid"
        self.labels = dict(labels or {})
        self.refreshes = 0
        self.errors: Counter[str] = Counter()
        self.last_duration = 0.0
        self._lister = lister
        self._mig_listing = mig_listing or _mig_listing(nvidia_smi)
        self._migs: dict[str, tuple[str, str]] = {}
        self._mig_listed_at: float | None = None
        self._snap = _Snapshot(False, (), "not listed yet", object())
        self._state: dict[str, str] = {}  # uuid -> last logged state
        self._unknown_logged: frozenset[tuple[str, str]] = frozenset()
        self._logged_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._view_key: tuple[object, frozenset[tuple[str, int | None]]] | None = None
        self._view: _View | None = None

    # ------------------------------------------------------------------------------------------ refreshing

    @property
    def token(self) -> object:
        """Changes (by identity) whenever a refresh changed what is served: the exporter's render cache key."""
        return self._snap.token

    @property
    def up(self) -> bool:
        """Whether the newest ``List`` worked."""
        return self._snap.up

    def refresh(self) -> bool:
        """Call ``List`` once now; errors are counted and logged once per change, never raised.

        Returns:
            Whether the call worked.
        """
        t0 = time.perf_counter()
        self.refreshes += 1
        try:
            grants = self._lister(self.socket_path, self.timeout)
        except Exception as exc:  # grpc.RpcError and anything the socket raises: attribution is off, never silent
            self.last_duration = time.perf_counter() - t0
            kind = _error_kind(exc)
            self.errors[kind] += 1
            why = f"{kind}: {_rpc_detail(exc)}"
            if why != self._logged_error:
                log.warning(
                    "smiquery exporter: kubelet pod-resources at %s: %s; GPU series go out without pod labels",
                    self.socket_path,
                    why,
                )
                self._logged_error = why
            if self._snap.up or self._snap.error != why:
                self._snap = _Snapshot(False, (), why, object())
            return False
        self.last_duration = time.perf_counter() - t0
        kept = tuple(g for g in grants if any(fnmatch.fnmatchcase(g.resource, p) for p in self.resources))
        if self._logged_error is not None:
            log.warning("smiquery exporter: kubelet pod-resources answers again at %s", self.socket_path)
            self._logged_error = None
        if not self._snap.up or kept != self._snap.grants:
            self._snap = _Snapshot(True, kept, None, object())
        return True

    def start(self) -> Attribution:
        """Refresh on a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-kubernetes", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        streak = 0
        while not self._stop.is_set():
            streak = 0 if self.refresh() else streak + 1
            wait = self.interval if streak == 0 else min(self.interval, self.retry.delay(None, streak))
            self._stop.wait(wait)

    def close(self) -> None:
        """Stop refreshing (a call in progress ends by its deadline)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timeout + 5.0)

    # ------------------------------------------------------------------------------------------ serving

    def _migs_for(self, ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        wanted = {(_REPLICA_RE.sub(r"\1", i)) for i in ids if i.startswith("MIG-")} - set(self._migs)
        now = time.monotonic()
        if wanted and (self._mig_listed_at is None or now - self._mig_listed_at >= _MIG_LISTING_EVERY):
            self._mig_listed_at = now
            try:
                listing = parse_list(self._mig_listing())
            except Exception as exc:  # no listing: MIG ids stay unknown and say so
                log.warning("smiquery exporter: nvidia-smi -L for MIG device ids failed: %s", one_line(exc))
                listing = {}
            for parent, devices in listing.items():
                for _, profile, mig in devices:
                    self._migs[mig] = (parent, profile)
        return self._migs

    def view(self, gpus: Mapping[str, int | None]) -> _View:
        """What is served for these GPUs (UUID -> index) now; recomputed only when either changed."""
        snap = self._snap
        key = (snap.token, frozenset(gpus.items()))
        with self._lock:
            if self._view is not None and self._view_key == key:
                return self._view
            view = _build_view(snap, gpus, self._migs_for(g.device_id for g in snap.grants))
            self._log_changes(view)
            self._view, self._view_key = view, key
            return view

    def _log_changes(self, view: _View) -> None:
        for uuid, state in sorted(view.states.items()):
            if self._state.get(uuid) != state:
                holders = ", ".join(f"{h.namespace}/{h.pod}/{h.container}" for h in view.holders.get(uuid, ()))
                log.info(
                    "smiquery exporter: GPU %s (%s) attribution: %s%s",
                    view.indices.get(uuid, "?"),
                    uuid,
                    state,
                    f" ({holders})" if holders else "",
                )
                self._state[uuid] = state
        unknown = frozenset((g.resource, g.device_id) for g in view.unknown)
        for res, dev in sorted(unknown - self._unknown_logged):
            log.warning(
                "smiquery exporter: the kubelet lists %s device %r, which is no GPU of this node "
                "(not a GPU UUID, a MIG UUID from nvidia-smi -L nor UUID::N)",
                res,
                dev,
            )
        self._unknown_logged = unknown

    def gpu_labels(self, uuid: str | None, gpus: Mapping[str, int | None]) -> dict[str, str]:
        """``pod``, ``namespace``, ``container`` for a GPU one container holds whole; empty otherwise."""
        if not uuid:
            return {}
        holder = self.view(gpus).exclusive.get(uuid)
        if holder is None:
            return {}
        return {"pod": holder.pod, "namespace": holder.namespace, "container": holder.container}

    def families(self, gpus: Mapping[str, int | None]) -> list[Metric]:
        """The attribution series: ``allocation_info``, the per-GPU state, unknown devices and the call's health."""
        view = self.view(gpus)
        uu = self.uuid_label
        info = Metric(
            "smiquery_gpu_allocation_info",
            "A device the kubelet allocated to a container (1); join with * on(uuid) group_left(pod, namespace, "
            "container).",
            "gauge",
        )
        for uuid, holder, res, mig, profile in view.allocations:
            idx = gpus.get(uuid)
            labels = {
                uu: uuid,
                "gpu": "" if idx is None else str(idx),
                "pod": holder.pod,
                "namespace": holder.namespace,
                "container": holder.container,
                "resource": res,
                "mig_uuid": mig,
                "mig_profile": profile,
                **self.labels,
            }
            info.add_sample(info.name, labels, 1.0)
        state = Metric(
            "smiquery_kubernetes_gpu_attribution_state",
            "The GPU's attribution state (1 for the current one): " + ", ".join(STATES) + ".",
            "gauge",
        )
        for uuid, now in sorted(view.states.items()):
            idx = gpus.get(uuid)
            for s in STATES:
                labels = {uu: uuid, "gpu": "" if idx is None else str(idx), "state": s, **self.labels}
                state.add_sample(state.name, labels, 1.0 if s == now else 0.0)
        unknown = Metric(
            "smiquery_kubernetes_unknown_device_info",
            "A device id the kubelet allocated that names no GPU of this node (1).",
            "gauge",
        )
        for g in sorted(set(view.unknown), key=lambda g: (g.namespace, g.pod, g.container, g.device_id)):
            labels = {
                "device_id": g.device_id,
                "resource": g.resource,
                "pod": g.pod,
                "namespace": g.namespace,
                "container": g.container,
                **self.labels,
            }
            unknown.add_sample(unknown.name, labels, 1.0)
        up = Metric(
            "smiquery_kubernetes_attribution_up",
            "1 when the last kubelet pod-resources List worked; 0: GPU series carry no pod labels.",
            "gauge",
        )
        up.add_sample(up.name, dict(self.labels), 1.0 if self._snap.up else 0.0)
        took = Metric("smiquery_kubernetes_attribution_refresh_seconds", "Seconds the last List call took.", "gauge")
        took.add_sample(took.name, dict(self.labels), self.last_duration)
        errs = Metric("smiquery_kubernetes_attribution_errors", "Failed List calls by error type.", "counter")
        for kind, n in sorted(self.errors.items()):
            errs.add_sample(errs.name + "_total", {"type": kind, **self.labels}, float(n))
        return [f for f in (info, state, unknown) if f.samples] + [up, took] + ([errs] if errs.samples else [])

    def holders_of(self, gpus: Mapping[str, int | None]) -> dict[str, tuple[Holder, ...]]:
        """GPU UUID -> the containers holding (part of) it, for per-pod usage."""
        return dict(self.view(gpus).holders)


@dataclass(frozen=True)
class _View:
    indices: dict[str, int | None]
    states: dict[str, str]
    holders: dict[str, tuple[Holder, ...]]
    exclusive: dict[str, Holder]
    allocations: tuple[tuple[str, Holder, str, str, str], ...]
    unknown: tuple[DeviceGrant, ...]


def _build_view(snap: _Snapshot, gpus: Mapping[str, int | None], migs: Mapping[str, tuple[str, str]]) -> _View:
    holders: dict[str, set[Holder]] = {}
    whole: dict[str, set[Holder]] = {}
    partitioned: set[str] = set()
    allocations: dict[tuple[str, Holder, str, str, str], None] = {}
    unknown: list[DeviceGrant] = []
    for g in snap.grants:
        r = resolve_device(g.device_id, migs, gpus)
        if r.gpu_uuid is None:
            unknown.append(g)
            continue
        h = Holder(g.namespace, g.pod, g.container)
        holders.setdefault(r.gpu_uuid, set()).add(h)
        if r.mig_uuid:
            partitioned.add(r.gpu_uuid)
        else:
            whole.setdefault(r.gpu_uuid, set()).add(h)
        allocations[(r.gpu_uuid, h, g.resource, r.mig_uuid, r.mig_profile)] = None
    states: dict[str, str] = {}
    exclusive: dict[str, Holder] = {}
    for uuid in gpus:
        if not snap.up:
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
    return _View(
        dict(gpus),
        states,
        {u: tuple(sorted(hs)) for u, hs in holders.items()},
        exclusive,
        tuple(allocations),
        tuple(unknown),
    )


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return "permission_denied"
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            name = getattr(code(), "name", None)
        except Exception:  # a half-built RpcError: its class name will do
            name = None
        if isinstance(name, str):
            return name.lower()
    return type(exc).__name__


def _rpc_detail(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            text = details()
        except Exception:  # a half-built RpcError: fall back to its message
            text = None
        if isinstance(text, str) and text:
            return text.splitlines()[0]
    return one_line(exc)
