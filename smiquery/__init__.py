"""smiquery: typed, trustworthy NVIDIA GPU monitoring through nvidia-smi."""

from __future__ import annotations

import logging

from smiquery.errors import (
    DriverNotLoadedError,
    DriverVersionMismatchError,
    GpuLostError,
    InfoRomWarning,
    InsufficientPermissionsError,
    InvalidArgumentError,
    InvalidFieldError,
    InvalidGpuIdError,
    InvalidRuleError,
    InvalidTimeZoneError,
    ListenError,
    NoDevicesFoundError,
    NotSupportedError,
    NvidiaSmiFailedError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    NvmlNotFoundError,
    ParseError,
    PortInUseError,
    RecordingError,
    ReplayError,
    ReportError,
    SmiqueryError,
    StreamEndedError,
    UsageError,
    WebConfigError,
)
from smiquery.fields import CATALOGUE, PRESETS, Field, Kind, get_field, parse_help_query_gpu, resolve_fields
from smiquery.oneshot import GpuProcess, get_gpu_status, processes, processes_df, query, query_df
from smiquery.parsing import CsvParser, parse_lines
from smiquery.records import GpuSample
from smiquery.source import SampleSource, StreamEvent, StreamStats, Sweep
from smiquery.supervisor import Stream, stream

__version__ = "0.1.0"

# A library stays quiet unless the application configures logging (the CLI and the exporter do).
logging.getLogger("smiquery").addHandler(logging.NullHandler())

# pandas is imported only when these are first used: `import smiquery` stays light.
_LAZY = {"read_csv": "smiquery.recordings", "to_dataframe": "smiquery.frames", "replay": "smiquery.playback"}
# Submodules reachable after a plain `import smiquery` (`smiquery.aio.query(...)`), imported on first use.
_LAZY_MODULES = frozenset({"aio", "compat", "pmon"})


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f"smiquery.{name}")  # the import binds it on the package
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'smiquery' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CATALOGUE",
    "PRESETS",
    "CsvParser",
    "DriverNotLoadedError",
    "DriverVersionMismatchError",
    "Field",
    "GpuLostError",
    "GpuProcess",
    "GpuSample",
    "InfoRomWarning",
    "InsufficientPermissionsError",
    "InvalidArgumentError",
    "InvalidFieldError",
    "InvalidGpuIdError",
    "InvalidRuleError",
    "InvalidTimeZoneError",
    "Kind",
    "ListenError",
    "NoDevicesFoundError",
    "NotSupportedError",
    "NvidiaSmiFailedError",
    "NvidiaSmiNotFoundError",
    "NvidiaSmiTimeoutError",
    "NvmlNotFoundError",
    "ParseError",
    "PortInUseError",
    "RecordingError",
    "ReplayError",
    "ReportError",
    "SampleSource",
    "SmiqueryError",
    "Stream",
    "StreamEndedError",
    "StreamEvent",
    "StreamStats",
    "Sweep",
    "UsageError",
    "WebConfigError",
    "__version__",
    "get_field",
    "get_gpu_status",
    "parse_help_query_gpu",
    "parse_lines",
    "processes",
    "processes_df",
    "query",
    "query_df",
    "read_csv",
    "replay",
    "resolve_fields",
    "stream",
    "to_dataframe",
]
