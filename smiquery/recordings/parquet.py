"""Parquet recordings: the columns and attrs of :func:`~smiquery.frames.to_dataframe`; written and read.

:class:`ParquetWriter` writes them (``smiquery stream --output run.parquet``), :func:`read_parquet` reads one into
a DataFrame and :func:`read_parquet_samples` as samples. pandas and pyarrow are imported on first use.
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
from smiquery.frames import missing_reasons, to_dataframe
from smiquery.recordings.values import build_sample, field_for, typed_value
from smiquery.sample import GpuSample, Schema, Value

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ParquetWriter", "read_parquet", "read_parquet_samples", "write_table"]


def write_table(table: Any, attrs: Mapping[str, Any], missing: Mapping[str, Mapping[int, str]], path: Path) -> None:
    """Write an Arrow ``table`` to ``path`` with ``attrs`` and the ``missing`` reasons as the attrs pandas restores."""
    import pyarrow.parquet as pq

    attrs = {**attrs, "missing": {c: {str(k): v for k, v in m.items()} for c, m in missing.items()}}
    meta = {**(table.schema.metadata or {}), b"PANDAS_ATTRS": json.dumps(attrs).encode("utf-8")}
    pq.write_table(table.replace_schema_metadata(meta), path)


class ParquetWriter:
    """Records samples to one Parquet file (pandas and pyarrow are imported on first use).

    It holds every row in memory and rewrites the file: fine for short runs. For recordings left running use
    :class:`~smiquery.recordings.dataset.ParquetDataset` (what ``stream --output x.parquet`` writes).

    Samples are buffered and the file is rewritten (to a temporary name, then renamed over the target) every
    ``chunk_rows`` samples or ``chunk_seconds`` seconds, and on :meth:`close`. So the file on disk is always a
    complete, readable Parquet file, and a crash (even SIGKILL) loses at most the last unwritten chunk. Columns
    and ``df.attrs`` are those of :func:`~smiquery.frames.to_dataframe`; ``pandas.read_parquet``
    restores both.

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
        tmp = self._tmp_path()
        write_table(whole, self._attrs, self._missing, tmp)
        os.replace(tmp, self.path)

    def _tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def close(self) -> None:
        """Write the rest and finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()


def read_parquet(path: str, *, error: type[RecordingError] = RecordingError) -> pd.DataFrame:
    """A Parquet recording as a DataFrame, with ``attrs["missing"]`` as :func:`to_dataframe` gives it.

    Args:
        path: the file.
        error: the error to raise (:class:`~smiquery.errors.ReplayError` for playback).

    Raises:
        RecordingError: pyarrow is not installed, or the file is no Parquet file.
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
    """The samples of a Parquet recording, in row order.

    Args:
        path: the file.
        tz: the zone of timestamps recorded without one (those with one are converted); None: as recorded.

    Yields:
        One sample per row; a missing value keeps its recorded reason (default ``not_available``).

    Raises:
        ReplayError: pyarrow is not installed, or the file is no Parquet file.
    """
    import pandas as pd

    df = read_parquet(path, error=ReplayError)
    names = list(df.columns)
    recorded = df.attrs.get("fields")
    if isinstance(recorded, list) and len(recorded) == len(names):
        fields = [field_for(str(n)) for n in recorded]
    else:
        fields = [field_for(str(n)) for n in names]
    schema = Schema(tuple(f.name for f in fields))
    missing_attr = missing_reasons(df)
    localizer = Localizer(tz) if tz is not None else None
    columns = []
    for col in names:
        values = df[col].tolist()
        columns.append([None if v is None or v is pd.NA or v is pd.NaT or v != v else v for v in values])
    reasons_by_row: dict[int, dict[str, str]] = {}
    for fld, col in zip(fields, names, strict=True):
        for row, reason in (missing_attr.get(col) or missing_attr.get(fld.name) or {}).items():
            reasons_by_row.setdefault(int(row), {})[fld.name] = str(reason)
    for i in range(len(df)):
        row_missing = reasons_by_row.get(i, {})
        values_out: list[Value] = []
        missing: dict[str, str] = {}
        for fld, col_values in zip(fields, columns, strict=True):
            v = col_values[i]
            if v is None:
                values_out.append(None)
                missing[fld.name] = row_missing.get(fld.name, "not_available")
            else:
                values_out.append(typed_value(fld, v, tz, localizer))
        yield build_sample(schema, fields, values_out, missing)
