"""Parquet files with the columns and attrs of :func:`~smiquery.frames.to_dataframe`; written and read.

pandas and pyarrow are imported on first use.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator, Mapping
from datetime import tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smiquery.clock import Localizer
from smiquery.errors import RecordingError, ReplayError
from smiquery.frames import MissingReasons, missing_reasons, to_dataframe
from smiquery.sample import GpuSample

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ParquetWriter", "read_parquet", "read_parquet_samples", "samples_table", "write_table"]


def samples_table(samples: list[GpuSample]) -> tuple[Any, dict[str, Any], MissingReasons]:
    """Samples as an Arrow table (the columns of :func:`to_dataframe`), its ``fields``/``units`` and missing reasons."""
    import pyarrow as pa

    df = to_dataframe(samples)
    attrs = {"fields": df.attrs.get("fields"), "units": df.attrs.get("units")}
    missing = missing_reasons(df)
    df.attrs = {}
    return pa.Table.from_pandas(df, preserve_index=False), attrs, missing


def write_table(table: Any, attrs: Mapping[str, Any], missing: Mapping[str, Mapping[int, str]], path: Path) -> None:
    """Write an Arrow ``table`` to ``path`` with ``attrs`` and the ``missing`` reasons as the attrs pandas restores."""
    import pyarrow.parquet as pq

    attrs = {**attrs, "missing": {c: {str(k): v for k, v in m.items()} for c, m in missing.items()}}
    meta = {**(table.schema.metadata or {}), b"PANDAS_ATTRS": json.dumps(attrs).encode("utf-8")}
    pq.write_table(table.replace_schema_metadata(meta), path)


class ParquetWriter:
    """Records samples to one Parquet file, with the columns and ``df.attrs`` of :func:`~smiquery.frames.to_dataframe`.

    It holds every row in memory and rewrites the file (aside, then renamed over it) every ``chunk_rows`` samples
    or ``chunk_seconds`` seconds and on :meth:`close`: a crash loses at most the last chunk. For recordings left
    running use :class:`~smiquery.recordings.dataset.ParquetDataset` (what ``stream --output x.parquet`` writes).

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
        self._table: Any = None
        self._missing = MissingReasons()
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
        probe.touch()
        probe.unlink()

    def write(self, sample: GpuSample) -> None:
        """Buffer one sample; writes the file when a chunk is full."""
        self._pending.append(sample)
        if len(self._pending) >= self.chunk_rows or time.monotonic() - self._since >= self.chunk_seconds:
            self.flush()

    def flush(self) -> None:
        """Write every sample so far to the file (atomically)."""
        import pyarrow as pa

        self._since = time.monotonic()
        if self._pending:
            table, attrs, missing = samples_table(self._pending)
            self._missing = MissingReasons.concat([(0, self._missing), (self.rows, missing)])
            self._attrs = self._attrs or attrs
            if self._table is not None:
                table = pa.concat_tables([self._table, table.cast(self._table.schema)])
            self._table = table
            self.rows += len(self._pending)
            self._pending = []
        elif self._table is None or self.path.exists():
            return
        tmp = self._tmp_path()
        write_table(self._table, self._attrs, self._missing, tmp)
        os.replace(tmp, self.path)

    def _tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def close(self) -> None:
        """Write the rest and finish. Idempotent."""
        if not self._closed:
            self._closed = True
            self.flush()


def read_parquet(path: str, *, error: type[RecordingError] = RecordingError) -> pd.DataFrame:
    """A Parquet recording as a DataFrame, with ``attrs["missing"]`` as :func:`to_dataframe` gives it.

    Raises:
        RecordingError (or ``error``): pyarrow is not installed, or the file is no Parquet file.
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
    missing value keeps its recorded reason (default ``not_available``).

    Raises:
        ReplayError: pyarrow is not installed, or the file is no Parquet file.
    """
    import pandas as pd

    from smiquery.recordings.jsonl import sample_from_json

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
