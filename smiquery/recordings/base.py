"""What every recording format shares: the format names, the file checks, ``tz=`` arguments and skipped lines."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import IO, Literal, Protocol

from smiquery.errors import InvalidTimeZoneError, ParseError, RecordingError
from smiquery.sample import GpuSample

__all__ = [
    "NS_MAX",
    "NS_MIN",
    "LineWriter",
    "RecordingFormat",
    "SampleWriter",
    "SkippedLines",
    "check_file",
    "detect_format",
    "resolve_zone",
]

RecordingFormat = Literal["csv", "jsonl", "parquet"]

#: What datetime64[ns] can hold: a timestamp outside is a garbled year.
NS_MIN, NS_MAX = datetime(1677, 9, 22), datetime(2262, 4, 11)


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


@dataclass(frozen=True)
class SkippedLines:
    """Lines of a recording that readers skipped: torn (a killed recorder's last line), garbled or not fitting.

    Attributes:
        count: how many lines were skipped.
        first_lineno: the line number (1-based) of the first one.
        first_line: that line's text (cut to 80 characters).
        reason: what is wrong with that line (``field 'memory.used': '7.5' is not a valid integer``), or "".
    """

    count: int
    first_lineno: int
    first_line: str = ""
    reason: str = ""

    @classmethod
    def after(cls, count: int, first: ParseError) -> SkippedLines:
        """``count`` skipped lines, the first of them the one ``first`` rejected."""
        why = first.reason if first.field is None else f"field {first.field!r}: {first.reason}"
        return cls(count, first.lineno, (first.line or "")[:80], why)

    def message(self, name: str = "the recording") -> str:
        """One line for a warning: ``skipped 2 unreadable lines in run.csv (first: line 316: ...)``.

        Args:
            name: how to call the recording (its path).

        Returns:
            The sentence, without a trailing period.
        """
        lines = "line" if self.count == 1 else "lines"
        why = f": {self.reason}" if self.reason else ""
        return f"skipped {self.count} unreadable {lines} in {name} (first: line {self.first_lineno}{why})"

    def unreadable(self) -> ParseError:
        """The error for a recording whose every row was skipped."""
        why = self.reason or "does not fit the header"
        return ParseError(
            f"no readable rows ({self.count} line(s) skipped, this one first): {why}",
            lineno=self.first_lineno,
            line=self.first_line,
        )


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


def check_file(path: str, error: type[RecordingError] = RecordingError) -> None:
    """Fail early, with what to do, when ``path`` is no file or an empty one.

    Args:
        path: the recording.
        error: the error to raise (:class:`~smiquery.errors.ReplayError` for playback).

    Raises:
        RecordingError: the file is missing, unreadable or empty.
    """
    if not os.path.isfile(path):
        raise error(f"recording {path} not found; record one with `smiquery stream --output FILE`")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise error(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    if size == 0:
        raise error(f"recording {path} is empty; a recording holds nvidia-smi's CSV header and rows")


class SampleWriter(Protocol):
    """Something that takes samples one at a time and can be closed."""

    def write(self, sample: GpuSample) -> None:
        """Write one sample."""
        ...

    def close(self) -> None:
        """Flush and release the output."""
        ...


class LineWriter:
    """Writes whole lines, one write call each, flushed per line when asked; closes ``out`` when it owns it.

    Args:
        out: a text stream.
        flush: flush after every line.
        owns: close ``out`` on :meth:`close`.
    """

    def __init__(self, out: IO[str], *, flush: bool = True, owns: bool = False) -> None:
        self.out = out
        self.flush = flush
        self.owns = owns

    def _line(self, text: str) -> None:
        self.out.write(text)
        if self.flush:
            self.out.flush()

    def close(self) -> None:
        """Flush (and close the file when it was opened for this writer)."""
        try:
            self.out.flush()
        finally:
            if self.owns:
                self.out.close()
