"""The collector: metric families from the newest sweep of one sample source, plus the exporter's health."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from smiquery import __version__
from smiquery._log import get_logger
from smiquery.attribution import check_labels
from smiquery.exporter.families import (
    attribution_families,
    details_health,
    fresh_details,
    gauge,
    merge_families,
    mig_families,
    nvsmi_number,
    pmon_families,
    pmon_health,
    process_families,
    pstate_number,
    workload_families,
    xid_families,
)
from smiquery.exporter.naming import NVSMI_INFO_LABELS, MetricSpec, Naming, bare_uuid, metric_specs, render
from smiquery.kinds import to_number
from smiquery.retry import one_line
from smiquery.sample import bus_key
from smiquery.source import StreamStats
from smiquery.sources.latest import Latest

if TYPE_CHECKING:
    from prometheus_client.process_collector import ProcessCollector

    from smiquery.alerts import AlertEvaluator
    from smiquery.attribution import Attribution
    from smiquery.exporter.pmonwatch import PmonWatcher, ProcessInstant
    from smiquery.fields import Field
    from smiquery.sample import BusKey, GpuSample, Value
    from smiquery.source import SampleSource, Sweep
    from smiquery.sources.apps import GpuProcess
    from smiquery.sources.details import GpuDetails
    from smiquery.sources.xid import XidWatcher

__all__ = ["DEFAULT_EXPORTER_ALERTS", "SmiCollector", "SourceHealth", "parse_labels", "revision", "source_health"]

log = get_logger("smiquery.exporter")


#: smiquery alert rules the exporter evaluates on every nvidia-smi sample by default: the rule that counts samples,
#: which PromQL cannot count whatever the scrape interval (the time-based rules stay in Prometheus).
DEFAULT_EXPORTER_ALERTS: tuple[str, ...] = ("temperature.gpu > 85 for 3",)


_LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class SourceHealth(StreamStats):
    """A source's :class:`~smiquery.source.StreamStats` as read at one moment, and whether its thread is alive."""

    running: bool = False


def source_health(source: SampleSource) -> SourceHealth:
    """A source's state now; a source whose thread ended with an error reads as ``failed``."""
    st = source.stats
    running, error = bool(source.running), source.error
    state: str = st.state
    last_type, last = st.last_error_type, st.last_error
    if not running:
        state = "failed" if error is not None else (state if state in ("ended", "closed", "failed") else "closed")
        if error is not None:
            last_type, last = type(error).__name__, one_line(error)
    elif state == "starting" and st.rows > 0:
        state = "running"  # a source that does not keep state: rows flow, so it runs
    if last_type is None and last is not None and st.errors:
        last_type = max(st.errors, key=lambda k: st.errors[k])
    # the counters and sets copied as they are now
    now = {f.name: copy.copy(getattr(st, f.name)) for f in dataclasses.fields(st)}
    now.update(running=running, state=state, last_error=last, last_error_type=last_type)
    return SourceHealth(**now)


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

    Raises ValueError for a malformed item, an invalid or reserved label name, or a name given twice.
    """
    pairs: list[tuple[str, str]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        for item in items or ():
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


class SmiCollector:
    """A ``prometheus_client`` collector over the newest sweep of one background stream; never runs nvidia-smi.

    Per-GPU series are served while the newest sweep is younger than ``stale_after`` (default: three intervals, at
    least 15 s); a missing value (a status token) leaves its series out for that GPU, never 0. The health metrics
    are always there. :meth:`exposition` (the server's fast path) renders the per-sweep text once per sweep.

    ``stream`` is a started :class:`~smiquery.source.SampleSource` (``fields`` defaults to its own). Optional
    sources: ``processes`` and ``details`` (:func:`~smiquery.exporter.server.process_poller`, ``details_poller``),
    ``pmon``, ``xid`` and ``attribution``. ``alerts`` is fed every sample; ``on_gpu_change(lost, index, uuid)`` is
    called when a GPU drops out or comes back, ``on_state(up, why)`` when fresh data stops or flows again.
    ``hostname`` is DCGM's ``Hostname`` label (default: this host's); ``process_metrics`` adds ``process_*``.
    """

    def __init__(
        self,
        stream: SampleSource,
        *,
        fields: Sequence[Field] | None = None,
        naming: Naming = "smiquery",
        labels: Mapping[str, str] | Iterable[str] | None = None,
        processes: Latest[tuple[GpuProcess, ...]] | None = None,
        pmon: PmonWatcher | None = None,
        details: Latest[tuple[GpuDetails, ...]] | None = None,
        xid: XidWatcher | None = None,
        stale_after: float | None = None,
        hostname: str | None = None,
        alerts: AlertEvaluator | None = None,
        on_gpu_change: Callable[[bool, int, str | None], None] | None = None,
        on_state: Callable[[bool, str], None] | None = None,
        nvidia_smi_path: str = "",
        attribution: Attribution | None = None,
        process_metrics: bool = False,
    ) -> None:
        self.stream = stream
        self._process_collector: ProcessCollector | None = None
        if process_metrics:  # prometheus_client's standard process_* families, unregistered
            from prometheus_client.process_collector import ProcessCollector

            self._process_collector = ProcessCollector(registry=None)
        flds: Sequence[Field] | None = fields if fields is not None else getattr(stream, "fields", None)
        if flds is None:
            raise ValueError("pass fields= for a stream without a .fields attribute")
        self.naming: Naming = naming
        self.specs = metric_specs(list(flds), naming)
        self.labels = parse_labels(labels)
        self.processes = processes
        self.pmon = pmon
        self.details = details
        self.xid = xid
        if pmon is not None:
            taken = sorted(set(self.labels) & set(PMON_LABELS))
            if taken:
                msg = f"label name {taken[0]!r} is set by the exporter itself with top processes; pick another name"
                raise ValueError(msg)
        interval = getattr(stream, "interval", 0.0)  # a live stream's; a replay has none
        self.stale_after = float(stale_after) if stale_after is not None else max(3 * interval, 15.0)
        self.hostname = self.labels.get("Hostname") or hostname or socket.gethostname()
        self.render_errors = 0
        self._lock = threading.Lock()
        self.attribution = attribution
        if attribution is not None:
            check_labels(attribution.backend, self.labels)
        self._att_gpus: dict[str, int | None] = {}  # the newest fresh sweep's GPUs (UUID -> index), for attribution
        self.alerts = alerts
        self.on_gpu_change = on_gpu_change
        self.on_state = on_state
        self.nvidia_smi_path = nvidia_smi_path
        self.driver_version = ""
        self._gpus: dict[str, TrackedGpu] = {}  # by UUID (or "index:N" without one): what was seen, until restart
        self._fired: dict[tuple[int, str], int] = {}
        # alert state per GPU (by UUID), dropped while the GPU is lost or the data stale: "unknown", not "firing"
        self._evals: dict[str, AlertEvaluator] = {}
        self._down_sweep: Sweep | None = None
        self._last_sweep: Sweep | None = None
        self._up: bool | None = None
        self._born = time.monotonic()  # a missing first sample is only news once it is overdue
        self._refresh_lock = threading.Lock()
        self.revive_at: float | None = None  # set by the exporter while a stopped stream waits to be replaced
        self._gpu_version = 0  # bumped whenever a sweep is taken in or the lost set may change
        self._texts: dict[str, tuple[tuple[object, ...], bytes]] = {}  # rendered parts, by what they came from
        period = min(max(float(getattr(stream, "interval", 1.0)) / 4, 0.05), 1.0)
        self._watch = Latest(self.refresh, period, name="watching the stream")  # a raise is logged, not fatal

    def refresh(self) -> None:
        """Take in the newest sweep: remember its GPUs, find lost ones, feed the alert rules. Cheap; any thread.

        Called on every scrape and, after :meth:`start`, every quarter interval (no sweep is missed by the rules).
        """
        with self._refresh_lock:
            sweep, age = self.stream.latest()
            health = source_health(self.stream)
            if sweep is not None and sweep is not self._last_sweep:
                self._last_sweep = sweep
                self._down_sweep = None  # a new sample: recovery may be announced
                # when it arrived, on the monotonic clock: alert holds never subtract wall-clock timestamps
                arrived = sweep.arrived if sweep.arrived is not None else time.monotonic() - (age or 0.0)
                self._take(sweep, health, arrived)
                self._gpu_version += 1
            elif health.lost_gpus or health.lost_uuids:
                self._mark_lost(health, None)
                self._gpu_version += 1
            up = self._is_up(sweep, age, health)
            if up != self._up:
                if not up:
                    # Until a new sample arrives, nothing is known: a retry that starts while the newest sample is
                    # still young is not a recovery, and no alert state is carried across the gap.
                    self._down_sweep = sweep
                    self._evals.clear()
                self._gpu_version += 1
                # the first sample is late once the stream failed, or none came within stale_after of the start
                late = (
                    health.state == "retrying" or not health.running or time.monotonic() - self._born > self.stale_after
                )
                if not up and self._up is None and sweep is None and not late:
                    return  # a normal start: nothing to say until the first sample is late
                if self.on_state is not None and (self._up is not None or (not up and health.state != "starting")):
                    self.on_state(up, "ok" if up else self.health()[1])
                self._up = up

    def _take(self, sweep: Sweep, health: SourceHealth, arrived: float) -> None:
        present: set[str] = set()
        reported: set[str] = set()
        for s in sweep:
            drv = s.get("driver_version")
            if drv is not None and not s.gpu_lost:
                self.driver_version = str(drv)
            key = s.uuid or f"index:{s.index}"
            gpu = self._gpus.get(key)
            if gpu is None:
                gpu = self._gpus[key] = TrackedGpu(s.index, s.uuid, self._sample_labels(s)[1])
            elif not s.gpu_lost:
                # Labels come from rows that carry them: a lost GPU's row (status tokens in every cell) keeps the
                # labels it had, so its series keep their identity exactly when they matter.
                if s.index != gpu.index:
                    self._evals.pop(key, None)  # renumbered after a driver reload: its alert holds start over
                gpu.index, gpu.labels = s.index, {**gpu.labels, **self._sample_labels(s)[1]}
            if s.gpu_lost:
                reported.add(key)  # nvidia-smi's own word: lost at once
                continue
            present.add(key)
            if self.alerts is not None:
                ev = self._evals.get(key)
                if ev is None:
                    ev = self._evals[key] = type(self.alerts)(self.alerts.rules, self.alerts.clock)
                for event in ev.update(s, arrived):
                    if event.state == "firing":
                        i = self.alerts.rules.index(event.rule)
                        self._fired[(i, key)] = self._fired.get((i, key), 0) + 1
        self._mark_lost(health, present, reported)

    def _mark_lost(
        self, health: SourceHealth, present: set[str] | None, reported: AbstractSet[str] = frozenset()
    ) -> None:
        lost_keys = set(reported)
        # The source names lost GPUs by UUID where it knows them: after a driver reload renumbers GPUs an index
        # says nothing about which GPU is gone.
        for uuid, idx in health.lost_uuids.items():
            lost_keys.add(uuid)
            self._gpus.setdefault(uuid, self._unseen_gpu(idx, uuid))
        named = set(health.lost_uuids.values())
        for idx in health.lost_gpus:
            if idx in named:
                continue
            candidates = [k for k, g in self._gpus.items() if g.index == idx and (present is None or k not in present)]
            if candidates:
                lost_keys.update(candidates)
                continue
            known = health.known_gpus.get(idx)
            key = known or f"index:{idx}"
            self._gpus.setdefault(key, self._unseen_gpu(idx, known))
            lost_keys.add(key)
        for key, gpu in self._gpus.items():
            if present is None:
                now_lost = gpu.lost or key in lost_keys  # no new sweep: only the source's word can add to it
            else:
                # Absent from two sweeps in a row: one cut sweep is not a lost GPU.
                gpu.absent = 0 if key in present else gpu.absent + 1
                now_lost = key in lost_keys or gpu.absent >= 2 or (gpu.lost and key not in present)
            if now_lost:
                self._evals.pop(key, None)  # a lost GPU's alert state ends: nothing is known about it
            if now_lost != gpu.lost:
                gpu.lost = now_lost
                if self.on_gpu_change is not None and gpu.index is not None:
                    self.on_gpu_change(now_lost, gpu.index, gpu.uuid)

    def _unseen_gpu(self, idx: int | None, uuid: str | None) -> TrackedGpu:
        # A GPU the source reported lost before the collector saw a row of it: the labels that can be known.
        return TrackedGpu(idx, uuid, self._identity(idx, uuid, None, None, self.driver_version or None)[1])

    def _identity(
        self, idx: int | None, uuid: str | None, name: str | None, bus: str | None, driver: str | None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """A GPU's labels: native (without unknown ``name`` and ``bus``), and the naming's (DCGM's or native)."""
        gpu = "" if idx is None else str(idx)
        native = {"gpu": gpu, "uuid": uuid or ""}
        if name is not None and bus is not None:
            native.update(name=name, pci_bus_id=bus)
        native.update(self.labels)
        if self.naming != "dcgm":
            return native, native
        dcgm = {
            "gpu": gpu,
            "UUID": uuid or "",
            "device": f"nvidia{gpu}",
            "modelName": name or "",
            "Hostname": self.hostname,
            "pci_bus_id": bus or "",
        }
        if driver is not None:
            dcgm["DCGM_FI_DRIVER_VERSION"] = driver
        return native, {**dcgm, **self.labels}

    def _sample_labels(self, s: GpuSample) -> tuple[dict[str, str], dict[str, str]]:
        drv = s.get("driver_version")
        name, bus = str(s.get("name") or ""), str(s.get("pci.bus_id") or "")
        return self._identity(s.index, s.uuid, name, bus, None if drv is None else str(drv))

    def _is_up(self, sweep: Sweep | None, age: float | None, health: SourceHealth) -> bool:
        if sweep is not None and sweep is self._down_sweep:
            return False  # still the sample from before the outage
        return health.running and health.state not in ("retrying", "failed", "closed") and self._fresh(sweep, age)

    def lost_gpus(self) -> list[tuple[int | None, str | None]]:
        """The GPUs seen earlier that are lost now, as (index, uuid)."""
        return [(g.index, g.uuid) for g in self._gpus.values() if g.lost]

    def start(self) -> SmiCollector:
        """Watch the source in a background thread (every quarter interval) so every sweep is taken in."""
        self._watch.start()
        return self

    def close(self) -> None:
        """Stop the watcher thread."""
        self._watch.close(5.0)

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not collect (and so not touch the stream)."""
        return []

    def _number(self, spec: MetricSpec, value: Value, raw: Mapping[str, str]) -> tuple[float, dict[str, str]] | None:
        """A value as ``spec`` exports it, with the labels it adds; None for no sample."""
        if spec.style == "info":
            text = raw.get(spec.field, str(value)) if isinstance(value, int) else str(value)
            return 1.0, {"value": text.strip()}
        if spec.style == "nvsmi":
            number = nvsmi_number(spec.field, value)
        elif spec.style == "pstate":
            number = pstate_number(value)
        else:
            number = to_number(value)
        return None if number is None else (number * spec.scale, {})

    def sweep_families(self, sweep: Sweep) -> list[Metric]:
        """The per-GPU metric families of one sweep (no health metrics): the non-empty ones, in spec order."""
        if not sweep:
            return []
        self._att_gpus = {s.uuid: s.index for s in sweep if s.uuid}
        per_gpu = []
        for s in sweep:
            pod = self.attribution.gpu_labels(s.uuid, self._att_gpus) if self.attribution is not None else {}
            native, named = self._sample_labels(s)
            if self.naming == "nvidia_smi":
                named = {"uuid": bare_uuid(s.uuid), **self.labels}
            per_gpu.append((s, {**native, **pod}, {**named, **pod}))
        out: list[Metric] = []
        for spec in self.specs:
            fam = Metric(spec.name, spec.help, spec.type)
            for s, native, named in per_gpu:
                value = s.get(spec.field)
                got = None if value is None else self._number(spec, value, s.raw)
                if got is not None:  # None: a status token: the series is absent for this GPU, never 0
                    labels = native if spec.naming == "smiquery" else named
                    fam.add_sample(spec.sample, {**labels, **got[1]} if got[1] else labels, got[0])
            if fam.samples:
                out.append(fam)
        if self.naming == "nvidia_smi":
            doc = "A metric with a constant '1' value labeled by gpu uuid, name and more."
            info = gauge("nvidia_smi_gpu_info", doc)
            for s in sweep:
                shown = {
                    label: s.raw.get(field, str(s.get(field) or "")).strip()
                    for field, label in NVSMI_INFO_LABELS.items()
                    if field in s
                }
                info.add_sample(info.name, {**shown, "uuid": bare_uuid(s.uuid), **self.labels}, 1.0)
            out.append(info)
        return out

    def pmon_families(self, instant: ProcessInstant) -> list[Metric]:
        """The busiest processes of each GPU from one pmon instant (:func:`~.families.pmon_families`)."""
        with self._refresh_lock:
            gpus = list(self._gpus.values())
        bare = self.naming == "nvidia_smi"  # its series join on the UUID without "GPU-"
        uuids = {g.index: (bare_uuid(g.uuid) if bare else g.uuid or "") for g in gpus if g.index is not None}
        return pmon_families(instant, uuids, self.labels)

    def _fresh(self, sweep: Sweep | None, age: float | None) -> bool:
        return sweep is not None and age is not None and age <= self.stale_after

    def _one(self, fam: Metric, value: float, labels: Mapping[str, str] | None = None) -> Metric:
        """``fam`` with one sample: the constant labels (and ``labels``)."""
        sample = fam.name + "_total" if fam.type == "counter" else fam.name
        fam.add_sample(sample, {**self.labels, **labels} if labels else self.labels, value)
        return fam

    def _health_head(self, sweep: Sweep | None, age: float | None) -> list[Metric]:
        st = self.stream.stats
        health = source_health(self.stream)
        one = self._one
        doc = f"1 when nvidia-smi delivers fresh samples (newest younger than {self.stale_after:g} s), else 0."
        out = [one(gauge("smiquery_up", doc), 1.0 if self._is_up(sweep, age, health) else 0.0)]
        doc = (
            "The nvidia-smi stream's state (starting, running, retrying, failed...), its last error type and "
            "whether that error needs a person (permanent); always 1."
        )
        state = {"state": health.state, "last_error_type": health.last_error_type or ""}
        out.append(one(gauge("smiquery_stream_info", doc), 1.0, {**state, "permanent": str(health.permanent).lower()}))
        next_at = health.next_retry_at if health.state == "retrying" else None
        if health.state == "failed" and self.revive_at is not None:
            next_at = self.revive_at
        if next_at is not None:
            doc = "Unix time at which nvidia-smi will be started again (while the stream retries)."
            out.append(one(gauge("smiquery_next_attempt_timestamp_seconds", doc), float(next_at)))
        build = {
            "version": __version__,
            "revision": revision(),
            "driver_version": self.driver_version,
            "nvidia_smi": self.nvidia_smi_path,
        }
        doc = "smiquery's version, its source revision (a commit, or unknown), the driver and its nvidia-smi; always 1."
        out.append(one(gauge("smiquery_build_info", doc), 1.0, build))
        if sweep is not None and age is not None:
            doc = "Unix time at which the newest sweep of nvidia-smi rows was received."
            out.append(one(gauge("smiquery_last_sample_timestamp_seconds", doc), time.time() - age))
            doc = "Age of the newest sweep of nvidia-smi rows."
            out.append(one(gauge("smiquery_last_sample_age_seconds", doc), age))
        for name, doc, n in (
            ("smiquery_nvidia_smi_starts", "nvidia-smi loop processes started.", st.starts),
            ("smiquery_nvidia_smi_restarts", "nvidia-smi loop processes restarted after a failure.", st.restarts),
            ("smiquery_sweeps", "Complete sweeps (one row per GPU) received.", st.sweeps),
            ("smiquery_dropped_rows", "Rows of nvidia-smi output rejected by the parser.", st.dropped_rows),
        ):
            out.append(one(Metric(name, doc, "counter"), float(n)))
        errors = Metric("smiquery_nvidia_smi_errors", "nvidia-smi failures, by error type and source.", "counter")
        for source, failures in (
            ("stream", st.errors),
            ("processes", self.processes.get().failures if self.processes is not None else None),
            ("pmon", self.pmon.errors if self.pmon is not None else None),
            ("details", self.details.get().failures if self.details is not None else None),
        ):
            for typ, n in sorted(dict(failures).items()) if failures is not None else ():
                errors.add_sample(errors.name + "_total", {**self.labels, "type": typ, "source": source}, float(n))
        return out + ([errors] if errors.samples else [])

    def _gpu_health(self) -> list[Metric]:
        """The per-GPU health (lost GPUs, alert state; they change only when a sweep is taken in), details, Xid."""
        doc = "1 while a GPU seen since the exporter started is lost (nvidia-smi says so, or its rows stopped), else 0."
        with self._refresh_lock:
            lost = ((gpu.labels, 1.0 if gpu.lost else 0.0) for gpu in self._gpus.values())
            fams = [gauge("smiquery_gpu_lost", doc, *lost)]
            if self.alerts is not None and self._gpus:
                firing = gauge(
                    "smiquery_alert_firing",
                    "1 while a smiquery alert rule, evaluated on every nvidia-smi sample, fires on the GPU, else 0; "
                    "absent while the GPU is lost or the data stale (unknown).",
                )
                doc = "Times a smiquery alert rule started firing on the GPU."
                fired = Metric("smiquery_alert_fired", doc, "counter")
                for i, rule in enumerate(self.alerts.rules):
                    for key, gpu in self._gpus.items():
                        labels = {**gpu.labels, "alert": str(rule)}
                        ev = self._evals.get(key)
                        if self._up and not gpu.lost:
                            track = gpu.index if gpu.index is not None else gpu.uuid
                            on = ev is not None and ev.state(i, track) == "firing"
                            firing.add_sample(firing.name, labels, 1.0 if on else 0.0)
                        fired.add_sample(fired.name + "_total", labels, float(self._fired.get((i, key), 0)))
                fams += [firing, fired]
        out = [f for f in fams if f.samples]
        if self.details is not None:
            out.extend(details_health(self.details, self.labels))
        if self.xid is not None:
            # the GPUs are known once the CSV has a sweep and, when details run, their first answer is in
            known = bool(self._gpus) and (self.details is None or self.details.get().value is not None)
            out.extend(xid_families(self.xid, self._gpu_at_bus(), self.labels, inventory_known=known))
        return out

    def _health_tail(self, duration: float) -> list[Metric]:
        one = self._one
        out: list[Metric] = []
        listed = self.processes.get() if self.processes is not None else None
        if listed is not None and self.naming == "nvidia_smi":
            ok = listed.polls > 0 and listed.error is None
            doc = "1 when the last process listing worked."
            out.append(one(gauge("nvidia_smi_compute_apps_last_collect_success", doc), 1.0 if ok else 0.0))
        if listed is not None and listed.at is not None:
            doc = "Unix time of the newest successful listing of compute processes."
            out.append(one(gauge("smiquery_processes_last_success_timestamp_seconds", doc), listed.at))
        if self.pmon is not None:
            out.extend(pmon_health(self.pmon, self.labels))
        if self.render_errors:
            doc = "Scrapes whose GPU metrics could not be built (a bug)."
            out.append(one(Metric("smiquery_collection_errors", doc, "counter"), float(self.render_errors)))
        doc = "Time spent building this scrape's metrics."
        out.append(one(gauge("smiquery_collection_duration_seconds", doc), duration))
        for fam in self._process_collector.collect() if self._process_collector is not None else ():
            fam.samples = [s._replace(labels={**s.labels, **self.labels}) for s in fam.samples]
            out.append(fam)
        return out

    def _inputs(self, sweep: Sweep | None, age: float | None) -> tuple[Any, ...]:
        """What the data families are built from: the sweep (None when stale), processes, pmon, details."""
        procs = self.processes
        return (
            sweep if self._fresh(sweep, age) else None,
            procs.get().fresh(max(3 * procs.interval, self.stale_after)) if procs is not None else None,
            self.pmon.fresh() if self.pmon is not None else None,
            fresh_details(self.details) if self.details is not None else None,
        )

    def _data_families(
        self,
        sweep: Sweep | None,
        procs: tuple[GpuProcess, ...] | None,
        instant: ProcessInstant | None,
        details: tuple[GpuDetails, ...] | None,
    ) -> list[Metric]:
        fams: list[Metric] = []
        try:
            if sweep is not None:
                fams.extend(self.sweep_families(sweep))
            if details is not None:
                # its own cadence: served while the newest -q -x is fresh, whatever the CSV's age
                fams.extend(mig_families(details, dcgm=self.naming == "dcgm", gpu_labels=self._details_labels))
            if procs is not None:
                fams.extend(process_families(procs, self.labels, nvsmi=self.naming == "nvidia_smi"))
            if instant is not None:
                fams.extend(self.pmon_families(instant))
            att = self.attribution
            if att is not None:  # stale data: the GPUs of the last fresh sweep keep their state
                uuid_label = "UUID" if self.naming == "dcgm" else "uuid"
                fams += attribution_families(att, self._att_gpus, uuid_label, self.labels)
                if att.backend.processes:
                    fams += workload_families(att, self._att_gpus, instant, procs, uuid_label, self.labels)
        except Exception:  # a bug must not take /metrics down: the health metrics still go out
            self.render_errors += 1
            log.exception("smiquery exporter: building the GPU metrics failed")
            return []
        return merge_families(fams)  # DCGM's FB families get MIG samples too: one family per name

    def _details_labels(self, gpu: GpuDetails) -> dict[str, str]:
        """The parent GPU's labels for its MIG series: as its CSV series have them, or from the details alone."""
        with self._refresh_lock:
            tracked = self._gpus.get(gpu.uuid or "")
        if tracked is not None:
            return dict(tracked.labels)
        return self._identity(gpu.index, gpu.uuid, gpu.name or "", gpu.pci_bus_id or "", gpu.driver_version or None)[1]

    def _gpu_at_bus(self) -> Callable[[BusKey], Mapping[str, str] | None]:
        """PCI key -> the ``gpu`` and ``uuid`` of the GPU there: the GPUs seen in the CSV, then in the details."""
        details = self.details.get().value if self.details is not None else None
        with self._refresh_lock:
            seen = [(g.labels.get("pci_bus_id", ""), g.index, g.uuid) for g in self._gpus.values()]
        found: dict[BusKey, dict[str, str]] = {}
        for bus, idx, uuid in [(d.pci_bus_id or "", d.index, d.uuid) for d in details or ()] + seen:
            key = bus_key(bus)
            if key is not None:
                found[key] = {"gpu": "" if idx is None else str(idx), "uuid": uuid or ""}
        return found.get

    def collect(self) -> Iterator[Metric]:
        """Yield the GPU, process and health metric families (the ``prometheus_client`` collector protocol)."""
        t0 = time.perf_counter()
        self.refresh()
        sweep, age = self.stream.latest()
        yield from self._data_families(*self._inputs(sweep, age))
        yield from self._health_head(sweep, age) + self._gpu_health()
        yield from self._health_tail(time.perf_counter() - t0)

    def _cached(self, part: str, key: tuple[object, ...], build: Callable[[], list[Metric]]) -> bytes:
        """``build()`` rendered, and rendered again only once ``key`` changes (call with ``_lock`` held)."""
        old = self._texts.get(part)
        if old is None or len(old[0]) != len(key) or not all(a is b or a == b for a, b in zip(key, old[0])):
            old = self._texts[part] = (key, render(build()).encode())
        return old[1]

    def exposition(self) -> bytes:
        """The whole ``/metrics`` body in the Prometheus text format; the per-sweep part rendered once per sweep."""
        t0 = time.perf_counter()
        self.refresh()
        sweep, age = self.stream.latest()
        data = self._inputs(sweep, age)
        key = (*data, *(self.attribution.token if self.attribution else ()))
        # the per-GPU health changes rarely, scrapes are frequent
        details = () if self.details is None else (fresh_details(self.details) is not None, self.details.get().value)
        xid = (self.xid.events, sum(self.xid.rejected().values()), self.xid.up) if self.xid is not None else ()
        with self._lock:
            body = self._cached("data", key, lambda: self._data_families(*data))
            gpus = self._cached("gpus", (self._gpu_version, *details, *xid), self._gpu_health)
        head = render(self._health_head(sweep, age)).encode()
        tail = render(self._health_tail(time.perf_counter() - t0)).encode()
        return body + head + gpus + tail

    def health(self) -> tuple[bool, str]:
        """``(True, "ok")`` while the data is fresh and every GPU seen is there, else ``(False, why)`` (``/readyz``)."""
        sweep, age = self.stream.latest()
        h = source_health(self.stream)
        last = f"; last error: {h.last_error}" if h.last_error else ""
        if not h.running:
            err = self.stream.error
            why = f"{type(err).__name__}: {err}".splitlines()[0] if err is not None else "not started or closed"
            if self.revive_at is not None:
                why += f"; a new one starts in {max(0.0, self.revive_at - time.time()):.0f} s"
            return False, f"nvidia-smi stream stopped: {why}"
        if h.state == "retrying":
            left = None if h.next_retry_at is None else max(0.0, h.next_retry_at - time.time())
            when = "" if left is None else f"; next attempt in {left:.0f} s"
            kind = "a permanent error (needs a person)" if h.permanent else "an error"
            return False, f"nvidia-smi is retrying after {kind}: {h.last_error_type or '?'}{when}{last}"
        if sweep is None or age is None:
            return False, f"no sample yet (waiting for nvidia-smi){last}"
        if age > self.stale_after:
            return False, f"stale: newest sample is {age:.1f} s old (limit {self.stale_after:g} s){last}"
        lost = self.lost_gpus()
        if lost:
            names = ", ".join(f"GPU {i} ({u or 'uuid unknown'})" for i, u in lost)
            return False, f"lost: {names}"
        return True, "ok"


_SHA = re.compile(r"[0-9a-f]{7,64}")
_PACKAGE = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def revision() -> str:
    """The source revision smiquery was built from (``revision`` in ``smiquery_build_info``), or ``unknown``.

    The first of: ``smiquery/_revision.py`` (``REVISION = "<commit>"``, written by a build), the commit pip recorded
    installing from a git URL, the commit checked out (read from ``.git``, no git run).
    """
    try:
        baked = str(getattr(importlib.import_module("smiquery._revision"), "REVISION", "")).strip()
    except ImportError:  # written by a build, absent in a checkout
        baked = ""
    return baked or _pip_recorded() or _git_checkout() or "unknown"


def _pip_recorded() -> str | None:
    for info in sorted(_PACKAGE.parent.glob("smiquery-*.dist-info/direct_url.json")):
        try:
            commit = json.loads(info.read_text(encoding="utf-8")).get("vcs_info", {}).get("commit_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(commit, str) and _SHA.fullmatch(commit):
            return commit
    return None


def _git_checkout() -> str | None:
    git = _PACKAGE.parent / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = Path(git.read_text(encoding="utf-8").split(":", 1)[1].strip())
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref: "):
            return head if _SHA.fullmatch(head) else None
        ref = head[5:]
        common = git / "commondir"
        roots = [git, (git / common.read_text(encoding="utf-8").strip()).resolve()] if common.is_file() else [git]
        loose = next((root / ref for root in roots if (root / ref).is_file()), None)
        if loose is not None:
            value = loose.read_text(encoding="utf-8").strip()
            return value if _SHA.fullmatch(value) else None
        packed = [root / "packed-refs" for root in roots if (root / "packed-refs").is_file()]
        lines = [line.split() for path in packed for line in path.read_text(encoding="utf-8").splitlines()]
        return next((p[0] for p in lines if len(p) == 2 and p[1] == ref and _SHA.fullmatch(p[0])), None)
    except (OSError, IndexError):
        return None
