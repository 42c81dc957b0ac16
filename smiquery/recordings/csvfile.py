"""nvidia-smi's CSV (``--format=csv``, with or without units and header; plain logs too): written and read.

:func:`read_csv` reads a file into a DataFrame; with pyarrow, :class:`ArrowCsvReader` splits it and vectorised
kernels convert it, to the same result as the pure-Python parser.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, tzinfo
from functools import cached_property, reduce
from itertools import accumulate, islice
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, Union

from smiquery.clock import localize_by_order
from smiquery.errors import ParseError, RecordingError, ReplayError
from smiquery.fields import Field, Kind, resolve_fields
from smiquery.frames import (
    MissingReasons,
    SkippedLines,
    empty_array,
    int_array,
    local_zone,
    make_frame,
    string_dtype,
    to_dataframe,
)
from smiquery.kinds import missing_reason  # the kinds' own converters and words: both paths read a cell alike
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
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import MESSAGE_PREFIXES, CsvParser, bad_cell_reason, format_row, header_line

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ArrowCsvReader",
    "CsvSource",
    "CsvWriter",
    "csv_header",
    "read_csv",
    "read_csv_recording",
    "read_csv_samples",
]

#: What :func:`smiquery.recordings.read_csv` accepts: a path, or an open binary or text file.
CsvSource = Union[str, "os.PathLike[str]", IO[bytes], IO[str]]

#: A header line is short; reading this much is enough to find it (and any blank lines before it).
HEAD_BYTES = 1 << 20
_BLOCK_BYTES = 4 << 20  # split and converted at a time
_HEAD_ROWS = 4000  # rows of the head that decide which numeric columns pyarrow converts itself
_WORKERS = max(1, min(4, os.cpu_count() or 1))


class CsvInput:
    """A CSV input: a path (read by pyarrow itself) or the bytes of an open file."""

    def __init__(self, src: CsvSource) -> None:
        self.path: str | None = None
        if isinstance(src, (str, os.PathLike)):
            self.path = os.fspath(src)
        else:
            raw = src.read()
            # surrogatepass: a str that holds lone surrogates still becomes bytes (undecodable ones, replaced later).
            self.data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)

    @cached_property
    def head(self) -> bytes:
        """The first :data:`HEAD_BYTES` of the input."""
        if self.path is None:
            return self.data[:HEAD_BYTES]
        with open(self.path, "rb") as f:
            return f.read(HEAD_BYTES)

    @cached_property
    def data(self) -> bytes:
        """The whole input (read once, on first use)."""
        return Path(self.path or "").read_bytes()


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class CsvLayout(NamedTuple):
    """What the probe of the first lines found: fields, units, header and how many lines precede the data."""

    fields: tuple[Field, ...]
    units: tuple[str, ...]
    header: list[str] | None
    skip: int

    def data_lines(self, data: bytes, *, notices: bool = False) -> Iterator[tuple[int, str, bool]]:
        """(line number, line, fits) of every row the reader keeps and every row of the wrong width.

        With ``notices``, the notice lines the reader sets aside instead.
        """
        ncols = len(self.fields)
        for lineno, raw in enumerate(data.splitlines(), 1):
            line = _decode(raw)
            if lineno <= self.skip or not line.strip():
                continue
            cells = line.split(",")
            notice = (len(cells) != ncols or ncols == 1) and line.startswith(MESSAGE_PREFIXES)
            if notices or notice:
                if notices and notice:
                    yield lineno, line, True
                continue
            fits = len(cells) == ncols
            if not fits or self.header is None or [c.strip() for c in cells] != self.header:
                yield lineno, line, fits


def probe_layout(src: CsvInput, fields: Sequence[str | Field] | None, tz: tzinfo) -> CsvLayout | None:
    """Read the first non-blank line with the strict parser: a header, or the first row of headerless output.

    Returns None when the input holds no non-blank line.
    """
    probe = CsvParser(fields, tz=tz)
    for n, raw in enumerate(src.head.splitlines(), 1):
        line = _decode(raw)
        if not line.rstrip("\r\n\t "):
            probe.feed(line)
            continue
        notices = len(probe.notices)
        sample = probe.feed(line)  # raises ParseError for a bad first row or a header that does not fit
        if sample is None and len(probe.notices) == notices:
            return CsvLayout(probe.fields, probe.units, [c.strip() for c in line.split(",")], n)
        return CsvLayout(probe.fields, probe.units, None, 0)
    return CsvLayout(probe.fields, probe.units, None, 0) if probe.fields else None


class _BadCells(Exception):
    """The cells of one column the converter rejects, at their rows in the block: all found in one pass."""

    def __init__(self, rows: list[int], cell: str, fld: Field) -> None:
        super().__init__(rows, cell, fld.name)
        self.rows = rows
        self.why = bad_cell_reason(fld, cell)


# Why cells of one column are missing: (row positions in the block, reason codes, reason words).
_Why = tuple[Any, Any, tuple[str, ...]]


class _Block(NamedTuple):
    """A converted block: a part per column, why cells are missing (by attr), rows kept, rows dropped, and why."""

    parts: list[Any]
    reasons: dict[str, _Why]
    rows: int
    bad: list[int]
    why: str


class ArrowCsvReader:
    """The fast path of :func:`read_csv`: pyarrow splits the file into blocks, threads convert them.

    Blocks are converted column by column (Arrow releases the GIL) and a block's text is freed once converted.
    Numeric columns whose first rows hold plain numbers and ``[N/A]`` only are converted by the CSV reader itself,
    the cheapest way; the rest is read as text and converted here. When a typed column meets anything else further
    on (a status token, a unit, a bad value), the read starts again with that column as text.
    """

    def __init__(self, src: CsvInput, layout: CsvLayout, tz: tzinfo, out_tz: tzinfo | None) -> None:
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

    def read(self) -> pd.DataFrame:
        """The whole file as a frame; a numeric column meeting an odd cell is read again as text."""
        pa, src = self.pa, self.src
        typed = self._typed_from_head()
        cleaned = False
        while True:
            try:
                if src.path is None:
                    return self._read(pa.BufferReader(src.data), typed)
                # Opened as a plain stream: given a path, pyarrow would also decompress ``.gz`` files by name.
                with pa.input_stream(src.path, compression=None) as stream:
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
                if "UTF8" in message and not cleaned:
                    # Undecodable bytes: read again with U+FFFD in their place, as the line parser would.
                    src.data, src.path, cleaned = _decode(src.data).encode("utf-8"), None, True
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
        head = self.src.head
        lines = head.splitlines()
        if len(head) >= HEAD_BYTES:
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
        if text.startswith(MESSAGE_PREFIXES):
            self.notices.append(text.rstrip("\r\n"))
        elif text.strip():
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
            self.notices = [line for _, line, _ in layout.data_lines(self.src.data, notices=True)]
        batches: list[Any] = table.to_batches()
        del table  # from here on, a block's text is freed as soon as the block is converted
        batches.reverse()
        blocks: list[_Block] = []
        pending: deque[Future[_Block]] = deque()
        with ThreadPoolExecutor(_WORKERS) as pool:
            while batches or pending:
                if batches:
                    columns = self._drop_non_rows(list(batches.pop().columns))
                    pending.append(pool.submit(self._convert_block, columns))
                    del columns
                    if len(pending) <= _WORKERS and batches:
                        continue
                blocks.append(pending.popleft().result())
        skipped = self._skipped(blocks)
        if skipped is not None and not any(b.rows for b in blocks):
            raise skipped.unreadable()
        return self._assemble(blocks, skipped)

    def _skipped(self, blocks: list[_Block]) -> SkippedLines | None:
        """What was skipped: rows of the wrong width (the reader's handler) and rows with a bad cell."""
        count = self.misfits + sum(len(b.bad) for b in blocks)
        if not count:
            return None
        data = self.src.data
        found: list[tuple[int, str, str]] = []
        misfits = ((n, line) for n, line, fits in self.layout.data_lines(data) if not fits)
        misfit = next(misfits, None) if self.misfits else None
        if misfit is not None:
            found.append((*misfit, f"expected {len(self.layout.fields)} columns, got {len(misfit[1].split(','))}"))
        starts = accumulate((b.rows + len(b.bad) for b in blocks), initial=0)  # rows as read before each block
        first = next(((start + b.bad[0], b.why) for start, b in zip(starts, blocks, strict=False) if b.bad), None)
        if first is not None:
            rows = ((n, line) for n, line, fits in self.layout.data_lines(data) if fits)
            found.append((*next(islice(rows, first[0], None), (0, "")), first[1]))
        lineno, line, reason = min(found) if found else (0, "", "")
        return SkippedLines(count, lineno, line[:80], reason)

    def _assemble(self, blocks: list[_Block], skipped: SkippedLines | None = None) -> pd.DataFrame:
        import numpy as np

        offsets = np.cumsum([0] + [b.rows for b in blocks])
        out: list[Any] = []
        for i, fld in enumerate(self.layout.fields):
            parts = [block.parts[i] for block in blocks]
            for block in blocks:
                block.parts[i] = None  # each block's part is freed once the column is whole
            out.append(self._concat(parts, fld))
            del parts
            self.pa.default_memory_pool().release_unused()
        missing = MissingReasons.concat(
            (int(offset), MissingReasons(b.reasons)) for offset, b in zip(offsets, blocks, strict=False)
        )
        return make_frame(self.layout.fields, out, missing, self.notices, skipped)

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
            notice = reduce(pc.or_, [pc.starts_with(first, prefix) for prefix in MESSAGE_PREFIXES])
            if pc.any(notice).as_py():
                self.notices.extend(pc.filter(first, notice).to_pylist())
            odd = pc.or_(notice, pc.equal(pc.ascii_trim_whitespace(first), ""))
            keep = pc.invert(odd) if keep is None else pc.and_(keep, pc.invert(odd))
        if keep is None or pc.all(keep).as_py():
            return columns
        return [pc.filter(c, keep) for c in columns]

    def _convert_block(self, columns: list[Any]) -> _Block:
        """One block's cells (per field: text, or numbers the reader converted) -> a :class:`_Block`.

        A row with a cell that does not fit its field (a garbled line) is dropped and the block converted again.
        """
        import numpy as np

        pa, pc = self.pa, self.pc
        layout = self.layout
        bad: list[int] = []
        first_why: tuple[int, str] | None = None  # the first bad row (as read) and what is wrong with it
        positions: Any = None  # current row -> row in the block as read, once rows were dropped
        while True:
            parts: list[Any] = []
            reasons: dict[str, _Why] = {}
            try:
                for i, fld in enumerate(layout.fields):
                    raw = columns[i]
                    if raw.type == pa.string():
                        values, why = self._convert(pc.ascii_trim_whitespace(raw), fld, layout.units[i])
                    else:
                        values, why = raw, None
                        if raw.null_count:  # the reader typed this column: each null was [N/A]
                            nulls = pc.indices_nonzero(pc.is_null(raw)).to_numpy()
                            why = nulls, np.zeros(len(nulls), dtype=np.int16), ("not_available",)
                    del raw
                    parts.append(self._part(values, fld))
                    if why is not None:
                        reasons[fld.attr] = why
            except _BadCells as exc:
                if positions is None:
                    positions = np.arange(len(columns[0]))
                dropped = positions[exc.rows]
                bad.extend(int(p) for p in dropped)
                if first_why is None or int(dropped[0]) < first_why[0]:
                    first_why = (int(dropped[0]), exc.why)
                keep = np.ones(len(positions), dtype=bool)
                keep[exc.rows] = False
                positions = positions[keep]
                mask = pa.array(keep)
                columns = [pc.filter(c, mask) for c in columns]
                continue
            break
        rows = len(columns[0])
        del columns
        # Hand the block's scratch memory back to the OS: NumPy (which holds the converted parts) cannot reuse it.
        pa.default_memory_pool().release_unused()
        return _Block(parts, reasons, rows, sorted(bad), "" if first_why is None else first_why[1])

    def _convert(self, col: Any, fld: Field, unit: str) -> tuple[Any, _Why | None]:
        """One trimmed text column of a block -> (typed Arrow array, why cells are missing)."""
        pc = self.pc
        kind = fld.kind
        # A cast that fails costs fifty times one that succeeds (Arrow builds the error), so the one-cast path
        # is taken only for a column that shows no unit and no status token.
        suffixed = bool(unit) and kind is not Kind.STR and pc.any(pc.ends_with(col, " " + unit)).as_py()
        if kind.is_numeric and not suffixed and not pc.any(pc.starts_with(col, "[")).as_py():
            typed = kind.ops.arrow_cast(col)
            if typed is not None:
                return typed, None
        col, reasons = self._tokens(col)
        if suffixed:
            # token cells are null by now: all() skips them
            has = pc.ends_with(col, " " + unit)
            stripped = pc.utf8_slice_codeunits(col, 0, -len(unit) - 1)
            col = stripped if pc.all(has).as_py() else pc.if_else(has, stripped, col)
        typed = kind.ops.arrow_cast(col)
        return (self._python_chunk(col, fld) if typed is None else typed), reasons

    def _tokens(self, col: Any) -> tuple[Any, _Why | None]:
        """``col`` with its status-token cells (``[...]``, bare ``N/A``, empty) null, and why they are missing."""
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
            return col, None
        rows = pc.indices_nonzero(token).to_numpy()
        encoded = pc.dictionary_encode(pc.filter(col, token))
        words = tuple(missing_reason(t) or t for t in encoded.dictionary.to_pylist())
        reasons = rows, encoded.indices.to_numpy(zero_copy_only=False), words
        return pc.if_else(token, pa.scalar(None, pa.string()), col), reasons

    def _python_chunk(self, col: Any, fld: Field) -> Any:
        """Convert a column cell by cell with the parser's own converter (rare: odd values, or a bad one)."""
        pa = self.pa
        convert: Callable[[str], Any] = fld.kind.ops.converter(self.tz)
        storage = fld.kind.ops.storage
        values: list[Any] = []
        bad: list[int] = []
        for row, cell in enumerate(col.to_pylist()):
            try:
                value = None if cell is None else convert(cell)
                if storage == "timestamp" and value is not None:
                    # wall-clock time in the reader's zone, like the fast path (localised with the rest in _concat)
                    value = value.astimezone(self.tz).replace(tzinfo=None)
                    if not NS_MIN <= value <= NS_MAX:
                        raise ValueError("outside datetime64[ns]")
            except Exception:  # any converter failure means the cell does not fit the field
                bad.append(row)
                value = None
            values.append(value)
        if bad:
            raise _BadCells(bad, col[bad[0]].as_py(), fld)
        if storage == "int":
            try:
                return pa.array(values, pa.int64())
            except (OverflowError, pa.ArrowInvalid):
                return pa.array(values, pa.uint64())  # a bitmask with the top bit set
        if storage == "timestamp":
            return pa.array(values, pa.timestamp("us")).cast(pa.timestamp("ns"))
        return pa.array(values, {"float": pa.float64(), "bool": pa.bool_()}.get(storage, pa.string()))

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
            return empty_array(fld, self.out_tz)
        if storage == "timestamp":
            naive = pd.DatetimeIndex(np.concatenate(parts) if len(parts) > 1 else parts[0])
            del parts
            if self.out_tz is None:
                return naive.as_unit("ns").array  # as recorded: nvidia-smi prints wall-clock time with no zone
            # the hour a DST fall-back repeats resolves by the order of the rows: the second 02:30 is later
            return localize_by_order(naive, self.out_tz).as_unit("ns").array
        if storage != "string":
            if len({p.dtype for p in parts}) > 1:  # Int64 blocks and a UInt64 one (a bitmask with the top bit set)
                return int_array([v for p in parts for v in p.tolist()])
            return parts[0] if len(parts) == 1 else type(parts[0])._concat_same_type(parts)
        return string_dtype().__from_arrow__(self.pa.chunked_array(parts, self.pa.string()))


class CsvWriter(LineWriter):
    """Writes samples (of ``fields``, in order) in nvidia-smi's ``--format=csv`` layout: header with units, rows."""

    def __init__(self, out: IO[str], fields: Sequence[Field], *, owns: bool = False) -> None:
        super().__init__(out, owns=owns)
        self.fields = tuple(fields)
        self._header_done = False

    def header(self) -> None:
        """Write the header now (it is otherwise written with the first row)."""
        if not self._header_done:
            self._header_done = True
            self._line(header_line(self.fields) + "\n")

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one complete line (a single write call; the header with the first)."""
        head = "" if self._header_done else header_line(self.fields) + "\n"
        self._header_done = True
        self._line(head + format_row(sample, self.fields, units=True) + "\n")


def csv_header(path: str | os.PathLike[str]) -> tuple[str, ...] | None:
    """The field names of a CSV recording's header line (read from its head only); None for no header or line.

    Raises RecordingError when it cannot be read.
    """
    try:
        layout = probe_layout(CsvInput(path), None, RECORDED_WITHOUT_ZONE)
    except ParseError:
        return None  # the first line is a row: no header
    except OSError as exc:
        raise RecordingError(f"cannot read recording {os.fspath(path)}: {exc.strerror or exc}") from exc
    return None if layout is None or layout.header is None else tuple(f.name for f in layout.fields)


def read_csv(
    path_or_buffer: CsvSource, fields: str | Sequence[str | Field] | None = None, *, tz: tzinfo | str | None = None
) -> pd.DataFrame:
    """Read a recorded ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` file into a DataFrame.

    The columns, dtypes and ``attrs`` of :func:`to_dataframe`, plus ``attrs["notices"]`` (driver notice lines such
    as ``WARNING: infoROM is corrupted...``), one row per readable data line. Unreadable lines (a killed
    recorder's torn last line, a garbled line, a row of the wrong width or with a value that does not fit) are
    skipped and counted in ``attrs["skipped"]`` (a :class:`~smiquery.recordings.SkippedLines`). With pyarrow
    (``smiquery[fast]``) vectorised kernels convert it; without, :class:`~smiquery.sources.query_gpu.CsvParser`
    (same result, slower; but past 4,000 rows the fast path reads a ``0x`` number in an integer column as hex).

    Args:
        path_or_buffer: a path, or an open file in binary or text mode.
        fields: the queried fields (names, aliases, a preset or a comma list), required for ``noheader``
            output; a header must match them.
        tz: the zone the recording was made in (a ``tzinfo`` or an IANA name): timestamps become aware in it.
            Default: naive (``datetime64[ns]``), nvidia-smi's wall-clock time exactly as recorded.

    Raises ParseError when there is neither a header nor ``fields``, or the header does not match ``fields``;
    InvalidFieldError or ValueError for an unknown name in ``fields`` or ``tz``.
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
    lines = [_decode(raw) for raw in src.data.splitlines()]
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
    """A CSV recording by its header, else by ``fields`` (a headerless log's columns); and whether ``fields`` did.

    Raises RecordingError: no header and no ``fields``, rows that do not fit ``fields``, or no readable row.
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
    """The samples of an open CSV recording (``source`` names it), line by line; unreadable ones go to ``on_drop``.

    ``columns``: a headerless log's, in order; ``tz``: the timestamps' zone (None: naive, as recorded). Raises
    ReplayError for no header and no ``columns``, or a header that does not fit ``columns``.
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
