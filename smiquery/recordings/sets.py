"""Several files read as one recording: a rotated set (``run*.csv``), a list of files, a Parquet dataset's parts."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from smiquery.errors import RecordingError
from smiquery.frames import MissingReasons, SkippedLines, missing_reasons
from smiquery.recordings.recorder import META_SUFFIX

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Sources", "concat_frames", "expand_sources", "no_rows", "read_members", "time_order"]

Sources = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

_GLOB_CHARS = frozenset("*?[")


def expand_sources(source: Sources, *, error: type[RecordingError] = RecordingError) -> list[str]:
    """The files ``source`` names (a path, a glob such as ``run*.csv``, or a list of either), each once.

    A glob's matches are sorted by name; the rest keep the order given.

    Raises:
        RecordingError (or ``error``): a glob that matches nothing, or no path at all.
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    out: list[str] = []
    for item in items:
        text = os.fspath(item)
        if _GLOB_CHARS & set(text) and not os.path.exists(text):
            matches = sorted(m for m in glob.glob(text) if not m.endswith(META_SUFFIX))
            if not matches:
                raise error(f"no recording matches {text}; check the pattern (quote it so the shell leaves it)")
            out.extend(matches)
        else:
            out.append(text)
    if not out:
        raise error("no recording named; give a file, several, or a pattern such as 'run*.csv'")
    return list(dict.fromkeys(out))


def read_members(paths: Sequence[str], read: Callable[[str], pd.DataFrame]) -> pd.DataFrame:
    """The files of a set (``read`` reads one) as one recording, in the order of their first timestamps.

    A rotating recorder starts a new file with only its header (or nothing yet) and prunes the oldest: a member
    that holds no row, is empty, or is gone by the time it is read is skipped, one line each in
    ``attrs["skipped_files"]`` (``skipped run.csv: it holds no rows``); other errors are raised.

    Raises:
        RecordingError: no member holds a row (the error names the first, as for one file).
    """
    frames: list[pd.DataFrame] = []
    notes: list[str] = []
    for path in paths:
        try:
            df = read(path)
        except (RecordingError, OSError):
            if os.path.lexists(path) and not _empty(path):
                raise
            df = None
        if df is not None and len(df):
            frames.append(df)
        else:
            why = "holds no rows" if os.path.lexists(path) else "is gone (rotation pruned it after it was listed?)"
            notes.append(f"skipped {path}: it {why}")
    if not frames:
        raise no_rows(paths[0])
    out = concat_frames([frames[i] for i in time_order([_first_time(df) for df in frames])])
    if notes:
        out.attrs["skipped_files"] = notes
    return out


def no_rows(path: str) -> RecordingError:
    """The error for a recording (or a set) without a single readable row."""
    return RecordingError(f"recording {path} holds no readable rows")


def _empty(path: str) -> bool:
    try:
        return os.path.getsize(path) == 0
    except OSError:
        return False


def _first_time(df: pd.DataFrame) -> Any:
    if "timestamp" not in df.columns:
        return None
    stamps = df["timestamp"].dropna()
    if len(stamps) == 0:
        return None
    first = stamps.iloc[0]
    return first.tz_convert("UTC").tz_localize(None) if getattr(first, "tzinfo", None) is not None else first


def time_order(firsts: Sequence[Any]) -> list[int]:
    """Positions of a set's files by their first timestamps (None: unknown, last); stable.

    Naive and aware times mixed cannot be compared: the order given.
    """
    known = [i for i, k in enumerate(firsts) if k is not None]
    try:
        known.sort(key=lambda i: firsts[i])
    except TypeError:
        return list(range(len(firsts)))
    return known + [i for i, k in enumerate(firsts) if k is None]


def concat_frames(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """One frame of several as the readers give them, in order, re-indexed from 0, with their ``attrs`` joined.

    The columns are the union (a column one frame lacks is ``<NA>`` there); missing-value reasons are re-numbered,
    skipped lines counted together, the rules of all kept.
    """
    import pandas as pd

    if len(frames) == 1:
        return frames[0]
    offsets = [0, *(len(df) for df in frames)]
    missing = MissingReasons.concat(zip(accumulate(offsets), map(missing_reasons, frames)))
    skips = [s for df in frames if isinstance(s := df.attrs.get("skipped"), SkippedLines)]
    units: dict[str, Any] = {}
    for df in reversed(frames):
        if isinstance(u := df.attrs.get("units"), dict):
            units.update(u)
    bare = []
    for df in frames:
        copy = df.copy(deep=False)
        copy.attrs = {}
        bare.append(copy)
    out: pd.DataFrame = pd.concat(bare, ignore_index=True)
    fields = list(dict.fromkeys(f for df in frames for f in df.attrs.get("fields") or []))
    out.attrs = {**frames[0].attrs, "fields": fields, "units": units, "missing": missing}
    rules = list(dict.fromkeys(r for df in frames for r in df.attrs.get("rules") or ()))
    if rules:
        out.attrs["rules"] = rules
    out.attrs.pop("skipped", None)
    if skips:
        first = skips[0]
        out.attrs["skipped"] = SkippedLines(
            sum(s.count for s in skips), first.first_lineno, first.first_line, first.reason
        )
    return out
