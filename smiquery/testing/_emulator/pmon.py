"""``nvidia-smi pmon`` in the fake executable (:mod:`smiquery.testing`): per-process lines in pmon's layout.

The processes are the fake's compute apps (``SMIQUERY_FAKE_APPS`` / the bundled list) on the recording's GPUs, or
those ``SMIQUERY_FAKE_PMON_PROCS`` lists (fixed SM/memory %, pids that can be the caller's own); an idle GPU
prints one line of ``-``. ``SMIQUERY_FAKE_PMON=FILE`` replays a pmon capture instead: printed as is, then
(without ``-c``) its data lines again every interval. Faults: the start-up ones, ``exit:``, ``hang``, the
row-counting ones (``hang-after:N``, ``crash-after:N``...; N counts data lines), ``ignore-term``. The variables in
:data:`PMON_ENV_VARS` (listed by ``nvidia-smi pmon -h``) make processes end and pmon stall, counted in samples.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import NoReturn

from smiquery.testing._emulator.core import ArgReader, Output, Settings, hang, usage_error
from smiquery.testing._emulator.faults import Faults, startup
from smiquery.testing._emulator.query import RowWriter, select_gpus
from smiquery.testing._emulator.recording import load_apps, load_recording

__all__ = ["PMON_ENV_VARS", "run_pmon"]

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


_OPTIONS = {"-i": "id", "-d": "delay", "-c": "count", "-s": "select", "-o": "options"}
_OPTIONS |= {"--id": "id", "--delay": "delay", "--count": "count", "--select": "select", "--options": "options"}


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


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    body = "".join(c.rjust(w) for c, w in zip(cells[:-1], widths))
    return f"{body}    {cells[-1][:15]:<15}"


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
    startup(faults, rec, out)
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
                data(_line([values.get(name, "-") for name in names], widths))
        out.flush()
        n += 1
        if count is None or n < count:
            out.sleep(delay)
    return 0
