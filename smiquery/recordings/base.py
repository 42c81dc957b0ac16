"""What every recording format shares: format names, file checks, zones, skipped lines, line writers, GPU 0."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import IO, Literal, Protocol

from smiquery.clock import Localizer, to_zone
from smiquery.errors import InvalidTimeZoneError, ParseError, RecordingError
from smiquery.fields import get_field
from smiquery.frames import SkippedLines
from smiquery.sample import GpuSample, Schema

__all__ = [
    "NS_MAX",
    "NS_MIN",
    "RECORDED_WITHOUT_ZONE",
    "Drops",
    "LineWriter",
    "RecordingFormat",
    "SampleWriter",
    "check_file",
    "detect_format",
    "in_zone",
    "resolve_zone",
    "with_gpu0",
    "with_timestamp",
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


#: The parser needs a zone for a timestamp written without one; this one marks "none was recorded", so that such
#: a timestamp can be given back naive (or put in the zone named by ``tz=``). A named UTC: never ``timezone.utc``.
RECORDED_WITHOUT_ZONE = timezone(timedelta(0), "no zone recorded")


def in_zone(dt: datetime, tz: tzinfo | None, localize: Localizer | None = None) -> datetime:
    """A parsed timestamp as the caller asked: naive as recorded, localized to ``tz``, or converted to ``tz``.

    ``localize`` (a :class:`~smiquery.clock.Localizer` for ``tz`` over the recording's rows in order) resolves the
    hour a DST fall-back repeats by that order; without one such a time is the first of its two instants.
    """
    if dt.tzinfo is RECORDED_WITHOUT_ZONE or dt.tzinfo is None:
        if tz is None:
            return dt.replace(tzinfo=None)  # the wall-clock time, naive, exactly as recorded
        return localize(dt) if localize is not None else dt.replace(tzinfo=tz)
    return dt if tz is None else to_zone(dt, tz)


def with_timestamp(sample: GpuSample, ts: datetime, *, keep_raw: bool = False) -> GpuSample:
    """The sample with another timestamp; its raw text too unless ``keep_raw`` (the same instant, as recorded)."""
    schema = sample.schema
    pos = schema.pos_timestamp
    if pos is None:
        return sample
    values = list(sample.values())
    values[pos] = ts
    raw = tuple(sample.raw.values())
    if not keep_raw:
        raw = (*raw[:pos], get_field("timestamp").format(ts), *raw[pos + 1 :])
    return GpuSample(schema, tuple(values), raw, dict(sample.missing) or None, sample.gpu_lost)


def with_gpu0(samples: Iterable[GpuSample]) -> Iterator[GpuSample]:
    """The samples, each with an ``index`` column: a single-GPU log (``timestamp, power.draw``) is GPU 0."""
    gpu0: dict[tuple[str, ...], Schema] = {}
    for sample in samples:
        if "index" in sample:
            yield sample
            continue
        schema = gpu0.get(sample.fields)
        if schema is None:
            schema = gpu0[sample.fields] = Schema(("index", *sample.fields))
        yield GpuSample(
            schema,
            (0, *(sample[n] for n in sample.fields)),
            ("0", *sample.raw.values()),
            dict(sample.missing) or None,
            sample.gpu_lost,
        )


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
