"""What every recording format shares: the format names, the file checks, ``tz=`` arguments, line writers."""

from __future__ import annotations

import os
from datetime import datetime, tzinfo
from pathlib import Path
from typing import IO, Literal, Protocol

from smiquery.errors import InvalidTimeZoneError, ParseError, RecordingError
from smiquery.frames import SkippedLines
from smiquery.sample import GpuSample

__all__ = [
    "NS_MAX",
    "NS_MIN",
    "Drops",
    "LineWriter",
    "RecordingFormat",
    "SampleWriter",
    "check_file",
    "detect_format",
    "resolve_zone",
]

RecordingFormat = Literal["csv", "jsonl", "parquet"]

_SUFFIXES: dict[str, RecordingFormat] = {
    **dict.fromkeys((".csv", ".txt", ".log"), "csv"),
    **dict.fromkeys((".jsonl", ".ndjson", ".json"), "jsonl"),
    **dict.fromkeys((".parquet", ".pq"), "parquet"),
}

#: What datetime64[ns] can hold: a timestamp outside is a garbled year.
NS_MIN, NS_MAX = datetime(1677, 9, 22), datetime(2262, 4, 11)


def resolve_zone(tz: tzinfo | str | None) -> tzinfo | None:
    """The zone a ``tz=`` argument names: a ``tzinfo`` as given, an IANA name (``"Europe/Berlin"``), or None.

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


def detect_format(path: str | os.PathLike[str]) -> RecordingFormat:
    """The recording format from the file name (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``/``.pq``).

    An unknown suffix is sniffed: ``PAR1`` means Parquet, a first character ``{`` JSONL, anything else CSV.

    Raises:
        RecordingError: the file cannot be opened.
    """
    known = _SUFFIXES.get(Path(path).suffix.lower())
    if known is not None:
        return known
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError as exc:
        raise RecordingError(f"cannot read recording {os.fspath(path)}: {exc.strerror or exc}") from exc
    if head.startswith(b"PAR1"):
        return "parquet"
    return "jsonl" if head.startswith(b"{") else "csv"


def check_file(path: str, error: type[RecordingError] = RecordingError) -> None:
    """Fail early, with what to do, when ``path`` is no file or an empty one (raise ``error``)."""
    if not os.path.isfile(path):
        raise error(f"recording {path} not found; record one with `smiquery stream --output FILE`")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise error(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    if size == 0:
        raise error(f"recording {path} is empty; a recording holds nvidia-smi's CSV header and rows")


class Drops:
    """Counts the lines a reader skips, keeping the first one's error; call it with each."""

    def __init__(self) -> None:
        self.count = 0
        self.first: ParseError | None = None

    def __call__(self, err: ParseError) -> None:
        """Count one skipped line."""
        self.count += 1
        self.first = self.first or err

    def skipped(self) -> SkippedLines | None:
        """What was skipped, for ``attrs["skipped"]``; None when nothing was."""
        return None if self.first is None else SkippedLines.after(self.count, self.first)


class SampleWriter(Protocol):
    """Something that takes samples one at a time and can be closed."""

    def write(self, sample: GpuSample) -> None:
        """Write one sample."""
        ...

    def close(self) -> None:
        """Flush and release the output."""
        ...


class LineWriter:
    """Writes whole lines to the text stream ``out``, one write call each, flushed per line when ``flush``.

    It closes ``out`` on :meth:`close` when it ``owns`` it.
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
