"""Alerts: rules over samples, where their events go, and the evidence saved when one fires.

Modules :mod:`~smiquery.alerts.rules` (pure) and :mod:`~smiquery.alerts.notify` (the handlers, the snapshot;
it imports rules). Every name below is imported from its module on first use: the CLI reads the rules for every
duration option, and should not bring in the webhook's HTTP client and threads.
"""

from __future__ import annotations

import typing

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


def __getattr__(name: str) -> object:
    # rules first: a name of the rules does not bring in the handlers
    import importlib

    if name in __all__:
        for module in ("rules", "notify"):
            found = getattr(importlib.import_module(f"smiquery.alerts.{module}"), name, None)
            if found is not None:
                globals()[name] = found
                return found
    raise AttributeError(f"module 'smiquery.alerts' has no attribute {name!r}")


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
