"""Option values every command shares, parsed without typer (the fast path of ``query`` never imports it)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Literal

from smiquery.cli._boundary import as_usage
from smiquery.errors import InvalidFieldError, InvalidGpuIdError, NoDevicesFoundError, UsageError
from smiquery.fields import PRESETS, Field, resolve_fields

__all__ = [
    "Format",
    "Settings",
    "StreamFormat",
    "choose_format",
    "gpu_ids_checked",
    "is_tty",
    "parse_fields",
    "parse_gpus",
    "parse_seconds",
    "ranges",
    "unknown_gpus",
]


#: Output formats of one-shot commands (query, ps, fields).
Format = Literal["table", "csv", "jsonl", "json"]
#: Output formats of ``stream`` (a stream has no end, so no JSON array).
StreamFormat = Literal["table", "csv", "jsonl"]


@dataclass(frozen=True)
class Settings:
    """The global options, kept on ``ctx.obj``: ``--nvidia-smi``, ``--timeout`` (seconds), ``--debug``."""

    nvidia_smi: str | None = None
    timeout: float = 10.0
    debug: bool = False


def parse_seconds(text: str, what: str) -> float:
    """Positive seconds from ``1``, ``0.5``, ``250ms``, ``2s``, ``10m``, ``1h``; else a UsageError naming ``what``."""
    from smiquery.alerts import parse_duration

    with as_usage("{}", ValueError):
        return parse_duration(text, what=what)


def parse_fields(spec: str | None, extra: Sequence[Field] = ()) -> tuple[Field, ...]:
    """The fields of ``--fields`` (a preset or a comma list; None: default), then ``extra`` ones not named."""
    with as_usage(f"--fields: {{}}; presets: {', '.join(PRESETS)}", InvalidFieldError):
        flds = resolve_fields(spec or "default")
    names = {f.name for f in flds}
    return (*flds, *(f for f in extra if f.name not in names))


def parse_gpus(spec: str | None) -> tuple[str, ...] | None:
    """GPU ids (indices, UUIDs or PCI bus ids, comma separated) as strings, None for all; else a UsageError."""
    from smiquery.streams.argv import normalize_gpus

    if spec is None:
        return None
    with as_usage("--gpus: {}", InvalidGpuIdError):
        return normalize_gpus(spec)


def is_tty(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal."""
    return bool(getattr(stream, "isatty", lambda: False)())


def choose_format(fmt: str | None, out: IO[str]) -> str:
    """The ``--format`` asked for, else a table on a terminal and CSV otherwise."""
    return fmt or ("table" if is_tty(out) else "csv")


def ranges(indices: Sequence[int]) -> str:
    """``0-3,5`` for [0, 1, 2, 3, 5]."""
    ordered = enumerate(sorted(set(indices)))
    runs = [[i for _, i in run] for _, run in itertools.groupby(ordered, lambda pair: pair[1] - pair[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def unknown_gpus(ids: Sequence[str] | None, settings: Settings) -> UsageError | None:
    """After "No devices were found" for ``ids``: the usage error naming those this machine lacks, else None.

    One cheap listing (``--query-gpu=index,uuid``) tells a wrong id from a machine without GPUs. None too when the
    listing fails, or for PCI bus ids (nvidia-smi's own message covers their several spellings).
    """
    from smiquery.errors import SmiqueryError
    from smiquery.sources.query_gpu import query

    if not ids:
        return None
    try:
        gpus = query(["index", "uuid"], nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
    except SmiqueryError:
        return None
    if not gpus or not all(i.isdigit() or i.lower().startswith(("gpu-", "mig-")) for i in ids):
        return None
    known = {str(g.index) for g in gpus} | {str(g.get("uuid")).lower() for g in gpus}
    absent = [i for i in ids if i.lower() not in known]
    if not absent:
        return None
    have = ranges([g.index for g in gpus if g.index is not None])
    plural = "s" if len(absent) > 1 else ""
    return UsageError(f"no GPU{plural} {', '.join(absent)}; this machine has {have}")


@contextlib.contextmanager
def gpu_ids_checked(ids: Sequence[str] | None, settings: Settings) -> Iterator[None]:
    """Turns "No devices were found" inside into the usage error naming the ``--gpus`` this machine lacks."""
    try:
        yield
    except NoDevicesFoundError:
        wrong = unknown_gpus(ids, settings)
        if wrong is None:
            raise
        raise wrong from None
