"""``--query-gpu`` and ``--query-compute-apps``: the CSV modes, one-shot and looping, with their faults."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

from smiquery.errors import InvalidFieldError
from smiquery.fields import Field
from smiquery.testing._emulator.apps import APP_ALIASES, APP_FIELDS, load_apps
from smiquery.testing._emulator.args import Options
from smiquery.testing._emulator.faults import GPU_LOST_REASON, HANDLE_ERROR, INFOROM_WARNING, Faults, startup
from smiquery.testing._emulator.output import HELP_HINT, FakeExit, Output
from smiquery.testing._emulator.recording import MappedSweeps, Recording, Sweeps, is_token, norm_bus_id, short_bus_id
from smiquery.testing._emulator.reload import Reload
from smiquery.testing._emulator.rows import Clock, RowWriter
from smiquery.testing._emulator.settings import Settings, is_number

# On a lost GPU these cells keep their values (NVIDIA-SMI.md section 3); every other cell reads [GPU is lost].
_SURVIVES_LOSS = frozenset({"timestamp", "index", "uuid", "pci.bus_id", "name"})


def _invalid_field(out: Output, name: str) -> NoReturn:
    out.line(f'Field "{name}" is not a valid field to query.')
    out.line()
    raise FakeExit(2)


def _format_flags(args_fmt: str | None, out: Output) -> tuple[bool, bool]:
    """(header, units) from ``--format``."""
    tokens = [t.strip() for t in (args_fmt or "").split(",") if t.strip()]
    if "csv" not in tokens or any(t not in ("csv", "noheader", "nounits") for t in tokens):
        out.line(f"Invalid combination of input arguments. {HELP_HINT}")
        raise FakeExit(2)
    return "noheader" not in tokens, "nounits" not in tokens


def select_gpus(rec: Recording, ids: str | None, out: Output) -> set[str]:
    """The keys (indices) of the GPUs that ``-i`` selects; exits 6 when an id matches nothing."""
    if ids is None:
        return {rec.key_of(row, pos) for pos, row in enumerate(rec.sweeps[0])}
    wanted = [i.strip() for i in ids.split(",") if i.strip()]
    chosen: set[str] = set()
    for ident in wanted:
        match = None
        for gpu in rec.gpus:
            if (
                (is_number(ident) and is_number(gpu["index"]) and int(ident) == int(gpu["index"]))
                or ident.lower() == gpu["uuid"].lower()
                or norm_bus_id(ident) == norm_bus_id(gpu["pci.bus_id"])
                or (gpu["serial"] not in ("[N/A]", "") and ident == gpu["serial"])
            ):
                match = gpu["index"]
                break
        if match is None:
            out.line("No devices were found")
            raise FakeExit(6)
        chosen.add(match)
    if not chosen:
        out.line("No devices were found")
        raise FakeExit(6)
    return chosen


def _sweep_order(first: int, sweeps: Sweeps | MappedSweeps, loop: bool) -> Iterator[int]:
    # modulo the sweep count, counted only when needed: counting reads the whole recording
    n = first if sweeps.has(first) else first % len(sweeps)
    if not loop:
        yield n
        return
    while True:
        yield n
        n = n + 1 if sweeps.has(n + 1) else 0


def _render(fld: Field, value: str | None, units: bool) -> str:
    if value is None:
        return fld.format(None)
    if units and fld.header_unit and not is_token(value):
        return f"{value} {fld.header_unit}"
    return value


def _dropped(rec: Recording, key: str, row: list[str], faults: Faults, out: Output) -> None:
    """``drop-gpu-after``: the GPU's row is left out, with nvidia-smi's `GPU is lost` line under ``:message``."""
    if faults.drop_gpu_message:
        ident = next((g for g in rec.gpus if g["index"] == key), rec.gpus[0])
        bus = short_bus_id(rec.cell(row, "pci.bus_id") or ident["pci.bus_id"])
        out.line(HANDLE_ERROR.format(bus=bus, reason=GPU_LOST_REASON))


def _cells(
    fields: list[Field],
    rec: Recording,
    row: list[str],
    units: bool,
    lost: bool,
    stamp: str | None,
    clock: Clock,
    rows: int,
) -> list[str]:
    """One GPU's cells: ``stamp`` is the timestamp cell, or None to keep the recorded one (moved by clock steps)."""
    cells = []
    for fld in fields:
        if lost and fld.name not in _SURVIVES_LOSS:
            cells.append("[GPU is lost]")
        elif fld.name == "timestamp" and stamp is not None:
            cells.append(stamp)
        elif fld.name == "timestamp":
            cells.append(clock.recorded(_render(fld, rec.cell(row, fld.name), units), rows))
        else:
            cells.append(_render(fld, rec.cell(row, fld.name), units))
    return cells


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
    header, units = _format_flags(opts.fmt, out)
    startup(faults, rec, out)
    selected = select_gpus(rec, opts.ids, out)
    clock = Clock(faults, settings.keep_time)
    keep_time = clock.keep_time and "timestamp" in rec.col
    stamped = any(f.name == "timestamp" for f in fields)
    loop = opts.interval is not None
    writer = RowWriter(out, faults, len(fields), opts.interval, reload)
    if header:
        out.line(", ".join(f.header for f in fields))
    if faults.garbage:
        writer.garbage()
        out.flush()
        return 0
    warned = False
    for count, n in enumerate(_sweep_order(settings.sweep, rec.sweeps, loop), 1):
        rows = [(rec.key_of(r, pos), r) for pos, r in enumerate(rec.sweeps[n])]
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
            dropped = faults.drop_gpu_after is not None and writer.rows >= faults.drop_gpu_after
            if dropped and key == str(faults.drop_gpu_index):
                _dropped(rec, key, row, faults, out)
                continue
            lost = (
                faults.gpu_lost_after is not None
                and writer.rows >= faults.gpu_lost_after
                and key == str(faults.gpu_lost_index)
            )
            live = stamped and not keep_time
            stamp = None if not live else clock.text(now + timedelta(seconds=late, milliseconds=i), writer.rows)
            cells = _cells(fields, rec, row, units, lost, stamp, clock, writer.rows)
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
        if loop:
            assert opts.interval is not None
            out.sleep(opts.interval)
    writer.check_stop("")
    return 0


def query_apps(
    opts: Options, rec: Recording, settings: Settings, faults: Faults, out: Output, reload: Reload | None
) -> int:
    assert opts.query_apps is not None
    names: list[str] = []
    for name in opts.query_apps.split(","):
        canonical = APP_ALIASES.get(name, name)
        if canonical not in APP_FIELDS:
            _invalid_field(out, name)
        names.append(canonical)
    header, units = _format_flags(opts.fmt, out)
    startup(faults, rec, out)
    selected = select_gpus(rec, opts.ids, out)
    uuids = {g["uuid"].lower() for g in rec.gpus if g["index"] in selected}
    apps = [a for a in load_apps(settings.apps, rec) if a.get("gpu_uuid", "").lower() in uuids or opts.ids is None]
    writer = RowWriter(out, faults, len(names), opts.interval, reload)
    if header:
        out.line(", ".join(f"{n} [{APP_FIELDS[n]}]" if APP_FIELDS[n] else n for n in names))
    if faults.garbage:
        writer.garbage()
        out.flush()
        return 0
    clock = Clock(faults, keep_time=False)
    while True:
        stamp = clock.text(clock.now(), writer.rows)
        for i, app in enumerate(apps):
            cells = []
            for n in names:
                value = stamp if n == "timestamp" else app.get(n)
                if value is None:
                    cells.append("[N/A]")
                elif units and APP_FIELDS[n] and not is_token(value):
                    cells.append(f"{value} {APP_FIELDS[n]}")
                else:
                    cells.append(value)
            writer.row(cells, bus_id=app.get("gpu_bus_id", ""), truncate=faults.truncated and i == len(apps) - 1)
        out.flush()
        if faults.truncated or opts.interval is None:
            break
        out.sleep(opts.interval)
    writer.check_stop("")
    return 0
