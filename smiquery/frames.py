"""Samples -> pandas DataFrames with nullable, catalogue-typed columns (pandas imported inside functions).

The recording readers (:mod:`smiquery.recordings`) build their frames with the same arrays and attrs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from smiquery.clock import localize_by_order
from smiquery.errors import InvalidFieldError, ParseError
from smiquery.fields import CATALOGUE, Field, Kind, get_field
from smiquery.sample import GpuSample, Value

if TYPE_CHECKING:
    import pandas as pd


__all__ = [
    "MissingReasons",
    "SkippedLines",
    "empty_array",
    "field_for",
    "int_array",
    "local_zone",
    "make_frame",
    "missing_reasons",
    "set_zone",
    "string_dtype",
    "to_dataframe",
]


@cache
def field_for(name: str) -> Field:
    """The field of a column: by nvidia-smi name or attribute name; text when not in the catalogue."""
    try:
        return get_field(name)
    except InvalidFieldError:
        by_attr = next((f for f in CATALOGUE if f.attr == name), None)
        return by_attr or Field(name, Kind.STR, help="Not in smiquery's catalogue.")


def string_dtype() -> Any:
    """The dtype of text columns: Arrow-backed when pyarrow is installed."""
    import pandas as pd

    if importlib.util.find_spec("pyarrow") is not None:
        return pd.StringDtype("pyarrow")
    return pd.StringDtype()


def local_zone() -> tzinfo:
    """The host's time zone, as an IANA zone when it can be named (pandas handles those fastest)."""
    from zoneinfo import ZoneInfo

    name = os.environ.get("TZ", "").lstrip(":")
    if not name:
        link = os.path.realpath("/etc/localtime")
        name = link.split("zoneinfo/", 1)[1] if "zoneinfo/" in link else ""
    if name:
        with contextlib.suppress(ValueError, OSError):
            return ZoneInfo(name)
    # dateutil (a pandas dependency) follows the host's DST rules even when the zone has no name.
    local: tzinfo = importlib.import_module("dateutil.tz").tzlocal()
    return local


class MissingReasons(Mapping[str, Mapping[int, str]]):
    """Why cells are missing: column -> {row position -> reason}, for the columns with a missing cell.

    Kept in ``df.attrs["missing"]``; immutable and shared, not copied, when pandas copies a frame's attrs (on
    nearly every operation). Row positions are those of the frame as read (before any filtering). ``columns``
    maps a column to (row positions, a reason code per position, the reason words), arrays or sequences.
    """

    __slots__ = ("_columns", "_dicts")

    def __init__(self, columns: Mapping[str, tuple[Any, Any, Sequence[str]]] | None = None) -> None:
        self._columns: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
            c: (rows, codes, tuple(words)) for c, (rows, codes, words) in (columns or {}).items() if len(rows)
        }
        self._dicts: dict[str, Mapping[int, str]] = {}

    @classmethod
    def from_dicts(cls, missing: Mapping[str, Mapping[Any, str]]) -> MissingReasons:
        """Build from column -> {row position (int or digit string, as a Parquet file's attrs hold it) -> reason}."""
        if isinstance(missing, MissingReasons):
            return missing
        out: dict[str, tuple[Any, Any, Sequence[str]]] = {}
        for col, reasons in missing.items():
            words: dict[str, int] = {}
            rows = [int(r) for r in reasons]
            codes = [words.setdefault(str(w), len(words)) for w in reasons.values()]
            out[str(col)] = (rows, codes, tuple(words))
        return cls(out)

    @classmethod
    def concat(cls, parts: Iterable[tuple[int, Mapping[str, Mapping[Any, str]]]]) -> MissingReasons:
        """The reasons of frames stacked in order, given as (row offset of the frame, its reasons) each."""
        import numpy as np

        compact = [(offset, cls.from_dicts(m)._columns) for offset, m in parts]
        out: dict[str, tuple[Any, Any, Sequence[str]]] = {}
        for col in dict.fromkeys(c for _, m in compact for c in m):
            found = [(offset, m[col]) for offset, m in compact if col in m]
            words = tuple(dict.fromkeys(w for _, (_, _, ws) in found for w in ws))
            code_of = {w: n for n, w in enumerate(words)}
            rows = np.concatenate([np.asarray(r, dtype=np.int64) + off for off, (r, _, _) in found])
            codes = [
                np.asarray([code_of[w] for w in ws], dtype=np.int16)[np.asarray(c, dtype=np.intp)]
                for _, (_, c, ws) in found
            ]
            out[col] = (rows, np.concatenate(codes), words)
        return cls(out)

    def __getitem__(self, column: str) -> Mapping[int, str]:
        cached = self._dicts.get(column)
        if cached is None:
            import numpy as np

            rows, codes, words = self._columns[column]
            pairs = zip(np.asarray(rows).tolist(), np.asarray(codes).tolist(), strict=True)
            cached = self._dicts[column] = MappingProxyType({r: words[c] for r, c in pairs})
        return cached

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __repr__(self) -> str:
        counts = ", ".join(f"{c}: {len(v[0])}" for c, v in self._columns.items())
        return f"MissingReasons({{{counts}}})"

    def __copy__(self) -> MissingReasons:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MissingReasons:
        return self

    def count(self, column: str) -> int:
        """How many cells of ``column`` (``power_draw``) are missing with a known reason; 0 for none."""
        return len(self._columns[column][0]) if column in self._columns else 0

    def series(self, column: str, length: int) -> pd.Series:
        """One column's reasons: a categorical Series of ``length`` rows (as read), ``<NA>`` where not missing."""
        import numpy as np
        import pandas as pd

        rows, reasons, words = self._columns.get(column, ((), (), ()))
        codes = np.full(length, -1, dtype=np.int16)
        codes[np.asarray(rows, dtype=np.int64)] = np.asarray(reasons, dtype=np.int16)
        series: pd.Series = pd.Series(pd.Categorical.from_codes(codes, categories=pd.Index(list(words))), name=column)
        return series


def missing_reasons(df: pd.DataFrame) -> MissingReasons:
    """column -> {row position -> reason} of a frame's missing cells (any reader's, :func:`to_dataframe`'s)."""
    return MissingReasons.from_dicts(df.attrs.get("missing") or {})


def int_array(values: Sequence[int | None]) -> Any:
    """A nullable integer array: ``Int64``, or ``UInt64`` when a value needs the 64th bit."""
    import pandas as pd

    try:
        return pd.array(values, dtype="Int64")
    except (OverflowError, TypeError, ValueError):
        # 64-bit bitmasks with the top bit set do not fit a signed int64.
        return pd.array(values, dtype="UInt64")


def _python_array(fld: Field, values: Sequence[Any], tz: tzinfo | None = None) -> Any:
    """A nullable pandas array for one column of Python values (None for missing)."""
    import pandas as pd

    storage = fld.kind.ops.storage
    if storage == "int":
        return int_array(values)
    if storage != "timestamp":
        dtype: Any = string_dtype() if storage == "string" else fld.kind.ops.dtype
        return pd.array(values, dtype=dtype)
    given = [v for v in values if isinstance(v, datetime)]
    if tz is None and given and all(v.tzinfo is None for v in given):
        # Recorded without a zone (a replayed nvidia-smi CSV): kept naive, as recorded.
        naive: list[Any] = list(values)
        return pd.to_datetime(naive).as_unit("ns").array
    # A naive datetime among aware ones (a hand-made sample) is taken as local time.
    stamps: list[Any] = [v.astimezone() if isinstance(v, datetime) and v.tzinfo is None else v for v in values]
    if tz is None:
        zones = {v.tzinfo for v in stamps if isinstance(v, datetime)}
        # the second pass of a fall-back's repeated hour carries a fixed offset beside its zone: the zone wins
        named = {z for z in zones if not isinstance(z, timezone)}
        tz = zones.pop() if len(zones) == 1 else named.pop() if len(named) == 1 else local_zone()
    return pd.to_datetime(stamps, utc=True).tz_convert(tz).as_unit("ns").array


def empty_array(fld: Field, tz: tzinfo | None) -> Any:
    """A column of no rows with the dtype ``fld`` gets (timestamps in ``tz``; naive for None)."""
    import pandas as pd

    if fld.kind.ops.storage == "timestamp" and tz is None:
        return pd.DatetimeIndex([], dtype="datetime64[ns]").array
    return _python_array(fld, [], tz)


def make_frame(
    fields: Sequence[Field],
    columns: Sequence[Any],
    missing: Mapping[str, Mapping[int, str]] | MissingReasons,
    notices: list[str] | None,
    skipped: SkippedLines | None = None,
) -> pd.DataFrame:
    """The frame of ``fields`` over ready column arrays, with the attrs every reader gives (fields, units...)."""
    import pandas as pd

    names = [f.attr for f in fields]
    # copy=False: the columns were built for this frame (pandas would otherwise copy every one).
    df: pd.DataFrame = pd.DataFrame(dict(zip(names, columns, strict=True)), columns=names, copy=False)
    df.attrs["fields"] = [f.name for f in fields]
    df.attrs["units"] = {f.attr: f.unit for f in fields}
    df.attrs["missing"] = MissingReasons.from_dicts(missing)
    if notices is not None:
        df.attrs["notices"] = notices
    if skipped is not None:
        df.attrs["skipped"] = skipped
    return df


def to_dataframe(samples: Iterable[GpuSample]) -> pd.DataFrame:
    """Put samples in a DataFrame, one row per sample and one nullable column per queried field.

    Columns are named after :attr:`Field.attr` (``memory.used`` -> ``memory_used``) and typed by their kind
    (:attr:`~smiquery.kinds.FieldKind.dtype`; timestamps stay naive when every sample's is, as a replayed CSV's
    are). A missing value is ``<NA>`` (never 0). ``df.attrs`` carries ``"fields"`` (canonical names), ``"units"``
    (column -> unit) and ``"missing"`` (:class:`MissingReasons`). Samples of different queries give the union of
    their fields, in first-seen order (``<NA>`` without a reason where a sample lacks one). ValueError for a
    timestamp outside ``datetime64[ns]`` (years 1677 to 2262).
    """
    rows = list(samples)
    if not rows:
        return make_frame((), (), {}, None)
    first = rows[0].fields
    columns_of: Sequence[Sequence[Value]]
    if all(s.fields is first or s.fields == first for s in rows):
        names: Sequence[str] = first
        columns_of = list(zip(*(s.values() for s in rows), strict=True))
    else:
        names = list(dict.fromkeys(n for s in rows for n in s.fields))
        columns_of = [[s.get(n) for s in rows] for n in names]
    fields = [field_for(n) for n in names]
    attr_of = {n: f.attr for n, f in zip(names, fields, strict=True)}
    missing: dict[str, dict[int, str]] = {}
    for i, s in enumerate(rows):
        for name, reason in s.missing.items():
            missing.setdefault(attr_of[name], {})[i] = reason
    columns = [_python_array(f, col) for f, col in zip(fields, columns_of, strict=True)]
    return make_frame(fields, columns, missing, None)


def set_zone(df: pd.DataFrame, tz: tzinfo | None) -> None:
    """Put the ``timestamp`` column in ``tz`` (None: leave it), in place: naive times localized, aware converted."""
    if tz is None or "timestamp" not in df.columns:
        return
    stamps = df["timestamp"]
    if getattr(stamps.dt, "tz", None) is None:
        # the hour a DST fall-back repeats resolves by the order of the rows, as read_csv resolves it
        df["timestamp"] = localize_by_order(stamps, tz).as_unit("ns").array
    else:
        df["timestamp"] = stamps.dt.tz_convert(tz)


@dataclass(frozen=True)
class SkippedLines:
    """``count`` lines of a recording that readers skipped: torn (a killed recorder's last line), garbled or unfit.

    The first of them is line ``first_lineno`` (from 1), ``first_line`` its text (80 characters at most) and
    ``reason`` what is wrong with it (``field 'memory.used': '7.5' is not a valid integer``), or "".
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
        """One line, no trailing period: ``skipped 2 unreadable lines in run.csv (first: line 316: ...)``."""
        lines = "line" if self.count == 1 else "lines"
        why = f": {self.reason}" if self.reason else ""
        return f"skipped {self.count} unreadable {lines} in {name} (first: line {self.first_lineno}{why})"

    def unreadable(self) -> ParseError:
        """The error for a recording whose every row was skipped."""
        why = self.reason or "does not fit the header"
        message = f"no readable rows ({self.count} line(s) skipped, this one first): {why}"
        return ParseError(message, lineno=self.first_lineno, line=self.first_line)
