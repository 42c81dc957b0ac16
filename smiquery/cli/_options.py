"""Option values every command shares, parsed without typer (the fast path of ``query`` never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import IO

from smiquery.errors import InvalidFieldError, InvalidGpuIdError, UsageError
from smiquery.fields import PRESETS, Field, resolve_fields

__all__ = [
    "Format",
    "Settings",
    "StreamFormat",
    "choose_format",
    "parse_fields",
    "parse_gpus",
    "parse_seconds",
    "unknown_gpus",
]


class Format(str, Enum):
    """Output formats of one-shot commands (query, ps, fields)."""

    table = "table"
    csv = "csv"
    jsonl = "jsonl"
    json = "json"


class StreamFormat(str, Enum):
    """Output formats of ``stream`` (a stream has no end, so no JSON array)."""

    table = "table"
    csv = "csv"
    jsonl = "jsonl"


@dataclass(frozen=True)
class Settings:
    """The global options, kept on ``ctx.obj``.

    Attributes:
        nvidia_smi: the binary to run (None: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        timeout: seconds before an nvidia-smi call counts as hung.
        debug: print tracebacks.
    """

    nvidia_smi: str | None = None
    timeout: float = 10.0
    debug: bool = False


def parse_seconds(text: str, what: str) -> float:
    """Seconds from ``1``, ``0.5``, ``250ms``, ``2s``, ``10m``, ``1h`` (what every duration option accepts).

    Args:
        text: the option value.
        what: the option name, for the message.

    Returns:
        The seconds (positive).

    Raises:
        UsageError: not a positive duration.
    """
    from smiquery.alerts import parse_duration

    try:
        return parse_duration(text, what=what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_fields(spec: str | None, extra: Sequence[Field] = ()) -> tuple[Field, ...]:
    """The fields of ``--fields`` (a preset or a comma list), plus ``extra`` ones not already named.

    Args:
        spec: the option value (None: the default preset).
        extra: fields needed besides (alert rules).

    Returns:
        The fields, in order.

    Raises:
        UsageError: an unknown field or preset.
    """
    try:
        flds = resolve_fields(spec or "default")
    except InvalidFieldError as exc:
        raise UsageError(f"--fields: {exc}; presets: {', '.join(PRESETS)}") from None
    names = {f.name for f in flds}
    return (*flds, *(f for f in extra if f.name not in names))


def parse_gpus(spec: str | None, what: str = "--gpus") -> tuple[str, ...] | None:
    """GPU ids of ``--gpus``: indices, UUIDs or PCI bus ids, comma separated (what every GPU option accepts).

    Args:
        spec: the option value (None: all GPUs).
        what: the option name, for the message.

    Returns:
        The ids as strings, or None for all.

    Raises:
        UsageError: an id that is none of the three forms.
    """
    from smiquery.streams.argv import normalize_gpus

    if spec is None:
        return None
    try:
        return normalize_gpus(spec)
    except InvalidGpuIdError as exc:
        raise UsageError(f"{what}: {exc}") from None


def choose_format(fmt: Enum | None, out: IO[str]) -> str:
    """The output format: the one asked for, else a table on a terminal and CSV otherwise.

    Args:
        fmt: the ``--format`` value.
        out: the output stream.

    Returns:
        ``"table"``, ``"csv"``, ``"jsonl"`` or ``"json"``.
    """
    if fmt is not None:
        return str(fmt.value)
    isatty = getattr(out, "isatty", None)
    return "table" if isatty is not None and isatty() else "csv"


def _ranges(indices: Sequence[int]) -> str:
    """``0-3,5`` for [0, 1, 2, 3, 5]."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def unknown_gpus(ids: Sequence[str] | None, settings: Settings) -> UsageError | None:
    """A usage error naming the requested GPUs this machine lacks, or None when they all exist.

    Called after nvidia-smi said "No devices were found" for an ``-i`` list: one cheap listing of the GPUs
    (``--query-gpu=index,uuid``) tells a wrong id (a usage error) from a machine without GPUs.

    Args:
        ids: the ids of ``--gpus``.
        settings: the global options.

    Returns:
        The error to raise, or None (the ids exist, or the listing failed too).
    """
    from smiquery.errors import SmiqueryError
    from smiquery.sources.query_gpu import query

    if not ids:
        return None
    try:
        gpus = query(["index", "uuid"], nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
    except SmiqueryError:
        return None
    if not gpus:
        return None
    known = {str(g.index) for g in gpus} | {str(g.get("uuid")).lower() for g in gpus}
    if not all(i.isdigit() or i.lower().startswith(("gpu-", "mig-")) for i in ids):
        return None  # PCI bus ids have several spellings: leave those to nvidia-smi's own message
    absent = [i for i in ids if i.lower() not in known]
    if not absent:
        return None
    have = _ranges([g.index for g in gpus if g.index is not None])
    plural = "s" if len(absent) > 1 else ""
    return UsageError(f"no GPU{plural} {', '.join(absent)}; this machine has {have}")
