"""Alerts: rules (:mod:`~smiquery.alerts.rules`) and where their events go (:mod:`~smiquery.alerts.notify`)."""

from __future__ import annotations

from smiquery.alerts.notify import (
    HANDLER_SPECS,
    AlertHandler,
    CallbackHandler,
    LogHandler,
    Notifier,
    SnapshotHandler,
    WebhookHandler,
    handler_from_spec,
    take_snapshot,
)
from smiquery.alerts.rules import (
    BUILTIN_RULES,
    STALL,
    AlertEvaluator,
    AlertEvent,
    Rule,
    StallRule,
    arrival,
    event_payload,
    parse_duration,
)

__all__ = [
    "BUILTIN_RULES",
    "HANDLER_SPECS",
    "STALL",
    "AlertEvaluator",
    "AlertEvent",
    "AlertHandler",
    "CallbackHandler",
    "LogHandler",
    "Notifier",
    "Rule",
    "SnapshotHandler",
    "StallRule",
    "WebhookHandler",
    "arrival",
    "event_payload",
    "handler_from_spec",
    "parse_duration",
    "take_snapshot",
]
