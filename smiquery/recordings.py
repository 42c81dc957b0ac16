"""Recordings: every file format smiquery writes and reads back (nvidia-smi CSV, JSONL, Parquet).

Writers put each row out whole (one ``write`` call, then a flush when asked), so a file or pipe that is cut off
ends on a complete row. pandas and pyarrow are imported only by the Parquet writer.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from smiquery.errors import ParseError, RecordingError
from smiquery.fields import Field
from smiquery.parsing import format_row, header_line
from smiquery.records import GpuSample, Value

if TYPE_CHECKING:
    from datetime import tzinfo

    import pandas as pd

__all__ = [
    "CsvWriter",
    "JsonlWriter",
    "ParquetWriter",
    "RecordingError",
    "RecordingFormat",
    "SampleWriter",
    "SkippedLines",
    "detect_format",
    "json_value",
    "open_recorder",
    "read_recording",
    "sample_to_json",
]

RecordingFormat = Literal["csv", "jsonl", "parquet"]


# ------------------------------------------------------------------------------------------------- values


def json_value(value: Value) -> object:
    """A value as JSON wants it: timestamps in ISO 8601, NaN/inf as null, the rest unchanged."""
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sample_to_json(sample: GpuSample) -> dict[str, object]:
    """One sample as a JSON-ready dict keyed by field name, plus ``"_missing": {field: reason}`` when any."""
    # sample[name] reads the same whether GpuSample keeps its values as a tuple or a mapping
    out: dict[str, object] = {n: json_value(sample[n]) for n in sample.fields}
    missing = sample.missing
    if missing:
        out["_missing"] = dict(missing)
    return out


class SampleWriter(Protocol):
    """Something that takes samples one at a time and can be closed."""

    def write(self, sample: GpuSample) -> None:
        """Write one sample."""
        ...

    def close(self) -> None:
        """Flush and release the output."""
        ...


class _LineWriter:
    """Writes whole lines, one write call each, flushed per line when asked; closes ``out`` when it owns it."""

    def __init__(self, out: IO[str], *, flush: bool = True, owns: bool = False) -> None:
        self.out = out
        self.flush = flush
        self.owns = owns
        self.rows = 0

    def _line(self, text: str) -> None:
        self.out.write(text)
        self.rows += 1
        if self.flush:
            self.out.flush()

    def close(self) -> None:
        """Flush (and close the file when it was opened for this writer)."""
        try:
            self.out.flush()
        finally:
            if self.owns:
                self.out.close()


class CsvWriter(_LineWriter):
    """Writes samples in nvidia-smi's own ``--format=csv`` layout: the header with units, then one line per sample.

    ``smiquery.read_csv``, ``--replay`` and :class:`~smiquery.CsvParser` read the result back.

    Args:
        out: a text stream.
        fields: the columns (must match the samples' fields, in order).
        flush: flush after every row (for pipes and recordings).
        owns: close ``out`` on :meth:`close`.
    """

    def __init__(self, out: IO[str], fields: Sequence[Field], *, flush: bool = True, owns: bool = False) -> None:
        super().__init__(out, flush=flush, owns=owns)
        self.fields = tuple(fields)
        self._header_done = False

    def header(self) -> None:
        """Write the header now (it is otherwise written with the first row)."""
        if not self._header_done:
            self._header_done = True
            self.out.write(header_line(self.fields) + "\n")
            if self.flush:
                self.out.flush()

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one complete line (a single write call)."""
        line = format_row(sample, self.fields, units=True) + "\n"
        if not self._header_done:
            self._header_done = True
            line = header_line(self.fields) + "\n" + line
        self._line(line)


class JsonlWriter(_LineWriter):
    """Writes one JSON object per sample and line: field names as keys, ISO 8601 times, null for missing.

    A ``"_missing"`` object gives the reason of each missing value. :func:`smiquery.playback.replay` reads it back.

    Args:
        out: a text stream.
        flush: flush after every row.
        owns: close ``out`` on :meth:`close`.
    """

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one complete line."""
        self._line(json.dumps(sample_to_json(sample), separators=(", ", ": ")) + "\n")


class ParquetWriter:
    """Records samples to a Parquet file (pandas and pyarrow are imported on first use).

    Samples are buffered and the file is rewritten (to a temporary name, then renamed over the target) every
    ``chunk_rows`` samples or ``chunk_seconds`` seconds, and on :meth:`close`. So the file on disk is always a
    complete, readable Parquet file, and a crash (even SIGKILL) loses at most the last unwritten chunk. Columns
    and ``df.attrs`` are those of :func:`smiquery.frames.to_dataframe`; ``pandas.read_parquet`` restores both.

    Args:
        path: the file to write.
        chunk_rows: samples per chunk.
        chunk_seconds: the longest time a sample waits in the buffer.

    Raises:
        OSError: the file cannot be written there (checked at once, like the CSV and JSONL writers do).
        RuntimeError: pyarrow is not installed.
    """

    def __init__(self, path: str | os.PathLike[str], *, chunk_rows: int = 10_000, chunk_seconds: float = 60.0) -> None:
        self.path = Path(path)
        self.chunk_rows = chunk_rows
        self.chunk_seconds = chunk_seconds
        self.rows = 0
        self._pending: list[GpuSample] = []
        self._tables: list[Any] = []
        self._missing: dict[str, dict[int, str]] = {}
        self._attrs: dict[str, Any] = {}
        self._since = time.monotonic()
        self._closed = False
        try:
            import pyarrow  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("writing Parquet needs pyarrow: pip install 'smiquery[parquet]'") from exc
        # The file is first written after a chunk (up to a minute in): find out now that it cannot be.
        if self.path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", os.fspath(self.path))
        probe = self._tmp_path()
        with open(probe, "wb"):
            pass
        probe.unlink()

    def write(self, sample: GpuSample) -> None:
        """Buffer one sample; writes the file when a chunk is full."""
        self._pending.append(sample)
        if len(self._pending) >= self.chunk_rows or time.monotonic() - self._since >= self.chunk_seconds:
            self.flush()

    def flush(self) -> None:
        """Write every sample so far to the file (atomically)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from smiquery.frames import missing_reasons, to_dataframe

        self._since = time.monotonic()
        if self._pending:
            df = to_dataframe(self._pending)
            offset = self.rows
            for col, rows in missing_reasons(df).items():
                target = self._missing.setdefault(col, {})
                for i, reason in rows.items():
                    target[offset + int(i)] = reason
            if not self._attrs:
                self._attrs = {"fields": df.attrs.get("fields"), "units": df.attrs.get("units")}
            df.attrs = {}
            table = pa.Table.from_pandas(df, preserve_index=False)
            if self._tables:
                table = table.cast(self._tables[0].schema)
            self._tables.append(table)
            self.rows += len(self._pending)
            self._pending = []
        elif self._tables and self.path.exists():
            return
        if not self._tables:
            return
        whole = pa.concat_tables(self._tables) if len(self._tables) > 1 else self._tables[0]
        self._tables = [whole]
        attrs = {**self._attrs, "missing": {c: {str(k): v for k, v in m.items()} for c, m in self._missing.items()}}
        meta = dict(whole.schema.metadata or {})
        meta[b"PANDAS_ATTRS"] = json.dumps(attrs).encode("utf-8")
        tmp = self._tmp_path()
        pq.write_table(whole.replace_schema_metadata(meta), tmp)
        os.replace(tmp, self.path)

    def _tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def close(self) -> None:
        """Write the rest and finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()


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


# ------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class SkippedLines:
    """Lines of a recording that readers skipped: torn (a killed recorder's last line), garbled or not fitting.

    Attributes:
        count: how many lines were skipped.
        first_lineno: the line number (1-based) of the first one.
        first_line: that line's text (cut to 80 characters).
    """

    count: int
    first_lineno: int
    first_line: str = ""

    def message(self, name: str = "the recording") -> str:
        """One line for a warning: ``skipped 2 unreadable lines in run.csv (first: line 316)``.

        Args:
            name: how to call the recording (its path).

        Returns:
            The sentence, without a trailing period.
        """
        lines = "line" if self.count == 1 else "lines"
        return f"skipped {self.count} unreadable {lines} in {name} (first: line {self.first_lineno})"


def detect_format(path: str | os.PathLike[str]) -> RecordingFormat:
    """The recording format from the file name (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``/``.pq``).

    An unknown suffix is sniffed: ``PAR1`` means Parquet, a first character ``{`` JSONL, anything else CSV.

    Args:
        path: the recording.

    Returns:
        ``"csv"``, ``"jsonl"`` or ``"parquet"``.

    Raises:
        RecordingError: the file cannot be opened.
    """
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".txt", ".log"):
        return "csv"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError as exc:
        raise RecordingError(f"cannot read recording {os.fspath(path)}: {exc.strerror or exc}") from exc
    if head.startswith(b"PAR1"):
        return "parquet"
    return "jsonl" if head.startswith(b"{") else "csv"


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise RecordingError(f"recording {path} not found; record one with `smiquery stream --output FILE`")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    if size == 0:
        raise RecordingError(f"recording {path} is empty; a recording holds nvidia-smi's CSV header and rows")


def _read_csv_any(path: str, fields: str | Sequence[str] | None, tz: tzinfo | str | None) -> pd.DataFrame:
    from smiquery.frames import read_csv

    try:
        return read_csv(path, tz=tz)
    except ParseError as exc:
        if "no header" not in str(exc):
            raise RecordingError(f"{path} holds no row smiquery can read ({exc})") from None
        if fields is None:
            raise RecordingError(
                f"{path} is not a recording smiquery can read: it has no nvidia-smi CSV header line; "
                "for a headerless (noheader) log, give its columns with --fields"
            ) from None
    try:
        return read_csv(path, fields, tz=tz)
    except ParseError as exc:
        raise RecordingError(f"{path} holds no row of the given fields ({exc})") from None


def _read_jsonl(path: str, tz: tzinfo | str | None) -> pd.DataFrame:
    from smiquery.frames import to_dataframe
    from smiquery.playback import Replay

    with Replay(path, speed=0, fmt="jsonl") as rec:
        df = to_dataframe(rec)
        dropped = rec.stats.dropped_rows
        first = rec.first_error
    if dropped and first is not None:
        df.attrs["skipped"] = SkippedLines(dropped, first.lineno, (first.line or "")[:80])
    return df


def _read_parquet(path: str) -> pd.DataFrame:
    import pandas as pd

    from smiquery.frames import missing_reasons

    try:
        df = pd.read_parquet(path)
    except ImportError as exc:
        raise RecordingError("reading Parquet needs pyarrow: pip install 'smiquery[parquet]'") from exc
    except (OSError, ValueError) as exc:
        raise RecordingError(f"cannot read Parquet recording {path}: {exc}") from exc
    df.attrs["missing"] = missing_reasons(df)
    return df


def _set_zone(df: pd.DataFrame, tz: tzinfo | str | None) -> None:
    if tz is None or "timestamp" not in df.columns:
        return
    stamps = df["timestamp"]
    if getattr(stamps.dt, "tz", None) is None:
        df["timestamp"] = stamps.dt.tz_localize(tz, ambiguous="NaT", nonexistent="shift_forward")
    else:
        df["timestamp"] = stamps.dt.tz_convert(tz)


def read_recording(
    source: str | os.PathLike[str],
    *,
    fields: str | Sequence[str] | None = None,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """Read any recording into a DataFrame with the columns of :func:`smiquery.frames.to_dataframe`.

    CSV (smiquery's or plain ``nvidia-smi --query-gpu=... --format=csv[,nounits][,noheader] -l 1 > log.csv``),
    JSONL and Parquet as ``smiquery stream --output`` writes them. Unreadable lines (a torn last line, garbage)
    are skipped and described in ``attrs["skipped"]`` (a :class:`SkippedLines`). A log without an ``index``
    column (one GPU, e.g. ``timestamp, power.draw``) reads as GPU 0.

    Args:
        source: the file (``.csv``, ``.jsonl``, ``.parquet``; other names are sniffed).
        fields: the columns of a headerless CSV log (names, a preset or a comma list); ignored when the file has
            a header.
        tz: the zone the recording was made in; default None keeps timestamps as recorded (naive for CSV,
            whose timestamps carry no zone).

    Returns:
        One row per sample, in file order.

    Raises:
        RecordingError: the file is missing, empty, not a recording, or holds no readable row.
        InvalidFieldError: an unknown name in ``fields``.
        ValueError: an unknown time zone name.
    """
    import numpy as np
    import pandas as pd

    path = os.fspath(source)
    _check_file(path)
    fmt = detect_format(path)
    if fmt == "csv":
        df = _read_csv_any(path, fields, tz)
    elif fmt == "parquet":
        df = _read_parquet(path)
        _set_zone(df, tz)
    else:
        df = _read_jsonl(path, tz)
        _set_zone(df, tz)
    if len(df) == 0:
        raise RecordingError(f"recording {path} holds no readable rows")
    if "index" not in df.columns:
        # A single-GPU log (`--query-gpu=timestamp,power.draw`): its one GPU is GPU 0.
        at = 1 if "timestamp" in df.columns else 0
        df.insert(at, "index", pd.Series(np.zeros(len(df), dtype=np.int64), index=df.index, dtype="Int64"))
        if isinstance(df.attrs.get("fields"), list):
            df.attrs["fields"] = [*df.attrs["fields"][:at], "index", *df.attrs["fields"][at:]]
    return df
