"""nvidia-smi's CSV (``--format=csv``, with or without units and header; plain logs too): written and read.

:func:`read_csv` reads a file into a DataFrame (its fast path: :mod:`smiquery.recordings.csv_arrow`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, tzinfo
from typing import IO, TYPE_CHECKING

from smiquery.errors import ParseError, RecordingError, ReplayError
from smiquery.fields import Field, resolve_fields
from smiquery.frames import empty_array, local_zone, make_frame, to_dataframe
from smiquery.recordings.base import (
    NS_MAX,
    NS_MIN,
    RECORDED_WITHOUT_ZONE,
    Drops,
    LineWriter,
    in_zone,
    resolve_zone,
    with_timestamp,
)
from smiquery.recordings.csv_arrow import ArrowCsvReader, CsvInput, CsvSource, probe_layout
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser, format_row, header_line

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CsvSource", "CsvWriter", "csv_header", "read_csv", "read_csv_recording", "read_csv_samples"]

_LINE_BREAK_RE = re.compile(r"\r\n|\r|\n")


class CsvWriter(LineWriter):
    """Writes samples in nvidia-smi's own ``--format=csv`` layout: the header with units, then one line per sample.

    ``fields`` are the columns (the samples' fields, in order); the rest is :class:`LineWriter`'s.
    ``smiquery.read_csv``, ``--replay`` and :class:`~smiquery.sources.query_gpu.CsvParser` read the result back.
    """

    def __init__(self, out: IO[str], fields: Sequence[Field], *, flush: bool = True, owns: bool = False) -> None:
        super().__init__(out, flush=flush, owns=owns)
        self.fields = tuple(fields)
        self._header_done = False

    def header(self) -> None:
        """Write the header now (it is otherwise written with the first row)."""
        if not self._header_done:
            self._header_done = True
            self._line(header_line(self.fields) + "\n")

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one complete line (a single write call)."""
        line = format_row(sample, self.fields, units=True) + "\n"
        if not self._header_done:
            self._header_done = True
            line = header_line(self.fields) + "\n" + line
        self._line(line)


def csv_header(path: str | os.PathLike[str]) -> tuple[str, ...] | None:
    """The canonical field names of a CSV recording's header line, in order; None for no header (or no line).

    Only the head of the file is read. Raises RecordingError when it cannot be read.
    """
    try:
        layout = probe_layout(CsvInput(path), None, RECORDED_WITHOUT_ZONE)
    except ParseError:
        return None  # the first line is a row: no header
    except OSError as exc:
        raise RecordingError(f"cannot read recording {os.fspath(path)}: {exc.strerror or exc}") from exc
    return None if layout is None or layout.header is None else tuple(f.name for f in layout.fields)


def read_csv(
    path_or_buffer: CsvSource,
    fields: str | Sequence[str | Field] | None = None,
    *,
    tz: tzinfo | str | None = None,
) -> pd.DataFrame:
    """Read a recorded ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` file into a DataFrame.

    Gives the same columns, dtypes and ``attrs`` as :func:`to_dataframe` of the parsed records, plus
    ``attrs["notices"]`` (driver notice lines such as ``WARNING: infoROM is corrupted...``). With pyarrow
    installed (``smiquery[fast]``) the file is converted column by column with vectorised kernels; without it the
    pure-Python :class:`~smiquery.sources.query_gpu.CsvParser` reads it (same result, slower; but past the first
    4,000 rows the fast path reads a ``0x`` number in an integer column as hex, which the parser rejects).

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
    zone = out_tz if out_tz is not None else local_zone()
    src = CsvInput(path_or_buffer)
    wanted = resolve_fields(fields) if isinstance(fields, str) else fields
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.csv  # noqa: F401  (the fast path needs it; absent, fall back)
    except ImportError:
        return _read_csv_python(src, wanted, zone, out_tz)
    layout = probe_layout(src, wanted, zone)
    if layout is None:
        return make_frame((), (), {}, [])
    return ArrowCsvReader(src, layout, zone, out_tz).read()


def _parsed(parser: CsvParser, lines: Iterable[str], on_drop: Callable[[ParseError], None]) -> Iterator[GpuSample]:
    """The samples ``parser`` reads from ``lines``; the error of each line it drops goes to ``on_drop``."""
    dropped = 0
    for line in lines:
        sample = parser.feed(line)
        if parser.dropped != dropped:
            dropped = parser.dropped
            if parser.last_error is not None:
                on_drop(parser.last_error)
        if sample is not None:
            yield sample


def _read_csv_python(
    src: CsvInput, fields: Sequence[str | Field] | None, tz: tzinfo, out_tz: tzinfo | None
) -> pd.DataFrame:
    parser = CsvParser(fields, tz=tz, strict=False)
    lines = _LINE_BREAK_RE.split(src.data().decode("utf-8", "replace"))
    if lines and lines[-1] == "":
        lines.pop()
    drops = Drops()
    samples: list[GpuSample] = []
    for sample in _parsed(parser, lines, drops):
        stamp = sample.get("timestamp")
        if isinstance(stamp, datetime) and not NS_MIN <= stamp.replace(tzinfo=None) <= NS_MAX:
            # outside what datetime64[ns] holds: a garbled year
            line = lines[parser.lineno - 1]
            drops(ParseError("timestamp out of range", lineno=parser.lineno, line=line, field="timestamp"))
        else:
            samples.append(sample)
    skipped = drops.skipped()
    if not samples:
        if skipped is not None:
            raise skipped.unreadable()
        return make_frame(parser.fields, [empty_array(f, out_tz) for f in parser.fields], {}, list(parser.notices))
    try:
        df = to_dataframe(samples)
    except (OverflowError, ValueError) as exc:  # a timestamp outside datetime64[ns] (years 1677-2262)
        raise ParseError(str(exc), lineno=0, line="") from exc
    if "timestamp" in df.columns:
        stamps = df["timestamp"].dt.tz_convert(tz)  # tz is out_tz, or the zone the parser read wall times in
        df["timestamp"] = stamps.dt.tz_localize(None) if out_tz is None else stamps
    df.attrs["notices"] = list(parser.notices)
    if skipped is not None:
        df.attrs["skipped"] = skipped
    return df


def read_csv_recording(path: str, fields: Sequence[Field] | None, tz: tzinfo | None) -> tuple[pd.DataFrame, bool]:
    """A CSV recording as :func:`smiquery.recordings.read_recording` reads it: by its header, else by ``fields``.

    ``fields`` are the columns of a headerless log, in order (None: it must have a header); ``tz`` the zone it was
    made in (None: as recorded). Returns the frame, and whether ``fields`` named its columns.

    Raises:
        RecordingError: no header and no ``fields``, rows that do not fit ``fields``, or no readable row.
    """
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


def read_csv_samples(
    fh: IO[str],
    source: str,
    on_drop: Callable[[ParseError], None],
    columns: Sequence[Field] | None = None,
    tz: tzinfo | None = None,
) -> Iterator[GpuSample]:
    """The samples of an open CSV recording (``source`` names it), line by line.

    An unreadable line is skipped and its error given to ``on_drop``. ``columns`` are those of a headerless log, in
    order; ``tz`` the zone of the timestamps (None: naive, as recorded).

    Raises:
        ReplayError: no header and no ``columns``, or a header that does not fit ``columns``.
    """
    parser = CsvParser(columns, strict=False, tz=tz if tz is not None else RECORDED_WITHOUT_ZONE)
    try:
        for sample in _parsed(parser, fh, on_drop):
            ts = sample.get("timestamp")
            if isinstance(ts, datetime) and ts.tzinfo is not tz:
                sample = with_timestamp(sample, in_zone(ts, tz), keep_raw=True)
            yield sample
    except ParseError as exc:
        if columns is not None:
            raise ReplayError(f"{source}: {exc}") from exc
        raise ReplayError(
            f"{source} is not a recording smiquery can read: it has no nvidia-smi CSV header line; "
            "for a headerless (noheader) log, give its columns (columns=, or --fields on the command line)"
        ) from exc
