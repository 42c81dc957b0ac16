"""The recorder of ``smiquery stream --output``: its options, opening it, and SIGHUP (logrotate's create mode).

``smiquery record``, the word users type first, is no command of its own: it says to use ``stream --output``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from smiquery.cli._common import app, settings_of
from smiquery.cli._options import parse_seconds
from smiquery.errors import RecordingError, SmiqueryError, UsageError
from smiquery.fields import Field

if TYPE_CHECKING:
    from smiquery.recordings import ParquetDataset, TextRecorder

__all__ = ["open_output", "parse_rotate", "recording_options", "reopen_on_hup"]


@app.command("record", hidden=True, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(ctx: typer.Context) -> None:
    """Not a command: recording is ``smiquery stream --output FILE``; says so, with the arguments given."""
    from smiquery.cli._boundary import boundary
    from smiquery.printable import printable

    args = [printable(a) for a in ctx.args]
    has_output = any(a in ("-o", "--output") or a.startswith("--output=") for a in args)
    command = " ".join(["smiquery stream", *([] if has_output else ["--output run.csv"]), *args])
    with boundary(settings_of(ctx).debug):
        raise UsageError(f"there is no `smiquery record`: record with `{command}`, then `smiquery report` the file")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_rotate(text: str) -> tuple[int | None, float | None]:
    """``--rotate``: (bytes, None) for ``100MB`` (``64MiB``: 1024s), (None, seconds) for ``1h``; else UsageError."""
    wrong = UsageError(f"--rotate {text!r}: give a size such as 100MB or 1GB, or a duration such as 1h or 30m")
    if re.search(r"b\s*$", text, re.IGNORECASE) or re.search(r"\d\s*[kgt]i?\s*$", text, re.IGNORECASE):
        m = _SIZE_RE.match(text)
        if m is None or float(m.group(1)) <= 0:
            raise wrong
        power = " kmgt".index(m.group(2).lower() or " ")
        return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power), None
    try:
        return None, parse_seconds(text, "--rotate")
    except UsageError:
        raise wrong from None


def recording_options(
    output: Path | None, *, force: bool, append: bool, rotate: str | None, keep: int | None, flush_every: str
) -> dict[str, Any]:
    """``open_recording``'s keyword arguments from ``--output``'s options; a UsageError before anything starts."""
    given = (("--force", force), ("--append", append), ("--rotate", rotate), ("--keep", keep))
    named = [n for n, value in given if value]  # --keep is at least 1
    if output is None and named:
        raise UsageError(f"{named[0]} goes with --output FILE")
    if force and append:
        raise UsageError("--force replaces the recording and --append continues it: pass one of them")
    if keep is not None and rotate is None:
        raise UsageError("--keep N keeps N rotated files: pass --rotate SIZE|DURATION too")
    rotate_bytes, rotate_seconds = parse_rotate(rotate) if rotate is not None else (None, None)
    text = flush_every.strip()
    return {
        "policy": "force" if force else "append" if append else "new",
        "rotate_bytes": rotate_bytes,
        "rotate_seconds": rotate_seconds,
        "keep": keep,
        "flush_every": 0.0 if text in ("0", "0s") or output is None else parse_seconds(text, "--flush-every"),
    }


def open_output(
    output: Path, fields: Sequence[Field], options: Mapping[str, Any], say: Callable[[str], None], rules: Sequence[str]
) -> TextRecorder | ParquetDataset:
    """The recorder for ``--output``, every failure one line naming the file; ``rules`` are recorded beside it."""
    from smiquery.recordings import open_recording

    try:
        return open_recording(output, fields, say=say, rules=rules, **options)
    except (UsageError, RecordingError):
        raise
    except OSError as exc:
        raise SmiqueryError(
            f"cannot write {output}: {(exc.strerror or str(exc)).lower()}; choose another --output"
        ) from None
    except RuntimeError as exc:
        raise SmiqueryError(str(exc)) from None


@contextlib.contextmanager
def reopen_on_hup(recorders: Sequence[object]) -> Iterator[None]:
    """While inside, SIGHUP makes each recorder reopen its file before its next row (logrotate's create mode).

    Outside the main thread (no handler can be set there) it does nothing.
    """
    targets = [r for r in recorders if callable(getattr(r, "reopen", None))]
    if not targets or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        yield
        return

    def on_hup(signum: int, frame: object) -> None:
        for r in targets:
            r.reopen()  # type: ignore[attr-defined]

    saved = signal.signal(signal.SIGHUP, on_hup)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, saved)
