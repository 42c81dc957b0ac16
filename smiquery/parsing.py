r"""Pure parsing of nvidia-smi ``--format=csv`` output: lines in, :class:`GpuSample` records out.

No subprocess, no pandas. Handles header or no header, units or no units, status tokens, ``\r``, blank lines,
stray notice lines, and rejects any row that does not fit with a :class:`ParseError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta, tzinfo
from typing import ClassVar

from smiquery.errors import InvalidFieldError, ParseError
from smiquery.fields import Field, Kind, get_field
from smiquery.records import GpuSample, Schema, Value

__all__ = [
    "MISSING_REASONS",
    "CsvParser",
    "format_row",
    "format_value",
    "header_line",
    "missing_reason",
    "parse_lines",
]

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

_BOOL_WORDS: dict[Kind, tuple[str, str]] = {
    Kind.ENABLED: ("Enabled", "Disabled"),
    Kind.YES_NO: ("Yes", "No"),
    Kind.ACTIVE: ("Active", "Not Active"),
}
_MAJOR_MINOR_RE = re.compile(r"\d+\.\d+")
_HEADER_UNIT_RE = re.compile(r"^(.*?) \[([^\]]*)\]$")
# Records of the fast path skip GpuSample.__init__ (the row's length is already checked): allocate, fill the slot.
_alloc = object.__new__
_fill = GpuSample._s.__set__  # type: ignore[attr-defined]


# The start of nvidia-smi's own message lines (NVIDIA-SMI.md section 5): never data, whatever the column count.
MESSAGE_PREFIXES = (
    "WARNING:",
    "ERROR:",
    "Unable to determine",
    "Failed to initialize NVML",
    "Failed to properly shut down NVML",
    "NVIDIA-SMI has failed",
    "NVIDIA-SMI couldn't find",
    "No devices were found",
    "Please also try adding directory",
)


def _row_converter(convs: Sequence[Callable[[str], Value]]) -> Callable[[list[str]], tuple[Value, ...]]:
    """One function converting a whole row's cells, unrolled: the hot path of every stream (no zip, no list)."""
    names = {f"c{i}": conv for i, conv in enumerate(convs)}
    body = "".join(f"c{i}(cells[{i}]), " for i in range(len(convs)))
    fn: Callable[[list[str]], tuple[Value, ...]] = eval(f"lambda cells: ({body})", names)
    return fn


def is_message(line: str) -> bool:
    """True for a line that is one of nvidia-smi's messages (an error, a warning, a notice), never a data row."""
    return line.lstrip().startswith(MESSAGE_PREFIXES)


def missing_reason(cell: str) -> str | None:
    """The missing-value reason for a status-token cell, or None when the cell holds a value.

    Known tokens map to short reasons (``"[N/A]"`` -> ``"not_available"``); any other ``[...]`` token is kept
    verbatim as its own reason.
    """
    cell = cell.strip()
    reason = MISSING_REASONS.get(cell)
    if reason is not None:
        return reason
    if len(cell) >= 2 and cell[0] == "[" and cell[-1] == "]":
        return cell
    return None


class _NotAValue(Exception):
    """Raised by a string converter for a cell that must go the slow way (token or odd spacing)."""


def _str(v: str) -> str:
    if not v or v[0] == "[" or v == "N/A" or v[0] == " " or v[-1] == " ":
        raise _NotAValue
    return v


def _hex(v: str) -> int:
    return int(v, 16)


def _major_minor(v: str) -> str:
    if not _MAJOR_MINOR_RE.fullmatch(v):
        raise ValueError("not major.minor")
    return v


class _Timestamp:
    """Parses ``YYYY/MM/DD HH:MM:SS.mmm`` local time; caches the whole-second part, since rows share it."""

    __slots__ = ("base", "prefix", "tz")

    # nvidia-smi prints milliseconds; adding a ready-made timedelta is ten times cheaper than replace().
    _MILLIS: ClassVar[dict[str, timedelta]] = {f"{i:03d}": timedelta(milliseconds=i) for i in range(1000)}

    def __init__(self, tz: tzinfo | None) -> None:
        self.tz = tz
        self.prefix = ""
        self.base: datetime | None = None

    def __call__(self, v: str) -> datetime:
        prefix = v[:19]
        if prefix != self.prefix or self.base is None:
            if len(v) < 19 or v[4] != "/" or v[7] != "/" or v[10] != " " or v[13] != ":" or v[16] != ":":
                return self._other(v)
            naive = datetime(int(v[0:4]), int(v[5:7]), int(v[8:10]), int(v[11:13]), int(v[14:16]), int(v[17:19]))
            # nvidia-smi prints the host's local time with no zone.
            self.base = naive.replace(tzinfo=self.tz) if self.tz is not None else naive.astimezone()
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

    def _other(self, v: str) -> datetime:
        # Recordings written by other tools may use ISO 8601.
        dt = datetime.fromisoformat(v)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=self.tz) if self.tz is not None else dt.astimezone()
        return dt


def _converter(fld: Field, tz: tzinfo | None) -> Callable[[str], Value]:
    kind = fld.kind
    if kind is Kind.INT:
        return int
    if kind is Kind.FLOAT:
        return float
    if kind in (Kind.HEX, Kind.BITMASK):
        return _hex
    if kind.is_bool:
        yes, no = _BOOL_WORDS[kind]
        return {yes: True, no: False}.__getitem__
    if kind is Kind.TIMESTAMP:
        return _Timestamp(tz)
    if kind is Kind.MAJOR_MINOR:
        return _major_minor
    return _str


def _split_header_cell(cell: str) -> tuple[str, str]:
    m = _HEADER_UNIT_RE.match(cell.strip())
    return (m.group(1), m.group(2)) if m else (cell.strip(), "")


class CsvParser:
    """Turns nvidia-smi CSV lines into :class:`GpuSample` records, one line at a time.

    Columns are mapped by position: nvidia-smi prints canonical names in the header even when an alias was
    queried. A header line (with ``[unit]`` suffixes) is recognised when it comes first; without one, ``fields``
    must be given. Values may carry units (``38 %``) or not.

    In strict mode a row that does not fit raises :class:`ParseError`. In lenient mode (for streams) it is
    dropped and counted in :attr:`dropped`, with the error kept in :attr:`last_error`. Either way no shifted or
    half-parsed row is ever returned.

    Args:
        fields: the queried fields in order (names, aliases or :class:`Field`); None to take them from a header.
        strict: raise on bad rows (True) or drop and count them (False).
        tz: time zone of the timestamps; default the host's local zone.
        known: extra field names this driver lists (unknown to the catalogue; parsed as strings).
    """

    def __init__(
        self,
        fields: Sequence[str | Field] | None = None,
        *,
        strict: bool = True,
        tz: tzinfo | None = None,
        known: Iterable[str] | None = None,
    ) -> None:
        self.strict = strict
        self.tz = tz
        self._known = tuple(known) if known is not None else None
        self.dropped = 0
        self.notices: list[str] = []
        self.last_error: ParseError | None = None
        self.lineno = 0
        self._header: str | None = None
        self._fields: tuple[Field, ...] = ()
        self._units: tuple[str, ...] = ()
        self.schema: Schema | None = None
        self._convs: tuple[Callable[[str], Value], ...] = ()
        self._row: Callable[[list[str]], tuple[Value, ...]] = _row_converter(())
        self._ncols = 0
        self._seen_row = False
        if fields is not None:
            self._set_fields(tuple(f if isinstance(f, Field) else get_field(f, known=known) for f in fields), None)

    @property
    def fields(self) -> tuple[Field, ...]:
        """The fields of each row (empty until a header was read, when none were given)."""
        return self._fields

    @property
    def units(self) -> tuple[str, ...]:
        """The unit of each column, from the header when it had one, else from the catalogue."""
        return self._units

    def _set_fields(self, fields: tuple[Field, ...], header_units: Sequence[str] | None) -> None:
        self._fields = fields
        self._units = tuple(header_units) if header_units is not None else tuple(f.header_unit or "" for f in fields)
        self.schema = Schema(tuple(f.name for f in fields))
        self._convs = tuple(_converter(f, self.tz) for f in fields)
        self._ncols = len(fields)
        self._row = _row_converter(self._convs)

    def _try_header(self, line: str) -> bool:
        cells = [_split_header_cell(c) for c in line.split(",")]
        try:
            fields = tuple(get_field(name, known=self._known) for name, _ in cells)
        except InvalidFieldError:
            if self._fields:
                return False
            # No fields given and the first line is no header: unknown names in a header are still a header
            # when every cell looks like a field name with an optional unit.
            if all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", n) for n, _ in cells) and any(u for _, u in cells):
                fields = tuple(Field(n, Kind.STR) for n, _ in cells)
            else:
                return False
        units = [u for _, u in cells]
        if self._fields:
            if tuple(f.name for f in fields) != tuple(f.name for f in self._fields):
                raise ParseError(
                    f"header does not match the requested fields ({', '.join(f.name for f in self._fields)})",
                    lineno=self.lineno,
                    line=line,
                )
            units = [u or f.header_unit or "" for u, f in zip(units, self._fields, strict=True)]
        self._set_fields(fields, units)
        self._header = line
        return True

    def feed(self, line: str) -> GpuSample | None:
        """Parse one line.

        Returns:
            The record, or None for a header, blank, notice or (lenient mode) dropped line.

        Raises:
            ParseError: in strict mode, for a row that does not fit (or a missing header without fields).
        """
        self.lineno += 1
        line = line.rstrip("\r\n\t ")
        if not line:
            return None
        if not self._seen_row and self._header is None and self._try_header_first(line):
            return None
        if line == self._header:
            return None  # a restarted stream without noheader prints its header again
        cells = line.split(", ")
        if len(cells) != self._ncols or self._ncols == 1:
            if line.startswith(MESSAGE_PREFIXES):
                # exit 14 prints "WARNING: infoROM is corrupted at gpu ..." after the rows
                self.notices.append(line)
                return None
            if len(cells) != self._ncols:
                alt = [c.strip() for c in line.split(",")]
                if len(alt) != self._ncols:
                    return self._reject(f"expected {self._ncols} columns, got {len(cells)}", line, None)
                cells = alt
        try:
            values = self._row(cells)
        except (ValueError, KeyError, TypeError, OverflowError, _NotAValue):
            return self._slow_row(line, cells)
        self._seen_row = True
        sample = _alloc(GpuSample)
        _fill(sample, (self.schema, values, tuple(cells), None, False))
        return sample

    def _try_header_first(self, line: str) -> bool:
        if self._try_header(line):
            return True
        if not self._fields:
            raise ParseError(
                "no header line and no fields given; pass fields= for noheader output",
                lineno=self.lineno,
                line=line,
            )
        return False

    def _slow_row(self, line: str, cells: list[str]) -> GpuSample | None:
        values: list[Value] = []
        missing: dict[str, str] = {}
        lost = False
        for fld, unit, conv, cell in zip(self._fields, self._units, self._convs, cells, strict=True):
            reason = missing_reason(cell)
            if reason is not None:
                values.append(None)
                missing[fld.name] = reason
                lost = lost or reason == "gpu_lost"
                continue
            text = cell.strip()
            if unit and text.endswith(" " + unit):
                text = text[: -len(unit) - 1]
            try:
                values.append(conv(text))
            except (ValueError, KeyError, TypeError, OverflowError, _NotAValue):
                return self._reject(f"{cell!r} is not a valid {fld.kind.value}", line, fld.name)
        self._seen_row = True
        assert self.schema is not None
        return GpuSample(self.schema, tuple(values), tuple(cells), missing, lost)

    def _reject(self, message: str, line: str, field: str | None) -> GpuSample | None:
        err = ParseError(message, lineno=self.lineno, line=line, field=field)
        if self.strict:
            raise err
        self.dropped += 1
        self.last_error = err
        return None

    def parse(self, lines: Iterable[str]) -> Iterator[GpuSample]:
        """Parse every line, yielding the records."""
        feed = self.feed
        for line in lines:
            sample = feed(line)
            if sample is not None:
                yield sample


def parse_lines(
    lines: Iterable[str] | str,
    fields: Sequence[str | Field] | None = None,
    *,
    strict: bool = True,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Parse nvidia-smi CSV output into records.

    Args:
        lines: the output, as an iterable of lines or one string.
        fields: the queried fields, required when the output has no header.
        strict: raise :class:`ParseError` on a bad row (True) or drop it (False).
        tz: time zone of the timestamps (default: the host's local zone).

    Returns:
        One record per data row.

    Raises:
        ParseError: a row does not fit (strict mode), or there is neither header nor ``fields``.
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    return list(CsvParser(fields, strict=strict, tz=tz).parse(lines))


def format_value(fld: Field, value: Value, reason: str | None = None, *, units: bool = False) -> str:
    """Write one value the way nvidia-smi prints it (the inverse of parsing).

    Args:
        fld: the field.
        value: the typed value, or None for a missing one.
        reason: the missing reason, used when ``value`` is None (default ``not_available``).
        units: append the header unit as nvidia-smi does without ``nounits``.
    """
    if value is None:
        r = reason or "not_available"
        return _TOKEN_FOR_REASON.get(r, r if r.startswith("[") else "[N/A]")
    kind = fld.kind
    if kind.is_bool:
        yes, no = _BOOL_WORDS[kind]
        text = yes if value else no
    elif kind is Kind.BITMASK:
        text = f"0x{value:016X}"
    elif kind is Kind.HEX:
        text = f"0x{value:X}"
    elif kind is Kind.TIMESTAMP:
        assert isinstance(value, datetime)
        text = value.strftime("%Y/%m/%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"
    elif kind is Kind.FLOAT:
        assert isinstance(value, (int, float))
        text = f"{value:.2f}" if fld.unit == "W" and round(float(value), 2) == value else repr(float(value))
    else:
        text = str(value)
    if units and fld.header_unit:
        text = f"{text} {fld.header_unit}"
    return text


def format_row(sample: GpuSample, fields: Sequence[Field] | None = None, *, units: bool = False) -> str:
    """One CSV line for ``sample`` in nvidia-smi's format (``, `` separated, no quoting, no newline).

    The typed values are formatted as nvidia-smi formats them, so parsing the line gives the same values back.
    """
    flds = fields or tuple(get_field(n) for n in sample.fields)
    missing = sample.missing
    return ", ".join(
        format_value(f, v, missing.get(f.name), units=units) for f, v in zip(flds, sample.values(), strict=True)
    )


def header_line(fields: Sequence[Field]) -> str:
    """The header nvidia-smi prints for these fields (``name [unit]`` titles)."""
    return ", ".join(f.header for f in fields)
