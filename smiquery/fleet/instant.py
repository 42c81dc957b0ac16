"""The fleet now: one :class:`FleetGpu` per GPU from a handful of PromQL instant queries."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

from smiquery.alerts.rules import STALL
from smiquery.fleet.client import PrometheusClient
from smiquery.fleet.naming import FleetNaming, GpuKey, check_regex, detect_namings, gpu_series, info_labels, selector

__all__ = ["COLUMNS", "SORT_KEYS", "FleetGpu", "filter_gpus", "snapshot", "sort_gpus"]

_TOP_FIELDS = ("utilization.gpu", "memory.used", "memory.total", "temperature.gpu", "power.draw")
# FleetGpu's values by the nvidia-smi field each holds
_FIELD_OF = dict(zip(("utilization", "memory_used", "memory_total", "temperature", "power"), _TOP_FIELDS, strict=True))

# FleetGpu's booleans: in to_dict() and the CSV as the one ``state``
_FLAGS = ("idle", "lost", "down", "stale")


@dataclass(frozen=True)
class FleetGpu:
    """One GPU of the fleet as it is now: values in percent, MiB, degrees C and watts (None: no sample now).

    Attributes:
        instance: the scrape target (node) it was exported from.
        gpu: its index on that node ("" when unknown).
        naming: the naming its metrics came in.
        alerts: names of the alerts firing for it.
        idle: under the idle utilization for the whole window while holding memory.
        lost: it reported during the window but has no sample now.
        down: its scrape target's ``up`` is 0 now; its values are None, whatever samples are left.
        stale: its newest utilization sample is older than ``stale_after`` (no ``up`` says why); values None.
    """

    instance: str
    gpu: str
    uuid: str
    name: str
    naming: str
    utilization: float | None
    memory_used: float | None
    memory_total: float | None
    temperature: float | None
    power: float | None
    namespace: str = ""
    pod: str = ""
    alerts: tuple[str, ...] = ()
    idle: bool = False
    lost: bool = False
    down: bool = False
    stale: bool = False

    @property
    def state(self) -> str:
        """``down``, ``stale``, ``lost``, ``idle`` or ``ok``."""
        return next((s for s in ("down", "stale", "lost", "idle") if getattr(self, s)), "ok")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, the values by their nvidia-smi names (percent, MiB, degrees C, watts), and ``state``."""
        out = {_FIELD_OF.get(k, k): v for k, v in asdict(self).items() if k not in _FLAGS}
        return {**out, "alerts": list(self.alerts), "state": self.state}


#: The keys of :meth:`FleetGpu.to_dict`, in order (``smiquery top --format csv``'s columns).
COLUMNS = (*(_FIELD_OF.get(f.name, f.name) for f in fields(FleetGpu) if f.name not in _FLAGS), "state")

#: ``--sort`` keys: the attribute, largest first (``node`` sorts by instance and GPU index).
SORT_KEYS: dict[str, str] = {"util": "utilization", "mem": "memory_used", "temp": "temperature", "power": "power"}


def sort_gpus(gpus: Sequence[FleetGpu], by: str = "node") -> list[FleetGpu]:
    """GPUs by node (instance, index), or by a value largest first (no value last, then by node)."""
    ordered = sorted(gpus, key=lambda g: GpuKey(g.instance, g.gpu, g.uuid).sort_key())
    if by == "node":
        return ordered
    attr = SORT_KEYS[by]
    return sorted(ordered, key=lambda g: -math.inf if getattr(g, attr) is None else getattr(g, attr), reverse=True)


def filter_gpus(
    gpus: Sequence[FleetGpu],
    *,
    node: str | None = None,
    namespace: str | None = None,
    pod: str | None = None,
    idle: bool = False,
) -> list[FleetGpu]:
    """The GPUs whose instance, namespace and pod match the (anchored) regexes; with ``idle`` only idle ones."""
    wanted = ((node, "instance"), (namespace, "namespace"), (pod, "pod"))
    checks = [(re.compile(pattern), attr) for pattern, attr in wanted if pattern is not None]
    return [g for g in gpus if (g.idle or not idle) and all(rx.fullmatch(getattr(g, a)) for rx, a in checks)]


def _number(sample: dict[str, Any], factor: float) -> float | None:
    try:
        v = float(sample["value"][1]) * factor
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def snapshot(
    client: PrometheusClient,
    *,
    namings: Sequence[str] | None = None,
    at: float | None = None,
    node: str | None = None,
    idle_minutes: float = 30.0,
    idle_utilization: float = 5.0,
    held_memory_mib: float = STALL.busy_memory_mib,
    stale_after: float | None = None,
) -> list[FleetGpu]:
    """Every GPU of the fleet at ``at`` (default now), each listed once, ordered by node.

    The server's firing ``ALERTS`` are matched to GPUs by UUID, else by instance and GPU index; ``up`` by instance,
    and job where that has one (see :class:`FleetGpu` for ``down`` and ``stale``: a target gone without staleness
    markers, e.g. across a server restart, keeps its last samples for the 5-minute lookback).

    Args:
        client: the server.
        at: Unix seconds to look at (default now).
        namings: read only these namings (default: every naming the server holds).
        node: only instances matching this regex (anchored, as in PromQL).
        idle_minutes: the window over which ``idle`` (and ``lost``) are judged.
        idle_utilization: a GPU is idle when utilization.gpu stayed under this (percent) for the whole window...
        held_memory_mib: ...while it holds at least this much memory now.
        stale_after: seconds; default three scrape intervals, at least 60 (the interval per job from its samples over
            the idle window: one more query, asked only when some sample is over 60 s old).

    Raises:
        PrometheusError: no GPU metric at all; the client's errors (see :class:`PrometheusClient`).
        UsageError: ``node`` is not a regex.
    """
    check_regex(node, "--node")
    when = time.time() if at is None else at
    window = f"{max(1, round(idle_minutes * 60))}s"
    found = detect_namings(client, when - idle_minutes * 60, when, namings, node)
    oldest = 60.0 if stale_after is None else stale_after
    queries: list[tuple[FleetNaming, str, str]] = []
    for n in found:
        sel = selector(n.metric("utilization.gpu"), node)
        for fld in _TOP_FIELDS:
            queries.append((n, fld, selector(n.metric(fld), node)))
        queries.append((n, "window", f"max_over_time({sel}[{window}])"))
        # the newest sample's own time (not ``at``), only where older than any limit: a healthy fleet's answer is empty
        queries.append((n, "seen", f"timestamp({sel}) < {when - oldest:.3f}"))
    asked = [*(q for _, _, q in queries), selector("ALERTS", node, 'alertstate="firing"'), selector("up", node)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(client.query, q, when) for q in asked]
        info_futures = {n.name: pool.submit(info_labels, client, n, node, when, "1h") for n in found}
        *results, alerts, up_rows = [f.result() for f in futures]
        infos = {k: f.result() for k, f in info_futures.items()}
    ups: dict[str, dict[str, float | None]] = {}  # instance -> job -> up
    for s in up_rows:
        labels = s.get("metric", {})
        ups.setdefault(labels.get("instance", ""), {})[labels.get("job", "")] = _number(s, 1.0)
    intervals: dict[tuple[str, str], float] = {}  # (naming, job) -> seconds between samples
    old = [n for (n, fld, _), result in zip(queries, results, strict=True) if fld == "seen" and result]
    for n in old if stale_after is None else ():  # samples per GPU over the window, the median per job
        sel = selector(n.metric("utilization.gpu"), node)
        for s in client.query(f"quantile by (job) (0.5, count_over_time({sel}[{window}]))", when):
            got = _number(s, 1.0)
            if got:
                intervals[(n.name, s.get("metric", {}).get("job", ""))] = idle_minutes * 60 / got
    idents: dict[GpuKey, dict[str, str]] = {}
    rows: dict[GpuKey, dict[str, float | None]] = {}
    jobs: dict[GpuKey, str] = {}
    read = ((n, fld, result) for (n, fld, _), result in zip(queries, results, strict=True))
    for n, fld, key, sample in gpu_series(read, infos, idents):
        factor = 1.0 if fld == "seen" else n.factor("utilization.gpu" if fld == "window" else fld)
        rows.setdefault(key, {})[fld] = _number(sample, factor)
        jobs.setdefault(key, sample.get("metric", {}).get("job", ""))
    firing: dict[GpuKey, list[str]] = {}
    targets: dict[Any, GpuKey] = {(k.instance, k.gpu): k for k in rows} | {k.uuid: k for k in rows if k.uuid}
    for a in alerts:
        labels = a.get("metric", {})
        uuid = labels.get("uuid") or labels.get("UUID") or ""
        target = targets.get(uuid) if uuid else targets.get((labels.get("instance", ""), labels.get("gpu", "")))
        if target is not None:
            firing.setdefault(target, []).append(labels.get("alertname", "alert"))
    out: list[FleetGpu] = []
    for key, row in rows.items():
        ident = idents[key]
        job = jobs.get(key, "")
        up = ups.get(key.instance, {})  # no ``up`` at all (federated, remote-written): judged by age only
        states = [up[job]] if job in up else list(up.values())
        down = bool(states) and all(v == 0 for v in states)
        limit = stale_after if stale_after is not None else max(oldest, 3 * intervals.get((ident["naming"], job), 0))
        seen = row.get("seen")
        stale = not down and seen is not None and when - seen > limit
        if down or stale:
            row = {}
        values: dict[str, Any] = {attr: row.get(f) for attr, f in _FIELD_OF.items()}
        lost = not (down or stale) and all(v is None for v in values.values())
        peak = row.get("window")
        used = values["memory_used"]
        idle = (
            not lost and peak is not None and peak < idle_utilization and used is not None and used >= held_memory_mib
        )
        values |= asdict(key) | {k: ident[k] for k in ("name", "naming", "namespace", "pod")}
        alerting = tuple(sorted(set(firing.get(key, ()))))
        out.append(FleetGpu(**values, alerts=alerting, idle=idle, lost=lost, down=down, stale=stale))
    return sort_gpus(out)
