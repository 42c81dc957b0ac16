"""What every recording format shares: format names, file checks, zones, skipped lines, line writers, GPU 0.

And sets: several files read as one recording (a rotated ``run*.csv``, a list of files, a dataset's parts).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta, timezone, tzinfo
from itertools import accumulate
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from smiquery.clock import Localizer, to_zone
from smiquery.errors import InvalidTimeZoneError, ParseError, RecordingError
from smiquery.fields import get_field
from smiquery.frames import MissingReasons, SkippedLines, missing_reasons
from smiquery.sample import GpuSample, Schema

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "META_SUFFIX",
    "NS_MAX",
    "NS_MIN",
    "RECORDED_WITHOUT_ZONE",
    "Drops",
    "LineWriter",
    "RecordingFormat",
    "SampleWriter",
    "Sources",
    "check_file",
    "concat_frames",
    "detect_format",
    "expand_sources",
    "in_zone",
    "no_rows",
    "read_members",
    "resolve_zone",
    "time_order",
    "with_gpu0",
    "with_timestamp",
]

RecordingFormat = Literal["csv", "jsonl", "parquet"]

_SUFFIXES: dict[str, RecordingFormat] = {
    **dict.fromkeys((".csv", ".txt", ".log"), "csv"),
    **dict.fromkeys((".jsonl", ".ndjson", ".json"), "jsonl"),
    **dict.fromkeys((".parquet", ".pq"), "parquet"),
}

#: A recording's metadata file beside it (``run.csv.meta.json``): the recorder's time zone, the fields, the
#: ``--alert`` rules. The CSV itself stays plain nvidia-smi CSV; JSONL keeps each timestamp's offset instead.
META_SUFFIX = ".meta.json"
#: What datetime64[ns] can hold: a timestamp outside is a garbled year.
NS_MIN, NS_MAX = datetime(1677, 9, 22), datetime(2262, 4, 11)


def resolve_zone(tz: tzinfo | str | None) -> tzinfo | None:
    """The zone a ``tz=`` argument names: a ``tzinfo`` as given, an IANA name (``"Europe/Berlin"``), or None.

    Raises InvalidTimeZoneError for a name that is not an IANA zone.
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

    An unknown suffix is sniffed: ``PAR1`` means Parquet, a first character ``{`` JSONL, anything else CSV (raises
    RecordingError when the file cannot be opened).
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
    """Writes whole lines to the text stream ``out``, one write call and flush each; closes it if it ``owns`` it."""

    def __init__(self, out: IO[str], *, owns: bool = False) -> None:
        self.out = out
        self.owns = owns

    def _line(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        """Flush (and close the file when it was opened for this writer)."""
        try:
            self.out.flush()
        finally:
            if self.owns:
                self.out.close()


Sources = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

_GLOB_CHARS = frozenset("*?[")


def expand_sources(source: Sources, *, error: type[RecordingError] = RecordingError) -> list[str]:
    """The files ``source`` names (a path, a glob such as ``run*.csv``, or a list of either), each once.

    A glob's matches are sorted by name; the rest keep the order given. Raises RecordingError (or ``error``) for a
    glob that matches nothing, or no path at all.
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
    ``attrs["skipped_files"]`` (``skipped run.csv: it holds no rows``); other errors are raised, and
    RecordingError (naming the first) when no member holds a row.
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
    bare = [df.copy(deep=False) for df in frames]
    for df in bare:
        df.attrs = {}
    out: pd.DataFrame = pd.concat(bare, ignore_index=True)
    fields = list(dict.fromkeys(f for df in frames for f in df.attrs.get("fields") or []))
    out.attrs = {**frames[0].attrs, "fields": fields, "units": units, "missing": missing}
    rules = list(dict.fromkeys(r for df in frames for r in df.attrs.get("rules") or ()))
    if rules:
        out.attrs["rules"] = rules
    out.attrs.pop("skipped", None)
    if skips:
        out.attrs["skipped"] = dataclasses.replace(skips[0], count=sum(s.count for s in skips))
    return out
