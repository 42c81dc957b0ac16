"""smiquery: typed, trustworthy NVIDIA GPU monitoring through nvidia-smi."""

from __future__ import annotations

from smiquery.errors import (
    InvalidFieldError,
    InvalidGpuIdError,
    NvidiaSmiFailedError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    ParseError,
    SmiqueryError,
)
from smiquery.fields import CATALOGUE, PRESETS, Field, Kind, get_field, parse_help_query_gpu, resolve_fields
from smiquery.parsing import CsvParser, parse_lines
from smiquery.records import GpuSample

__version__ = "0.1.0"

__all__ = [
    "CATALOGUE",
    "PRESETS",
    "CsvParser",
    "Field",
    "GpuSample",
    "InvalidFieldError",
    "InvalidGpuIdError",
    "Kind",
    "NvidiaSmiFailedError",
    "NvidiaSmiNotFoundError",
    "NvidiaSmiTimeoutError",
    "ParseError",
    "SmiqueryError",
    "__version__",
    "get_field",
    "parse_help_query_gpu",
    "parse_lines",
    "resolve_fields",
]
