"""The command line and the CSV modes (``--query-gpu``, ``--query-compute-apps``), with the row-counting faults."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, NoReturn

from smiquery.errors import InvalidFieldError
from smiquery.fields import Field, Kind
from smiquery.kinds import FIELD_KINDS
from smiquery.testing._emulator.core import (
    HELP_HINT,
    ArgReader,
    FakeExit,
    Output,
    Settings,
    hang,
    is_number,
    usage_error,
)
from smiquery.testing._emulator.faults import (
    GPU_LOST_REASON,
    HANDLE_ERROR,
    INFOROM_WARNING,
    NOTICE_BATCH,
    Faults,
    startup,
)
from smiquery.testing._emulator.recording import (
    APP_ALIASES,
    APP_FIELDS,
    APP_UNITS,
    Recording,
    Reload,
    Sweeps,
    is_token,
    load_apps,
    norm_bus_id,
    record_reload,
    short_bus_id,
)

if TYPE_CHECKING:
    import random

_ACTIONS = {"-L": "list", "--list-gpus": "list", "-h": "help", "--help": "help", "--fake-help": "help"}
_ACTIONS |= {option: option[2:] for option in ("--help-query-gpu", "--help-query-compute-apps", "--version")}
_VALUES = {"--query-gpu": "query_gpu", "--query-compute-apps": "query_apps", "--format": "fmt", "-i": "ids"}
# On a lost GPU these cells keep their values (NVIDIA-SMI.md section 3); every other cell reads [GPU is lost].
_SURVIVES_LOSS = frozenset({"timestamp", "index", "uuid", "pci.bus_id", "name"})
# The fall-back of `dst-fallback`: 2026-10-25 03:00 CEST (UTC+2) is 02:00 CET (UTC+1), at 01:00 UTC.
_DST_CHANGE_UTC = datetime(2026, 10, 25, 1, 0, 0)


@dataclasses.dataclass
class Options:
    query_gpu: str | None = None
    query_apps: str | None = None
    fmt: str | None = None
    ids: str | None = None
    interval: float | None = None
    action: str | None = None


def parse_args(argv: Sequence[str], out: Output) -> Options:
    opts = Options()
    args = ArgReader(argv, usage_error(out, HELP_HINT))

    def interval(option: str, text: str, scale: float) -> float:
        if not is_number(text) or int(text) <= 0:
            args.fail(f"Invalid value {text!r} for option {option}.")
        return int(text) * scale

    for arg, name, inline in args:
        if arg in _ACTIONS:
            opts.action = opts.action or _ACTIONS[arg]
        elif name in _VALUES or name == "--id":
            setattr(opts, _VALUES.get(name, "ids"), args.value(name, inline))
        elif name in ("-l", "--loop"):
            text = inline if inline is not None else args.optional_number()
            # `-l` without a value loops every 5 seconds (manual)
            opts.interval = interval(name, text, 1.0) if text is not None else 5.0
        elif name in ("-lms", "--loop-ms"):
            opts.interval = interval(name, args.value(name, inline), 0.001)
        else:
            args.fail(f"Option {name} is not recognized.")
    return opts


class Clock:
    """The wall clock behind the timestamp cells: the local time, or ``dst-fallback``'s, plus the clock steps."""

    def __init__(self, faults: Faults, keep_time: bool) -> None:
        self.steps = faults.clock_steps
        self.dst_before = faults.dst_before
        self.keep_time = keep_time and self.dst_before is None
        self.start = time.monotonic()

    def now(self) -> datetime:
        """The instant a sweep starts: local time, or (``dst-fallback``) UTC, to be turned by :meth:`text`."""
        if self.dst_before is None:
            return datetime.now()
        return _DST_CHANGE_UTC + timedelta(seconds=time.monotonic() - self.start - self.dst_before)

    def text(self, instant: datetime, rows: int) -> str:
        """The timestamp cell of a row written after ``rows`` rows, at ``instant`` (from :meth:`now`)."""
        instant += timedelta(seconds=sum(seconds for after, seconds in self.steps if rows >= after))
        if self.dst_before is not None:  # Europe/Berlin: UTC+2 until the change, UTC+1 after it
            instant += timedelta(hours=2 if instant < _DST_CHANGE_UTC else 1)
        return FIELD_KINDS[Kind.TIMESTAMP].format(instant)

    def recorded(self, cell: str, rows: int) -> str:
        """A recorded timestamp cell (``SMIQUERY_FAKE_KEEP_TIME``), moved by the clock steps struck so far."""
        if not any(rows >= after for after, _ in self.steps):
            return cell
        try:
            instant = datetime.strptime(cell.strip(), "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            return cell
        return self.text(instant, rows)


class RowWriter:
    """Writes data rows and springs the row-counting faults (``hang-after``, ``crash-after``...)."""

    def __init__(
        self, out: Output, faults: Faults, ncols: int, interval: float | None = None, reload: Reload | None = None
    ) -> None:
        self.out = out
        self.faults = faults
        self.ncols = ncols
        self.interval = interval
        self.reload = reload
        self.rows = 0

    @functools.cached_property
    def rng(self) -> random.Random:
        import random  # on the first garbage line: not imported per call

        return random.Random(20240521)

    def due(self, limit: int | None) -> bool:
        return limit is not None and self.rows >= limit

    def _device_error(self, next_bus_id: str) -> NoReturn:
        bus = short_bus_id(next_bus_id) if next_bus_id else "0000:00:00.0"
        self.out.line(HANDLE_ERROR.format(bus=bus, reason="Unknown Error"))
        self.out.flush()
        raise FakeExit(255)

    def check_stop(self, next_bus_id: str) -> None:
        """Hang, crash, exit or turn to notices when their row count is reached."""
        if self.due(self.faults.hang_after):
            hang(self.out)
        if self.due(self.faults.crash_after):
            self._device_error(next_bus_id)
        if self.due(self.faults.exit_after):
            if self.faults.exit_after_message:
                self.out.line(self.faults.exit_after_message)
            self.out.flush()
            raise FakeExit(self.faults.exit_after_code)
        while self.due(self.faults.notices_after):  # forever
            for text in NOTICE_BATCH:
                self.out.line(text)
            self.out.flush()
            self.out.sleep(self.interval if self.interval is not None else 1.0)
        if self.reload is not None and self.rows >= self.reload.after:
            record_reload(self.reload.state, self.reload.struck + 1)
            self._device_error(next_bus_id)

    def row(self, cells: list[str], *, bus_id: str = "", truncate: bool = False) -> None:
        self.check_stop(bus_id)
        if self.rows == self.faults.garbage_after:  # once, before row N
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")
        if self.rows == self.faults.wrong_columns_after:
            cells = cells[:-1]
        data = ", ".join(cells).encode("utf-8")
        self.out.raw(data[: max(1, len(data) // 2)] if truncate else data + b"\n")
        self.rows += 1

    def garbage(self) -> NoReturn:
        """The ``garbage`` fault: 12 garbage lines after the header, exit 0."""
        for _ in range(12):
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")
        raise FakeExit(0)


def _garbage_line(rng: random.Random, ncols: int) -> bytes:
    """A line that can never pass for a row of ``ncols`` cells: random bytes, invalid UTF-8, wrong cell count."""
    # no separators and nothing any reader could take for a line break (str.splitlines() knows eight of them)
    alphabet = bytes(b for b in range(256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    noise = bytes(rng.choice(alphabet) for _ in range(rng.randint(8, 60)))
    cells = ncols + 1 + rng.randint(0, 3)
    return b"\xff\xfe" + noise + b", \xc3(" * (cells - 1)


def select_gpus(rec: Recording, ids: str | None, out: Output) -> set[str]:
    """The keys (indices) of the GPUs that ``-i`` selects; exits 6 when an id matches nothing."""
    if ids is None:
        return {rec.key_of(row, pos) for pos, row in enumerate(rec.sweep(0))}

    def matches(ident: str, gpu: dict[str, str]) -> bool:
        return (
            (is_number(ident) and is_number(gpu["index"]) and int(ident) == int(gpu["index"]))
            or ident.lower() == gpu["uuid"].lower()
            or norm_bus_id(ident) == norm_bus_id(gpu["pci.bus_id"])
            or (gpu["serial"] not in ("[N/A]", "") and ident == gpu["serial"])
        )

    wanted = [ident.strip() for ident in ids.split(",") if ident.strip()]
    found = [[gpu["index"] for gpu in rec.gpus if matches(ident, gpu)] for ident in wanted]
    if not found or not all(found):
        out.line("No devices were found")
        raise FakeExit(6)
    return {indices[0] for indices in found}


def _sweep_order(first: int, sweeps: Sweeps, loop: bool) -> Iterator[int]:
    # modulo the sweep count, counted only when needed: counting reads the whole recording
    n = first if sweeps.has(first) else first % len(sweeps)
    yield n
    while loop:
        n = n + 1 if sweeps.has(n + 1) else 0
        yield n


def _start(
    opts: Options, rec: Recording, faults: Faults, out: Output, reload: Reload | None, heads: list[str]
) -> tuple[RowWriter, set[str], bool]:
    """After the field names are checked: the format, the start-up faults, ``-i``, the header; and ``garbage``."""
    tokens = [t.strip() for t in (opts.fmt or "").split(",") if t.strip()]
    if "csv" not in tokens or any(t not in ("csv", "noheader", "nounits") for t in tokens):
        out.line(f"Invalid combination of input arguments. {HELP_HINT}")
        raise FakeExit(2)
    startup(faults, rec, out)
    selected = select_gpus(rec, opts.ids, out)
    writer = RowWriter(out, faults, len(heads), opts.interval, reload)
    if "noheader" not in tokens:
        out.line(", ".join(heads))
    if faults.garbage:
        writer.garbage()
    return writer, selected, "nounits" not in tokens


def _invalid_field(out: Output, name: str) -> NoReturn:
    out.line(f'Field "{name}" is not a valid field to query.')
    out.line()
    raise FakeExit(2)


def _render(fld: Field, value: str | None, units: bool) -> str:
    if value is None:
        return fld.format(None)
    return f"{value} {fld.header_unit}" if units and fld.header_unit and not is_token(value) else value


def query_gpu(
    opts: Options, rec: Recording, settings: Settings, faults: Faults, out: Output, reload: Reload | None
) -> int:
    assert opts.query_gpu is not None
    fields: list[Field] = []
    for name in opts.query_gpu.split(","):
        try:
            fields.append(rec.resolve(name))
        except InvalidFieldError:
            _invalid_field(out, name)
    writer, selected, units = _start(opts, rec, faults, out, reload, [f.header for f in fields])
    clock = Clock(faults, settings.keep_time)
    live = any(f.name == "timestamp" for f in fields) and not (clock.keep_time and "timestamp" in rec.col)
    loop = opts.interval is not None
    warned = False
    for count, n in enumerate(_sweep_order(settings.sweep, rec.sweeps, loop), 1):
        rows = [(rec.key_of(r, pos), r) for pos, r in enumerate(rec.sweep(n))]
        rows = [(key, r) for key, r in rows if key in selected]
        now = clock.now()
        slow = faults.slow_every is not None and count % faults.slow_every == 0
        late = 0.0  # how late this sweep's rows are, once its slow row has come
        for i, (key, row) in enumerate(rows):
            delay = 0.0
            if slow and key == str(faults.slow_index):
                delay = faults.slow_fraction * (opts.interval if opts.interval is not None else 1.0)
                out.flush()  # the rows before it reach the reader on time
                out.sleep(delay)
            if writer.due(faults.drop_gpu_after) and key == str(faults.drop_gpu_index):
                if faults.drop_gpu_message:  # nvidia-smi's `GPU is lost` line in place of the row
                    ident = next((g for g in rec.gpus if g["index"] == key), rec.gpus[0])
                    bus = short_bus_id(rec.cell(row, "pci.bus_id") or ident["pci.bus_id"])
                    out.line(HANDLE_ERROR.format(bus=bus, reason=GPU_LOST_REASON))
                continue
            lost = writer.due(faults.gpu_lost_after) and key == str(faults.gpu_lost_index)
            stamp = clock.text(now + timedelta(seconds=late, milliseconds=i), writer.rows) if live else None
            cells = []
            for fld in fields:
                if lost and fld.name not in _SURVIVES_LOSS:
                    cells.append("[GPU is lost]")
                elif fld.name == "timestamp" and stamp is not None:
                    cells.append(stamp)
                elif fld.name == "timestamp":  # the recorded one, moved by clock steps
                    cells.append(clock.recorded(_render(fld, rec.cell(row, fld.name), units), writer.rows))
                else:
                    cells.append(_render(fld, rec.cell(row, fld.name), units))
            late += delay  # the slow row's timestamp was taken before its slow answer; the rows after it are late
            truncate = faults.truncated and i == len(rows) - 1
            writer.row(cells, bus_id=rec.cell(row, "pci.bus_id") or "", truncate=truncate)
        out.flush()
        if faults.truncated:
            return 0
        if faults.inforom and not warned:
            if not loop:
                writer.check_stop("")
            out.line(INFOROM_WARNING)
            out.flush()
            warned = True
            if not loop:
                return 14
        if opts.interval is not None:
            out.sleep(opts.interval)
    writer.check_stop("")
    return 0


def query_apps(
    opts: Options, rec: Recording, settings: Settings, faults: Faults, out: Output, reload: Reload | None
) -> int:
    assert opts.query_apps is not None
    names: list[str] = []
    for name in opts.query_apps.split(","):
        names.append(APP_ALIASES.get(name, name))
        if names[-1] not in APP_FIELDS:
            _invalid_field(out, name)
    heads = [f"{n} [{APP_UNITS[n]}]" if n in APP_UNITS else n for n in names]
    writer, selected, units = _start(opts, rec, faults, out, reload, heads)
    uuids = {g["uuid"].lower() for g in rec.gpus if g["index"] in selected}
    apps = [a for a in load_apps(settings.apps, rec) if a.get("gpu_uuid", "").lower() in uuids or opts.ids is None]
    clock = Clock(faults, keep_time=False)
    while True:
        stamp = clock.text(clock.now(), writer.rows)
        for i, app in enumerate(apps):
            cells = []
            for n in names:
                value = stamp if n == "timestamp" else app.get(n)
                if value is None:
                    cells.append("[N/A]")
                elif units and n in APP_UNITS and not is_token(value):
                    cells.append(f"{value} {APP_UNITS[n]}")
                else:
                    cells.append(value)
            writer.row(cells, bus_id=app.get("gpu_bus_id", ""), truncate=faults.truncated and i == len(apps) - 1)
        out.flush()
        if faults.truncated or opts.interval is None:
            break
        out.sleep(opts.interval)
    writer.check_stop("")
    return 0
