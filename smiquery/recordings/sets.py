"""Several files read as one recording: a rotated set (``run*.csv``), a list of files, a Parquet dataset's parts.

:func:`expand_sources` turns what a user names (paths, globs) into files; :func:`read_members` reads them as one,
skipping a member that holds no row or is gone; :func:`concat_frames` joins their frames with their ``attrs``
(missing-value reasons re-numbered, skipped lines counted together).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from datetime import tzinfo
from typing import TYPE_CHECKING, Any

from smiquery.errors import RecordingError
from smiquery.frames import MissingReasons, SkippedLines, missing_reasons
from smiquery.recordings.recorder import META_SUFFIX

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Sources", "concat_frames", "csv_zone", "expand_sources", "no_rows", "read_members", "time_order"]

Sources = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

_GLOB_CHARS = frozenset("*?[")


def expand_sources(source: Sources, *, error: type[RecordingError] = RecordingError) -> list[str]:
    """The files ``source`` names: a path, a glob (``run*.csv``), or a list of either; duplicates once.

    Args:
        source: what the user gave.
        error: the error to raise.

    Returns:
        The paths, in the order given (a glob's matches sorted by name).

    Raises:
        RecordingError: a glob that matches nothing, or no path at all.
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
    """The files of a set read as one recording, in the order of their first timestamps.

    A rotating recorder starts a new file with only its header (or nothing yet) and prunes the oldest: a member
    that holds no row, is empty, or is gone by the time it is read, is skipped. Each skip is one line in the
    frame's ``attrs["skipped_files"]`` (``skipped run.csv: it holds no rows``); other errors are raised.

    Args:
        paths: the members (:func:`expand_sources`).
        read: reads one member into a frame, without rows when it holds none.

    Returns:
        The rows of all members, as :func:`concat_frames` joins them.

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
    out = concat_frames([frames[i] for i in time_order(frames)])
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


def csv_zone(path: str | os.PathLike[str]) -> tzinfo | None:
    """The zone a CSV recording was made in, from its ``run.csv.meta.json``; None when it has none (a plain log).

    Args:
        path: the CSV file.
    """
    import json
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        with open(os.fspath(path) + META_SUFFIX, encoding="utf-8") as fh:
            name = json.load(fh).get("tz")
        return ZoneInfo(name) if isinstance(name, str) and name else None
    except (OSError, ValueError, AttributeError, ZoneInfoNotFoundError):
        return None


def _first_time(df: pd.DataFrame) -> Any:
    if "timestamp" not in df.columns or len(df) == 0:
        return None
    stamps = df["timestamp"].dropna()
    if len(stamps) == 0:
        return None
    first = stamps.iloc[0]
    return first.tz_convert("UTC").tz_localize(None) if getattr(first, "tzinfo", None) is not None else first


def time_order(frames: Sequence[pd.DataFrame]) -> list[int]:
    """Positions of ``frames`` by their first timestamp (a rotated set's files, whatever their names); stable."""
    keys = [_first_time(df) for df in frames]
    known = [i for i, k in enumerate(keys) if k is not None]
    try:
        known.sort(key=lambda i: keys[i])
    except TypeError:  # naive and aware times mixed: keep the order given
        return list(range(len(frames)))
    return known + [i for i, k in enumerate(keys) if k is None]


def concat_frames(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """One frame of several, in the order given, with their ``attrs`` joined.

    Args:
        frames: frames as the readers give them (``fields``, ``units``, ``missing``, ``skipped`` in ``attrs``).

    Returns:
        The rows of all, re-indexed from 0; columns the union (a column one file lacks is ``<NA>`` there).
    """
    import pandas as pd

    if len(frames) == 1:
        return frames[0]
    columns: dict[str, tuple[list[Any], list[Any], list[str]]] = {}
    offset = 0
    skipped: SkippedLines | None = None
    fields: list[Any] = []
    units: dict[str, Any] = {}
    for df in frames:
        reasons = missing_reasons(df)
        for col in reasons:
            rows, codes, words = columns.setdefault(col, ([], [], []))
            for r, w in reasons[col].items():
                if w not in words:
                    words.append(w)
                rows.append(offset + int(r))
                codes.append(words.index(w))
        offset += len(df)
        s = df.attrs.get("skipped")
        if isinstance(s, SkippedLines):
            skipped = (
                s
                if skipped is None
                else SkippedLines(skipped.count + s.count, skipped.first_lineno, skipped.first_line, skipped.reason)
            )
        for f in df.attrs.get("fields") or []:
            if f not in fields:
                fields.append(f)
        u = df.attrs.get("units")
        if isinstance(u, dict):
            units = {**u, **units}
    bare = []
    for df in frames:
        copy = df.copy(deep=False)
        copy.attrs = {}
        bare.append(copy)
    out: pd.DataFrame = pd.concat(bare, ignore_index=True)
    out.attrs = {**frames[0].attrs, "fields": fields, "units": units, "missing": MissingReasons(columns)}
    rules = list(dict.fromkeys(r for df in frames for r in df.attrs.get("rules") or ()))
    if rules:
        out.attrs["rules"] = rules
    if skipped is not None:
        out.attrs["skipped"] = skipped
    else:
        out.attrs.pop("skipped", None)
    return out
