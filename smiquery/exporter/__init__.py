"""Prometheus exporter: :class:`SmiCollector` (families of ONE background stream's newest sweep) and :func:`serve`.

A scrape never starts nvidia-smi; :func:`serve` publishes over HTTP(S). Needs ``pip install 'smiquery[export]'``.
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "smiquery.exporter needs prometheus_client: pip install 'smiquery[export]' (the core does not)"
    ) from _exc

from smiquery.exporter.collector import DEFAULT_EXPORTER_ALERTS, SmiCollector, SourceHealth, parse_labels, source_health
from smiquery.exporter.events import EventLog, configure_logging
from smiquery.exporter.naming import (
    DCGM_MAP,
    HEALTH_METRICS,
    IDENTITY_FIELDS,
    PMON_METRICS,
    MetricSpec,
    Naming,
    metric_specs,
    render,
)
from smiquery.exporter.pmonwatch import PmonWatcher, ProcessInstant
from smiquery.exporter.server import Exporter, serve
from smiquery.httpd.webconfig import WebConfig, load_web_config

__all__ = [
    "DCGM_MAP",
    "DEFAULT_EXPORTER_ALERTS",
    "HEALTH_METRICS",
    "IDENTITY_FIELDS",
    "PMON_METRICS",
    "EventLog",
    "Exporter",
    "MetricSpec",
    "Naming",
    "PmonWatcher",
    "ProcessInstant",
    "SmiCollector",
    "SourceHealth",
    "WebConfig",
    "configure_logging",
    "load_web_config",
    "metric_specs",
    "parse_labels",
    "render",
    "serve",
    "source_health",
]
