"""Value kinds and units: how a field's cell is parsed, written, shown, typed and exported, in one place.

Each :class:`Kind` has one :class:`FieldKind` (``kind.ops``) that owns its cell grammar; each unit has one
:class:`Unit` (:func:`unit_info`) that owns its precision and Prometheus base unit.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from enum import Enum
from typing import Any, ClassVar, Literal

from smiquery.sample import Value

__all__ = [
    "CONVERT_ERRORS",
    "FIELD_KINDS",
    "MISSING_REASONS",
    "UNITS",
    "FieldKind",
    "Kind",
    "Unit",
    "missing_reason",
    "split_header_cell",
    "strip_unit",
    "to_number",
    "unit_info",
]


class Kind(str, Enum):
    """What a field's cells hold, and so what Python type its values parse to."""

    INT = "integer"
    FLOAT = "float"
    STR = "string"
    ENABLED = "enabled/disabled"
    YES_NO = "yes/no"
    ACTIVE = "active/not-active"
    HEX = "hex"
    BITMASK = "bitmask"
    TIMESTAMP = "timestamp"
    VERSION = "version"
    MAJOR_MINOR = "major.minor"

    @property
    def is_numeric(self) -> bool:
        """True for kinds whose values are numbers (int or float)."""
        return FIELD_KINDS[self].storage in ("int", "float")

    @property
    def is_bool(self) -> bool:
        """True for two-state kinds parsed to ``bool``."""
        return FIELD_KINDS[self].storage == "bool"

    @property
    def is_quantity(self) -> bool:
        """True for integers and decimals (measurements, counts); hex ids and bitmasks are numeric but no quantities."""
        return self is Kind.INT or self is Kind.FLOAT

    @property
    def ops(self) -> FieldKind:
        """The object that parses, formats, displays, types and exports this kind's values."""
        return FIELD_KINDS[self]


#: Status tokens nvidia-smi prints instead of a value, and the reason smiquery records for each.
MISSING_REASONS: dict[str, str] = {
    "[N/A]": "not_available",
    "N/A": "not_available",
    "[Not Supported]": "not_supported",
    "[Unknown Error]": "unknown_error",
    "[Insufficient Permissions]": "insufficient_permissions",
    "[Requested functionality has been deprecated]": "deprecated",
    "[Function Not Found]": "function_not_found",
    "[GPU is lost]": "gpu_lost",
    "[GPU requires reset]": "gpu_requires_reset",
    "": "empty",
}
_TOKEN_FOR_REASON = {v: k for k, v in reversed(MISSING_REASONS.items())}


def missing_reason(cell: str) -> str | None:
    """The missing-value reason of a status-token cell (``"[N/A]"`` -> ``"not_available"``), None for a value.

    Any other ``[...]`` token is its own reason.
    """
    cell = cell.strip()
    reason = MISSING_REASONS.get(cell)
    if reason is None and len(cell) >= 2 and cell[0] == "[" and cell[-1] == "]":
        return cell
    return reason


_HEADER_UNIT = re.compile(r"^(.*?) \[([^\]]*)\]$")


def split_header_cell(cell: str) -> tuple[str, str]:
    """A csv header cell as (name, unit): ``"power.draw [W]"`` -> ``("power.draw", "W")``; no unit -> ``""``."""
    m = _HEADER_UNIT.match(cell.strip())
    return (m.group(1), m.group(2)) if m else (cell.strip(), "")


def strip_unit(cell: str, unit: str) -> str:
    """A cell without surrounding spaces and without its `` unit`` suffix (nvidia-smi's default csv format)."""
    text = cell.strip()
    return text[: -len(unit) - 1] if unit and text.endswith(" " + unit) else text


@dataclass(frozen=True)
class Unit:
    """One of nvidia-smi's units (``symbol``, ``"MiB"``).

    ``digits``: decimals nvidia-smi prints (and a table shows) for a decimal value (None: as many as it needs);
    ``summary_digits``: decimals of a report's statistics in this unit; ``base``: the Prometheus base unit a metric
    is exported in (``"bytes"``, empty for none), ``scale`` the factor to it (MiB -> bytes: 1048576).
    """

    symbol: str
    digits: int | None = None
    summary_digits: int = 1
    base: str = ""
    scale: float = 1.0


#: The units of the catalogue, by symbol.
UNITS: dict[str, Unit] = {
    u.symbol: u
    for u in (
        Unit("C", summary_digits=0, base="celsius"),
        Unit("MiB", summary_digits=0, base="bytes", scale=1048576.0),
        Unit("W", digits=2, summary_digits=1, base="watts"),
        Unit("MHz", summary_digits=0, base="hertz", scale=1e6),
        Unit("%", summary_digits=0, base="ratio", scale=0.01),
        Unit("us", summary_digits=0, base="seconds", scale=1e-6),
        Unit("ms", base="seconds", scale=1e-3),
        Unit("seconds", base="seconds"),
        Unit("W/s", base="watts_per_second"),
    )
}
_NO_UNIT = Unit("")


def unit_info(symbol: str) -> Unit:
    """The :class:`Unit` for ``symbol``; a unit smiquery does not know has no precision and no base unit."""
    return UNITS.get(symbol) or (_NO_UNIT if not symbol else Unit(symbol))


class _NotAValue(Exception):  # a cell that must go the slow way (status token or odd spacing)
    pass


def _str(v: str) -> str:
    if not v or v[0] == "[" or v == "N/A" or v[0] == " " or v[-1] == " ":
        raise _NotAValue
    return v


_hex = functools.partial(int, base=16)
_MAJOR_MINOR_RE = re.compile(r"\d+\.\d+")


def _major_minor(v: str) -> str:
    if not _MAJOR_MINOR_RE.fullmatch(v):
        raise ValueError("not major.minor")
    return v


class _Timestamp:
    """Parses ``YYYY/MM/DD HH:MM:SS.mmm`` local time; caches the whole-second part, since rows share it."""

    __slots__ = ("base", "hour", "hour_base", "localize", "prefix")

    # nvidia-smi prints milliseconds; adding a ready-made timedelta is ten times cheaper than replace().
    _MILLIS: ClassVar[dict[str, timedelta]] = {f"{i:03d}": timedelta(milliseconds=i) for i in range(1000)}
    # minutes and seconds into an hour, for the rows of an hour without a zone change
    _MINSEC: ClassVar[dict[str, timedelta]] = {
        f"{m:02d}:{sec:02d}": timedelta(minutes=m, seconds=sec) for m in range(60) for sec in range(60)
    }

    def __init__(self, tz: tzinfo | None) -> None:
        from smiquery.clock import Localizer

        # one converter reads one timeline in order: the repeated hour of a DST fall-back resolves by that order
        self.localize = Localizer(tz)
        self.prefix = ""
        self.base: datetime | None = None
        self.hour = ""  # "YYYY/MM/DD HH" of an hour without a zone change, whose start is hour_base
        self.hour_base: datetime | None = None

    def __call__(self, v: str) -> datetime:
        prefix = v[:19]
        if prefix != self.prefix or self.base is None:
            if len(v) < 19 or v[4] != "/" or v[7] != "/" or v[10] != " " or v[13] != ":" or v[16] != ":":
                dt = datetime.fromisoformat(v)  # recordings written by other tools may use ISO 8601
                return self.localize(dt) if dt.tzinfo is None else dt
            # a new whole second (nvidia-smi prints the host's local time with no zone)
            into = self._MINSEC.get(v[14:19]) if v[:13] == self.hour else None
            if into is not None and self.hour_base is not None:
                self.base = self.localize.last = self.hour_base + into
            else:
                naive = datetime(int(v[0:4]), int(v[5:7]), int(v[8:10]), int(v[11:13]), int(v[14:16]), int(v[17:19]))
                self.base = self.localize(naive)
                plain = self.localize.plain_hour(naive)  # no zone change: the hour's rows reuse its start
                self.hour = v[:13] if plain else ""
                self.hour_base = self.base - timedelta(minutes=naive.minute, seconds=naive.second) if plain else None
            self.prefix = prefix
        ms = self._MILLIS.get(v[20:]) if len(v) == 23 and v[19] == "." else None
        if ms is not None:
            return self.base + ms
        if len(v) == 19:
            return self.base
        frac = v[20:]
        if v[19] != "." or not frac.isdigit() or len(frac) > 6:
            raise ValueError("bad fraction of a second")
        return self.base.replace(microsecond=int(frac) * 10 ** (6 - len(frac)))


#: Exceptions a converter raises for a cell that does not fit its kind.
CONVERT_ERRORS = (ValueError, KeyError, TypeError, OverflowError, _NotAValue)

Storage = Literal["int", "float", "bool", "timestamp", "string"]
MetricStyle = Literal["number", "bool", "bitmask", "info", "none"]
_DTYPES = {"int": "Int64", "float": "Float64", "bool": "boolean", "timestamp": "datetime64[ns]", "string": "string"}


@dataclass(frozen=True)
class FieldKind:
    """Everything smiquery does with one :class:`Kind`'s values, from the CSV cell to the table, frame and metric.

    ``storage`` says how values are held, ``words`` a two-state kind's words for True and False; ``metric`` how the
    exporter shows it: a gauge in the unit's base unit, 1/0, the bitmask's number, the text as a label of a gauge of
    1 (``info``), or not at all.
    """

    kind: Kind
    storage: Storage
    words: tuple[str, str] | None = None
    metric: MetricStyle = "number"

    @property
    def dtype(self) -> str:
        """The nullable pandas dtype of a column of this kind (``"Int64"``...; timestamps ``datetime64[ns]``)."""
        return _DTYPES[self.storage]

    def converter(self, tz: tzinfo | None = None) -> Callable[[str], Value]:
        """A function from a bare cell (no unit, trimmed) to its value; one of :data:`CONVERT_ERRORS` otherwise."""
        storage = self.storage
        if storage == "int":
            return _hex if self.kind in (Kind.HEX, Kind.BITMASK) else int
        if storage == "float":
            return float
        if self.words is not None:
            yes, no = self.words
            return {yes: True, no: False}.__getitem__
        if storage == "timestamp":
            return _Timestamp(tz)
        if self.kind is Kind.MAJOR_MINOR:
            return _major_minor
        return _str

    def parse(self, cell: str, unit: str = "", *, tz: tzinfo | None = None) -> Value:
        """One CSV cell -> its value: None for a status token, the `` unit`` suffix stripped; else ValueError."""
        if missing_reason(cell) is not None:
            return None
        try:
            return self.converter(tz)(strip_unit(cell, unit))
        except CONVERT_ERRORS as exc:
            raise ValueError(f"{cell!r} is not a valid {self.kind.value}") from exc

    def from_python(self, value: object) -> Value:
        """A JSON or pandas value (number, bool, datetime, text) as this kind's type; ValueError/TypeError if unfit."""
        if value is None:
            return None
        if isinstance(value, str):
            return value if self.kind is Kind.STR else self.converter(None)(value.strip())
        storage = self.storage
        if storage == "int":
            if self.kind is Kind.INT and isinstance(value, float) and not value.is_integer():
                raise ValueError(f"{value!r} is not an integer")
            return int(value)  # type: ignore[call-overload,no-any-return]
        if storage == "float":
            return float(value)  # type: ignore[arg-type]
        if storage == "bool":
            return bool(value)
        if storage == "timestamp":
            to_py = getattr(value, "to_pydatetime", None)
            dt = to_py() if to_py is not None else value
            if not isinstance(dt, datetime):
                raise TypeError(f"{value!r} is not a timestamp")
            return dt
        return str(value)

    def arrow_cast(self, col: Any) -> Any | None:
        """The vectorised :meth:`converter` over bare cells (pyarrow strings, null tokens); None if one would differ."""
        import pyarrow as pa
        import pyarrow.compute as pc

        kind, storage = self.kind, self.storage
        try:
            if kind is Kind.INT:
                typed = pc.cast(col, pa.int64())
                # Arrow's cast also reads "0x1F" as hex; Python's int(), and so the parser, rejects it.
                decimal = pc.all(pc.ascii_is_decimal(col)).as_py()
                return typed if decimal or not pc.any(pc.match_substring_regex(col, "^0[xX]")).as_py() else None
            if storage == "int":
                # Arrow reads "0x1F" as hex but "10" as decimal; the parser reads hex and bitmask cells as hex.
                return pc.cast(col, pa.int64()) if pc.all(pc.starts_with(col, "0x")).as_py() else None
            if storage == "float":
                return pc.cast(col, pa.float64())
            if self.words is not None:
                yes, no = self.words
                # equal() leaves missing cells null and all() skips them (is_in() would make them false).
                return pc.equal(col, yes) if pc.all(pc.or_(pc.equal(col, yes), pc.equal(col, no))).as_py() else None
            if storage == "timestamp":  # YYYY/MM/DD HH:MM:SS[.ffffff]; anything else (ISO 8601...) cell by cell
                lengths = pc.min_max(pc.binary_length(col)).as_py()
                if lengths["min"] is None:
                    return pc.cast(col, pa.timestamp("ns"))  # every cell missing
                raw = col.cast(pa.binary())  # a zero-copy view, for byte slicing
                slashes = (pc.all(pc.equal(pc.binary_slice(raw, at, at + 1), b"/")).as_py() for at in (4, 7))
                if lengths["min"] < 19 or lengths["max"] > 26 or not all(slashes):
                    return None
                # Arrow's cast reads ISO 8601 (checking every other character); the date separators were checked above.
                iso = pc.binary_replace_slice(pc.binary_replace_slice(col, 4, 5, "-"), 7, 8, "-")
                return pc.cast(iso, pa.timestamp("ns"))
            if kind is Kind.MAJOR_MINOR and not pc.all(pc.match_substring_regex(col, r"^\d+\.\d+$")).as_py():
                return None
        except pa.ArrowInvalid:
            return None
        return col

    def format(self, value: Value, unit: str = "", *, reason: str | None = None, suffix: str = "") -> str:
        """A value written as nvidia-smi prints it in CSV, so that :meth:`parse` gives it back.

        None is the status token for ``reason``; ``unit`` decides a decimal's digits; ``suffix`` (``"MiB"``) follows
        a value, never a token, as in nvidia-smi's default format.
        """
        if value is None:  # the status token of the reason: a "[...]" reason is its own, [N/A] for any other
            r = reason or "not_available"
            return _TOKEN_FOR_REASON.get(r, r if r.startswith("[") else "[N/A]")
        storage = self.storage
        if self.words is not None:
            text = self.words[0] if value else self.words[1]
        elif self.kind is Kind.BITMASK:
            text = f"0x{value:016X}"
        elif self.kind is Kind.HEX:
            text = f"0x{value:X}"
        elif storage == "timestamp":
            assert isinstance(value, datetime)
            text = value.strftime("%Y/%m/%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"
        elif storage == "float":
            assert isinstance(value, (int, float))
            digits = unit_info(unit).digits
            number = float(value)
            text = f"{number:.{digits}f}" if digits is not None and round(number, digits) == number else repr(number)
        else:
            text = str(value)
        return f"{text} {suffix}" if suffix else text

    def display(self, value: Value, unit: str = "", *, missing: str = "n/a", with_unit: bool = False) -> str:
        """A value as a table shows it: nvidia-smi's spelling, decimals rounded to the unit's precision.

        ``missing`` is shown for None; ``with_unit`` appends the unit (``"70 %"``; tables put it in the title).
        """
        if value is None:
            return missing
        storage = self.storage
        if storage == "timestamp" and isinstance(value, datetime):
            text = value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"
        elif storage == "float" and isinstance(value, (int, float)) and unit_info(unit).digits is not None:
            text = f"{float(value):.{unit_info(unit).digits}f}"
        else:
            text = self.format(value, unit)
        return f"{text} {unit}" if with_unit and unit else text

    def summary_digits(self, unit: str = "") -> int:
        """Decimals a report gives a statistic of this kind in ``unit``: the unit's, else 0 for integers."""
        if unit in UNITS:
            return UNITS[unit].summary_digits
        return 0 if self.storage == "int" else 1


def to_number(value: Value) -> float | None:
    """Any parsed value as a float when it is a number or a bool (1/0); None for text, timestamps and None."""
    return float(value) if isinstance(value, (int, float)) else None


#: The :class:`FieldKind` of every :class:`Kind`.
FIELD_KINDS: dict[Kind, FieldKind] = {
    k.kind: k
    for k in (
        FieldKind(Kind.INT, "int"),
        FieldKind(Kind.FLOAT, "float"),
        FieldKind(Kind.STR, "string", metric="info"),
        FieldKind(Kind.ENABLED, "bool", ("Enabled", "Disabled"), metric="bool"),
        FieldKind(Kind.YES_NO, "bool", ("Yes", "No"), metric="bool"),
        FieldKind(Kind.ACTIVE, "bool", ("Active", "Not Active"), metric="bool"),
        FieldKind(Kind.HEX, "int", metric="info"),  # ids (pci.device_id): the hex text is what people search for
        FieldKind(Kind.BITMASK, "int", metric="bitmask"),
        FieldKind(Kind.TIMESTAMP, "timestamp", metric="none"),  # the scrape has its own time
        FieldKind(Kind.VERSION, "string", metric="info"),
        FieldKind(Kind.MAJOR_MINOR, "string", metric="info"),
    )
}
