"""Recordings, the one owner of their I/O: nvidia-smi CSV (plain logs too), JSONL and Parquet, written and read.

Rows are written whole; readers build DataFrames with :mod:`smiquery.frames` and keep timestamps as recorded
unless ``tz=`` names the zone.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol, Union

from smiquery.clock import localize_by_order
from smiquery.errors import InvalidTimeZoneError, ParseError, RecordingError
from smiquery.fields import Field, Kind, resolve_fields
from smiquery.frames import (
    MissingReasons,
    _empty_array,
    _frame,
    _int_array,
    _local_zone,
    _string_dtype,
    missing_reasons,
    to_dataframe,
)

# Cells are read by their kind's own converters and words (smiquery.kinds), so that both paths read a cell the
# same way.
from smiquery.kinds import missing_reason
from smiquery.parsing import MESSAGE_PREFIXES, CsvParser, format_row, header_line
from smiquery.sample import GpuSample, Value

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CsvSource",
    "CsvWriter",
    "JsonlWriter",
    "ParquetWriter",
    "RecordingError",
    "RecordingFormat",
    "SampleWriter",
    "SkippedLines",
    "csv_header",
    "detect_format",
    "json_value",
    "open_recorder",
    "read_csv",
    "read_recording",
    "resolve_zone",
    "sample_to_json",
]

RecordingFormat = Literal["csv", "jsonl", "parquet"]

#: What :func:`read_csv` accepts: a path, or an open binary or text file.
CsvSource = Union[str, "os.PathLike[str]", IO[bytes], IO[str]]

# What datetime64[ns] can hold.
_NS_MIN, _NS_MAX = datetime(1677, 9, 22), datetime(2262, 4, 11)
# A header line is short; reading this much is enough to find it (and any blank lines before it).
_HEAD_BYTES = 1 << 20
_LINE_BREAK_RE = re.compile(r"\r\n|\r|\n")
# read_csv splits and converts blocks of about this size; a converted block is a fraction of its text.
_BLOCK_BYTES = 4 << 20
# Rows of the file's head that decide which numeric columns the CSV reader converts itself.
_HEAD_ROWS = 4000
# Threads converting blocks.
_WORKERS = max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------------- values


def resolve_zone(tz: tzinfo | str | None) -> tzinfo | None:
    """The zone a ``tz=`` argument names: a ``tzinfo`` as given, an IANA name (``"Europe/Berlin"``, ``"UTC"``).

    Args:
        tz: the zone, or None (keep timestamps as recorded).

    Returns:
        The ``tzinfo``, or None.

    Raises:
        InvalidTimeZoneError: a name that is not an IANA zone.
    """
    if tz is None or isinstance(tz, tzinfo):
        return tz
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not isinstance(tz, str) or not tz.strip():
        raise InvalidTimeZoneError(str(tz))
    try:
        return ZoneInfo(tz.strip())
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidTimeZoneError(tz) from None


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


def csv_header(path: str | os.PathLike[str]) -> tuple[str, ...] | None:
    """The field names of a CSV recording's header line, or None when it has none (a ``noheader`` log).

    Only the head of the file is read. A headerless log needs its columns named (``fields=``, ``--fields``).

    Args:
        path: the recording.

    Returns:
        The canonical field names, in column order; None for no header (or no line at all).

    Raises:
        RecordingError: the file cannot be read.
    """
    parser = CsvParser()
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            for _ in range(64):  # blank lines before the header, at most
                line = fh.readline(_HEAD_BYTES)
                if not line:
                    return None
                try:
                    parser.feed(line)
                except ParseError:
                    return None  # the first line is a row: no header
                if parser.fields:
                    return tuple(f.name for f in parser.fields)
    except OSError as exc:
        raise RecordingError(f"cannot read recording {os.fspath(path)}: {exc.strerror or exc}") from exc
    return None


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise RecordingError(f"recording {path} not found; record one with `smiquery stream --output FILE`")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    if size == 0:
        raise RecordingError(f"recording {path} is empty; a recording holds nvidia-smi's CSV header and rows")


# --------------------------------------------------------------------------------------------------------------
# CSV (nvidia-smi's --format=csv, with or without units and header) -> DataFrame


class _Source:
    """A CSV input: a path (read by pyarrow itself) or the bytes of an open file."""

    def __init__(self, src: CsvSource) -> None:
        self.path: str | None = None
        self._data: bytes | None = None
        self._head: bytes | None = None
        if isinstance(src, (str, os.PathLike)):
            self.path = os.fspath(src)
        else:
            raw = src.read()
            # surrogatepass: a str that holds lone surrogates still becomes bytes (undecodable ones, replaced later).
            self._data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)

    def head(self) -> bytes:
        if self._data is not None:
            return self._data[:_HEAD_BYTES]
        if self._head is None:
            assert self.path is not None
            with open(self.path, "rb") as f:
                self._head = f.read(_HEAD_BYTES)
        return self._head

    def data(self) -> bytes:
        if self._data is None:
            assert self.path is not None
            self._data = Path(self.path).read_bytes()
        return self._data


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _is_notice(line: str) -> bool:
    return line.startswith(MESSAGE_PREFIXES)


class _Layout:
    """What the probe of the first lines found: fields, units, header and how many lines precede the data."""

    def __init__(self, fields: tuple[Field, ...], units: tuple[str, ...], header: list[str] | None, skip: int):
        self.fields = fields
        self.units = units
        self.header = header
        self.skip = skip

    def data_lines(self, data: bytes, *, notices: bool = False) -> Iterator[tuple[int, str, bool]]:
        """(line number, line, fits) for every row the reader keeps, plus the rows with a wrong column count.

        With ``notices``, the notice lines the reader sets aside instead.
        """
        ncols = len(self.fields)
        for lineno, raw in enumerate(data.splitlines(), 1):
            if lineno <= self.skip:
                continue
            line = _decode(raw)
            if not line.strip():
                continue
            cells = line.split(",")
            if len(cells) != ncols or ncols == 1:
                if _is_notice(line):
                    if notices:
                        yield lineno, line, True
                    continue
                if len(cells) != ncols:
                    if not notices:
                        yield lineno, line, False
                    continue
            if notices:
                continue
            if self.header is not None and [c.strip() for c in cells] == self.header:
                continue
            yield lineno, line, True

    def locate(self, data: bytes, row: int) -> tuple[int, str]:
        """The line number and text of data row ``row`` (0-based, in reading order)."""
        i = 0
        for lineno, line, fits in self.data_lines(data):
            if fits:
                if i == row:
                    return lineno, line
                i += 1
        return 0, ""  # pragma: no cover - rows always come from the same data

    def first_misfit(self, data: bytes) -> tuple[int, str] | None:
        for lineno, line, fits in self.data_lines(data):
            if not fits:
                return lineno, line
        return None


def _probe(src: _Source, fields: Sequence[str | Field] | None, tz: tzinfo) -> _Layout | None:
    """Read the first non-blank line with the strict parser: a header, or the first row of headerless output.

    Returns None when the input holds no non-blank line.
    """
    probe = CsvParser(fields, tz=tz)
    lines = src.head().splitlines()
    for n, raw in enumerate(lines, 1):
        line = _decode(raw)
        if not line.rstrip("\r\n\t "):
            probe.feed(line)
            continue
        notices = len(probe.notices)
        sample = probe.feed(line)  # raises ParseError for a bad first row or a header that does not fit
        if sample is None and len(probe.notices) == notices:
            return _Layout(probe.fields, probe.units, [c.strip() for c in line.split(",")], n)
        return _Layout(probe.fields, probe.units, None, 0)
    if probe.fields:
        return _Layout(probe.fields, probe.units, None, 0)
    return None


def _as_fields(fields: str | Sequence[str | Field] | None) -> Sequence[str | Field] | None:
    if isinstance(fields, str):
        return resolve_fields(fields)
    return fields


def read_csv(
    path_or_buffer: CsvSource,
    fields: str | Sequence[str | Field] | None = None,
    *,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """Read a recorded ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` file into a DataFrame.

    Gives the same columns, dtypes and ``attrs`` as :func:`to_dataframe` of the parsed records, plus
    ``attrs["notices"]`` (driver notice lines such as ``WARNING: infoROM is corrupted...``). With pyarrow
    installed (``smiquery[fast]``) the file is split by pyarrow's CSV reader and converted column by column
    with vectorised kernels; without it the pure-Python :class:`~smiquery.CsvParser` is used (same result,
    slower). One difference: past the first 4,000 rows, the fast path reads a ``0x``-prefixed number in an
    integer column as hex, where the parser rejects it (nvidia-smi prints hex only in hex fields).

    Args:
        path_or_buffer: a path, or an open file in binary or text mode.
        fields: the queried fields (names, aliases, a preset or a comma list), required for ``noheader``
            output; when the file has a header as well, it must match them.
        tz: the time zone the recording was made in (a ``tzinfo`` or an IANA name such as ``"Europe/Berlin"``):
            timestamps become aware in that zone. Default None: nvidia-smi prints the recording host's wall-clock
            time with no zone, and the column stays naive (``datetime64[ns]``), exactly as recorded.

    Returns:
        One row per readable data line. Lines that cannot be read (the torn last line of a killed recorder, a
        garbled line, a row of the wrong width or with a value that does not fit its field) are skipped;
        ``attrs["skipped"]`` is then a :class:`~smiquery.recordings.SkippedLines` with their count and the first
        one's line number.

    Raises:
        ParseError: there is neither a header nor ``fields``, or the header does not match ``fields``.
        InvalidFieldError: a name in ``fields`` is unknown.
        ValueError: an unknown time zone name.
    """
    out_tz = resolve_zone(tz)
    # The parser needs a zone to read a timestamp; the wall-clock time it reads is what is kept.
    zone = out_tz if out_tz is not None else _local_zone()
    src = _Source(path_or_buffer)
    wanted = _as_fields(fields)
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.csv  # noqa: F401  (the fast path needs it; absent, fall back)
    except ImportError:
        return _read_csv_python(src, wanted, zone, out_tz)
    layout = _probe(src, wanted, zone)
    if layout is None:
        return _frame((), (), {}, [])
    return _ArrowReader(src, layout, zone, out_tz).read()


def _read_csv_python(
    src: _Source, fields: Sequence[str | Field] | None, tz: tzinfo, out_tz: tzinfo | None
) -> pd.DataFrame:
    parser = CsvParser(fields, tz=tz, strict=False)
    first: ParseError | None = None
    lines = _LINE_BREAK_RE.split(_decode(src.data()))
    if lines and lines[-1] == "":
        lines.pop()
    samples: list[GpuSample] = []
    dropped = 0
    for line in lines:
        sample = parser.feed(line)
        if sample is not None and "timestamp" in sample:
            stamp = sample.timestamp
            if isinstance(stamp, datetime) and not _NS_MIN <= stamp.replace(tzinfo=None) <= _NS_MAX:
                sample = None  # outside what datetime64[ns] holds: a garbled year
                dropped += 1
                if first is None:
                    first = ParseError("timestamp out of range", lineno=parser.lineno, line=line, field="timestamp")
        if sample is not None:
            samples.append(sample)
        elif first is None and parser.last_error is not None:
            first = parser.last_error
    skipped = None
    if parser.dropped or dropped:
        assert first is not None
        skipped = SkippedLines(parser.dropped + dropped, first.lineno, (first.line or "")[:80])
        if not samples:
            raise _unreadable(skipped)
    if samples:
        try:
            df = to_dataframe(samples)
        except (OverflowError, ValueError) as exc:  # a timestamp outside datetime64[ns] (years 1677-2262)
            raise ParseError(str(exc), lineno=0, line="") from exc
        if "timestamp" in df.columns:
            stamps = df["timestamp"].dt.tz_convert(tz)
            df["timestamp"] = stamps.dt.tz_localize(None) if out_tz is None else stamps.dt.tz_convert(out_tz)
        df.attrs["notices"] = list(parser.notices)
        if skipped is not None:
            df.attrs["skipped"] = skipped
        return df
    flds = parser.fields
    return _frame(flds, [_empty_array(f, out_tz) for f in flds], {}, list(parser.notices), skipped)


def _unreadable(skipped: SkippedLines) -> ParseError:
    return ParseError(
        f"no readable rows: {skipped.count} line(s) do not fit the header (first: line {skipped.first_lineno})",
        lineno=skipped.first_lineno,
        line=skipped.first_line,
    )


class _BadCell(Exception):
    """A cell the parser's converter rejects, at a row position counted over the whole file."""

    def __init__(self, row: int, cell: str, fld: Field) -> None:
        super().__init__(row, cell, fld.name)
        self.row = row
        self.cell = cell
        self.fld = fld


# Why cells of one column are missing: (row positions, reason codes, reason words); row positions are local to a
# block while it is converted.
_Why = tuple[Any, Any, tuple[str, ...]]


class _Block:
    """One converted block: a pandas-ready part per column, the missing reasons per column, and the rows dropped.

    ``bad`` holds the positions (in the block as read) of rows with a cell that does not fit its field; the first
    of them (with its cell) is in ``first_bad``.
    """

    __slots__ = ("bad", "first_bad", "parts", "reasons", "rows")

    def __init__(self, parts: list[Any], reasons: list[_Why | None], rows: int, bad: list[int]) -> None:
        self.parts = parts
        self.reasons = reasons
        self.rows = rows
        self.bad = bad


class _ArrowReader:
    """The fast path of :func:`read_csv`.

    pyarrow's multi-threaded CSV reader splits the file into blocks of rows; worker threads then convert the
    blocks, column by column, with vectorised kernels (Arrow releases the GIL), and a block's text is freed as
    soon as it is converted.

    Numeric columns whose first rows hold plain numbers and ``[N/A]`` only are converted by the CSV reader
    itself (``[N/A]`` -> null), the cheapest way there is; every other column is read as text and converted
    here. When a typed column meets anything else further on (another status token, a unit, a bad value), the
    read starts again with that column as text.
    """

    def __init__(self, src: _Source, layout: _Layout, tz: tzinfo, out_tz: tzinfo | None) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv

        self.pa, self.pc, self.pacsv = pa, pc, pacsv
        self.src = src
        self.layout = layout
        self.tz = tz
        self.out_tz = out_tz
        self.notices: list[str] = []
        self.misfits = 0

    # -- reading ---------------------------------------------------------------------------------------------

    def read(self) -> pd.DataFrame:
        pa = self.pa
        typed = self._typed_from_head()
        clean: bytes | None = None
        while True:
            try:
                if clean is not None:
                    return self._read(pa.BufferReader(clean), typed)
                if self.src.path is None:
                    return self._read(pa.BufferReader(self.src.data()), typed)
                # Opened as a plain stream: given a path, pyarrow would also decompress ``.gz`` files by name.
                with pa.input_stream(self.src.path, compression=None) as stream:
                    return self._read(stream, typed)
            except pa.ArrowInvalid as exc:
                message = str(exc)
                failed = re.match(r"In CSV column #(\d+): CSV conversion error.*invalid value '(.*)'$", message)
                if failed is not None and int(failed.group(1)) in typed:
                    column = int(failed.group(1))
                    header = self.layout.header
                    if header is not None and failed.group(2).strip() == header[column]:
                        typed.clear()  # the header again (a restarted recording): every column as text
                    else:
                        typed.discard(column)  # that column as text this time
                    continue
                if "UTF8" in message and clean is None:
                    # Undecodable bytes: read again with U+FFFD in their place, as the line parser would.
                    clean = _decode(self.src.data()).encode("utf-8")
                    continue
                raise ParseError(message, lineno=0, line="") from exc

    def _typed_from_head(self) -> set[int]:
        """The numeric columns whose cells in the first rows are plain numbers or ``[N/A]``."""
        layout = self.layout
        convert: dict[int, Callable[[str], object]] = {
            i: f.kind.ops.converter() for i, f in enumerate(layout.fields) if f.kind.is_quantity
        }
        if not convert:
            return set()
        ncols = len(layout.fields)
        head = self.src.head()
        lines = head.splitlines()
        if len(head) >= _HEAD_BYTES:
            lines.pop()  # may be cut short
        for raw in lines[layout.skip : layout.skip + _HEAD_ROWS]:
            cells = _decode(raw).split(",")
            if len(cells) != ncols:
                continue
            for i in list(convert):
                cell = cells[i].strip()
                if cell == "[N/A]":
                    continue
                try:
                    convert[i](cell)
                except ValueError:
                    del convert[i]
            if not convert:
                break
        return set(convert)

    def _handler(self, row: Any) -> str:
        text: str = row.text or ""
        if not text.strip():
            return "skip"
        if _is_notice(text):
            self.notices.append(text.rstrip("\r\n"))
            return "skip"
        self.misfits += 1
        return "skip"

    def _read(self, source: Any, typed: set[int]) -> pd.DataFrame:
        pa, pacsv = self.pa, self.pacsv
        layout = self.layout
        names = [f"c{i}" for i in range(len(layout.fields))]
        types = {
            name: (pa.int64() if fld.kind.ops.storage == "int" else pa.float64()) if i in typed else pa.string()
            for i, (name, fld) in enumerate(zip(names, layout.fields, strict=True))
        }
        self.notices.clear()
        self.misfits = 0
        try:
            table = pacsv.read_csv(
                source,
                read_options=pacsv.ReadOptions(column_names=names, skip_rows=layout.skip, block_size=_BLOCK_BYTES),
                # nvidia-smi never quotes: a '"' is part of a value.
                parse_options=pacsv.ParseOptions(delimiter=",", quote_char=False, invalid_row_handler=self._handler),
                convert_options=pacsv.ConvertOptions(
                    column_types=types,
                    # in typed (numeric) columns only: text columns keep every cell as text
                    null_values=["[N/A]", " [N/A]"],
                    strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" not in str(exc):
                raise
            return self._assemble([])
        if len(self.notices) > 1:
            # the reader's threads report bad rows in no particular order
            self.notices = [line for _, line, _ in layout.data_lines(self.src.data(), notices=True)]
        batches: list[Any] = table.to_batches()
        del table  # from here on, a block's text is freed as soon as the block is converted
        batches.reverse()
        blocks: list[_Block] = []
        pending: deque[Future[_Block]] = deque()
        rows = 0
        starts: deque[int] = deque()
        first_bad: int | None = None  # row position (over the whole file, as read) of the first bad row
        bad_rows = 0
        with ThreadPoolExecutor(_WORKERS) as pool:
            while batches or pending:
                if batches:
                    columns = self._drop_non_rows(list(batches.pop().columns))
                    size = len(columns[0])
                    pending.append(pool.submit(self._convert_block, columns))
                    starts.append(rows)
                    rows += size
                    del columns
                    if len(pending) <= _WORKERS and batches:
                        continue
                block = pending.popleft().result()
                start = starts.popleft()
                if block.bad:
                    bad_rows += len(block.bad)
                    if first_bad is None:
                        first_bad = start + block.bad[0]
                blocks.append(block)
        skipped = self._skipped(bad_rows, first_bad)
        if skipped is not None and rows == bad_rows:
            raise _unreadable(skipped)
        return self._assemble(blocks, skipped)

    def _skipped(self, bad_rows: int, first_bad: int | None) -> SkippedLines | None:
        """What was skipped: rows of the wrong width (the reader's handler) and rows with a bad cell."""
        count = bad_rows + self.misfits
        if not count:
            return None
        data = self.src.data()
        found: list[tuple[int, str]] = []
        if self.misfits:
            misfit = self.layout.first_misfit(data)
            if misfit is not None:
                found.append(misfit)
        if first_bad is not None:
            found.append(self.layout.locate(data, first_bad))
        lineno, line = min(found) if found else (0, "")
        return SkippedLines(count, lineno, line[:80])

    def _assemble(self, blocks: list[_Block], skipped: SkippedLines | None = None) -> pd.DataFrame:
        import numpy as np

        layout = self.layout
        out: list[Any] = []
        missing: dict[str, _Why] = {}
        offsets = np.cumsum([0] + [b.rows for b in blocks])
        for i, fld in enumerate(layout.fields):
            parts = [block.parts[i] for block in blocks]
            for block in blocks:
                block.parts[i] = None  # each block's part is freed once the column is whole
            out.append(self._concat(parts, fld))
            del parts
            self.pa.default_memory_pool().release_unused()
            found = [(offsets[k], why) for k, b in enumerate(blocks) if (why := b.reasons[i]) is not None]
            if found:
                words = tuple(dict.fromkeys(w for _, why in found for w in why[2]))
                code_of = {w: n for n, w in enumerate(words)}
                rows = np.concatenate([why[0] + off for off, why in found])
                codes = np.concatenate(
                    [np.asarray([code_of[w] for w in why[2]], dtype=np.int16)[why[1]] for _, why in found]
                )
                missing[fld.attr] = (rows, codes, words)
        return _frame(layout.fields, out, MissingReasons(missing), self.notices, skipped)

    def _drop_non_rows(self, columns: list[Any]) -> list[Any]:
        """Drop repeated header lines and, for one-column output, notice and blank lines."""
        pa, pc = self.pa, self.pc
        first = columns[0]
        if first.type != pa.string():
            return columns  # a header or notice line would have failed this column's conversion
        keep = None
        header = self.layout.header
        if header is not None and pc.any(pc.equal(pc.ascii_trim_whitespace(first), header[0])).as_py():
            # a restarted stream without noheader prints its header again
            same = None
            for col, title in zip(columns, header, strict=True):
                eq = pc.equal(pc.ascii_trim_whitespace(col.cast(pa.string())), title)
                same = eq if same is None else pc.and_(same, eq)
            keep = pc.invert(same)
        if len(columns) == 1:
            notice = pc.or_(pc.starts_with(first, "WARNING:"), pc.starts_with(first, "ERROR:"))
            if pc.any(notice).as_py():
                self.notices.extend(pc.filter(first, notice).to_pylist())
            odd = pc.or_(notice, pc.equal(pc.ascii_trim_whitespace(first), ""))
            keep = pc.invert(odd) if keep is None else pc.and_(keep, pc.invert(odd))
        if keep is None or pc.all(keep).as_py():
            return columns
        return [pc.filter(c, keep) for c in columns]

    # -- converting -------------------------------------------------------------------------------------------

    def _convert_block(self, columns: list[Any]) -> _Block:
        """One block -> a pandas-ready part per column, the missing reasons, and the rows dropped as bad.

        A row with a cell that does not fit its field (a garbled line) is dropped and the block converted again
        without it.

        Args:
            columns: the block's cells, one array per field: text, or numbers the reader converted.
        """
        import numpy as np

        pa, pc = self.pa, self.pc
        layout = self.layout
        bad: list[int] = []
        positions: Any = None  # current row -> row in the block as read, once rows were dropped
        while True:
            parts: list[Any] = []
            reasons: list[_Why | None] = []
            try:
                for i, fld in enumerate(layout.fields):
                    raw = columns[i]
                    if raw.type == pa.string():
                        values, why = self._convert(pc.ascii_trim_whitespace(raw), fld, layout.units[i])
                    else:
                        values, why = raw, self._nulls(raw)
                    del raw
                    parts.append(self._part(values, fld))
                    reasons.append(why)
            except _BadCell as exc:
                if positions is None:
                    positions = np.arange(len(columns[0]))
                bad.append(int(positions[exc.row]))
                keep = np.ones(len(positions), dtype=bool)
                keep[exc.row] = False
                positions = positions[keep]
                mask = pa.array(keep)
                columns = [pc.filter(c, mask) for c in columns]
                continue
            break
        rows = len(columns[0])
        del columns
        # Hand the block's scratch memory back to the OS: the allocator would keep it, and NumPy (which holds
        # the converted parts) cannot reuse it.
        pa.default_memory_pool().release_unused()
        return _Block(parts, reasons, rows, sorted(bad))

    def _nulls(self, col: Any) -> _Why | None:
        """The reasons for the nulls of a column the reader typed: each was ``[N/A]``."""
        import numpy as np

        if not col.null_count:
            return None
        rows = self.pc.indices_nonzero(self.pc.is_null(col)).to_numpy()
        return rows, np.zeros(len(rows), dtype=np.int16), ("not_available",)

    def _convert(self, col: Any, fld: Field, unit: str) -> tuple[Any, _Why | None]:
        """One trimmed text column of a block -> (typed Arrow array, why cells are missing)."""
        pa, pc = self.pa, self.pc
        kind = fld.kind
        # A cast that fails costs fifty times one that succeeds (Arrow builds the error), so the one-cast path
        # is taken only for a column that shows no unit and no status token.
        suffixed = bool(unit) and kind is not Kind.STR and pc.any(pc.ends_with(col, " " + unit)).as_py()
        if kind.is_numeric and not suffixed and not pc.any(pc.starts_with(col, "[")).as_py():
            typed = self._typed(col, fld)
            if typed is not None:
                return typed, None
        token = self._tokens(col)
        reasons: _Why | None = None
        if token is not None:
            reasons = self._reasons(col, token)
            col = self.pc.if_else(token, pa.scalar(None, pa.string()), col)
        del token
        if suffixed:
            col = self._strip_unit(col, unit)
        typed = self._typed(col, fld)
        if typed is None:
            typed = self._python_chunk(col, fld)
        return typed, reasons

    def _tokens(self, col: Any) -> Any | None:
        """Mask of the status-token cells (``[...]``, bare ``N/A``, empty), or None when there is none."""
        pa, pc = self.pa, self.pc
        token = None
        bracket = pc.starts_with(col, "[")
        if pc.any(bracket).as_py():
            token = pc.and_(bracket, pc.ends_with(col, "]"))
        del bracket
        if pc.min(pc.binary_length(col)).as_py() == 0 or pc.any(pc.equal(col, "N/A")).as_py():
            bare = pc.is_in(col, value_set=pa.array(["N/A", ""]))
            token = bare if token is None else pc.or_(token, bare)
        if token is None or not pc.any(token).as_py():
            return None
        return token

    def _reasons(self, col: Any, token: Any) -> _Why:
        pc = self.pc
        rows = pc.indices_nonzero(token).to_numpy()
        encoded = pc.dictionary_encode(pc.filter(col, token))
        words = tuple(missing_reason(t) or t for t in encoded.dictionary.to_pylist())
        return rows, encoded.indices.to_numpy(zero_copy_only=False), words

    def _strip_unit(self, col: Any, unit: str) -> Any:
        pc = self.pc
        suffix = " " + unit
        has = pc.ends_with(col, suffix)
        if not pc.any(has).as_py():
            return col
        stripped = pc.utf8_slice_codeunits(col, 0, -len(suffix))
        if pc.all(has).as_py():
            return stripped  # every cell carries the unit (token cells are null by now and skipped)
        return pc.if_else(has, stripped, col)

    def _typed(self, col: Any, fld: Field) -> Any | None:
        """The column cast to its kind's Arrow type, or None when some cell needs the parser's own converter."""
        return fld.kind.ops.arrow_cast(col)

    def _python_chunk(self, col: Any, fld: Field) -> Any:
        """Convert a column cell by cell with the parser's own converter (rare: odd values, or a bad one)."""
        pa = self.pa
        convert: Callable[[str], Value] = fld.kind.ops.converter(self.tz)
        values: list[Value] = []
        for row, cell in enumerate(col.to_pylist()):
            if cell is None:
                values.append(None)
                continue
            try:
                values.append(convert(cell))
            except Exception as exc:  # any converter failure means the cell does not fit the field
                raise _BadCell(row, cell, fld) from exc
        storage = fld.kind.ops.storage
        if storage == "int":
            try:
                return pa.array(values, pa.int64())
            except (OverflowError, pa.ArrowInvalid):
                return pa.array(values, pa.uint64())  # a bitmask with the top bit set
        if storage == "timestamp":
            # wall-clock time in the reader's zone, like the fast path (localised with the rest in _concat)
            naive: list[datetime | None] = []
            for row, v in enumerate(values):
                wall = None if v is None else v.astimezone(self.tz).replace(tzinfo=None)  # type: ignore[union-attr]
                if wall is not None and not _NS_MIN <= wall <= _NS_MAX:
                    raise _BadCell(row, col[row].as_py(), fld)
                naive.append(wall)
            return pa.array(naive, pa.timestamp("us")).cast(pa.timestamp("ns"))
        arrow_type = {"float": pa.float64(), "bool": pa.bool_()}.get(storage, pa.string())
        return pa.array(values, arrow_type)

    def _part(self, typed: Any, fld: Field) -> Any:
        """A block's typed Arrow array in the form pandas keeps it: NumPy-backed except for text."""
        import pandas as pd

        pa = self.pa
        ops = fld.kind.ops
        if ops.storage == "timestamp":
            return typed.to_numpy(zero_copy_only=False)  # naive datetime64[ns], NaT where missing
        if ops.storage == "string":
            return typed
        # the kind's own nullable dtype; UInt64 for a bitmask block with the top bit set
        dtype: Any = pd.UInt64Dtype() if typed.type == pa.uint64() else pd.api.types.pandas_dtype(ops.dtype)
        return dtype.__from_arrow__(typed)

    def _concat(self, parts: list[Any], fld: Field) -> Any:
        import numpy as np
        import pandas as pd

        storage = fld.kind.ops.storage
        if not parts:
            return _empty_array(fld, self.out_tz)
        if storage == "timestamp":
            naive = pd.DatetimeIndex(np.concatenate(parts) if len(parts) > 1 else parts[0])
            del parts
            if self.out_tz is None:
                return naive.as_unit("ns").array  # as recorded: nvidia-smi prints wall-clock time with no zone
            # the hour a DST fall-back repeats resolves by the order of the rows: the second 02:30 is later
            return localize_by_order(naive, self.out_tz).as_unit("ns").array
        if storage != "string":
            if len({p.dtype for p in parts}) > 1:  # Int64 blocks and a UInt64 one (a bitmask with the top bit set)
                return _int_array([v for p in parts for v in p.tolist()])
            return parts[0] if len(parts) == 1 else type(parts[0])._concat_same_type(parts)
        return _string_dtype().__from_arrow__(self.pa.chunked_array(parts, self.pa.string()))


def _read_csv_any(path: str, fields: Sequence[Field] | None, tz: tzinfo | None) -> tuple[pd.DataFrame, bool]:
    """The CSV recording, and whether ``fields`` named its columns (it has no header)."""
    try:
        return read_csv(path, tz=tz), False
    except ParseError as exc:
        if "no header" not in str(exc):
            raise RecordingError(f"{path} holds no row smiquery can read ({exc})") from None
        if fields is None:
            raise RecordingError(
                f"{path} is not a recording smiquery can read: it has no nvidia-smi CSV header line; "
                "for a headerless (noheader) log, give its columns with --fields"
            ) from None
    try:
        return read_csv(path, fields, tz=tz), True
    except ParseError as exc:
        names = ",".join(f.name for f in fields)
        raise RecordingError(
            f"{path} has no header and its rows do not fit --fields {names}: give its columns, in order ({exc})"
        ) from None


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


def _read_jsonl(path: str, tz: tzinfo | str | None) -> pd.DataFrame:
    from smiquery.playback import Replay

    with Replay(path, speed=0, fmt="jsonl", tz=tz) as rec:
        df = to_dataframe(rec)
        dropped = rec.stats.dropped_rows
        first = rec.first_error
    if dropped and first is not None:
        df.attrs["skipped"] = SkippedLines(dropped, first.lineno, (first.line or "")[:80])
    return df


def _read_parquet(path: str) -> pd.DataFrame:
    import pandas as pd

    try:
        df = pd.read_parquet(path)
    except ImportError as exc:
        raise RecordingError("reading Parquet needs pyarrow: pip install 'smiquery[parquet]'") from exc
    except (OSError, ValueError) as exc:
        raise RecordingError(f"cannot read Parquet recording {path}: {exc}") from exc
    df.attrs["missing"] = missing_reasons(df)
    return df


def _set_zone(df: pd.DataFrame, tz: tzinfo | None) -> None:
    if tz is None or "timestamp" not in df.columns:
        return
    stamps = df["timestamp"]
    if getattr(stamps.dt, "tz", None) is None:
        # the hour a DST fall-back repeats resolves by the order of the rows, as read_csv resolves it
        df["timestamp"] = localize_by_order(stamps, tz).as_unit("ns").array
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
    _check_file(path)
    fmt = detect_format(path)
    as_columns = False
    if fmt == "csv":
        df, as_columns = _read_csv_any(path, wanted, zone)
    elif fmt == "parquet":
        df = _read_parquet(path)
        _set_zone(df, zone)
    else:
        df = _read_jsonl(path, zone)
        _set_zone(df, zone)
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
