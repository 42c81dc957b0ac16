"""``--query-gpu``: its CSV parsed into :class:`GpuSample` records (a pure parser), and the one-shot ``query()``."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, tzinfo
from typing import TYPE_CHECKING, Any

from smiquery.errors import InfoRomWarning, InvalidFieldError, NvidiaSmiFailedError, ParseError, failure_from_exit
from smiquery.fields import Field, FieldsArg, Kind, get_field, resolve_fields
from smiquery.kinds import CONVERT_ERRORS, missing_reason, split_header_cell, strip_unit
from smiquery.sample import GpuSample, Schema, Value
from smiquery.streams.argv import GpusArg, build_argv, normalize_gpus

if TYPE_CHECKING:
    import os

    import pandas as pd

    from smiquery.runner import Completed, Runner

__all__ = [
    "DEFAULT_TIMEOUT",
    "MESSAGE_PREFIXES",
    "CsvParser",
    "bad_cell_reason",
    "check_and_parse",
    "format_row",
    "get_gpu_status",
    "header_line",
    "is_message",
    "judge_exit",
    "parse_lines",
    "query",
    "query_df",
]

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


def bad_cell_reason(fld: Field, cell: str) -> str:
    """Why a cell was rejected, for error lines: ``field 'memory.used': '7.5' is not a valid integer``."""
    return f"field {fld.name!r}: {cell!r} is not a valid {fld.kind.value}"


def is_message(line: str) -> bool:
    """True for a line that is one of nvidia-smi's messages (an error, a warning, a notice), never a data row."""
    return line.lstrip().startswith(MESSAGE_PREFIXES)


class CsvParser:
    """Turns nvidia-smi CSV lines into :class:`GpuSample` records, one line at a time.

    Columns map by position. A header line (``name [unit]``) is recognised when it comes first; without one,
    ``fields`` (names, aliases or :class:`Field`) must be given. Values may carry units or not; notices and blank
    lines are skipped. A row that does not fit raises :class:`ParseError` when ``strict``, else it is counted in
    :attr:`dropped` (the error in :attr:`last_error`); no shifted or half-parsed row is ever returned. ``tz``: the
    timestamps' zone (default the host's); ``known``: field names this driver lists beyond the catalogue (strings).
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
        #: The fields of each row (empty until a header was read, when none were given).
        self.fields: tuple[Field, ...] = ()
        #: The unit of each column, from the header when it had one, else from the catalogue.
        self.units: tuple[str, ...] = ()
        self.schema: Schema | None = None
        self._convs: tuple[Callable[[str], Value], ...] = ()
        self._row: Callable[[list[str]], tuple[Value, ...]] = _row_converter(())
        self._ncols = 0
        self._seen_row = False
        if fields is not None:
            self._set_fields(tuple(f if isinstance(f, Field) else get_field(f, known=known) for f in fields), None)

    def _set_fields(self, fields: tuple[Field, ...], header_units: Sequence[str] | None) -> None:
        self.fields = fields
        self.units = tuple(header_units) if header_units is not None else tuple(f.header_unit or "" for f in fields)
        self.schema = Schema(tuple(f.name for f in fields))
        self._convs = tuple(f.kind.ops.converter(self.tz) for f in fields)
        self._ncols = len(fields)
        self._row = _row_converter(self._convs)

    def _try_header(self, line: str) -> bool:
        cells = [split_header_cell(c) for c in line.split(",")]
        try:
            fields = tuple(get_field(name, known=self._known) for name, _ in cells)
        except InvalidFieldError:
            # Without fields given, unknown names are still a header when every cell looks like a field name with
            # an optional unit, and one has a unit.
            looks = all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", n) for n, _ in cells) and any(u for _, u in cells)
            if self.fields or not looks:
                return False
            fields = tuple(Field(n, Kind.STR) for n, _ in cells)
        units = [u for _, u in cells]
        if self.fields:
            if tuple(f.name for f in fields) != tuple(f.name for f in self.fields):
                msg = f"header does not match the requested fields ({', '.join(f.name for f in self.fields)})"
                raise ParseError(msg, lineno=self.lineno, line=line)
            units = [u or f.header_unit or "" for u, f in zip(units, self.fields, strict=True)]
        self._set_fields(fields, units)
        self._header = line
        return True

    def feed(self, line: str) -> GpuSample | None:
        """The line's record; None for a header, blank, notice or dropped line (strict: ParseError instead)."""
        self.lineno += 1
        line = line.rstrip("\r\n\t ")
        if not line:
            return None
        if not self._seen_row and self._header is None:
            if self._try_header(line):
                return None
            if not self.fields:
                msg = "no header line and no fields given; pass fields= for noheader output"
                raise ParseError(msg, lineno=self.lineno, line=line)
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
        except CONVERT_ERRORS:
            return self._slow_row(line, cells)
        self._seen_row = True
        sample = _alloc(GpuSample)
        _fill(sample, (self.schema, values, tuple(cells), None, False))
        return sample

    def _slow_row(self, line: str, cells: list[str]) -> GpuSample | None:
        values: list[Value] = []
        missing: dict[str, str] = {}
        lost = False
        for fld, unit, conv, cell in zip(self.fields, self.units, self._convs, cells, strict=True):
            reason = missing_reason(cell)
            if reason is not None:
                values.append(None)
                missing[fld.name] = reason
                lost = lost or reason == "gpu_lost"
                continue
            try:
                values.append(conv(strip_unit(cell, unit)))
            except CONVERT_ERRORS:
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
        return (sample for sample in map(self.feed, lines) if sample is not None)


def parse_lines(
    lines: Iterable[str] | str,
    fields: Sequence[str | Field] | None = None,
    *,
    strict: bool = True,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Parse nvidia-smi CSV output (lines or one string) into records; ``fields`` is needed without a header.

    Raises ParseError for a row that does not fit (strict mode), or when there is neither header nor ``fields``.
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    return list(CsvParser(fields, strict=strict, tz=tz).parse(lines))


def format_row(sample: GpuSample, fields: Sequence[Field] | None = None, *, units: bool = False) -> str:
    """One CSV line for ``sample`` as nvidia-smi prints it (no newline): parsing it gives the same values back."""
    flds = fields or tuple(get_field(n) for n in sample.fields)
    missing = sample.missing
    return ", ".join(f.format(v, missing.get(f.name), units=units) for f, v in zip(flds, sample.values(), strict=True))


def header_line(fields: Sequence[Field]) -> str:
    """The header nvidia-smi prints for these fields (``name [unit]`` titles)."""
    return ", ".join(f.header for f in fields)


#: Seconds a one-shot call waits by default: a cold start without persistence mode takes 15-30 s on large hosts.
DEFAULT_TIMEOUT = 45.0


def judge_exit(argv: Sequence[str], done: Completed, what: str) -> Completed:
    """A finished one-shot call's typed error when it failed; exit 14 (infoROM) warns and returns ``what``."""
    if done.returncode not in (0, 14):
        raise failure_from_exit(argv, done.returncode, done.output)
    if done.returncode == 14:
        notice = next((ln for ln in done.stdout.splitlines() if ln.startswith("WARNING:")), "infoROM warning")
        warnings.warn(f"nvidia-smi exited 14 ({notice}); {what} returned", InfoRomWarning, stacklevel=3)
    return done


def check_and_parse(
    argv: Sequence[str], done: Completed, parser: CsvParser, fields: Sequence[Field]
) -> list[GpuSample]:
    """Judge a finished one-shot call: its typed error, or its rows (exit 14 keeps them and warns)."""
    returncode = done.returncode
    samples: list[GpuSample] = []
    if returncode in (0, 14):
        try:
            samples = list(parser.parse(done.stdout.splitlines()))
        except ParseError:
            if returncode == 0:
                raise
    if not samples and returncode:  # exit 14 without rows is a failure too
        # what nvidia-smi said, without the data rows it printed first (a one-column row is data, not a message)
        probe = CsvParser(fields, strict=False)
        said = [ln for ln in done.stdout.splitlines() if ln.strip() and (is_message(ln) or probe.feed(ln) is None)]
        raise failure_from_exit(argv, returncode, "\n".join(said) + (("\n" + done.stderr) if done.stderr else ""))
    if not samples:
        hint = "run plain `nvidia-smi` to see what it prints, or `smiquery doctor`"
        raise NvidiaSmiFailedError(
            argv, returncode, done.output, f"nvidia-smi exited 0 but printed no GPU rows; {hint}"
        )
    if returncode == 14:
        notice = parser.notices[0] if parser.notices else "infoROM warning"
        warnings.warn(f"nvidia-smi exited 14 ({notice}); rows returned", InfoRomWarning, stacklevel=3)
    return samples


def query(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Take one snapshot: one record per GPU.

    ``fields``: a preset (``"default"``, ``"health"``, ...), ``"a,b,c"`` or a sequence of names or fields; ``gpus``:
    indices, UUIDs or PCI bus ids (None: all); ``nvidia_smi``: the binary (default: ``$SMIQUERY_NVIDIA_SMI``, PATH,
    the usual places); ``timeout``: seconds before the child is killed; ``runner``: how to run it (tests inject
    one); ``tz``: the timestamps' zone (default: the host's).

    Raises InvalidFieldError or InvalidGpuIdError before anything runs, NvidiaSmiNotFoundError (no usable binary),
    NvidiaSmiTimeoutError (no answer within ``timeout``), NvidiaSmiFailedError (a non-zero exit, as its typed
    subclass) and ParseError (output that does not fit the fields).
    """
    from smiquery.runner import default_runner, find_nvidia_smi  # here: the parser's users never load subprocess

    flds = resolve_fields(fields)
    ids = normalize_gpus(gpus)
    run = runner or default_runner()
    argv = build_argv(find_nvidia_smi(nvidia_smi, runner=run), flds, ids)
    done = run.run(argv, timeout)
    return check_and_parse(argv, done, CsvParser(flds, tz=tz), flds)


def query_df(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`query`, as a DataFrame (:func:`smiquery.frames.to_dataframe`: ``memory_used`` as ``Int64``)."""
    from smiquery.frames import to_dataframe

    return to_dataframe(query(fields, gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner))


_STATUS_FIELDS = ("timestamp", "index", "name", "temperature.gpu", "utilization.gpu", "utilization.memory")
_STATUS_KEYS = {
    "index": "index",
    "name": "name",
    "temperature.gpu": "temperature_c",
    "utilization.gpu": "gpu_util_percent",
    "utilization.memory": "memory_util_percent",
}


def get_gpu_status(
    fields: FieldsArg = None,
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> dict[str, Any]:
    """One call for scripts and training loops; never raises for anything nvidia-smi does.

    Success: ``{"success": True, "data": [{"index", "name", "temperature_c", "gpu_util_percent",
    "memory_util_percent", "timestamp"}, ...]}`` (missing values are None; ``timestamp`` is ISO 8601; extra
    ``fields`` add snake_case keys such as ``power_draw``). Failure: ``{"success": False, "error": "<one line>",
    "error_type": "<exception class name>"}``. It returns within ``timeout`` seconds even when nvidia-smi hangs.
    """
    try:
        flds = resolve_fields([*_STATUS_FIELDS, *(resolve_fields(fields) if fields else ())])
        samples = query(flds, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
        data = []
        for s in samples:
            ts = s.timestamp
            item: dict[str, Any] = {key: s[name] for name, key in _STATUS_KEYS.items()}
            item["timestamp"] = ts.isoformat(timespec="milliseconds") if ts is not None else None
            for f in flds[len(_STATUS_FIELDS) :]:
                value = s[f.name]
                item[f.attr] = value.isoformat() if isinstance(value, datetime) else value
            data.append(item)
        return {"success": True, "data": data}
    except Exception as exc:  # the contract: a dict, never an exception
        message = " ".join(str(exc).split()) or type(exc).__name__
        return {"success": False, "error": message, "error_type": type(exc).__name__}
