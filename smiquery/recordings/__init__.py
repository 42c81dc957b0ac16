"""Recordings, the one owner of their I/O: nvidia-smi CSV (plain logs too), JSONL and Parquet, written and read.

One module per format, each with a writer and readers (:mod:`~smiquery.recordings.csv`,
:mod:`~smiquery.recordings.jsonl`, :mod:`~smiquery.recordings.parquet`); :mod:`~smiquery.recordings.frames`
turns samples into DataFrames and :mod:`~smiquery.recordings.playback` plays a recording back, paced. This front
picks the format by the file name (:func:`open_recorder`, :func:`read_recording`). Readers keep timestamps as
recorded unless ``tz=`` names the zone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import tzinfo
from pathlib import Path
from typing import TYPE_CHECKING

from smiquery.errors import RecordingError
from smiquery.fields import Field, resolve_fields
from smiquery.recordings.base import (
    RecordingFormat,
    SampleWriter,
    SkippedLines,
    check_file,
    detect_format,
    resolve_zone,
)
from smiquery.recordings.csv import CsvSource, CsvWriter, csv_header, read_csv, read_csv_recording
from smiquery.recordings.frames import MissingReasons, missing_reasons, set_zone, to_dataframe
from smiquery.recordings.jsonl import JsonlWriter, json_value, read_jsonl, sample_from_json, sample_to_json
from smiquery.recordings.parquet import ParquetWriter, read_parquet
from smiquery.recordings.playback import Replay, replay

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CsvSource",
    "CsvWriter",
    "JsonlWriter",
    "MissingReasons",
    "ParquetWriter",
    "RecordingFormat",
    "Replay",
    "SampleWriter",
    "SkippedLines",
    "csv_header",
    "detect_format",
    "json_value",
    "missing_reasons",
    "open_recorder",
    "read_csv",
    "read_recording",
    "replay",
    "resolve_zone",
    "sample_from_json",
    "sample_to_json",
    "set_zone",
    "to_dataframe",
]


def open_recorder(path: str | os.PathLike[str], fields: Sequence[Field]) -> SampleWriter:
    """A writer for ``--output PATH``, by suffix: ``.csv``, ``.jsonl``/``.ndjson`` or ``.parquet``/``.pq``.

    Raises:
        ValueError: an unknown suffix.
        OSError: the file cannot be created.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return CsvWriter(open(path, "w", encoding="utf-8", newline=""), fields, owns=True)
    if suffix in (".jsonl", ".ndjson"):
        return JsonlWriter(open(path, "w", encoding="utf-8", newline=""), owns=True)
    if suffix in (".parquet", ".pq"):
        return ParquetWriter(path)
    raise ValueError(f"cannot tell the format of {os.fspath(path)!r}: name it .csv, .jsonl or .parquet")


def _check_recorded(df: pd.DataFrame, wanted: Sequence[Field], path: str) -> None:
    """Each of the ``wanted`` fields must be a column of a recording that names its own (header, JSONL, Parquet)."""
    lacking = [f.name for f in wanted if f.attr not in df.columns]
    if lacking:
        recorded = df.attrs.get("fields")
        held = recorded if isinstance(recorded, list) and len(recorded) == len(df.columns) else list(df.columns)
        raise RecordingError(
            f"--fields does not agree with {path}: it has no {', '.join(lacking)}; "
            f"it records {', '.join(map(str, held))}"
        )


def read_recording(
    source: str | os.PathLike[str],
    *,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """Read any recording into a DataFrame with the columns of :func:`~smiquery.recordings.frames.to_dataframe`.

    CSV (smiquery's or plain ``nvidia-smi --query-gpu=... --format=csv[,nounits][,noheader] -l 1 > log.csv``),
    JSONL and Parquet as ``smiquery stream --output`` writes them. Unreadable lines (a torn last line, garbage)
    are skipped and described in ``attrs["skipped"]`` (a :class:`SkippedLines`). A log without an ``index``
    column (one GPU, e.g. ``timestamp, power.draw``) reads as GPU 0.

    Args:
        source: the file (``.csv``, ``.jsonl``, ``.parquet``; other names are sniffed).
        fields: names, a preset or a comma list. For a headerless CSV log, its columns in order (required).
            For a recording that names its columns (a header, JSONL, Parquet), each must be one of them (all
            columns are read all the same).
        tz: the zone the recording was made in (an IANA name such as ``"Europe/Berlin"``, or a ``tzinfo``):
            timestamps recorded without a zone are localized to it, ones with a zone converted to it. Default None
            keeps them as recorded: naive for nvidia-smi's CSV (it prints local time with no zone), never assumed
            to be UTC.

    Returns:
        One row per sample, in file order; ``attrs["headerless"]`` is True when ``fields`` named the columns.

    Raises:
        RecordingError: the file is missing, empty, not a recording (a headerless log without ``fields``), holds
            no readable row, or lacks one of ``fields``.
        InvalidFieldError: an unknown name in ``fields``.
        InvalidTimeZoneError: an unknown time zone name.
    """
    import numpy as np
    import pandas as pd

    zone = resolve_zone(tz)
    wanted = resolve_fields(fields) if fields is not None else None
    path = os.fspath(source)
    check_file(path)
    fmt = detect_format(path)
    as_columns = False
    if fmt == "csv":
        df, as_columns = read_csv_recording(path, wanted, zone)
    elif fmt == "parquet":
        df = read_parquet(path)
        set_zone(df, zone)
    else:
        df = read_jsonl(path, zone)
        set_zone(df, zone)
    if len(df) == 0:
        raise RecordingError(f"recording {path} holds no readable rows")
    if "index" not in df.columns:
        # A single-GPU log (`--query-gpu=timestamp,power.draw`): its one GPU is GPU 0.
        at = 1 if "timestamp" in df.columns else 0
        df.insert(at, "index", pd.Series(np.zeros(len(df), dtype=np.int64), index=df.index, dtype="Int64"))
        if isinstance(df.attrs.get("fields"), list):
            df.attrs["fields"] = [*df.attrs["fields"][:at], "index", *df.attrs["fields"][at:]]
    if wanted is not None and not as_columns:
        _check_recorded(df, wanted, path)
    if as_columns:
        df.attrs["headerless"] = True
    return df
