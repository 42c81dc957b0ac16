"""The three ways GPU metrics are named in Prometheus, and which of them a server holds.

``smiquery`` (``smiquery export``), ``dcgm`` (dcgm-exporter, ``DCGM_FI_*``) and ``nvidia_smi`` (nvidia_gpu_exporter,
``nvidia_smi_*``): :class:`FleetNaming` turns a series back into nvidia-smi's field, unit and GPU identity.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smiquery.errors import PrometheusError, UsageError

if TYPE_CHECKING:
    from smiquery.fleet.client import PrometheusClient

__all__ = [
    "EXTRA_FIELDS",
    "FLEET_FIELDS",
    "NAMINGS",
    "FleetNaming",
    "GpuKey",
    "check_regex",
    "detect_namings",
    "gpu_series",
    "held_metrics",
    "info_labels",
    "naming_by_name",
    "selector",
]

#: The nvidia-smi fields the fleet view reads (what the report and the plot need), in the order of a recording.
FLEET_FIELDS: tuple[str, ...] = (
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "clocks.current.sm",
    "clocks_event_reasons.active",
)


# Per field read back too: its sample names (counters with their _total) in smiquery and DCGM naming ("=": the DCGM
# naming writes the slowdown reasons under smiquery's names, DCGM has only the bitmask); nvidia_gpu_exporter's are
# nvidia_smi_ and the field's name.
_EXTRA_METRICS = [
    row.split()
    for row in """
    clocks_event_reasons.hw_thermal_slowdown smiquery_clocks_event_reasons_hw_thermal_slowdown_active =
    clocks_event_reasons.sw_thermal_slowdown smiquery_clocks_event_reasons_sw_thermal_slowdown_active =
    clocks_event_reasons.hw_power_brake_slowdown smiquery_clocks_event_reasons_hw_power_brake_slowdown_active =
    ecc.errors.corrected.volatile.total smiquery_ecc_errors_corrected_volatile_total DCGM_FI_DEV_ECC_SBE_VOL_TOTAL
    ecc.errors.uncorrected.volatile.total smiquery_ecc_errors_uncorrected_volatile_total DCGM_FI_DEV_ECC_DBE_VOL_TOTAL
    ecc.errors.corrected.aggregate.total smiquery_ecc_errors_corrected_aggregate_total DCGM_FI_DEV_ECC_SBE_AGG_TOTAL
    ecc.errors.uncorrected.aggregate.total smiquery_ecc_errors_uncorrected_aggregate_total DCGM_FI_DEV_ECC_DBE_AGG_TOTAL
    retired_pages.single_bit_ecc.count smiquery_retired_pages_single_bit_ecc_total DCGM_FI_DEV_RETIRED_SBE
    retired_pages.double_bit.count smiquery_retired_pages_double_bit_total DCGM_FI_DEV_RETIRED_DBE
    retired_pages.pending smiquery_retired_pages_pending DCGM_FI_DEV_RETIRED_PENDING
    remapped_rows.correctable smiquery_remapped_rows_correctable_total DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS
    remapped_rows.uncorrectable smiquery_remapped_rows_uncorrectable_total DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS
    remapped_rows.failure smiquery_remapped_rows_failure DCGM_FI_DEV_ROW_REMAP_FAILURE
    remapped_rows.pending smiquery_remapped_rows_pending DCGM_FI_DEV_ROW_REMAP_PENDING
    """.strip().splitlines()
]
#: Fields read back too where the server holds them: the slowdown reasons the built-in rules watch and the memory
#: health a recording's report checks (ECC errors, retired pages, remapped rows). Their metrics are in
#: nvidia-smi's units in every naming (the exporter writes flags as 1/0).
EXTRA_FIELDS: tuple[str, ...] = tuple(row[0] for row in _EXTRA_METRICS)


@dataclass(frozen=True)
class GpuKey:
    """One GPU of the fleet: the scrape target it came from and its identity there."""

    instance: str
    gpu: str
    uuid: str

    def sort_key(self) -> tuple[str, int, str, str]:
        """By instance, then GPU index as a number."""
        return (self.instance, int(self.gpu) if self.gpu.isdigit() else 1 << 30, self.gpu, self.uuid)


@dataclass(frozen=True)
class FleetNaming:
    """One naming: metric names per nvidia-smi field and which labels hold the GPU's index, UUID and model.

    Attributes:
        metrics: nvidia-smi field -> (metric name, factor from the metric's unit to nvidia-smi's).
        info_metric: a metric whose labels give index and model by UUID (nvidia_smi naming), or "".
    """

    name: str
    metrics: Mapping[str, tuple[str, float]]
    gpu_label: str
    uuid_label: str
    model_label: str = ""
    info_metric: str = ""

    def metric(self, fld: str) -> str:
        """The metric name of an nvidia-smi field."""
        return self.metrics[fld][0]

    def factor(self, fld: str) -> float:
        """What to multiply the metric's values by to get nvidia-smi's unit."""
        return self.metrics[fld][1]

    def uuid_of(self, labels: Mapping[str, str]) -> tuple[str, str]:
        """The label holding a series' UUID, and its value: the naming's, else ``uuid`` or ``UUID`` (else ``""``)."""
        return next(((x, labels[x]) for x in (self.uuid_label, "uuid", "UUID") if labels.get(x)), ("", ""))

    def key(self, labels: Mapping[str, str], info: Mapping[str, Mapping[str, str]] | None = None) -> GpuKey:
        """The GPU a series belongs to."""
        uuid = self.uuid_of(labels)[1]
        gpu = labels.get(self.gpu_label, "") if self.gpu_label else ""
        if not gpu and info is not None:
            gpu = info.get(uuid, {}).get("index", "")
        return GpuKey(labels.get("instance", ""), gpu, uuid)

    def model(self, labels: Mapping[str, str], info: Mapping[str, Mapping[str, str]] | None = None) -> str:
        """The GPU's model name, from the series' labels or the info metric."""
        if self.model_label:
            return labels.get(self.model_label, "")
        if info is not None:
            return info.get(labels.get(self.uuid_label, ""), {}).get("name", "")
        return ""


# Per field of FLEET_FIELDS, in its order: its metric in each naming (smiquery, dcgm, nvidia_smi).
_METRICS = [
    row.split()
    for row in """
    smiquery_utilization_gpu_ratio DCGM_FI_DEV_GPU_UTIL nvidia_smi_utilization_gpu_ratio
    smiquery_utilization_memory_ratio DCGM_FI_DEV_MEM_COPY_UTIL nvidia_smi_utilization_memory_ratio
    smiquery_memory_used_bytes DCGM_FI_DEV_FB_USED nvidia_smi_memory_used_bytes
    smiquery_memory_total_bytes DCGM_FI_DEV_FB_TOTAL nvidia_smi_memory_total_bytes
    smiquery_temperature_gpu_celsius DCGM_FI_DEV_GPU_TEMP nvidia_smi_temperature_gpu
    smiquery_power_draw_watts DCGM_FI_DEV_POWER_USAGE nvidia_smi_power_draw_watts
    smiquery_clocks_current_sm_hertz DCGM_FI_DEV_SM_CLOCK nvidia_smi_clocks_current_sm_clock_hz
    smiquery_clocks_event_reasons_active_bitmask DCGM_FI_DEV_CLOCKS_EVENT_REASONS nvidia_smi_clocks_event_reasons_active
    """.strip().splitlines()
]
# From base units (ratio, bytes, hertz) to nvidia-smi's, per field; dcgm-exporter's metrics are in nvidia-smi's units.
_FROM_BASE = (100.0, 100.0, 2**-20, 2**-20, 1.0, 1.0, 1e-6, 1.0)


def _metrics(column: int, factors: Sequence[float] = _FROM_BASE) -> dict[str, tuple[str, float]]:
    got = {f: (row[column], k) for f, row, k in zip(FLEET_FIELDS, _METRICS, factors, strict=True)}
    for f, ours, dcgm in _EXTRA_METRICS:
        got[f] = ((ours, ours if dcgm == "=" else dcgm, "nvidia_smi_" + f.replace(".", "_"))[column], 1.0)
    return got


NAMINGS: tuple[FleetNaming, ...] = (
    FleetNaming("smiquery", _metrics(0), gpu_label="gpu", uuid_label="uuid", model_label="name"),
    FleetNaming("dcgm", _metrics(1, [1.0] * 8), gpu_label="gpu", uuid_label="UUID", model_label="modelName"),
    FleetNaming("nvidia_smi", _metrics(2), gpu_label="", uuid_label="uuid", info_metric="nvidia_smi_gpu_info"),
)


def naming_by_name(name: str) -> FleetNaming:
    """The naming called ``name``; UsageError for an unknown name."""
    for n in NAMINGS:
        if n.name == name:
            return n
    raise UsageError(f"--naming: {name!r} is not a naming; use {', '.join(n.name for n in NAMINGS)}")


def selector(metric: str, node: str | None = None, matchers: str = "") -> str:
    """``metric{instance=~"NODE",MATCHERS}`` (PromQL regexes are anchored), or the bare metric name."""
    got = ",".join(m for m in ("" if node is None else f"instance=~{json.dumps(node)}", matchers) if m)
    return f"{metric}{{{got}}}" if got else metric


def check_regex(pattern: str | None, what: str) -> None:
    """Fail as a usage error on a regex Python cannot compile (PromQL's RE2 is close to Python's ``re``)."""
    try:
        re.compile(pattern or "")
    except re.error as exc:
        raise UsageError(f"{what}: {pattern!r} is not a regular expression: {exc}") from None


def detect_namings(
    client: PrometheusClient,
    start: float,
    end: float,
    wanted: Sequence[str] | None = None,
    node: str | None = None,
) -> list[FleetNaming]:
    """The namings whose utilisation metric has series between ``start`` and ``end`` (a mixed fleet has several).

    ``wanted`` namings (``--naming``) are not looked up; ``node``: only instances matching this regex count.
    PrometheusError when no naming's series are there.
    """
    if wanted:
        return [naming_by_name(n) for n in dict.fromkeys(wanted)]
    names = {n.metric("utilization.gpu"): n for n in NAMINGS}
    found = held_metrics(client, names, start, end, node)
    out = [n for metric, n in names.items() if metric in found]
    if not out:
        where = "" if node is None else f" on instances matching {node!r}"
        raise PrometheusError(
            f"no GPU metrics in Prometheus at {client.url} for that time{where} ({', '.join(names)}); check the "
            "exporters' scrape jobs, the time range and --node"
        )
    return out


def held_metrics(
    client: PrometheusClient, names: Iterable[str], start: float, end: float, node: str | None = None
) -> set[str]:
    """Which of the metric ``names`` have series between ``start`` and ``end`` (on instances matching ``node``)."""
    on_node = "" if node is None else f",instance=~{json.dumps(node)}"
    pattern = "|".join(sorted(set(names)))
    return set(client.metric_names([f'{{__name__=~"{pattern}"{on_node}}}'], start, end))


# Where each identity of a GPU sits, the first set one wins: the exporter's own labels before the scrape's; a node's
# own name where it is not the target's address (dcgm-exporter's ``Hostname``); a Slurm job id where an exporter
# labels it (dcgm-exporter's HPC job mapping: ``hpc_job``).
_IDENT_LABELS = {
    "node": ("exported_node", "node", "Hostname"),
    "job": ("slurm_job_id", "slurm_job", "hpc_job"),
    "namespace": ("exported_namespace", "namespace"),
    "pod": ("exported_pod", "pod"),
}


def info_labels(
    client: PrometheusClient, naming: FleetNaming, node: str | None, at: float | None, window: str
) -> dict[str, Mapping[str, str]]:
    """The labels of the naming's info metric over ``window`` up to ``at``, by UUID (empty for a naming without)."""
    if not naming.info_metric:
        return {}
    rows = client.query(f"last_over_time({selector(naming.info_metric, node)}[{window}])", at)
    return {r["metric"].get(naming.uuid_label, ""): r["metric"] for r in rows}


def gpu_series(
    results: Iterable[tuple[FleetNaming, str, Sequence[dict[str, Any]]]],
    infos: Mapping[str, Mapping[str, Mapping[str, str]]],
    idents: dict[GpuKey, dict[str, str]],
) -> Iterator[tuple[FleetNaming, str, GpuKey, dict[str, Any]]]:
    """Each series of query ``results`` (naming, field, the series) with the GPU it belongs to.

    A GPU exported twice (its UUID under another key: a second exporter) is read once, under the first naming
    that gave it. ``idents`` gathers what each GPU is: its ``naming``, ``name`` (model), ``namespace``, ``pod``,
    ``node`` and ``job`` (a Slurm job id), the first found of each. ``infos`` holds
    :func:`info_labels` by naming.
    """
    owners: dict[str, GpuKey] = {}
    for n, fld, result in results:
        info = infos.get(n.name)
        for series in result:
            labels = series.get("metric", {})
            key = n.key(labels, info)
            if key.uuid and owners.setdefault(key.uuid, key) != key:
                continue
            got = idents.setdefault(key, {"naming": n.name, "name": "", **dict.fromkeys(_IDENT_LABELS, "")})
            got["name"] = got["name"] or n.model(labels, info)
            for what, names in _IDENT_LABELS.items():
                got[what] = got[what] or next((labels[x] for x in names if labels.get(x)), "")
            yield n, fld, key, series
