"""``smiquery export`` wired into the app, taking durations and GPU ids as ``stream`` does.

The command itself lives in :mod:`smiquery.cli_export`; here its duration options (``--interval 250ms``,
``--processes-interval 1m``, ``--stale-after 30s``) get the parser every command shares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import typer

from smiquery.cli._common import app, seconds_option

__all__ = ["register"]

_DURATIONS = ("interval", "processes_interval", "stale_after")


def _with_durations(command: Any) -> Any:
    """``command`` with its duration options parsed like ``stream --interval`` (a copy; the original is untouched)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return command(*args, **kwargs)

    hints = get_type_hints(command, include_extras=True)
    sig = inspect.signature(command)
    params = []
    annotations: dict[str, Any] = dict(getattr(command, "__annotations__", {}))
    for p in sig.parameters.values():
        hint = hints.get(p.name, p.annotation)
        if p.name in _DURATIONS and get_origin(hint) is Annotated:
            base, *meta = get_args(hint)
            info = next((m for m in meta if isinstance(m, typer.models.OptionInfo)), None)
            if info is not None:
                option = seconds_option("--" + p.name.replace("_", "-"))
                option.help = f"{info.help} Takes 5, 0.5, 250ms, 2s, 1m." if info.help else None
                option.param_decls = info.param_decls
                hint = Annotated[base, option]
        annotations[p.name] = hint
        params.append(p.replace(annotation=hint))
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = annotations
    return wrapper


def register(target: typer.Typer = app) -> None:
    """Add ``export`` to the app.

    Args:
        target: the app.
    """
    from smiquery.cli_export import export

    target.command("export", context_settings={"help_option_names": ["-h", "--help"]})(_with_durations(export))
