"""Parquet recordings: a dataset folder of closed parts (:class:`ParquetDataset`); single files are read too.

``stream --output run.parquet`` writes a dataset (docs/recording.md): ``_smiquery.json`` (the metadata), closed
``part-000001.parquet`` files and ``_open.jsonl``, the journal of the part being recorded (a Parquet file is
readable only once its footer is written). Closing a part renames the journal ``_closing-N.jsonl`` first, so a
crash while it closes leaves either the journal or the part, never both read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import tzinfo
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smiquery.clock import Localizer
from smiquery.errors import RecordingError, ReplayError, UsageError
from smiquery.fields import Field
from smiquery.frames import missing_reasons, to_dataframe
from smiquery.recordings.base import concat_frames, with_gpu0
from smiquery.recordings.jsonl import read_jsonl, read_jsonl_samples, sample_from_json
from smiquery.recordings.recorder import (
    FULL_DISK,
    META,
    Policy,
    TextRecorder,
    check_columns,
    check_target,
    prune_rotated,
    read_meta,
    write_meta,
    zone_name,
)
from smiquery.sample import GpuSample

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ParquetDataset",
    "dataset_files",
    "is_dataset",
    "read_dataset",
    "read_parquet",
    "read_parquet_samples",
    "write_frame",
]


def write_frame(df: pd.DataFrame, path: Path, schema: Any = None) -> Any:
    """Write a frame as :func:`to_dataframe` gives it to the Parquet file ``path``, with the attrs pandas restores.

    Its columns take the types of ``schema`` where they fit them; returns the schema written, without metadata.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    missing = {c: {str(k): v for k, v in m.items()} for c, m in missing_reasons(df).items()}
    attrs = {"fields": df.attrs.get("fields"), "units": df.attrs.get("units"), "missing": missing}
    df.attrs = {}
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = {**(table.schema.metadata or {}), b"PANDAS_ATTRS": json.dumps(attrs).encode("utf-8")}
    if schema is not None:
        with contextlib.suppress(pa.ArrowInvalid, ValueError, TypeError):
            table = table.cast(schema)  # other types than the first part: still a readable part
    pq.write_table(table.replace_schema_metadata(meta), path)  # the cast dropped pandas' dtypes: put back
    return table.schema.remove_metadata()


def read_parquet(path: str, *, error: type[RecordingError] = RecordingError) -> pd.DataFrame:
    """A Parquet recording as a DataFrame, with ``attrs["missing"]`` as :func:`to_dataframe` gives it.

    Raises RecordingError (or ``error``) without pyarrow, or for a file that is no Parquet file.
    """
    import pandas as pd

    try:
        df = pd.read_parquet(path)
    except ImportError as exc:
        raise error("reading Parquet needs pyarrow: pip install 'smiquery[parquet]'") from exc
    except (OSError, ValueError) as exc:
        raise error(f"cannot read Parquet recording {path}: {exc}") from exc
    df.attrs["missing"] = missing_reasons(df)
    return df


def read_parquet_samples(path: str, tz: tzinfo | None) -> Iterator[GpuSample]:
    """The samples of a Parquet recording in row order, each read as its JSONL line would be.

    ``tz`` is the zone of timestamps recorded without one (those with one are converted); None: as recorded. A
    missing value keeps its recorded reason (default ``not_available``). Raises ReplayError as :func:`read_parquet`.
    """
    import pandas as pd

    df = read_parquet(path, error=ReplayError)
    recorded = df.attrs.get("fields")
    names = [str(n) for n in (recorded if isinstance(recorded, list) and len(recorded) == len(df.columns) else df)]
    reasons = missing_reasons(df)
    by_row: dict[int, dict[str, str]] = {}
    for name, col in zip(names, df.columns, strict=True):
        for row, why in (reasons.get(col) or reasons.get(name) or {}).items():
            by_row.setdefault(int(row), {})[name] = str(why)
    localizer = Localizer(tz) if tz is not None else None
    columns = [df[col].tolist() for col in df.columns]
    for i, values in enumerate(zip(*columns, strict=True)):
        obj: dict[str, Any] = {
            n: None if v is None or v is pd.NA or v is pd.NaT or v != v else v
            for n, v in zip(names, values, strict=True)
        }
        obj["_missing"] = by_row.get(i)
        yield sample_from_json(obj, tz=tz, localizer=localizer)


JOURNAL = "_open.jsonl"
_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
_CLOSING_RE = re.compile(r"^_closing-(\d+)\.jsonl$")


def is_dataset(path: str | os.PathLike[str]) -> bool:
    """True for a folder ``smiquery stream --output X.parquet`` wrote (it holds ``_smiquery.json``)."""
    return os.path.isfile(os.path.join(path, META))


def _numbered(root: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """A dataset folder's closed parts and closing journals, by number."""
    parts: dict[int, Path] = {}
    closing: dict[int, Path] = {}
    for p in root.iterdir():
        if m := _PART_RE.match(p.name):
            parts[int(m.group(1))] = p
        elif m := _CLOSING_RE.match(p.name):
            closing[int(m.group(1))] = p
    return parts, closing


def dataset_files(path: str | os.PathLike[str]) -> tuple[list[Path], list[Path]]:
    """(closed parts, journals still to read: a closing one whose part is missing, the open one), oldest first."""
    root = Path(path)
    parts, closing = _numbered(root)
    journals = [closing[n] for n in sorted(closing) if n not in parts]
    if (root / JOURNAL).is_file():
        journals.append(root / JOURNAL)
    return [parts[n] for n in sorted(parts)], journals


def read_dataset(path: str, *, error: type[RecordingError] = RecordingError) -> pd.DataFrame:
    """A dataset folder as one DataFrame: its parts in order, then the rows of the journals.

    Raises RecordingError (or ``error``) when it holds no readable row, or a part is no Parquet file.
    """
    parts, journals = dataset_files(path)
    frames = [read_parquet(os.fspath(p), error=error) for p in parts]
    for j in journals:
        if os.path.getsize(j) == 0:
            continue
        try:
            frames.append(read_jsonl(os.fspath(j), None))
        except RecordingError:
            continue  # a journal of only a torn line: nothing to add
    if not frames:
        raise error(f"recording {path} holds no readable rows yet")
    return concat_frames(frames)


class ParquetDataset:
    """Records samples into a dataset folder (see the module): a JSONL journal, closed into Parquet parts.

    Takes :class:`~smiquery.recordings.recorder.TextRecorder`'s arguments (``rotate_bytes`` counts the journal's
    bytes, ``rotate_seconds`` defaults to an hour, ``keep`` counts parts), and closes a part at ``part_rows`` rows.
    Raises UsageError (it exists and ``policy`` is ``"new"``, it is a file or another folder, or has other
    columns), RecordingError (the folder cannot be made or written) or RuntimeError (no pyarrow).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: Sequence[Field],
        *,
        policy: Policy = "new",
        rotate_bytes: int | None = None,
        rotate_seconds: float | None = None,
        keep: int | None = None,
        flush_every: float = 10.0,
        part_rows: int = 50_000,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rules: Sequence[str] = (),
    ) -> None:
        try:
            import pyarrow  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("writing Parquet needs pyarrow: pip install 'smiquery[parquet]'") from exc
        self.path = Path(path)
        self.fields = tuple(fields)
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds if rotate_seconds is not None else 3600.0
        self.keep = keep
        self.part_rows = part_rows
        self.say = say or (lambda line: None)
        self.clock = clock
        self._flush_every = flush_every
        self._closed = False
        self._reopen = False
        self._schema: Any = None
        self._zone_due = True
        if check_target(self.path, policy):
            self._take_over(policy)
        try:
            self.path.mkdir(exist_ok=True)
            names = [f.name for f in self.fields]
            write_meta(self.path / META, {"format": "smiquery-parquet-dataset", "version": 1, "fields": names}, rules)
        except OSError as exc:
            raise RecordingError(f"cannot write {self.path}: {(exc.strerror or str(exc)).lower()}") from None
        self._roll()  # a killed recorder's open part becomes its own part, before this run's rows

    def _take_over(self, policy: Policy) -> None:
        if self.path.is_file():
            if policy == "append":
                raise UsageError(
                    f"--append: {self.path} is a single Parquet file from an older smiquery; record to another --output"
                )
            self.path.unlink()
            return
        if not is_dataset(self.path):
            raise UsageError(f"{self.path} is a folder but no smiquery recording; choose another --output")
        if policy == "force":
            for p in self.path.iterdir():
                if _PART_RE.match(p.name) or _CLOSING_RE.match(p.name) or p.name in (JOURNAL, META):
                    p.unlink()
            return
        check_columns(self.path, read_meta(self.path / META).get("fields"), self.fields)

    def reopen(self) -> None:
        """Close the open part before the next row (SIGHUP). Signal-safe."""
        self._reopen = True

    def write(self, sample: GpuSample) -> None:
        """Write one sample to the journal; close the part first when it is due."""
        j = self._journal
        due = (
            self._reopen
            or j.rows >= self.part_rows
            or (self.rotate_bytes is not None and j.size >= self.rotate_bytes)
            or (j.rows > 0 and j.age >= self.rotate_seconds)
        )
        if due:
            self._reopen = False
            self.close_part()
        self._journal.write(sample)
        if self._zone_due:  # the zone of the first row's timestamp
            self._zone_due = False
            try:
                write_meta(self.path / META, {"tz": zone_name(sample)})
            except OSError as exc:
                self.say(f"smiquery: cannot write {self.path / META}: {exc}; the recording's time zone is not recorded")

    def close_part(self) -> None:
        """Turn the journal into the next closed part (a full disk leaves the journal to a later try)."""
        self._journal.close()
        self._roll()

    def _roll(self) -> None:
        journal = self.path / JOURNAL
        if journal.exists() and journal.stat().st_size > 0:
            number = max(chain(*_numbered(self.path)), default=0) + 1
            os.replace(journal, self.path / f"_closing-{number:06d}.jsonl")
        self._close_leftovers()
        self._journal = TextRecorder(
            journal,
            self.fields,
            kind="jsonl",
            policy="append",
            flush_every=self._flush_every,
            say=self.say,
            clock=self.clock,
        )

    def _close_leftovers(self) -> None:
        """Make parts of the closing journals (also a killed recorder's, on --append)."""
        parts, closing = _numbered(self.path)
        for n in closing.keys() & parts.keys():
            closing.pop(n).unlink()  # its part was renamed into place before the kill
        for n, j in sorted(closing.items()):
            try:
                self._write_part(j, self.path / f"part-{n:06d}.parquet")
            except OSError as exc:
                if exc.errno not in FULL_DISK:
                    raise RecordingError(f"cannot write {self.path}: {(exc.strerror or str(exc)).lower()}") from None
                self.say(f"smiquery: cannot close a part of {self.path}: the disk is full; its rows stay in {j.name}")
                return
            j.unlink()
        prune_rotated(dataset_files(self.path)[0], self.keep, self.say)

    def _write_part(self, journal: Path, target: Path) -> None:
        import pyarrow.parquet as pq

        with open(journal, encoding="utf-8", errors="replace", newline="") as fh:
            samples = list(with_gpu0(read_jsonl_samples(fh, lambda err: None, None)))  # as read_jsonl reads it
        if not samples:
            return
        df = to_dataframe(samples)
        del samples
        if self._schema is None:
            parts = dataset_files(self.path)[0]
            if parts:
                self._schema = pq.read_schema(parts[0]).remove_metadata()
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            schema = write_frame(df, tmp, self._schema)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self._schema is None:
            self._schema = schema  # the first part: the types every later part takes
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @property
    def rows(self) -> int:
        """Rows in the open part."""
        return self._journal.rows

    def close(self) -> None:
        """Close the open part into a Parquet part. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.close_part()
        self._journal.close()
        journal = self.path / JOURNAL
        if journal.exists() and journal.stat().st_size == 0:
            journal.unlink()
