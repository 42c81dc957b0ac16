"""Prometheus exporter: metric families from the newest sweep of ONE background stream, served over HTTP(S).

:class:`SmiCollector` turns the newest sweep of a background :func:`~smiquery.stream` into metric families, and
:func:`serve` publishes them on ``/metrics`` with ``/healthz``.

A scrape never starts nvidia-smi: it reads :meth:`Stream.latest`. Needs ``prometheus_client``
(``pip install 'smiquery[export]'``); the rest of smiquery does not import this module.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

try:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.utils import floatToGoString as _untyped_float_to_go
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "smiquery.exporter needs prometheus_client: pip install 'smiquery[export]' (the core does not)"
    ) from _exc

from smiquery import __version__
from smiquery.errors import SmiqueryError
from smiquery.fields import Field, Kind, resolve_fields
from smiquery.oneshot import GpuProcess, normalize_gpus, processes
from smiquery.source import Sweep
from smiquery.supervisor import stream

if TYPE_CHECKING:
    import os

    from smiquery.oneshot import GpusArg
    from smiquery.records import GpuSample, Value
    from smiquery.source import StreamStats

__all__ = [
    "DCGM_MAP",
    "HEALTH_METRICS",
    "IDENTITY_FIELDS",
    "Exporter",
    "ListenError",
    "MetricSpec",
    "Naming",
    "PortInUseError",
    "ProcessPoller",
    "SmiCollector",
    "SweepSource",
    "metric_specs",
    "parse_labels",
    "render",
    "serve",
]

log = logging.getLogger("smiquery.exporter")
_go_float = cast("Callable[[float], str]", _untyped_float_to_go)  # the text format's float spelling (+Inf, 1e+06)

Naming = Literal["smiquery", "dcgm"]

#: Fields the exporter always queries: they become the ``gpu``, ``uuid``, ``name`` and ``pci_bus_id`` labels.
IDENTITY_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "pci.bus_id")
# With DCGM naming the driver version becomes the DCGM_FI_DRIVER_VERSION label, as dcgm-exporter does.
_DCGM_EXTRA_IDENTITY = ("driver_version",)
# The DCGM exporter's default counters that nvidia-smi supplies on every driver but the health preset lacks.
_DCGM_DEFAULT_EXTRAS = ("memory.free", "temperature.memory", "clocks.current.memory")
_NOT_EXPORTED = frozenset({"timestamp", *IDENTITY_FIELDS})

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
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ListenError(SmiqueryError):
    """The HTTP server cannot listen where asked.

    Attributes:
        port: the port asked for.
        bind: the address asked for.
        option: the option to change, ``--port`` or ``--bind``.
    """

    def __init__(self, message: str, *, port: int, bind: str, option: str = "--port") -> None:
        self.port = port
        self.bind = bind
        self.option = option
        super().__init__(message)


class PortInUseError(ListenError):
    """Another program listens on the port already."""


# ----------------------------------------------------------------------------------------------- metric specs


@dataclass(frozen=True)
class MetricSpec:
    """How one nvidia-smi field becomes one metric family.

    Attributes:
        field: the nvidia-smi field name (``memory.used``).
        name: the metric family name; for native counters without the ``_total`` the samples carry.
        sample: the name on each sample line (``..._total`` for native counters).
        type: ``gauge`` or ``counter``.
        help: the HELP text.
        scale: factor from nvidia-smi's unit to the metric's (MiB to bytes: 1048576).
        style: ``number`` (the value), ``bool`` (1/0), ``pstate`` (P3 -> 3) or ``info`` (value as a label).
        naming: ``smiquery`` or ``dcgm`` (decides the label set).
    """

    field: str
    name: str
    sample: str
    type: str
    help: str
    scale: float = 1.0
    style: str = "number"
    naming: str = "smiquery"


# nvidia-smi unit -> (Prometheus base-unit suffix, factor)
_UNITS: dict[str, tuple[str, float]] = {
    "C": ("celsius", 1.0),
    "MiB": ("bytes", 1048576.0),
    "W": ("watts", 1.0),
    "MHz": ("hertz", 1e6),
    "%": ("ratio", 0.01),
    "us": ("seconds", 1e-6),
    "ms": ("seconds", 1e-3),
    "seconds": ("seconds", 1.0),
    "W/s": ("watts_per_second", 1.0),
}
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
_BOOL_WORDS = {Kind.ENABLED: ("Enabled", "Disabled"), Kind.ACTIVE: ("Active", "Not Active"), Kind.YES_NO: ("Yes", "No")}
_INFO_KINDS = frozenset({Kind.STR, Kind.VERSION, Kind.MAJOR_MINOR, Kind.HEX})


def _snake(text: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", text).lower().replace(".", "_")


def _native_spec(fld: Field) -> list[MetricSpec]:
    base = "smiquery_" + _NATIVE_RENAMES.get(fld.name, _snake(fld.name))
    source = f"(nvidia-smi {fld.name})"
    help_text = fld.help.rstrip(".") or fld.name
    if fld.kind.is_bool:
        yes, no = _BOOL_WORDS[fld.kind]
        name = base + _BOOL_SUFFIX[fld.kind]
        return [MetricSpec(fld.name, name, name, "gauge", f"{help_text}: 1 = {yes}, 0 = {no} {source}.", style="bool")]
    if fld.kind is Kind.BITMASK:
        name = base + "_bitmask"
        return [MetricSpec(fld.name, name, name, "gauge", f"{help_text}, as the numeric bitmask {source}.")]
    if fld.kind in _INFO_KINDS or not fld.kind.is_numeric:
        name = base + "_info"
        specs = [
            MetricSpec(
                fld.name, name, name, "gauge", f"{help_text}; the value is the label 'value' {source}.", style="info"
            )
        ]
        if fld.name == "pstate":
            specs.append(
                MetricSpec(
                    fld.name, base, base, "gauge", f"{help_text}, as a number (P0 -> 0) {source}.", style="pstate"
                )
            )
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


#: nvidia-smi field -> (DCGM exporter metric name, Prometheus type, help) for ``--naming dcgm``. Values keep
#: DCGM's units (which are nvidia-smi's: C, %, MiB, W, MHz); two-state fields become 1/0.
DCGM_MAP: dict[str, tuple[tuple[str, str, str], ...]] = {
    "clocks.current.sm": (("DCGM_FI_DEV_SM_CLOCK", "gauge", "Streaming multiprocessor clock now, MHz."),),
    "clocks.current.memory": (("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock now, MHz."),),
    "clocks.current.video": (("DCGM_FI_DEV_VIDEO_CLOCK", "gauge", "Video engine clock now, MHz."),),
    "clocks.max.sm": (
        ("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", "Highest streaming multiprocessor clock the GPU supports, MHz."),
    ),
    "clocks.max.memory": (("DCGM_FI_DEV_MAX_MEM_CLOCK", "gauge", "Highest memory clock the GPU supports, MHz."),),
    "clocks_event_reasons.active": (
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Why clocks are held down now, as NVML's bitmask of reasons."),
        (
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "gauge",
            "Why clocks are held down now, as NVML's bitmask (the pre-3.3 DCGM name).",
        ),
    ),
    "temperature.gpu": (("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU core temperature, degrees C."),),
    "temperature.memory": (("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "HBM memory temperature, degrees C."),),
    "temperature.gpu.tlimit": (
        ("DCGM_FI_DEV_GPU_TEMP_TLIMIT", "gauge", "Thermal margin: degrees C left before the GPU slows down."),
    ),
    "power.draw": (("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power the GPU draws, watts."),),
    "power.draw.instant": (
        ("DCGM_FI_DEV_POWER_USAGE_INSTANT", "gauge", "Power the GPU draws at this instant, watts."),
    ),
    "power.limit": (("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Software power limit, watts."),),
    "power.min_limit": (("DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN", "gauge", "Lowest power limit that can be set, watts."),),
    "power.max_limit": (("DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX", "gauge", "Highest power limit that can be set, watts."),),
    "power.default_limit": (("DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF", "gauge", "Power limit out of the box, watts."),),
    "enforced.power.limit": (
        ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "Power limit the driver enforces after all limiters, watts."),
    ),
    "pstate": (("DCGM_FI_DEV_PSTATE", "gauge", "Performance state, 0 (P0, highest) to 15."),),
    "fan.speed": (("DCGM_FI_DEV_FAN_SPEED", "gauge", "Fan speed the driver asks for, percent of maximum."),),
    "utilization.gpu": (("DCGM_FI_DEV_GPU_UTIL", "gauge", "Share of time a kernel ran on the GPU, percent."),),
    "utilization.memory": (
        ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Share of time GPU memory was read or written, percent."),
    ),
    "utilization.encoder": (("DCGM_FI_DEV_ENC_UTIL", "gauge", "Video encoder busy time, percent."),),
    "utilization.decoder": (("DCGM_FI_DEV_DEC_UTIL", "gauge", "Video decoder busy time, percent."),),
    "pcie.link.gen.current": (("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe generation the link runs at now."),),
    "pcie.link.gen.max": (
        ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "gauge", "Highest PCIe generation the GPU and slot support."),
    ),
    "pcie.link.width.current": (("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe lanes in use now."),),
    "pcie.link.width.max": (("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "gauge", "Most PCIe lanes the link supports."),),
    "memory.total": (("DCGM_FI_DEV_FB_TOTAL", "gauge", "GPU memory in all, MiB."),),
    "memory.free": (("DCGM_FI_DEV_FB_FREE", "gauge", "GPU memory not allocated, MiB."),),
    "memory.used": (("DCGM_FI_DEV_FB_USED", "gauge", "GPU memory allocated by contexts, MiB."),),
    "memory.reserved": (("DCGM_FI_DEV_FB_RESERVED", "gauge", "GPU memory the driver keeps for itself, MiB."),),
    "ecc.mode.current": (("DCGM_FI_DEV_ECC_CURRENT", "gauge", "ECC mode: 1 = enabled."),),
    "ecc.mode.pending": (("DCGM_FI_DEV_ECC_PENDING", "gauge", "ECC mode after the next reboot: 1 = enabled."),),
    "persistence_mode": (("DCGM_FI_DEV_PERSISTENCE_MODE", "gauge", "Persistence mode: 1 = enabled."),),
    "mig.mode.current": (("DCGM_FI_DEV_MIG_MODE", "gauge", "MIG mode: 1 = enabled."),),
    "ecc.errors.corrected.volatile.total": (
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Corrected (single-bit) ECC errors since the driver loaded."),
    ),
    "ecc.errors.uncorrected.volatile.total": (
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Uncorrected (double-bit) ECC errors since the driver loaded."),
    ),
    "ecc.errors.corrected.aggregate.total": (
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Corrected (single-bit) ECC errors over the GPU's life."),
    ),
    "ecc.errors.uncorrected.aggregate.total": (
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Uncorrected (double-bit) ECC errors over the GPU's life."),
    ),
    "retired_pages.single_bit_ecc.count": (
        ("DCGM_FI_DEV_RETIRED_SBE", "counter", "Memory pages taken out of use after repeated corrected errors."),
    ),
    "retired_pages.double_bit.count": (
        ("DCGM_FI_DEV_RETIRED_DBE", "counter", "Memory pages taken out of use after an uncorrected error."),
    ),
    "retired_pages.pending": (
        (
            "DCGM_FI_DEV_RETIRED_PENDING",
            "counter",
            "Memory pages waiting to be retired; nvidia-smi only tells whether there are any: 1 = some, 0 = none.",
        ),
    ),
    "remapped_rows.uncorrectable": (
        (
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
            "counter",
            "Memory rows replaced by spares after uncorrected errors.",
        ),
    ),
    "remapped_rows.correctable": (
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Memory rows replaced by spares after corrected errors."),
    ),
    "remapped_rows.failure": (
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "1 when a memory row could not be replaced by a spare."),
    ),
    "remapped_rows.pending": (
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "1 when a row replacement waits for a GPU reset."),
    ),
    "remapped_rows.histogram.max": (
        ("DCGM_FI_DEV_BANKS_REMAP_ROWS_AVAIL_MAX", "gauge", "Memory banks with every spare row left."),
    ),
    "remapped_rows.histogram.high": (
        ("DCGM_FI_DEV_BANKS_REMAP_ROWS_AVAIL_HIGH", "gauge", "Memory banks with many spare rows left."),
    ),
    "remapped_rows.histogram.partial": (
        ("DCGM_FI_DEV_BANKS_REMAP_ROWS_AVAIL_PARTIAL", "gauge", "Memory banks with some spare rows left."),
    ),
    "remapped_rows.histogram.low": (
        ("DCGM_FI_DEV_BANKS_REMAP_ROWS_AVAIL_LOW", "gauge", "Memory banks with few spare rows left."),
    ),
    "remapped_rows.histogram.none": (
        ("DCGM_FI_DEV_BANKS_REMAP_ROWS_AVAIL_NONE", "gauge", "Memory banks with no spare rows left."),
    ),
}
# Per-location ECC counters: nvidia-smi location -> DCGM suffix.
for _where, _dcgm in (
    ("l1_cache", "L1"),
    ("l2_cache", "L2"),
    ("device_memory", "DEV"),
    ("register_file", "REG"),
    ("texture_memory", "TEX"),
    ("cbu", "CBU"),
    ("sram", "SRM"),
):
    for _corr, _bits in (("corrected", "SBE"), ("uncorrected", "DBE")):
        for _span, _short in (("volatile", "VOL"), ("aggregate", "AGG")):
            DCGM_MAP[f"ecc.errors.{_corr}.{_span}.{_where}"] = (
                (
                    f"DCGM_FI_DEV_ECC_{_bits}_{_short}_{_dcgm}",
                    "counter",
                    f"{'Corrected' if _bits == 'SBE' else 'Uncorrected'} ECC errors in the {_where.replace('_', ' ')}, "
                    f"{'since the driver loaded' if _span == 'volatile' else 'over the GPU life'}.",
                ),
            )
del _where, _dcgm, _corr, _bits, _span, _short


def _dcgm_specs(fld: Field) -> list[MetricSpec]:
    entries = DCGM_MAP.get(fld.name)
    if not entries:
        return _native_spec(fld)  # no DCGM name: keep it, under its native name and labels
    style = "bool" if fld.kind.is_bool else "pstate" if fld.name == "pstate" else "number"
    return [
        MetricSpec(fld.name, name, name, typ, f"{text} (nvidia-smi {fld.name})", style=style, naming="dcgm")
        for name, typ, text in entries
    ]


def metric_specs(
    fields: str | Sequence[str] | Sequence[Field] = "all", naming: Naming = "smiquery"
) -> list[MetricSpec]:
    """The metric families the exporter makes from ``fields`` (identity fields become labels, not metrics).

    Args:
        fields: a preset, a comma list, or a sequence of names or :class:`Field` objects.
        naming: ``smiquery`` (base units, ``smiquery_*``) or ``dcgm`` (the DCGM exporter's names and units).

    Returns:
        One spec per metric family, in field order.

    Raises:
        InvalidFieldError: an unknown field.
        ValueError: an unknown naming.
    """
    if naming not in ("smiquery", "dcgm"):
        raise ValueError(f"naming must be 'smiquery' or 'dcgm', not {naming!r}")
    if isinstance(fields, str):
        flds: Sequence[Field] = resolve_fields(fields)
    else:
        flds = [f if isinstance(f, Field) else resolve_fields([f])[0] for f in fields]
    out: list[MetricSpec] = []
    for fld in flds:
        if fld.name in _NOT_EXPORTED or fld.kind is Kind.TIMESTAMP:
            continue
        if naming == "dcgm" and fld.name in _DCGM_EXTRA_IDENTITY:
            continue  # a label in DCGM naming
        out.extend(_dcgm_specs(fld) if naming == "dcgm" else _native_spec(fld))
    return out


# ------------------------------------------------------------------------------------------------- rendering


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render(families: Iterable[Metric]) -> str:
    """Write metric families in the Prometheus text format (0.0.4), as ``prometheus_client.generate_latest`` does.

    The one difference: a counter whose samples carry the family's own name (the DCGM exporter's counters, such
    as ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``) keeps that name on its HELP and TYPE lines, where ``generate_latest``
    would append ``_total`` and so describe a metric that no sample has.

    Args:
        families: the families to write.

    Returns:
        The exposition text.
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


# ------------------------------------------------------------------------------------------------- processes


class ProcessPoller:
    """Samples the compute processes (:func:`smiquery.processes`) on its own interval, in a background thread.

    Each poll runs nvidia-smi twice (GPU list and compute apps); scrapes only read the newest result.

    Args:
        interval: seconds between polls.
        gpus: only these GPUs.
        nvidia_smi: path of the binary.
        timeout: seconds per nvidia-smi call.
    """

    def __init__(
        self,
        interval: float = 15.0,
        *,
        gpus: GpusArg = None,
        nvidia_smi: str | os.PathLike[str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        if interval <= 0:
            raise ValueError("the processes interval must be positive")
        self.interval = float(interval)
        self.gpus = normalize_gpus(gpus)
        self.nvidia_smi = nvidia_smi
        self.timeout = timeout
        self.errors: Counter[str] = Counter()
        self.polls = 0
        self.last_error: str | None = None
        self._latest: tuple[tuple[GpuProcess, ...], float, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Run one poll now (errors are counted, never raised)."""
        self.polls += 1
        try:
            got = processes(gpus=self.gpus or None, nvidia_smi=self.nvidia_smi, timeout=self.timeout)
        except SmiqueryError as exc:
            self.errors[type(exc).__name__] += 1
            self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("smiquery exporter: listing processes failed: %s", self.last_error)
            return
        self._latest = (tuple(got), time.monotonic(), time.time())

    def latest(self) -> tuple[tuple[GpuProcess, ...] | None, float | None, float | None]:
        """The newest process list, its age in seconds and its wall-clock time; Nones before the first success."""
        got = self._latest
        if got is None:
            return None, None, None
        return got[0], time.monotonic() - got[1], got[2]

    def start(self) -> ProcessPoller:
        """Poll in a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-processes", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def close(self, timeout: float = 15.0) -> None:
        """Stop polling and wait for a poll in progress (each nvidia-smi call is bounded by ``timeout``)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


# ------------------------------------------------------------------------------------------------- collector


class SweepSource(Protocol):
    """What the collector reads: a started :class:`~smiquery.supervisor.Stream` (or a stand-in in tests)."""

    @property
    def interval(self) -> float:
        """Seconds between samples."""
        ...

    @property
    def stats(self) -> StreamStats:
        """The stream's counters."""
        ...

    @property
    def running(self) -> bool:
        """True while the stream's thread is alive."""
        ...

    @property
    def error(self) -> BaseException | None:
        """The error that ended the stream, if any."""
        ...

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds."""
        ...


def _gauge(name: str, doc: str) -> Metric:
    return Metric(name, doc, "gauge")


def _counter(name: str, doc: str) -> Metric:
    return Metric(name, doc, "counter")


def parse_labels(items: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Check constant labels given as ``key=value`` strings (or a mapping).

    Args:
        items: ``["site=lab", "rack=3"]`` or ``{"site": "lab"}``.

    Returns:
        The labels as a dict.

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
        if key in _RESERVED_LABELS:
            raise ValueError(f"label name {key!r} is set by the exporter itself; pick another name")
        if key in out:
            raise ValueError(f"label {key!r} is given twice")
        out[key] = value
    return out


# Labels the exporter sets itself (Hostname is not here: --label Hostname=... overrides the DCGM label).
_RESERVED_LABELS = frozenset(
    {"gpu", "uuid", "name", "pci_bus_id", "value", "pid", "process_name", "type", "source"}
    | {"UUID", "device", "modelName", "DCGM_FI_DRIVER_VERSION"}
)


def _pstate_number(value: Value) -> float | None:
    if isinstance(value, str) and value[:1] in "Pp" and value[1:].isdigit():
        return float(value[1:])
    return None


class SmiCollector:
    """A ``prometheus_client`` collector over the newest sweep of one background stream.

    :meth:`collect` reads :meth:`Stream.latest` and never runs nvidia-smi. Per-GPU series are served only while
    the newest sweep is fresher than ``stale_after``; a missing value (any status token) leaves its series out
    for that GPU, never 0. The health metrics (``smiquery_up``, sample age, restarts, errors by type, dropped
    rows, lost GPUs) are always there. :meth:`exposition` is the fast path the HTTP server uses: the per-sweep
    text is rendered once per sweep; only the health metrics are rendered for every scrape.

    Args:
        stream: a started stream (anything with ``latest()``, ``stats``, ``running``, ``error``, ``interval``).
        fields: the fields the stream queries (default: ``stream.fields``).
        naming: ``smiquery`` or ``dcgm``.
        labels: constant labels added to every series.
        processes: a :class:`ProcessPoller` to add per-process GPU memory; None for none.
        stale_after: seconds after which the newest sweep counts as stale (default ``max(3 * interval, 15)``).
        hostname: the DCGM ``Hostname`` label (default: this host's name).
    """

    def __init__(
        self,
        stream: SweepSource,
        *,
        fields: Sequence[Field] | None = None,
        naming: Naming = "smiquery",
        labels: Mapping[str, str] | Iterable[str] | None = None,
        processes: ProcessPoller | None = None,
        stale_after: float | None = None,
        hostname: str | None = None,
    ) -> None:
        self.stream = stream
        flds: Sequence[Field] | None = fields if fields is not None else getattr(stream, "fields", None)
        if flds is None:
            raise ValueError("pass fields= for a stream without a .fields attribute")
        self.naming: Naming = naming
        self.specs = metric_specs(list(flds), naming)
        self.labels = parse_labels(labels)
        self.processes = processes
        self.stale_after = float(stale_after) if stale_after is not None else max(3 * stream.interval, 15.0)
        self.hostname = self.labels.get("Hostname") or hostname or socket.gethostname()
        self.render_errors = 0
        self._lock = threading.Lock()
        self._cache_key: tuple[object, object] = (object(), object())
        self._cache: bytes = b""

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not collect (and so not touch the stream)."""
        return []

    # ----------------------------------------------------------------------------------------- per sweep

    def _dcgm_labels(self, s: GpuSample) -> dict[str, str]:
        gpu = "" if s.index is None else str(s.index)
        out = {
            "gpu": gpu,
            "UUID": s.uuid or "",
            "device": f"nvidia{gpu}",
            "modelName": str(s.get("name") or ""),
            "Hostname": self.hostname,
            "pci_bus_id": str(s.get("pci.bus_id") or ""),
        }
        drv = s.get("driver_version")
        if drv is not None:
            out["DCGM_FI_DRIVER_VERSION"] = str(drv)
        out.update(self.labels)
        return out

    def _native_labels(self, s: GpuSample) -> dict[str, str]:
        idx = s.index
        out = {
            "gpu": "" if idx is None else str(idx),
            "uuid": s.uuid or "",
            "name": str(s.get("name") or ""),
            "pci_bus_id": str(s.get("pci.bus_id") or ""),
        }
        out.update(self.labels)
        return out

    def sweep_families(self, sweep: Sweep) -> list[Metric]:
        """The per-GPU metric families of one sweep (without health metrics).

        Args:
            sweep: the samples of one instant.

        Returns:
            The non-empty families, in spec order.
        """
        if not sweep:
            return []
        per_gpu = []
        for s in sweep:
            pos = {n: i for i, n in enumerate(s.fields)}
            native = self._native_labels(s)
            dcgm = self._dcgm_labels(s) if self.naming == "dcgm" else native
            per_gpu.append((s.values, pos, dcgm, native, s.raw))
        out: list[Metric] = []
        for spec in self.specs:
            fam = Metric(spec.name, spec.help, spec.type)
            for values, pos, dcgm_labels, native_labels, raw in per_gpu:
                i = pos.get(spec.field)
                if i is None:
                    continue
                value = values[i]
                if value is None:
                    continue  # a status token: the series is absent for this GPU, never 0
                labels = dcgm_labels if spec.naming == "dcgm" else native_labels
                if spec.style == "info":
                    text = raw.get(spec.field, str(value)) if isinstance(value, int) else str(value)
                    fam.add_sample(spec.sample, {**labels, "value": text.strip()}, 1.0)
                    continue
                if spec.style == "pstate":
                    number = _pstate_number(value)
                    if number is not None:
                        fam.add_sample(spec.sample, labels, number)
                    continue
                if isinstance(value, bool):
                    fam.add_sample(spec.sample, labels, 1.0 if value else 0.0)
                elif isinstance(value, (int, float)):
                    fam.add_sample(spec.sample, labels, float(value) * spec.scale)
            if fam.samples:
                out.append(fam)
        return out

    def process_families(self, procs: Sequence[GpuProcess]) -> list[Metric]:
        """Per-process GPU memory (``smiquery_process_used_memory_bytes``), labelled pid, process_name, gpu, uuid.

        Args:
            procs: the processes of one poll.

        Returns:
            One family (empty list when no process reports its memory).
        """
        fam = _gauge(
            "smiquery_process_used_memory_bytes",
            "GPU memory used by a compute process, in bytes (nvidia-smi --query-compute-apps used_memory).",
        )
        # One series per (pid, GPU): a process listed twice on one GPU (one row per MIG instance) is summed, as
        # Prometheus rejects a whole scrape that repeats a series.
        total: dict[tuple[int, str, str, str], float] = {}
        for p in procs:
            if p.used_memory is None:
                continue
            key = (p.pid, p.process_name, "" if p.gpu_index is None else str(p.gpu_index), p.gpu_uuid)
            total[key] = total.get(key, 0.0) + float(p.used_memory) * 1048576.0
        for (pid, pname, gpu, uuid), used in total.items():
            labels = {"pid": str(pid), "process_name": pname, "gpu": gpu, "uuid": uuid, **self.labels}
            fam.add_sample(fam.name, labels, used)
        return [fam] if fam.samples else []

    # ------------------------------------------------------------------------------------------- health

    def _fresh(self, sweep: Sweep | None, age: float | None) -> bool:
        return sweep is not None and age is not None and age <= self.stale_after

    def health_families(self, sweep: Sweep | None, age: float | None, duration: float) -> list[Metric]:
        """The exporter's own health metrics for this scrape.

        Args:
            sweep: the newest sweep (or None).
            age: its age in seconds.
            duration: seconds spent building this scrape so far.

        Returns:
            The families.
        """
        st = self.stream.stats
        const = self.labels
        out: list[Metric] = []

        def one(fam: Metric, value: float, labels: Mapping[str, str] | None = None) -> None:
            sample = fam.name + "_total" if fam.type == "counter" else fam.name
            fam.add_sample(sample, {**const, **labels} if labels else const, value)
            out.append(fam)

        up = 1.0 if self.stream.running and self._fresh(sweep, age) else 0.0
        one(
            _gauge(
                "smiquery_up",
                f"1 when nvidia-smi delivers fresh samples (newest younger than {self.stale_after:g} s), else 0.",
            ),
            up,
        )
        if sweep is not None and age is not None:
            one(
                _gauge(
                    "smiquery_last_sample_timestamp_seconds",
                    "Unix time at which the newest sweep of nvidia-smi rows was received.",
                ),
                time.time() - age,
            )
            one(_gauge("smiquery_last_sample_age_seconds", "Age of the newest sweep of nvidia-smi rows."), age)
        one(_counter("smiquery_nvidia_smi_starts", "nvidia-smi loop processes started."), float(st.starts))
        one(
            _counter("smiquery_nvidia_smi_restarts", "nvidia-smi loop processes restarted after a failure."),
            float(st.restarts),
        )
        one(_counter("smiquery_sweeps", "Complete sweeps (one row per GPU) received."), float(st.sweeps))
        one(
            _counter("smiquery_dropped_rows", "Rows of nvidia-smi output rejected by the parser."),
            float(st.dropped_rows),
        )
        errors = _counter("smiquery_nvidia_smi_errors", "nvidia-smi failures, by error type and source.")
        for typ, n in sorted(dict(st.errors).items()):
            errors.add_sample(errors.name + "_total", {**const, "type": typ, "source": "stream"}, float(n))
        if self.processes is not None:
            for typ, n in sorted(dict(self.processes.errors).items()):
                errors.add_sample(errors.name + "_total", {**const, "type": typ, "source": "processes"}, float(n))
        if errors.samples:
            out.append(errors)
        lost = set(st.lost_gpus)
        lost_fam = _gauge("smiquery_gpu_lost", "1 while nvidia-smi reports the GPU as lost ([GPU is lost]), else 0.")
        seen: set[int] = set()
        if sweep is not None:
            for s in sweep:
                if s.index is None:
                    continue
                seen.add(s.index)
                lost_fam.add_sample(lost_fam.name, self._native_labels(s), 1.0 if s.index in lost else 0.0)
        for idx in sorted(lost - seen):
            lost_fam.add_sample(lost_fam.name, {**const, "gpu": str(idx)}, 1.0)
        if lost_fam.samples:
            out.append(lost_fam)
        if self.processes is not None:
            _, _, when = self.processes.latest()
            if when is not None:
                one(
                    _gauge(
                        "smiquery_processes_last_success_timestamp_seconds",
                        "Unix time of the newest successful listing of compute processes.",
                    ),
                    when,
                )
        if self.render_errors:
            one(
                _counter("smiquery_collection_errors", "Scrapes whose GPU metrics could not be built (a bug)."),
                float(self.render_errors),
            )
        one(
            _gauge("smiquery_collection_duration_seconds", "Time spent building this scrape's metrics."),
            duration,
        )
        return out

    # ------------------------------------------------------------------------------------------- output

    def _data_families(self, sweep: Sweep | None, fresh: bool, procs: tuple[GpuProcess, ...] | None) -> list[Metric]:
        fams: list[Metric] = []
        try:
            if fresh and sweep is not None:
                fams.extend(self.sweep_families(sweep))
            if procs is not None:
                fams.extend(self.process_families(procs))
        except Exception:  # a bug must not take /metrics down: the health metrics still go out
            self.render_errors += 1
            log.exception("smiquery exporter: building the GPU metrics failed")
            return []
        return fams

    def _fresh_processes(self) -> tuple[GpuProcess, ...] | None:
        if self.processes is None:
            return None
        procs, age, _ = self.processes.latest()
        if procs is None or age is None or age > max(3 * self.processes.interval, self.stale_after):
            return None
        return procs

    def collect(self) -> Iterator[Metric]:
        """Yield the GPU, process and health metric families (the ``prometheus_client`` collector protocol)."""
        t0 = time.perf_counter()
        sweep, age = self.stream.latest()
        fams = self._data_families(sweep, self._fresh(sweep, age), self._fresh_processes())
        yield from fams
        yield from self.health_families(sweep, age, time.perf_counter() - t0)

    def exposition(self) -> bytes:
        """The whole ``/metrics`` body; the per-sweep part is rendered once per sweep and reused.

        Returns:
            UTF-8 text in the Prometheus text format.
        """
        t0 = time.perf_counter()
        sweep, age = self.stream.latest()
        fresh = self._fresh(sweep, age)
        procs = self._fresh_processes()
        key = (sweep if fresh else None, procs)
        with self._lock:
            if key[0] is not self._cache_key[0] or key[1] is not self._cache_key[1]:
                self._cache = render(self._data_families(sweep, fresh, procs)).encode()
                self._cache_key = key
            body = self._cache
        health = render(self.health_families(sweep, age, time.perf_counter() - t0))
        return body + health.encode()

    def health(self) -> tuple[bool, str]:
        """Whether the data is fresh, with one line saying why not (what ``/healthz`` answers).

        Returns:
            ``(True, "ok")`` or ``(False, reason)``.
        """
        sweep, age = self.stream.latest()
        st = self.stream.stats
        if not self.stream.running:
            err = self.stream.error
            why = f"{type(err).__name__}: {err}".splitlines()[0] if err is not None else "not started or closed"
            return False, f"nvidia-smi stream stopped: {why}"
        if sweep is None or age is None:
            extra = f"; last error: {st.last_error}" if st.last_error else ""
            return False, f"no sample yet (waiting for nvidia-smi){extra}"
        if age > self.stale_after:
            extra = f"; last error: {st.last_error}" if st.last_error else ""
            return False, f"stale: newest sample is {age:.1f} s old (limit {self.stale_after:g} s){extra}"
        return True, "ok"


# ---------------------------------------------------------------------------------------------------- server


_INDEX = (
    "<!doctype html><html><head><title>smiquery exporter</title></head><body>"
    "<h1>smiquery exporter</h1><p>version {version}, naming {naming}</p>"
    '<ul><li><a href="metrics">/metrics</a></li><li><a href="healthz">/healthz</a></li></ul></body></html>\n'
)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "smiquery-exporter/" + __version__
    sys_version = ""
    timeout = 60  # an idle keep-alive connection is closed after this many seconds
    server: _Server

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        collector = self.server.collector
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE, collector.exposition() + self.server.extra(), head)
        elif path == "/healthz":
            ok, why = collector.health()
            self._send(200 if ok else 503, "text/plain; charset=utf-8", (why + "\n").encode(), head)
        elif path in ("/", "/index.html"):
            page = _INDEX.format(version=__version__, naming=collector.naming).encode()
            self._send(200, "text/html; charset=utf-8", page, head)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n", head)

    def _send(self, code: int, ctype: str, body: bytes, head: bool) -> None:
        # One write for status, headers and body: no small-segment delays, one syscall.
        reason = self.responses.get(code, ("",))[0]
        conn = "Connection: close\r\n" if self.close_connection else ""
        top = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Server: {self.server_version}\r\n{conn}\r\n"
        ).encode("latin-1")
        self.wfile.write(top if head else top + body)
        if code >= 400 or log.isEnabledFor(logging.DEBUG):
            self.log_request(code, len(body))

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    collector: SmiCollector
    ssl_context: ssl.SSLContext | None = None
    extra: Callable[[], bytes]

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the FQDN of the address, which can stall on hosts without DNS.
        super(ThreadingHTTPServer, self).server_bind()  # TCPServer.server_bind: bind only
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        ctx = self.ssl_context
        conn = request
        if ctx is not None:
            # The TLS handshake runs here, in the connection's own thread, so a slow client cannot block accept().
            request.settimeout(10.0)
            try:
                conn = ctx.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.debug("smiquery exporter: TLS handshake with %s failed: %s", client_address, exc)
                return
        with self._conns_lock:
            self._conns[conn] = threading.current_thread()
        try:
            _Handler(conn, client_address, self)
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)
            if conn is not request:
                with contextlib.suppress(OSError):
                    conn.close()

    def close_connections(self, timeout: float = 2.0) -> None:
        """End open keep-alive connections (their threads are blocked reading the next request) and wait."""
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in conns.values():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-response is routine; never print tracebacks from the server threads.
        log.debug("smiquery exporter: request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _tls_context(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], client_ca: str | os.PathLike[str] | None
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return ctx


def _family_of(bind: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(bind.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bind, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {bind!r}: {exc.strerror}", port=0, bind=bind, option="--bind") from None
    return infos[0][0] if infos else socket.AF_INET


def _make_server(bind: str, port: int) -> _Server:
    cls = _Server6 if _family_of(bind) == socket.AF_INET6 else _Server
    try:
        return cls((bind.strip("[]"), port), _Handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {bind} is in use; pick another with --port", port=port, bind=bind
            ) from None
        if exc.errno == errno.EACCES:
            msg = f"no permission to listen on port {port} on {bind} (below 1024 needs root); pick another with --port"
            raise ListenError(msg, port=port, bind=bind) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            msg = f"cannot listen on {bind}: the address is not on this machine; pick another with --bind"
            raise ListenError(msg, port=port, bind=bind, option="--bind") from None
        raise ListenError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}", port=port, bind=bind) from None


class Exporter:
    """A running exporter: one background stream, optionally a process poller, and an HTTP(S) server thread.

    Made by :func:`serve`. Use it as a context manager or call :meth:`stop`.

    Attributes:
        collector: the :class:`SmiCollector` behind ``/metrics``.
        stream: the background :class:`~smiquery.supervisor.Stream`.
        poller: the :class:`ProcessPoller`, when ``processes=True``.
    """

    def __init__(self, server: _Server, collector: SmiCollector, poller: ProcessPoller | None, tls: bool) -> None:
        self._server = server
        self.collector = collector
        self.stream = collector.stream
        self.poller = poller
        self._tls = tls
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.25}, name="smiquery-http", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port actually listened on (useful with ``port=0``)."""
        return self._server.server_port

    @property
    def bind(self) -> str:
        """The address listened on."""
        return self._server.server_name

    @property
    def url(self) -> str:
        """The base URL (``http://127.0.0.1:9849``); metrics are at ``url + "/metrics"``."""
        host = self.bind
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` has run."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop serving, close the stream (nvidia-smi is reaped) and the poller. Idempotent; any thread."""
        with self._lock:
            if self._stopped.is_set():
                return
            try:
                self._server.shutdown()
                self._server.server_close()
                self._server.close_connections()
                self._thread.join(2.0)
            finally:
                try:
                    close = getattr(self.stream, "close", None)
                    if close is not None:
                        close()
                finally:
                    if self.poller is not None:
                        self.poller.close()
                    self._stopped.set()

    def serve_forever(self, poll: float = 0.5) -> None:
        """Block until :meth:`stop` is called (from a signal handler or another thread).

        Args:
            poll: seconds between checks, so that signal handlers run promptly in the main thread.
        """
        while not self._stopped.wait(poll):
            pass

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    *,
    port: int = 9849,
    bind: str = "127.0.0.1",
    interval: float = 5.0,
    fields: str | Sequence[str] | None = "health",
    gpus: GpusArg = None,
    labels: Mapping[str, str] | Iterable[str] | None = None,
    naming: Naming = "smiquery",
    processes: bool = False,
    processes_interval: float = 15.0,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    client_ca: str | os.PathLike[str] | None = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    registry: Any = None,
    stale_after: float | None = None,
    stall_timeout: float | None = None,
) -> Exporter:
    """Start exporting: one background nvidia-smi loop, and an HTTP(S) server for ``/metrics`` and ``/healthz``.

    Returns at once; the work happens in daemon threads. Listens on 127.0.0.1 unless ``bind`` says otherwise.

    Example::

        with smiquery.exporter.serve(port=9849, interval=5) as exp:
            exp.serve_forever()

    Args:
        port: TCP port (0: any free port; see :attr:`Exporter.port`).
        bind: address to listen on; ``0.0.0.0`` or ``::`` listen on all interfaces.
        interval: seconds between nvidia-smi samples.
        fields: a preset or field list; the identity fields (index, uuid, name, pci.bus_id) are always added.
            With DCGM naming the default ``health`` also gets memory.free, temperature.memory and
            clocks.current.memory (DCGM default counters).
        gpus: only these GPUs.
        labels: constant labels for every series (``["site=lab"]`` or a mapping).
        naming: ``smiquery`` (native, base units) or ``dcgm`` (the DCGM exporter's names, units and labels).
        processes: also export per-process GPU memory, polled every ``processes_interval`` seconds.
        processes_interval: seconds between process polls.
        tls_cert: PEM certificate: serve HTTPS.
        tls_key: PEM private key for ``tls_cert``.
        client_ca: PEM CA bundle: require client certificates signed by it.
        nvidia_smi: path of the binary.
        registry: a ``prometheus_client`` registry whose metrics are appended to ``/metrics`` (e.g. your own).
        stale_after: seconds after which data counts as stale (default ``max(3 * interval, 15)``).
        stall_timeout: seconds without output before nvidia-smi counts as hung (default ``max(3 * interval, 10)``).

    Returns:
        The running :class:`Exporter`.

    Raises:
        PortInUseError: the port is taken (nvidia-smi is not started).
        ListenError: the address cannot be listened on (not on this machine, unknown name, no permission).
        InvalidFieldError: an unknown field.
        InvalidGpuIdError: a malformed GPU id.
        NvidiaSmiNotFoundError: no usable nvidia-smi.
        ValueError: a bad label, naming, interval, or TLS option.
        OSError, ssl.SSLError: unreadable TLS files.
    """
    if naming not in ("smiquery", "dcgm"):
        raise ValueError(f"naming must be 'smiquery' or 'dcgm', not {naming!r}")
    if interval <= 0:
        raise ValueError("interval must be positive")
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (0-65535)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and a key")
    if client_ca is not None and tls_cert is None:
        raise ValueError("client certificates (client_ca) need TLS (tls_cert and tls_key)")
    const = parse_labels(labels)
    wanted = list(resolve_fields(fields if fields is not None else "health"))
    extras: tuple[str, ...] = IDENTITY_FIELDS
    if naming == "dcgm":
        extras += _DCGM_EXTRA_IDENTITY
        if fields in (None, "health"):
            extras += _DCGM_DEFAULT_EXTRAS
    names = [*IDENTITY_FIELDS, *(f.name for f in wanted)]
    names += [n for n in extras if n not in names]
    flds = resolve_fields(names)
    normalize_gpus(gpus)
    ctx = _tls_context(tls_cert, tls_key, client_ca) if tls_cert is not None and tls_key is not None else None

    server = _make_server(bind, port)  # fail on a taken port before nvidia-smi starts
    s = None
    poller = None
    try:
        s = stream(
            [f.name for f in flds],
            interval=interval,
            gpus=gpus,
            nvidia_smi=nvidia_smi,
            stall_timeout=stall_timeout,
            max_attempts=1 << 62,  # an exporter never gives up on a retryable failure; backoff caps at 30 s
            backoff_max=30.0,
        )
        if processes:
            poller = ProcessPoller(processes_interval, gpus=gpus, nvidia_smi=nvidia_smi)
        collector = SmiCollector(
            s, fields=s.fields, naming=naming, labels=const, processes=poller, stale_after=stale_after
        )
        server.collector = collector
        server.ssl_context = ctx
        if registry is not None:
            from prometheus_client import generate_latest

            def extra() -> bytes:
                try:
                    return bytes(generate_latest(registry))
                except Exception:  # someone else's collector must not take /metrics down
                    log.exception("smiquery exporter: collecting the extra registry failed")
                    return b""

            server.extra = extra
        else:
            server.extra = bytes
        s.start()
        if poller is not None:
            poller.start()
        exp = Exporter(server, collector, poller, ctx is not None)
    except BaseException:
        server.server_close()
        if s is not None:
            s.close()
        if poller is not None:
            poller.close()
        raise
    log.info("smiquery exporter: serving %s/metrics (naming %s)", exp.url, naming)
    return exp
