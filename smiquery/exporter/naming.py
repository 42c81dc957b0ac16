"""Metric naming: how each nvidia-smi field becomes a metric family in each naming, and the text format."""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString as _untyped_float_to_go

from smiquery._log import get_logger
from smiquery.errors import InvalidFieldError, NvidiaSmiFailedError
from smiquery.fields import Field, Kind, help_query_gpu, resolve_fields
from smiquery.kinds import UNITS, unit_info

if TYPE_CHECKING:
    import os

__all__ = [
    "DCGM_DEFAULT_EXTRAS",
    "DCGM_MAP",
    "HEALTH_METRICS",
    "IDENTITY_FIELDS",
    "MIG_SERIES",
    "NAMINGS",
    "NVSMI_DEFAULT_EXTRAS",
    "NVSMI_INFO_LABELS",
    "NVSMI_WORDS",
    "PMON_METRICS",
    "PMON_SERIES",
    "MetricSpec",
    "Naming",
    "bare_uuid",
    "exporter_fields",
    "metric_specs",
    "render",
]

log = get_logger("smiquery.exporter")
_go_float = cast("Callable[[float], str]", _untyped_float_to_go)  # the text format's float spelling (+Inf, 1e+06)


Naming = Literal["smiquery", "dcgm", "nvidia_smi"]
#: The namings :func:`metric_specs` and the exporter accept.
NAMINGS: tuple[str, ...] = ("smiquery", "dcgm", "nvidia_smi")

#: Fields the exporter always queries: they become the ``gpu``, ``uuid``, ``name`` and ``pci_bus_id`` labels.
IDENTITY_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "pci.bus_id")
#: With DCGM naming and the default fields: every counter of dcgm-exporter's default list (default-counters.csv)
#: that nvidia-smi can supply and the ``health`` preset lacks. The rest of that list (energy, PCIe replays, XID,
#: NVLink, vGPU licence, DCGM_FI_PROF_*) has no nvidia-smi query field.
DCGM_DEFAULT_EXTRAS: tuple[str, ...] = (
    "memory.free",
    "memory.reserved",
    "temperature.memory",
    "clocks.current.memory",
    "utilization.encoder",
    "utilization.decoder",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.failure",
)

#: The per-MIG-instance families (``--details-interval``): (native name, DCGM name, MigDevice attribute, help).
MIG_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("smiquery_mig_memory_used_bytes", "DCGM_FI_DEV_FB_USED", "memory_used", "Framebuffer memory used"),
    ("smiquery_mig_memory_free_bytes", "DCGM_FI_DEV_FB_FREE", "memory_free", "Framebuffer memory free"),
    ("smiquery_mig_memory_total_bytes", "DCGM_FI_DEV_FB_TOTAL", "memory_total", "Framebuffer memory"),
)
#: The exporter's own metrics (sample names), served in both namings whatever the fields.
HEALTH_METRICS: tuple[str, ...] = (
    "smiquery_up",
    "smiquery_last_sample_timestamp_seconds",
    "smiquery_last_sample_age_seconds",
    "smiquery_collection_duration_seconds",
    "smiquery_nvidia_smi_starts_total",
    "smiquery_nvidia_smi_restarts_total",
    "smiquery_nvidia_smi_errors_total",
    "smiquery_sweeps_total",
    "smiquery_dropped_rows_total",
    "smiquery_gpu_lost",
    "smiquery_processes_last_success_timestamp_seconds",
    "smiquery_process_used_memory_bytes",
    "smiquery_collection_errors_total",
    "smiquery_build_info",
    "smiquery_stream_info",
    "smiquery_next_attempt_timestamp_seconds",
    "smiquery_alert_firing",
    "smiquery_alert_fired_total",
    "smiquery_details_up",
    "smiquery_details_last_success_timestamp_seconds",
    *(name for name, *_ in MIG_SERIES),
    "smiquery_xid_source_up",
    "smiquery_xid_errors_total",
    "smiquery_xid_rejected_lines_total",
)

#: Per-process series from ``nvidia-smi pmon`` (``--top-processes N``): pmon column -> (metric, help). The same
#: names in every naming (no DCGM or nvidia_gpu_exporter metric says this), in base units: ``fb`` MiB as bytes,
#: the rest percentages divided by 100 (35 % -> 0.35 exactly, where 35 * 0.01 is 0.35000000000000003).
PMON_SERIES: dict[str, tuple[str, str]] = {
    "sm": ("smiquery_process_sm_utilization_ratio", "Share of time the process ran kernels on the GPU's SMs"),
    "mem": ("smiquery_process_memory_utilization_ratio", "Share of time the process read or wrote GPU memory"),
    "enc": ("smiquery_process_encoder_utilization_ratio", "Share of the video encoder the process used"),
    "dec": ("smiquery_process_decoder_utilization_ratio", "Share of the video decoder the process used"),
    "jpg": ("smiquery_process_jpeg_utilization_ratio", "Share of the JPEG decoder the process used"),
    "ofa": ("smiquery_process_ofa_utilization_ratio", "Share of the optical-flow accelerator the process used"),
    "fb": ("smiquery_process_gpu_memory_used_bytes", "GPU (framebuffer) memory the process uses, bytes"),
}
#: Every metric the exporter serves with ``--top-processes N`` (sample names), in both namings.
PMON_METRICS: tuple[str, ...] = (
    *(name for name, _ in PMON_SERIES.values()),
    "smiquery_gpu_processes",
    "smiquery_process_up",
    "smiquery_process_stream_info",
    "smiquery_process_last_sample_timestamp_seconds",
)


# ----------------------------------------------------------------------------------------------- metric specs


@dataclass(frozen=True)
class MetricSpec:
    """How one nvidia-smi ``field`` becomes one metric family (``type`` gauge or counter, ``help`` its HELP).

    ``name`` is the family's (a native counter's without the ``_total`` its ``sample`` names have); ``scale`` turns
    nvidia-smi's unit into the metric's; ``style``: ``number``, ``bool`` (1/0), ``pstate`` (P3 -> 3), ``info`` (the
    value as a label) or ``nvsmi``; ``naming``: whose labels the series carry (native for a field DCGM lacks).
    """

    field: str
    name: str
    sample: str
    type: str
    help: str
    scale: float = 1.0
    style: str = "number"
    naming: str = "smiquery"


# nvidia-smi unit -> (Prometheus base-unit suffix, factor), as smiquery.kinds.UNITS says
_UNITS: dict[str, tuple[str, float]] = {u.symbol: (u.base, u.scale) for u in UNITS.values() if u.base}
# Cumulative counts: exported as counters (name ending in _total), which is what they are: they only grow, and
# reset when the driver reloads (volatile ECC, clock-event time) or when an operator clears them.
_COUNTER_RE = re.compile(
    r"ecc\.errors\..*|retired_pages\.[a-z_]+\.count|remapped_rows\.(un)?correctable(_inactive)?"
    r"|clocks_event_reasons_counters\..*|bbx\.time_run"
)
# Names that would end in a suffix Prometheus reserves for other types (_count, _total) as gauges.
# promtool also objects to a type's name inside a metric name (histogram, summary).
_NATIVE_RENAMES = {
    "count": "gpus",
    "encoder.stats.sessionCount": "encoder_stats_sessions",
    "fabric.health.summary": "fabric_health_overall",
    **{
        f"remapped_rows.histogram.{k}": f"remapped_rows_availability_{k}"
        for k in ("max", "high", "partial", "low", "none")
    },
}
_BOOL_SUFFIX = {Kind.ENABLED: "_enabled", Kind.ACTIVE: "_active", Kind.YES_NO: ""}


def _snake(text: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", text).lower().replace(".", "_")


def _native_spec(fld: Field) -> list[MetricSpec]:
    base = "smiquery_" + _NATIVE_RENAMES.get(fld.name, _snake(fld.name))
    source = f"(nvidia-smi {fld.name})"
    help_text = fld.help.rstrip(".") or fld.name
    ops = fld.kind.ops
    if ops.metric == "bool":
        assert ops.words is not None
        yes, no = ops.words
        name = base + _BOOL_SUFFIX[fld.kind]
        return [MetricSpec(fld.name, name, name, "gauge", f"{help_text}: 1 = {yes}, 0 = {no} {source}.", style="bool")]
    if ops.metric == "bitmask":
        name = base + "_bitmask"
        return [MetricSpec(fld.name, name, name, "gauge", f"{help_text}, as the numeric bitmask {source}.")]
    if ops.metric != "number":
        doc = f"{help_text}; the value is the label 'value' {source}."
        specs = [MetricSpec(fld.name, base + "_info", base + "_info", "gauge", doc, style="info")]
        if fld.name == "pstate":
            doc = f"{help_text}, as a number (P0 -> 0) {source}."
            specs.append(MetricSpec(fld.name, base, base, "gauge", doc, style="pstate"))
        return specs
    suffix, scale = _UNITS.get(fld.unit, ("", 1.0))
    if scale != 1.0:
        source = f"(nvidia-smi {fld.name}, converted from {fld.unit} to {suffix})"
    elif suffix:
        source = f"(nvidia-smi {fld.name}, in {suffix})"
    if _COUNTER_RE.fullmatch(fld.name):
        stem = re.sub(r"_(total|count)$", "", base) + (f"_{suffix}" if suffix else "")
        return [MetricSpec(fld.name, stem, stem + "_total", "counter", f"{help_text} {source}.", scale=scale)]
    name = base + (f"_{suffix}" if suffix else "")
    return [MetricSpec(fld.name, name, name, "gauge", f"{help_text} {source}.", scale=scale)]


def _read_dcgm() -> dict[str, tuple[tuple[str, str, str], ...]]:
    out: dict[str, tuple[tuple[str, str, str], ...]] = {}
    with open(Path(__file__).with_name("dcgm.csv"), encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            out[row["field"]] = (*out.get(row["field"], ()), (row["metric"], row["type"], row["help"]))
    return out


#: nvidia-smi field -> (DCGM exporter metric name, Prometheus type, help) for ``--naming dcgm``, read from
#: ``dcgm.csv`` beside this module. Values keep DCGM's units (which are nvidia-smi's: C, %, MiB, W, MHz); two-state
#: fields become 1/0.
DCGM_MAP = _read_dcgm()


def _dcgm_specs(fld: Field) -> list[MetricSpec]:
    entries = DCGM_MAP.get(fld.name)
    if not entries:
        return _native_spec(fld)  # no DCGM name: keep it, under its native name and labels
    style = "bool" if fld.kind.is_bool else "pstate" if fld.name == "pstate" else "number"
    return [
        MetricSpec(fld.name, name, name, typ, f"{text} (nvidia-smi {fld.name})", style=style, naming="dcgm")
        for name, typ, text in entries
    ]


# ``--naming nvidia_smi``: the names of utkuozdemir/nvidia_gpu_exporter (derived from its outputs for the captures
# in shared/nvidia_gpu_exporter): nvidia_smi_<field in snake case><unit suffix>, values in base units, label uuid.
_NVSMI_UNITS: dict[str, tuple[str, float]] = {
    unit: (suffix, unit_info(unit).scale)
    for unit, suffix in (("MHz", "_clock_hz"), ("MiB", "_bytes"), ("%", "_ratio"), ("W", "_watts"), ("us", "_seconds"))
}
#: Word values that fields of nvidia_smi naming turn into numbers (NVML's enum order).
NVSMI_WORDS: dict[str, dict[str, float]] = {
    "compute_mode": {"Default": 0, "Exclusive_Thread": 1, "Prohibited": 2, "Exclusive_Process": 3},
    "fabric.state": {"Not Supported": 0, "Not Started": 1, "In Progress": 2, "Completed": 3},
    "gpu_recovery_action": {"None": 0, "Reset": 1, "Reboot": 2, "Drain P2P": 3, "Drain and Reset": 4},
}
#: Fields that become labels of ``nvidia_smi_gpu_info`` in nvidia_smi naming, with their label names.
NVSMI_INFO_LABELS: dict[str, str] = {
    field: field.replace(".", "_")
    for field in (
        *("uuid", "index", "name", "pci.bus_id", "driver_version", "vbios_version", "serial", "compute_cap"),
        *("pci.sub_device_id", "driver_model.current", "driver_model.pending"),
    )
}
#: With nvidia_smi naming and the default fields: what nvidia_gpu_exporter's dashboard (Grafana 14574) reads.
NVSMI_DEFAULT_EXTRAS: tuple[str, ...] = (
    "driver_version",
    "vbios_version",
    "serial",
    "compute_cap",
    "fan.speed",
    "compute_mode",
    "gpu_recovery_action",
    "fabric.state",
    "clocks.current.graphics",
    "clocks.current.memory",
    "clocks.current.video",
    "clocks.max.graphics",
    "clocks.max.memory",
    "enforced.power.limit",
    "power.default_limit",
    "clocks_event_reasons.gpu_idle",
    "clocks_event_reasons.applications_clocks_setting",
    "clocks_event_reasons.sw_power_cap",
    "clocks_event_reasons.sync_boost",
    "ecc.errors.uncorrected.aggregate.total",
)


def bare_uuid(uuid: str | None) -> str:
    """The UUID without nvidia-smi's ``GPU-`` prefix ("" for None)."""
    # nvidia_gpu_exporter labels GPUs by the UUID without nvidia-smi's "GPU-" prefix (its dashboard matches on it)
    text = uuid or ""
    return text[4:] if text.startswith("GPU-") else text


def _nvsmi_spec(fld: Field) -> list[MetricSpec]:
    # nvidia-smi's CSV header gives averageLatency no unit, so nvidia_gpu_exporter adds no suffix nor conversion
    unit = "" if fld.name == "encoder.stats.averageLatency" else fld.unit
    suffix, scale = _NVSMI_UNITS.get(unit, ("", 1.0))
    name = "nvidia_smi_" + _snake(fld.name) + suffix
    help_text = f"{fld.name} [{fld.unit}]" if fld.unit else fld.name
    return [MetricSpec(fld.name, name, name, "gauge", help_text, scale=scale, style="nvsmi", naming="nvidia_smi")]


@dataclass(frozen=True)
class _Rules:
    """What sets one naming apart: its specs, the fields that are never metrics, the fields it adds."""

    specs: Callable[[Field], list[MetricSpec]]
    not_metrics: frozenset[str]
    identity: tuple[str, ...] = ()  # always queried besides IDENTITY_FIELDS (labels)
    extras: tuple[str, ...] = ()  # queried with the default fields


_RULES: dict[str, _Rules] = {
    "smiquery": _Rules(_native_spec, frozenset({"timestamp", *IDENTITY_FIELDS})),
    # the driver version is the DCGM_FI_DRIVER_VERSION label, as dcgm-exporter does
    "dcgm": _Rules(
        _dcgm_specs,
        frozenset({"timestamp", *IDENTITY_FIELDS, "driver_version"}),
        ("driver_version",),
        DCGM_DEFAULT_EXTRAS,
    ),
    "nvidia_smi": _Rules(
        _nvsmi_spec,
        frozenset({"timestamp", "uuid", "name", "pci.bus_id", "driver_version", "vbios_version"}),
        extras=NVSMI_DEFAULT_EXTRAS,
    ),
}


def metric_specs(
    fields: str | Sequence[str] | Sequence[Field] = "all", naming: Naming = "smiquery"
) -> list[MetricSpec]:
    """The metric families the exporter makes from ``fields`` (a preset, names or fields), in field order.

    Identity fields become labels. ``naming``: ``smiquery`` (base units, ``smiquery_*``), ``dcgm`` (the DCGM
    exporter's names and units) or ``nvidia_smi`` (nvidia_gpu_exporter's). Raises InvalidFieldError, ValueError.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {', '.join(NAMINGS)}, not {naming!r}")
    rules = _RULES[naming]
    return [
        spec
        for fld in (resolve_fields(fields) if fields or isinstance(fields, str) else ())
        if fld.name not in rules.not_metrics and fld.kind.ops.metric != "none"
        for spec in rules.specs(fld)
    ]


# ------------------------------------------------------------------------------------------------- rendering


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render(families: Iterable[Metric]) -> str:
    """Metric families in the Prometheus text format (0.0.4), as ``prometheus_client.generate_latest`` writes them.

    But a counter whose samples carry the family's own name (DCGM's ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``) keeps that
    name on its HELP and TYPE lines, where ``generate_latest`` would describe a metric no sample has (``_total``).
    """
    out: list[str] = []
    for fam in families:
        name = fam.name
        if fam.type == "counter" and not (fam.samples and fam.samples[0].name == name):
            name += "_total"
        typ = "untyped" if fam.type == "unknown" else fam.type
        doc = fam.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {typ}\n")
        for s in fam.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(s.labels.items()))
                out.append(f"{s.name}{{{labels}}} {_go_float(s.value)}\n")
            else:
                out.append(f"{s.name} {_go_float(s.value)}\n")
    return "".join(out)


def exporter_fields(
    fields: str | Sequence[str] | None, naming: Naming, *, nvidia_smi: str | os.PathLike[str] | None = None
) -> list[str]:
    """The nvidia-smi fields an exporter queries, without repeats: the identity fields, the wanted ones, extras.

    ``fields`` is a preset or field list (None: ``health``); ``supported`` asks ``nvidia_smi`` for every field this
    driver lists and supplies on at least one GPU (a SmiqueryError when it cannot). DCGM naming adds the driver
    version (a label); with the default fields each naming adds its extras. Raises InvalidFieldError.
    """
    if fields == "supported":
        fields = _supported_fields(nvidia_smi)
    wanted = resolve_fields(fields if fields is not None else "health")
    rules = _RULES[naming]
    extras = rules.identity + (rules.extras if fields in (None, "health") else ())
    names = [*IDENTITY_FIELDS, *(f.name for f in wanted), *extras]
    return list(dict.fromkeys(names))


def _supported_fields(nvidia_smi: str | os.PathLike[str] | None) -> list[str]:
    """The catalogue fields this driver lists in ``--help-query-gpu`` and supplies on at least one GPU, in its order."""
    from smiquery.runner import default_runner, find_nvidia_smi
    from smiquery.sources.query_gpu import query

    binary = find_nvidia_smi(nvidia_smi)
    listed: list[str] = []
    unknown = 0
    for entry in help_query_gpu(default_runner().run, binary, 30.0):
        try:
            listed.append(resolve_fields([entry.name])[0].name)
        except InvalidFieldError:
            unknown += 1  # a field newer than smiquery's catalogue: no unit or type to export it with
    listed = list(dict.fromkeys(listed))
    if not listed:
        argv = [binary, "--help-query-gpu"]
        raise NvidiaSmiFailedError(argv, 0, "", "nvidia-smi --help-query-gpu listed no field smiquery knows")
    samples = query(listed, nvidia_smi=binary, timeout=30.0)
    keep = [name for name in listed if not samples or any(s.missing.get(name) != "not_supported" for s in samples)]
    msg = "smiquery exporter: --fields supported: %d fields (%d listed, %d not supported on any GPU, %d unknown)"
    log.info(msg, len(keep), len(listed), len(listed) - len(keep), unknown)
    return keep
