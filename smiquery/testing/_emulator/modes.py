"""nvidia-smi's output modes in the fake: the CSV queries with the row-counting faults, ``pmon``, ``-q -x`` and ``-L``.

``pmon`` shows the compute apps on the recording's GPUs, or what :data:`PMON_ENV_VARS` set; ``-q -x`` the
``SMIQUERY_FAKE_XML`` capture, else a small XML made from the recording's sweep; ``-L`` lists its GPUs and MIG devices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, NoReturn

from smiquery.errors import InvalidFieldError
from smiquery.fields import Field, Kind
from smiquery.kinds import FIELD_KINDS
from smiquery.sample import bus_key
from smiquery.testing._emulator.core import (
    GPU_LOST_REASON,
    HANDLE_ERROR,
    HELP_HINT,
    INFOROM_WARNING,
    NOISE,
    NOTICE_BATCH,
    ArgReader,
    FakeExit,
    FakeUsageError,
    Faults,
    Output,
    Settings,
    hang,
    is_number,
    startup,
    usage_error,
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
    load_recording,
    norm_bus_id,
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
        if self.reload is not None and self.rows >= self.reload[0]:
            self.reload[1]()
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


def _garbage_line(rng: random.Random, ncols: int) -> bytes:
    """A line that can never pass for a row of ``ncols`` cells: random bytes, invalid UTF-8, wrong cell count."""
    noise = bytes(rng.choice(b"\0" + NOISE) for _ in range(rng.randint(8, 60)))
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
    startup(faults, rec.driver_version, out)
    selected = select_gpus(rec, opts.ids, out)
    writer = RowWriter(out, faults, len(heads), opts.interval, reload)
    if "noheader" not in tokens:
        out.line(", ".join(heads))
    if faults.garbage:  # 12 garbage lines after the header, exit 0
        for _ in range(12):
            out.raw(_garbage_line(writer.rng, len(heads)) + b"\n")
        raise FakeExit(0)
    return writer, selected, "nounits" not in tokens


def _invalid_field(out: Output, name: str) -> NoReturn:
    out.line(f'Field "{name}" is not a valid field to query.')
    out.line()
    raise FakeExit(2)


def _render(value: str | None, unit: str | None) -> str:
    """A cell: ``[N/A]`` for a column the data lack, ``unit`` appended to a value (none to a token)."""
    if value is None:
        return "[N/A]"
    return f"{value} {unit}" if unit and not is_token(value) else value


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
                cell = _render(rec.cell(row, fld.name), fld.header_unit if units else None)
                if lost and fld.name not in _SURVIVES_LOSS:
                    cell = "[GPU is lost]"
                elif fld.name == "timestamp":  # live, or the recorded one moved by clock steps
                    cell = stamp if stamp is not None else clock.recorded(cell, writer.rows)
                cells.append(cell)
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
            cells = [
                _render(stamp if n == "timestamp" else app.get(n), APP_UNITS.get(n) if units else None) for n in names
            ]
            writer.row(cells, bus_id=app.get("gpu_bus_id", ""), truncate=faults.truncated and i == len(apps) - 1)
        out.flush()
        if faults.truncated or opts.interval is None:
            break
        out.sleep(opts.interval)
    writer.check_stop("")
    return 0


#: Environment variables only the pmon mode reads (at every start), and what they do.
PMON_ENV_VARS: dict[str, str] = {
    "SMIQUERY_FAKE_PMON": "pmon capture to replay instead of the compute apps (its data lines again every interval)",
    "SMIQUERY_FAKE_PMON_ENDS": "PID:N[,PID:N...]: that process is printed in the first N samples only, then it has "
    "ended (a GPU left without processes prints its idle line)",
    "SMIQUERY_FAKE_PMON_HANG_AFTER": "N: after N samples pmon prints nothing more and keeps running (a stall of "
    "pmon alone; the --query-gpu loop goes on)",
    "SMIQUERY_FAKE_PMON_PROCS": "GPU:PID:SM:MEM[,...]: pmon's processes instead of the compute apps, with fixed SM "
    "and memory % (`-` for no value); PID may be `self` (this nvidia-smi; in-process, the caller) or `parent` (the "
    "process that started it, e.g. a training run watching its own share)",
    "SMIQUERY_FAKE_PMON_UNSUPPORTED": "1: pmon prints what old GeForce drivers print (`Not supported on the "
    "device(s)`, `Failed to process command line`) and exits 3, while the --query-gpu modes work",
}
_UNSUPPORTED_EXIT = 3  # not captured for pmon; nvidia-smi's NVML_ERROR_NOT_SUPPORTED status (NVIDIA-SMI.md 5)

_MAX_GPUS = 4  # pmon watches at most four devices
_JPG_OFA_FROM = 530  # the fake's first branch with jpg and ofa columns (seen on 590+, absent on R4xx)


_OPTIONS = {opt: name for name in ("id", "delay", "count", "select", "options") for opt in (f"-{name[0]}", f"--{name}")}


def _columns(branch: int, select: str, options: str) -> list[tuple[str, str]]:
    cols: list[tuple[str, str]] = []
    if "D" in options:
        cols.append(("Date", "YYYYMMDD"))
    if "T" in options:
        cols.append(("Time", "HH:MM:SS"))
    cols += [("gpu", "Idx"), ("pid", "#"), ("type", "C/G")]
    if "u" in select:
        cols += [("sm", "%"), ("mem", "%"), ("enc", "%"), ("dec", "%")]
        if branch >= _JPG_OFA_FROM:
            cols += [("jpg", "%"), ("ofa", "%")]
    if "m" in select:
        cols.append(("fb", "MB"))
    cols.append(("command", "name"))
    return cols


def _widths(names: Sequence[str], *, header: bool = False) -> list[int]:
    # the header's pid and type columns are one character wider than the data's (seen in every 590+ capture),
    # so header and data do not line up: columns are found by splitting on blanks, never by position
    fixed = {"Date": 9, "Time": 10, "gpu": 5, "pid": 12 if header else 11, "type": 7 if header else 6}
    return [fixed.get(n, 7) for n in names]


def _ends(text: str, fail: Callable[[str], NoReturn]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        pid, sep, after = item.partition(":")
        if not sep or not pid.isdigit() or not after.isdigit():
            fail(f"SMIQUERY_FAKE_PMON_ENDS takes PID:N items, not {item!r}")
        out[pid] = int(after)
    return out


def _procs(text: str, gpus: Sequence[dict[str, str]], fail: Callable[[str], NoReturn]) -> list[dict[str, str]]:
    """The SMIQUERY_FAKE_PMON_PROCS entries as app-like dicts (``pid``, ``gpu_uuid``, ``sm``, ``mem``...)."""
    by_index = {g["index"]: g for g in gpus}
    out: list[dict[str, str]] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        if len(parts) != 4:
            fail(f"SMIQUERY_FAKE_PMON_PROCS takes GPU:PID:SM:MEM items, not {item!r}")
        gpu, pid, sm, mem = parts
        pid = {"self": str(os.getpid()), "parent": str(os.getppid())}.get(pid, pid)
        if not pid.isdigit() or any(not (v.isdigit() or v == "-") for v in (sm, mem)):
            fail(f"SMIQUERY_FAKE_PMON_PROCS: {item!r} needs a pid (or self/parent) and SM/MEM numbers or -")
        where = by_index.get(gpu)
        if where is None:
            continue  # a GPU this run does not watch (-i) or the recording lacks
        out.append({"pid": pid, "gpu_uuid": where["uuid"], "sm": sm, "mem": mem, "process_name": f"proc-{pid}"})
    return out


def run_pmon(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    """Run ``nvidia-smi pmon ARGS`` against the fake's recording; returns the exit status."""
    opts: dict[str, str] = {}
    args = ArgReader(argv, usage_error(out, "Please run 'nvidia-smi pmon -h' for help."))
    for arg, name, inline in args:
        if arg in ("-h", "--help"):
            opts["help"] = "1"
        elif name in _OPTIONS:
            opts[_OPTIONS[name]] = args.value(name, inline)
        else:
            args.fail(f"Option {name} is not recognized.")
    if "help" in opts:
        out.line("Usage: nvidia-smi pmon [-i ID] [-d SEC] [-c COUNT] [-s um] [-o DT]  (smiquery fake)")
        out.line()
        out.line("Environment variables of the pmon mode (read at every start):")
        out.table(PMON_ENV_VARS)
        return 0
    rec = load_recording(settings.recording)
    startup(faults, rec.driver_version, out)
    if os.environ.get("SMIQUERY_FAKE_PMON_UNSUPPORTED", "") not in ("", "0"):
        out.line("Not supported on the device(s)")
        out.line("Failed to process command line")
        return _UNSUPPORTED_EXIT
    delay = int(opts.get("delay", "1")) if opts.get("delay", "1").isdigit() else 0
    if not 1 <= delay <= 10:
        args.fail("Invalid value for -d (1 to 10 seconds).")
    count = int(opts["count"]) if opts.get("count", "").isdigit() else None
    selected = select_gpus(rec, opts.get("id"), out)
    gpus = [g for g in rec.gpus if g["index"] in selected][:_MAX_GPUS]
    writer = RowWriter(out, faults, 0)

    def data(text: str) -> None:
        writer.check_stop("")
        out.line(text)
        writer.rows += 1

    replay = os.environ.get("SMIQUERY_FAKE_PMON")
    if replay:
        lines = pathlib.Path(replay).read_text(encoding="utf-8").splitlines()
        for text in lines:
            (out.line if text.startswith("#") or not text.strip() else data)(text)
        out.flush()
        body = [t for t in lines if t.strip() and not t.startswith("#")]
        while count is None and body:
            out.sleep(delay)
            for text in body:
                data(text)
            out.flush()
        return 0

    cols = _columns(rec.driver_branch, opts.get("select", "u"), opts.get("options", ""))
    names = [n for n, _ in cols]
    widths = _widths(names)
    head_widths = _widths(names, header=True)
    head = "".join(c.rjust(w) for c, w in zip(names[:-1], head_widths)) + "    command "
    units = "".join(u.rjust(w) for (_, u), w in zip(cols[:-1], head_widths)) + "    name "
    out.line("#" + head[1:])
    out.line("#" + units[1:])
    fail = usage_error(out)
    procs_var = os.environ.get("SMIQUERY_FAKE_PMON_PROCS", "").strip()
    apps = _procs(procs_var, gpus, fail) if procs_var else load_apps(settings.apps, rec)
    ends = _ends(os.environ.get("SMIQUERY_FAKE_PMON_ENDS", ""), fail)
    hang_after = os.environ.get("SMIQUERY_FAKE_PMON_HANG_AFTER", "").strip()
    if not hang_after.isdigit() and hang_after:
        fail(f"SMIQUERY_FAKE_PMON_HANG_AFTER takes a whole number of samples, not {hang_after!r}")
    n = 0
    while count is None or n < count:
        if hang_after and n >= int(hang_after):
            hang(out)
        now = datetime.now()
        for gpu in gpus:
            procs = [
                a
                for a in apps
                if a.get("gpu_uuid", "").lower() == gpu["uuid"].lower() and n < ends.get(a.get("pid", ""), n + 1)
            ]
            if not procs:
                procs = [{}]
            for app in procs:
                pid = app.get("pid", "-")
                busy = (int(pid) * 7 + n * 13) % 100 if pid.isdigit() else None
                sm = app.get("sm", "-" if busy is None else str(busy))
                mem = app.get("mem", "-" if busy is None else str(busy // 4))
                values = {
                    "Date": now.strftime("%Y%m%d"),
                    "Time": now.strftime("%H:%M:%S"),
                    "gpu": gpu["index"],
                    "pid": pid,
                    "type": "C" if app else "-",
                    "sm": sm,
                    "mem": mem,
                    "fb": app["used_gpu_memory"] if app.get("used_gpu_memory", "").isdigit() else "-",
                    "command": app.get("process_name", "-").rsplit("/", 1)[-1] if app else "-",
                }
                cells = [values.get(name, "-") for name in names]
                data("".join(c.rjust(w) for c, w in zip(cells[:-1], widths)) + f"    {cells[-1][:15]:<15}")
        out.flush()
        n += 1
        if count is None or n < count:
            out.sleep(delay)
    return 0


_GPU_RE = re.compile(r"[ \t]*<gpu id=\"[^\"]*\">.*?</gpu>[ \t]*\n?", re.DOTALL)
_SM_PER_SLICE = 14  # A100: 7 slices of 14 SMs (H100: 16; the fake names profiles the A100 way)


def _tag(block: str, name: str) -> str:
    m = re.search(rf"<{name}>\s*([^<]*?)\s*</{name}>", block)
    return m.group(1) if m else ""


def _selected(blocks: Sequence[str], ids: str | None) -> list[int] | None:
    """Positions of the GPUs ``-i`` names (all without ``-i``); None when one id matches no GPU."""
    if not ids:
        return list(range(len(blocks)))

    def names(wanted: str, pos: int, block: str) -> bool:
        gpu_id = re.search(r'id="([^"]*)"', block)
        bus = _tag(block, "pci_bus_id") or (gpu_id.group(1) if gpu_id else "")
        return (
            wanted == str(pos)
            or wanted.lower() == _tag(block, "uuid").lower()
            or (":" in wanted and bool(bus) and bus_key(wanted) == bus_key(bus))
        )

    chosen: list[int] = []
    for wanted in (raw.strip() for raw in ids.split(",")):
        hits = [pos for pos, block in enumerate(blocks) if names(wanted, pos, block)]
        if not hits:
            return None
        if hits[-1] not in chosen:
            chosen.append(hits[-1])
    return chosen


def _synthesized(rec: Recording, settings: Settings) -> str:
    """A small -q -x document for the recording's current sweep (the fields a recording can carry)."""
    from xml.sax.saxutils import escape

    rows = rec.sweep(settings.sweep % len(rec.sweeps))
    apps = load_apps(settings.apps, rec)
    out = [
        '<?xml version="1.0" ?>',
        '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">',
        "<nvidia_smi_log>",
        f"\t<driver_version>{escape(rec.driver_version)}</driver_version>",
        f"\t<attached_gpus>{len(rows)}</attached_gpus>",
    ]
    for pos, row in enumerate(rows):
        ident = rec.gpus[pos] if pos < len(rec.gpus) else rec.gpus[-1]

        def cell(name: str, row: Sequence[str] = row) -> str:
            value = rec.cell(row, name)
            return "N/A" if value is None or value.startswith("[") else value

        out.append(f'\t<gpu id="{escape(ident["pci.bus_id"])}">')
        out.append(f"\t\t<product_name>{escape(ident['name'])}</product_name>")
        mig = cell("mig.mode.current")
        out.append(f"\t\t<mig_mode>\n\t\t\t<current_mig>{mig}</current_mig>\n\t\t</mig_mode>")
        out.append(f"\t\t<uuid>{escape(ident['uuid'])}</uuid>")
        # the device's /dev/nvidia<minor>: real drivers number them in probe order, as the recording's GPUs are
        out.append(f"\t\t<minor_number>{pos}</minor_number>")
        out.append(f"\t\t<pci>\n\t\t\t<pci_bus_id>{escape(ident['pci.bus_id'])}</pci_bus_id>\n\t\t</pci>")
        out.append("\t\t<fb_memory_usage>")
        for part in ("total", "used", "free"):
            value = cell(f"memory.{part}")
            out.append(f"\t\t\t<{part}>{value}{' MiB' if value != 'N/A' else ''}</{part}>")
        out.append("\t\t</fb_memory_usage>")
        out.append("\t\t<clocks_event_reasons>")
        for fld in rec.columns:
            short = fld.name.removeprefix("clocks_event_reasons.")
            if short != fld.name and short not in ("active", "supported"):
                out.append(f"\t\t\t<clocks_event_reason_{short}>{cell(fld.name)}</clocks_event_reason_{short}>")
        out.append("\t\t</clocks_event_reasons>")
        out.append("\t\t<processes>")
        for app in apps:
            if app.get("gpu_uuid", "").lower() == ident["uuid"].lower():
                out.append(
                    "\t\t\t<process_info>\n\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>\n"
                    "\t\t\t\t<compute_instance_id>N/A</compute_instance_id>\n"
                    f"\t\t\t\t<pid>{escape(app.get('pid', '0'))}</pid>\n\t\t\t\t<type>C</type>\n"
                    f"\t\t\t\t<process_name>{escape(app.get('process_name', ''))}</process_name>\n"
                    f"\t\t\t\t<used_memory>{escape(app.get('used_gpu_memory', 'N/A'))} MiB</used_memory>\n"
                    "\t\t\t</process_info>"
                )
        out.append("\t\t</processes>")
        out.append("\t</gpu>")
    out.append("</nvidia_smi_log>")
    return "\n".join(out) + "\n"


def _listing(blocks: Sequence[str], chosen: Sequence[int], out: Output) -> None:
    import hashlib

    for pos in chosen:
        uuid = _tag(blocks[pos], "uuid")
        out.line(f"GPU {pos}: {_tag(blocks[pos], 'product_name')} (UUID: {uuid})")
        for dev in re.findall(r"<mig_device>.*?</mig_device>", blocks[pos], re.DOTALL):
            fb = re.search(r"<fb_memory_usage>(.*?)</fb_memory_usage>", dev, re.DOTALL)
            mib = int(_tag(fb.group(1), "total").removesuffix(" MiB") or 0) if fb else 0
            sms = int(_tag(dev, "multiprocessor_count") or 0)
            profile = f"{max(1, sms // _SM_PER_SLICE)}g.{round(mib / 1024 / 5) * 5 or 5}gb"
            instance = f"{uuid}/{_tag(dev, 'gpu_instance_id')}/{_tag(dev, 'compute_instance_id')}"
            h = hashlib.sha256(instance.encode()).hexdigest()
            mig = f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            out.line(f"  MIG {profile:<12s}Device {_tag(dev, 'index'):>2s}: (UUID: {mig})")


def _parse(argv: Sequence[str]) -> tuple[set[str], str | None]:
    def fail(message: str) -> NoReturn:
        raise FakeUsageError(f"the -q -x / -L emulation: {message}")

    flags = {"-q": "q", "--query": "q", "-x": "x", "--xml-format": "x", "-L": "L", "--list-gpus": "L"}
    found: set[str] = set()
    ids: str | None = None
    args = ArgReader(argv, fail)
    for arg, name, inline in args:
        if name in ("-i", "--id"):
            ids = args.value(name, inline)
        elif arg in flags:
            found.add(flags[arg])
        else:
            fail(f"option {arg!r} is not emulated")
    if "q" in found and "x" not in found:
        fail("only `-q -x` is emulated, not the text form of -q")
    return found, ids


def run_details(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    """Answer ``-q -x [-i IDS]`` or (with an XML set) ``-L``; returns the exit status."""
    flags, ids = _parse(argv)
    rec = load_recording(settings.recording)
    startup(faults, rec.driver_version, out)
    if settings.xml:
        try:
            text = pathlib.Path(settings.xml).read_text(encoding="utf-8")
        except OSError as exc:
            raise FakeUsageError(f"cannot read SMIQUERY_FAKE_XML {settings.xml}: {exc}") from exc
    else:
        text = _synthesized(rec, settings)
    blocks = _GPU_RE.findall(text)
    chosen = _selected(blocks, ids)
    if chosen is None or not blocks:
        out.line("No devices were found")
        return 6
    if "L" in flags:
        _listing(blocks, chosen, out)
        return 0
    if faults.garbage:
        import random

        rng = random.Random(len(text))
        out.raw(bytes(rng.randrange(256) for _ in range(512)) + b"\n")
        return 0
    first = _GPU_RE.search(text)
    head = text[: first.start()] if first else text
    tail = text[text.rfind("</gpu>") + len("</gpu>") :].lstrip(" \t").removeprefix("\n") if first else ""
    doc = head + "".join(blocks[i] for i in chosen) + tail
    if faults.truncated:
        doc = doc[: len(doc) // 2]
    out.raw(doc.encode("utf-8"))
    return 0
