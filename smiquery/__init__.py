"""smiquery: typed, trustworthy NVIDIA GPU monitoring through nvidia-smi."""

from __future__ import annotations

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
    KernelLogError,
    ListenError,
    NoDevicesFoundError,
    NotSupportedError,
    NvidiaSmiFailedError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    NvmlNotFoundError,
    OutputTooLargeError,
    ParseError,
    PortInUseError,
    PrometheusError,
    PrometheusQueryError,
    PrometheusUnreachableError,
    RecordingError,
    ReplayError,
    ReportError,
    SmiqueryError,
    StreamEndedError,
    UsageError,
    WebConfigError,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and re) at run time

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from smiquery import aio, compat, fields, oneshot, parsing, pmon, runner, sample, source, streams  # noqa: F401
    from smiquery.details import inspect
    from smiquery.fields import CATALOGUE, PRESETS, Field, Kind, get_field, parse_help_query_gpu, resolve_fields
    from smiquery.oneshot import GpuProcess, get_gpu_status, processes, processes_df, query, query_df
    from smiquery.parsing import CsvParser, parse_lines
    from smiquery.recordings.csv import read_csv
    from smiquery.recordings.frames import to_dataframe
    from smiquery.recordings.playback import replay
    from smiquery.retry import RetryPolicy
    from smiquery.sample import GpuSample
    from smiquery.source import SampleSource, StreamEvent, StreamStats, Sweep
    from smiquery.streams.sync import Stream, stream
del TYPE_CHECKING  # not a public name

__version__ = "0.1.0"

# Only the errors are imported eagerly (they are light, and `except smiquery.SmiqueryError` needs no other import):
# every other public name is imported from its module on first use, so `import smiquery` (and every fake
# nvidia-smi the tests start) stays a fraction of the interpreter's own start-up. Neither subprocess, logging nor
# pandas is imported until something needs it; tests/test_startup.py checks.
_LAZY = {
    **dict.fromkeys(
        ("CATALOGUE", "PRESETS", "Field", "Kind", "get_field", "parse_help_query_gpu", "resolve_fields"),
        "smiquery.fields",
    ),
    **dict.fromkeys(
        ("GpuProcess", "get_gpu_status", "processes", "processes_df", "query", "query_df"), "smiquery.oneshot"
    ),
    **dict.fromkeys(("CsvParser", "parse_lines"), "smiquery.parsing"),
    "GpuSample": "smiquery.sample",
    "RetryPolicy": "smiquery.retry",
    "inspect": "smiquery.details",
    **dict.fromkeys(("SampleSource", "StreamEvent", "StreamStats", "Sweep"), "smiquery.source"),
    **dict.fromkeys(("Stream", "stream"), "smiquery.streams.sync"),
    # these import pandas on first use
    "read_csv": "smiquery.recordings.csv",
    "to_dataframe": "smiquery.recordings.frames",
    "replay": "smiquery.recordings.playback",
}
# Submodules reachable after a plain `import smiquery` (`smiquery.aio.query(...)`, `smiquery.fields.CATALOGUE`),
# imported on first use: the adoption modules, and those that `import smiquery` used to import eagerly.
_LAZY_MODULES = frozenset(
    {"aio", "compat", "pmon", "fields", "oneshot", "parsing", "runner", "sample", "source", "streams"}
)


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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _LAZY_MODULES)


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
    "KernelLogError",
    "Kind",
    "ListenError",
    "NoDevicesFoundError",
    "NotSupportedError",
    "NvidiaSmiFailedError",
    "NvidiaSmiNotFoundError",
    "NvidiaSmiTimeoutError",
    "NvmlNotFoundError",
    "OutputTooLargeError",
    "ParseError",
    "PortInUseError",
    "PrometheusError",
    "PrometheusQueryError",
    "PrometheusUnreachableError",
    "RecordingError",
    "ReplayError",
    "ReportError",
    "RetryPolicy",
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
    "inspect",
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
