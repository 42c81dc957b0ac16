"""The fleet view: GPUs of many machines read back from Prometheus, not from nvidia-smi.

:func:`snapshot` gives every GPU now (``smiquery top``); :func:`fleet_frame` gives a time range as the DataFrame a
recording gives, so the report and the plot run on it unchanged. Each exporter's naming present is found.
"""

from __future__ import annotations

from smiquery.fleet.client import HttpConfig, PrometheusClient, load_http_config, parse_time
from smiquery.fleet.history import MAX_POINTS, FleetGpuInfo, chunks, estimate_step, fleet_frame, gpu_names
from smiquery.fleet.instant import SORT_KEYS, FleetGpu, filter_gpus, snapshot, sort_gpus
from smiquery.fleet.naming import FLEET_FIELDS, NAMINGS, FleetNaming, GpuKey, detect_namings, naming_by_name

__all__ = [
    "FLEET_FIELDS",
    "MAX_POINTS",
    "NAMINGS",
    "SORT_KEYS",
    "FleetGpu",
    "FleetGpuInfo",
    "FleetNaming",
    "GpuKey",
    "HttpConfig",
    "PrometheusClient",
    "chunks",
    "detect_namings",
    "estimate_step",
    "filter_gpus",
    "fleet_frame",
    "gpu_names",
    "load_http_config",
    "naming_by_name",
    "parse_time",
    "snapshot",
    "sort_gpus",
]
