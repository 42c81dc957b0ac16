"""Recordings, the one owner of their I/O: nvidia-smi CSV (plain logs too), JSONL and Parquet, written and read.

One module per format, with its writer and readers; this front picks the format by the file name
(:func:`open_recorder`, :func:`open_recording`, :func:`read_recording`); :mod:`~smiquery.recordings.playback`
plays a recording back, paced.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smiquery.errors import RecordingError, UsageError
from smiquery.fields import Field, resolve_fields
from smiquery.frames import MissingReasons, SkippedLines, missing_reasons, set_zone, to_dataframe
from smiquery.recordings.base import (
    RecordingFormat,
    SampleWriter,
    Sources,
    check_file,
    detect_format,
    expand_sources,
    no_rows,
    read_members,
    resolve_zone,
)
from smiquery.recordings.csvfile import CsvSource, CsvWriter, csv_header, read_csv, read_csv_recording
from smiquery.recordings.jsonl import JsonlWriter, json_value, read_jsonl, sample_from_json, sample_to_json
from smiquery.recordings.parquet import ParquetDataset, is_dataset, read_dataset, read_parquet
from smiquery.recordings.playback import Replay, replay
from smiquery.recordings.recorder import Policy, TextRecorder, recorded_rules, recorded_zone

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CsvSource",
    "CsvWriter",
    "JsonlWriter",
    "MissingReasons",
    "ParquetDataset",
    "Policy",
    "RecordingFormat",
    "Replay",
    "SampleWriter",
    "SkippedLines",
    "Sources",
    "TextRecorder",
    "csv_header",
    "detect_format",
    "json_value",
    "missing_reasons",
    "open_recorder",
    "open_recording",
    "read_csv",
    "read_recording",
    "replay",
    "resolve_zone",
    "sample_from_json",
    "sample_to_json",
    "set_zone",
    "to_dataframe",
]


_WRITTEN = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def open_recorder(path: str | os.PathLike[str], fields: Sequence[Field]) -> SampleWriter:
    """A writer for ``PATH`` (replaced if it exists), by suffix: ``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``/``.pq``.

    Parquet is a dataset folder (:class:`~smiquery.recordings.parquet.ParquetDataset`). ``stream --output`` uses
    :func:`open_recording` instead (refusal, append, rotation). Raises ValueError (an unknown suffix) or OSError.
    """
    kind = _WRITTEN.get(Path(path).suffix.lower())
    if kind == "parquet":
        import errno

        target = Path(path)
        if not target.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such directory", os.fspath(target.parent))
        if target.is_dir() and not is_dataset(target):
            raise IsADirectoryError(errno.EISDIR, "is a directory (not a smiquery recording)", os.fspath(target))
        return ParquetDataset(path, fields, policy="force")
    if kind is None:
        raise ValueError(f"cannot tell the format of {os.fspath(path)!r}: name it .csv, .jsonl or .parquet")
    out = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 - the writer owns it
    return CsvWriter(out, fields, owns=True) if kind == "csv" else JsonlWriter(out, owns=True)


def open_recording(
    path: str | os.PathLike[str],
    fields: Sequence[Field],
    *,
    policy: Policy = "new",
    rotate_bytes: int | None = None,
    rotate_seconds: float | None = None,
    keep: int | None = None,
    flush_every: float = 10.0,
    say: Callable[[str], None] | None = None,
    rules: Sequence[str] = (),
) -> TextRecorder | ParquetDataset:
    """The recorder of ``smiquery stream --output PATH``, by suffix, with these arguments.

    A :class:`TextRecorder` for ``.csv`` and ``.jsonl``/``.ndjson``, a :class:`ParquetDataset` for
    ``.parquet``/``.pq``. The ``rules`` come back in :func:`read_recording`'s ``attrs["rules"]``. Raises UsageError
    (an unknown suffix, an existing recording under ``"new"``, other columns under ``"append"``), RecordingError (it
    cannot be written there) or RuntimeError (Parquet without pyarrow).
    """
    kind = _WRITTEN.get(Path(path).suffix.lower())
    if kind is None:
        raise UsageError(
            f"--output {os.fspath(path)}: cannot tell the format from the name; name it .csv, .jsonl or .parquet"
        )
    options: dict[str, Any] = {"policy": policy, "keep": keep, "flush_every": flush_every, "say": say, "rules": rules}
    options |= {"rotate_bytes": rotate_bytes, "rotate_seconds": rotate_seconds}
    if kind == "parquet":
        return ParquetDataset(path, fields, **options)
    return TextRecorder(path, fields, kind="csv" if kind == "csv" else "jsonl", **options)


def read_recording(
    source: Sources, *, fields: str | Sequence[str] | None = None, tz: tzinfo | str | None = None
) -> pd.DataFrame:
    """Read any recording into a DataFrame with the columns of :func:`~smiquery.frames.to_dataframe`, a row per sample.

    CSV (smiquery's or plain ``nvidia-smi --query-gpu=... --format=csv[,nounits][,noheader] -l 1 > log.csv``),
    JSONL and Parquet as ``smiquery stream --output`` writes them. Unreadable lines (a torn last line, garbage)
    are skipped and described in ``attrs["skipped"]`` (a :class:`SkippedLines`). A log without an ``index``
    column (one GPU, e.g. ``timestamp, power.draw``) reads as GPU 0.

    Args:
        source: a file (other names than ``.csv``, ``.jsonl``, ``.parquet`` are sniffed), a dataset folder,
            several, or a glob (``"run*.csv"``): a rotated set is read as one recording, its files in the order of
            their first timestamps. One that holds no row yet or is gone since it was listed is skipped, one line
            each in ``attrs["skipped_files"]``.
        fields: names, a preset or a comma list: a headerless CSV log's columns in order (then
            ``attrs["headerless"]`` is True); for a recording that names its columns, each must be one of them.
        tz: the zone the recording was made in (an IANA name or a ``tzinfo``): times recorded without a zone are
            localized to it, others converted. Default: the zone the recording names (``run.csv.meta.json``, a
            dataset's ``_smiquery.json``), else as recorded (naive for a plain nvidia-smi log, never assumed UTC).

    Raises RecordingError when the file is missing, empty, not a recording (a headerless log without ``fields``),
    holds no readable row (of several: none of them holds one), or lacks one of ``fields``; InvalidFieldError or
    InvalidTimeZoneError for an unknown name in ``fields`` or ``tz``.
    """
    zone = resolve_zone(tz)
    wanted = resolve_fields(fields) if fields is not None else None
    paths = expand_sources(source)
    if len(paths) == 1:
        df = _read_one(paths[0], wanted, zone)
        if len(df) == 0:
            raise no_rows(paths[0])
        return df
    return read_members(paths, lambda p: _read_one(p, wanted, zone))


def _read_one(path: str, wanted: Sequence[Field] | None, zone: tzinfo | None) -> pd.DataFrame:
    """One file or dataset as a frame; without rows when it holds none (a header alone), the caller decides."""
    import numpy as np
    import pandas as pd

    as_columns = False
    zone = zone if zone is not None else recorded_zone(path)
    if os.path.isdir(path) and is_dataset(path):
        df = read_dataset(path)
        set_zone(df, zone)
    else:
        check_file(path)
        fmt = detect_format(path)
        if fmt == "csv":
            df, as_columns = read_csv_recording(path, wanted, zone)  # its timestamps are in the zone already
        else:
            df = read_parquet(path) if fmt == "parquet" else read_jsonl(path, zone)
            set_zone(df, zone)
    if len(df) == 0 and isinstance(df.attrs.get("skipped"), SkippedLines):
        raise no_rows(path)  # only unreadable lines: not a file just started
    rules = recorded_rules(path)
    if rules:
        df.attrs["rules"] = list(rules)
    if "index" not in df.columns:
        # A single-GPU log (`--query-gpu=timestamp,power.draw`): its one GPU is GPU 0.
        at = 1 if "timestamp" in df.columns else 0
        df.insert(at, "index", pd.Series(np.zeros(len(df), dtype=np.int64), index=df.index, dtype="Int64"))
        if isinstance(df.attrs.get("fields"), list):
            df.attrs["fields"] = [*df.attrs["fields"][:at], "index", *df.attrs["fields"][at:]]
    lacking = [f.name for f in wanted or () if f.attr not in df.columns]
    if lacking and not as_columns:
        recorded = df.attrs.get("fields")
        held = recorded if isinstance(recorded, list) and len(recorded) == len(df.columns) else list(df.columns)
        raise RecordingError(
            f"--fields does not agree with {path}: it has no {', '.join(lacking)}; "
            f"it records {', '.join(map(str, held))}"
        )
    if as_columns:
        df.attrs["headerless"] = True
    return df
