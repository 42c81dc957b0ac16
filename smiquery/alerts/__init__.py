"""Alerts: rules over samples, where their events go, and the evidence saved when one fires.

Modules :mod:`~smiquery.alerts.rules` (pure) and :mod:`~smiquery.alerts.notify` (the handlers, the snapshot).
The handlers' names are imported on first use: the CLI reads the rules for every duration option, and should not
bring in the webhook's HTTP client and threads.
"""

from __future__ import annotations

import typing

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

if typing.TYPE_CHECKING:
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


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'smiquery.alerts' has no attribute {name!r}")
    from smiquery.alerts import notify

    found = globals()[name] = getattr(notify, name)
    return found


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
