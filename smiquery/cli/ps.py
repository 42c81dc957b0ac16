"""``smiquery ps``: the compute processes on each GPU, with their user, command line and CPU use from /proc.

``--watch`` shows which of them keep each GPU busy, live, from ``nvidia-smi pmon`` (several children, 4 GPUs each).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Literal, NamedTuple

import typer

from smiquery.cli._boundary import boundary, cli_text, quiet_stdout, say
from smiquery.cli._common import FormatOpt, GpusOpt, app, settings_of
from smiquery.cli._options import Settings, choose_format, gpu_ids_checked, is_tty, parse_gpus, parse_seconds
from smiquery.cli._signals import END, Failure, Signals, SourceEvent, start_pump
from smiquery.cli.keys import KEY_HELP, KeyReader, Viewport
from smiquery.errors import NotSupportedError, NvidiaSmiFailedError, StreamEndedError, UsageError
from smiquery.retry import RetryPolicy
from smiquery.sources.pmon import pmon_unsupported, proc_stat

if TYPE_CHECKING:
    from smiquery.cli.display import Column
    from smiquery.source import StreamEvent
    from smiquery.sources.pmon import PmonRow

__all__ = ["ProcCache", "ProcInfo", "PsSort", "pmon_interval", "proc_info", "ps", "run_watch"]

_CPU_WINDOW = 0.1  # seconds between the two reads of a process's CPU time


@dataclass(frozen=True)
class ProcInfo:
    """What /proc tells about one process (``cpu_percent``: of one core, over 0.1 s); None where it cannot."""

    user: str | None = None
    command: str | None = None
    cpu_percent: float | None = None


def _cpu_ticks(pid: int) -> int | None:
    stat = proc_stat(pid)
    try:
        return int(stat[11]) + int(stat[12])  # utime + stime
    except (IndexError, ValueError):
        return None


def _identity(pid: int, name: str | None) -> ProcInfo | None:
    """User and command line of ``pid``, or None when /proc cannot tell or it is another process than ``name``."""
    from smiquery.sources.pmon import process_user

    proc = Path(f"/proc/{pid}")
    try:
        raw = (proc / "cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    if name:  # in a container, PIDs are the host's: this pid may be someone else here
        want = os.path.basename(name.split()[0]) if name.split() else name
        try:
            comm = (proc / "comm").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            comm = ""
        seen = {comm, *(os.path.basename(a) for a in argv[:2])}
        if not any(want == s or (len(comm) == 15 and want.startswith(s)) for s in seen if s):
            return None
    return ProcInfo(process_user(pid), " ".join(argv) or None)


def proc_info(processes: Mapping[int, str | None]) -> dict[int, ProcInfo]:
    """User, command line and CPU use of each pid (-> the name nvidia-smi gave it); all None where unreadable."""
    first: dict[int, int] = {}
    out: dict[int, ProcInfo] = {}
    start = time.monotonic()
    for pid, name in processes.items():
        info = _identity(pid, name)
        out[pid] = info or ProcInfo()
        ticks = _cpu_ticks(pid) if info is not None else None
        if ticks is not None:
            first[pid] = ticks
    if first:
        time.sleep(max(0.0, _CPU_WINDOW - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        hz = os.sysconf("SC_CLK_TCK")
        for pid, before in first.items():
            after = _cpu_ticks(pid)
            if after is not None and elapsed > 0:
                out[pid] = replace(out[pid], cpu_percent=round(100.0 * (after - before) / hz / elapsed, 1))
    return out


class ProcCache:
    """User and full command line of each pid from /proc, read once per process (a pid seen again is cached)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str | None], ProcInfo] = {}

    def lookup(self, pid: int, name: str | None) -> ProcInfo:
        """User and command line of ``pid``; None for what /proc cannot tell or when it is another process."""
        if (pid, name) not in self._known:
            self._known[pid, name] = _identity(pid, name) or ProcInfo()
        return self._known[pid, name]

    def keep(self, pids: set[tuple[int, str | None]]) -> None:
        """Forget processes no longer listed (their pids may be reused)."""
        self._known = {k: info for k, info in self._known.items() if k in pids}


_MAX_GPUS = 4  # nvidia-smi pmon watches at most four devices
_DESCENDING = frozenset({"sm", "mem", "fb"})  # busiest first; pid and gpu ascend
_DELAY = re.compile(r"\bin (\d+(?:\.\d+)?) s\b")


#: What ``ps --watch --sort`` orders by.
PsSort = Literal["sm", "mem", "fb", "pid", "gpu"]


def _pmon_reason(exc: BaseException) -> str:
    """What went wrong, in nvidia-smi's own words: its first output line that is no header (``#``) or row.

    (The runner keeps pmon's rows among the lines it quotes: they hold no ``", "``; they start with blanks or digits.)
    """
    if isinstance(exc, StreamEndedError) and exc.returncode == 0 and not exc.output.strip():
        return "nvidia-smi pmon ended by itself"
    if isinstance(exc, NvidiaSmiFailedError):
        said = [
            ln.strip()
            for ln in exc.output.splitlines()
            if ln.strip() and not ln.startswith("#") and not ln[:1].isspace() and not ln[:1].isdigit()
        ]
        if said:
            return cli_text(f"nvidia-smi pmon exited with code {exc.returncode}: {said[0]}")
        return f"nvidia-smi pmon exited with code {exc.returncode}"
    text = str(exc).splitlines()
    return cli_text(text[0]) if text and text[0] else type(exc).__name__


def _final_error(exc: BaseException) -> BaseException:
    """The error that ends the command, with pmon's own message (and, when pmon is unsupported, what to do)."""
    if not isinstance(exc, NvidiaSmiFailedError):
        return exc
    reason = _pmon_reason(exc)
    if pmon_unsupported(exc):
        return NotSupportedError(
            exc.argv,
            exc.returncode,
            exc.output,
            f"per-process monitoring (nvidia-smi pmon) is not supported on this GPU or driver ({reason}); "
            "`smiquery ps` without --watch still lists each process's GPU memory",
        )
    return type(exc)(exc.argv, exc.returncode, exc.output, f"{reason}; {exc.hint}")


def _event_line(event: StreamEvent) -> str | None:
    """The line for a pmon restart (with the error behind it), recovery or dropped line; none for an error."""
    if event.kind == "restart":
        found = _DELAY.search(event.detail)
        when = f" in {float(found.group(1)):.1f} s" if found else ""
        why = _pmon_reason(event.error) if event.error is not None else cli_text(event.detail)
        return f"smiquery: restarting nvidia-smi pmon{when} after: {why}"
    if event.kind == "recovered":
        return "smiquery: nvidia-smi pmon rows flow again"
    if event.kind == "dropped_row":
        return f"smiquery: warning: dropped a line nvidia-smi pmon printed: {cli_text(event.detail)}"
    return None


def _records(instant: Sequence[PmonRow], sort: str, procs: ProcCache) -> list[dict[str, object]]:
    from smiquery.sources.pmon import sort_rows

    rows = sorted((r for r in instant if not r.idle), key=lambda r: (r.gpu if r.gpu is not None else -1, r.pid or 0))
    rows = sort_rows(rows, sort, descending=sort in _DESCENDING)
    stamp = _instant_time(instant).isoformat()  # as CSV and JSON show it (a table shows no time column)
    out: list[dict[str, object]] = []
    for r in rows:
        info = procs.lookup(r.pid, r.command) if r.pid is not None else ProcInfo()
        out.append(
            {
                "time": stamp,
                "gpu_index": r.gpu,
                "pid": r.pid,
                "type": r.type,
                "user": info.user,
                "sm": r.sm,
                "mem": r.mem,
                "used_memory": r.fb,
                "process_name": r.command,
                "command": info.command or r.command,
            }
        )
    procs.keep({(r.pid, r.command) for r in rows if r.pid is not None})
    return out


def _instant_time(instant: Sequence[PmonRow]) -> datetime:
    stamps = (r.timestamp for r in instant if r.timestamp is not None)
    return next(stamps, None) or datetime.now().replace(microsecond=0)


def _columns(table: bool) -> list[Column]:
    from smiquery.cli.display import UNKNOWN_USER, Column

    return [
        *([] if table else [Column("time")]),
        Column("gpu_index", "gpu" if table else "gpu_index", right=True),
        Column("pid", right=True),
        *([] if table else [Column("type")]),
        Column("user", missing=UNKNOWN_USER),
        Column("sm", unit="%", right=True),
        Column("mem", unit="%", right=True),
        Column("used_memory", "gpu mem" if table else "used_memory", unit="MiB", right=True),
        *([] if table else [Column("process_name")]),
        Column("command"),
    ]


def _idle_note(instant: Sequence[PmonRow]) -> str:
    busy = {r.gpu for r in instant if not r.idle}
    idle = sorted({r.gpu for r in instant if r.idle and r.gpu is not None and r.gpu not in busy})
    return f" · idle GPU {', '.join(map(str, idle))}" if idle else ""


class _Blocks:
    """Piped output: one block per instant (a table, CSV rows under one header, JSON lines, or a JSON array)."""

    def __init__(self, out: IO[str], form: str) -> None:
        self.out = out
        self.form = form
        self.columns = _columns(form == "table")
        self._header_done = False

    def show(self, instant: Sequence[PmonRow], records: list[dict[str, object]]) -> None:
        from smiquery.cli.display import render

        when = _instant_time(instant)
        if self.form == "table":
            text = f"# {when.isoformat(sep=' ')}{_idle_note(instant)}\n"
            text += render(records, "table", columns=self.columns, empty="no processes") + "\n"
        elif self.form == "json":
            text = json.dumps(records) + "\n"  # one array per instant, one per line
        else:
            text = render(records, self.form, columns=self.columns)
            if self.form == "csv":
                text = text.partition("\n")[2] if self._header_done else text
                self._header_done = True
        self.out.write(text)
        self.out.flush()


class _Live:
    """A terminal: the table redrawn in place every interval (cursor home, lines rewritten, the rest cleared)."""

    def __init__(self, out: IO[str], title: str) -> None:
        from smiquery.cli.display import use_color

        self.out = out
        self.title = title
        self.color = use_color(out)
        self.columns = _columns(True)
        self._events: list[str] = []
        self._records: list[dict[str, object]] = []
        self._after: list[str] = []  # the line under the table (none before the first sample)
        self._started = False
        self.view = Viewport({}, "")

    def show(self, instant: Sequence[PmonRow], records: list[dict[str, object]]) -> None:
        self._records = records
        self._after = [f"sampled {_instant_time(instant).strftime('%H:%M:%S')}{_idle_note(instant)}"]
        self.draw()

    def _body(self, room: int) -> list[str]:
        """The table with the rows that fit ``room`` lines, and a line saying which are shown of how many."""
        from smiquery.cli.display import render

        if not self._after:
            return ["waiting for the first sample..."]
        view = self.view
        words = ("gpu_index", "pid", "user", "command")
        matching = [r for r in self._records if view.matches(" ".join(str(r.get(k)) for k in words))]
        shown = view.window(matching, max(1, room - 2), lambda r: False)
        table = render(shown, "table", columns=self.columns, color=self.color, empty="no processes").splitlines()
        where = view.status("processes", len(shown), len(matching), len(self._records))
        if len(shown) < len(matching):
            where += " · PgDn/↓ for more"
        return [*table, "", *([where] if where else []), *self._after]

    def note(self, line: str) -> None:
        """A notice for the legend (stderr is this terminal: a line there would tear the table)."""
        self._events.append(line.removeprefix("smiquery: "))
        del self._events[:-4]
        self.draw()

    def draw(self) -> None:
        from smiquery.cli.display import frame_text, paint, terminal_size

        cols, rows = terminal_size()
        legend = [*self._events, "n/a = not available, ? = user not known", f"{KEY_HELP} · Ctrl-C to stop"]
        after = [paint(x, "dim", self.color) for x in legend]
        room = rows - 1 - 1 - len(after) - 1 - 2 if rows > 0 else 1 << 30  # title, header, blank, footer lines
        lines = [paint(self.title, "header", self.color), *self._body(room), *after]
        if rows > 0 and len(lines) > rows - 1:
            lines = lines[: max(1, rows - 1)]
        self.out.write(frame_text(lines, cols, first=not self._started))
        self.out.flush()
        self._started = True

    def close(self) -> None:
        """Show the cursor again; the last frame stays on screen."""
        from smiquery.cli.display import show_cursor

        if self._started:
            show_cursor(self.out)


class _Instant(NamedTuple):
    """One instant of the pmon child watching group ``group`` of the GPUs."""

    group: int
    rows: tuple[PmonRow, ...]


class _Merge:
    """The instants of several pmon children (4 GPUs each) as one refresh of all GPUs.

    A refresh is shown once every child has given a new instant, or when one gives its next before the others
    (a slow or restarting child does not hold the view back; its GPUs keep their last rows).
    """

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.latest: dict[int, tuple[PmonRow, ...]] = {}
        self.fresh: set[int] = set()

    def add(self, item: _Instant) -> list[tuple[PmonRow, ...]]:
        """The refreshes this instant completes (none, one, or two when it comes again before the others)."""
        out: list[tuple[PmonRow, ...]] = []
        if item.group in self.fresh:
            out.append(self.merged())
            self.fresh.clear()
        self.latest[item.group] = item.rows
        self.fresh.add(item.group)
        if len(self.fresh) == self.groups:
            out.append(self.merged())
            self.fresh.clear()
        return out

    def merged(self) -> tuple[PmonRow, ...]:
        return tuple(r for g in sorted(self.latest) for r in self.latest[g])


def _gpu_groups(ids: tuple[str, ...] | None, settings: Settings) -> list[tuple[str, ...] | None]:
    """The GPUs of each pmon child, 4 at most (pmon's limit); [None] (pmon's default: all) for up to 4 GPUs.

    Without ``--gpus`` the GPUs are listed first; when that fails, the one child reports it with its typed error.
    """
    if not ids:
        from smiquery.errors import SmiqueryError
        from smiquery.sources.query_gpu import query

        try:
            found = query(["index"], nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        except SmiqueryError:
            return [None]
        if len(found) <= _MAX_GPUS:
            return [None]
        ids = tuple(str(s.index) for s in found)
    return [ids[i : i + _MAX_GPUS] for i in range(0, len(ids), _MAX_GPUS)]


def run_watch(
    settings: Settings,
    gpus: str | None,
    interval: int,
    count: int | None,
    duration: float | None,
    sort: str,
    fmt: str | None,
) -> int:
    """Run ``ps --watch`` until ``count`` refreshes (``interval`` s apart), ``duration`` s, a signal or a fault.

    Returns the exit code (0, 130, 143). Raises the SmiqueryError when pmon is unsupported, or failed before the
    first refresh in a way a restart cannot fix; later failures are retried under the stream's policy.
    """
    from smiquery.streams.pmon import stream

    ids = parse_gpus(gpus)
    out = sys.stdout
    form = choose_format(fmt, out)
    items: queue.SimpleQueue[object] = queue.SimpleQueue()
    sources = [
        stream(
            gpus=group,
            interval=interval,
            select="um",
            options="DT",
            nvidia_smi=settings.nvidia_smi,
            stall_timeout=max(settings.timeout, 3.0 * interval),
            # interactive: a fault before the first refresh ends the command with its typed error
            retry=RetryPolicy(fail_fast=True),
            on_event=lambda ev: items.put(SourceEvent(ev)),
        )
        for group in _gpu_groups(ids, settings)
    ]
    view: _Live | _Blocks
    if is_tty(out) and form == "table":
        children = f" · {len(sources)} pmon children" if len(sources) > 1 else ""
        title = f"smiquery ps --watch · every {interval} s · sorted by {sort}{children} · {sources[0].argv[0]}"
        view = _Live(out, title)
    else:
        view = _Blocks(out, form)
    procs = ProcCache()
    threads: list[threading.Thread] = []
    merge = _Merge(len(sources))
    failure: BaseException | None = None
    shown = 0
    ended = 0
    live = view if isinstance(view, _Live) else None
    note = live.note if live is not None and is_tty(sys.stderr) else say
    reader = KeyReader(items.put) if live is not None else contextlib.nullcontext()
    with Signals() as sigs, reader:
        try:
            if live is not None:
                live.draw()
            threads = [
                start_pump(src.samples, items, name=f"smiquery-pmon-pump-{g}", wrap=functools.partial(_Instant, g))
                for g, src in enumerate(sources)
            ]
            deadline = time.monotonic() + duration if duration is not None else None
            while count is None or shown < count:
                if sigs.signum is not None or (deadline is not None and time.monotonic() >= deadline):
                    break
                try:
                    item = items.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(item, str):  # a key typed: scroll or filter
                    if live is not None and live.view.key(item):
                        live.draw()
                elif isinstance(item, SourceEvent):
                    if item.event.kind == "error" and pmon_unsupported(item.event.error):
                        failure = item.event.error  # pmon said so: restarting cannot help
                        break
                    line = _event_line(item.event)
                    if line is not None:
                        note(line)
                elif isinstance(item, Failure):
                    failure = item.exc
                    break
                elif item is END:
                    ended += 1
                    if ended == len(sources):
                        break
                else:
                    assert isinstance(item, _Instant)
                    for instant in merge.add(item):
                        if count is not None and shown >= count:
                            break
                        view.show(instant, _records(instant, sort, procs))
                        shown += 1
        except BrokenPipeError:
            quiet_stdout()  # the reader went away (`| head`): a normal end
        finally:
            sigs.closing = True
            for src in sources:
                with contextlib.suppress(Exception):
                    src.close()  # each reaps its own child
            for thread in threads:
                thread.join(max(10.0, 2.0 * interval))
            if live is not None:
                live.close()
            code = sigs.exit_code
    if failure is not None and code == 0:
        with gpu_ids_checked(ids, settings):
            raise _final_error(failure) from None
    return code


@app.command(
    epilog="""\b
User, command line and CPU% come from /proc; they show as n/a (null in
JSON) where /proc cannot tell: another PID namespace (a container), or
no permission.

\b
--watch runs nvidia-smi pmon, one child per 4 GPUs (pmon's limit), so every
GPU (or each of --gpus) is watched, and shows every process's SM %,
memory-controller % and GPU memory,
refreshed every --interval (1 to 10 s): redrawn in place on a terminal; piped,
one block per refresh (CSV rows under one header, JSON lines, a JSON array
per line with --format json, or a table with --format table), flushed each
time so `| head` works. An instant is known whole when pmon starts the next
one, so the view lags one interval. Values pmon does not give show as n/a
(--sort puts them last). Restarts of pmon print one line each on stderr;
Ctrl-C stops cleanly (exit 130).

\b
Examples:
  smiquery ps
  smiquery ps --gpus 0 --format json
  smiquery ps --watch --sort fb
  smiquery ps --watch --interval 5s --duration 1m --format csv > busy.csv
"""
)
def ps(
    ctx: typer.Context,
    gpus: GpusOpt = None,
    fmt: FormatOpt = None,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Live per-process GPU use (SM %, memory) from nvidia-smi pmon.")
    ] = False,
    interval: Annotated[
        str | None,
        typer.Option(
            "--interval",
            "-l",
            metavar="DURATION",
            help="--watch: time between refreshes: 1, 2s, 5 (pmon refreshes every 1 to 10 whole seconds; a shorter "
            "or fractional one is rounded up, with a note). [default: 1]",
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option("--duration", "-d", metavar="DURATION", help="--watch: stop after this long: 30s, 10m, 1h."),
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", "-n", min=1, metavar="N", help="--watch: stop after N refreshes.")
    ] = None,
    sort: Annotated[
        PsSort | None,
        typer.Option(
            "--sort",
            "-s",
            case_sensitive=False,
            help="--watch: order by sm, mem, fb (GPU memory; these busiest first), pid or gpu. [default: sm]",
        ),
    ] = None,
) -> None:
    """List compute processes per GPU: memory, user, CPU% and command line (like `gpustat -upc`).

    One row per process holding GPU memory, sorted by GPU index, then pid. With --watch: which processes keep
    each GPU busy, live (like `nvtop`'s process list).
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        if watch:
            stop_after = parse_seconds(duration, "--duration") if duration is not None else None
            raise typer.Exit(run_watch(settings, gpus, pmon_interval(interval), count, stop_after, sort or "sm", fmt))
        options = (("--interval", interval), ("--duration", duration), ("--count", count), ("--sort", sort))
        given = [name for name, value in options if value]
        if given:
            verb = "goes" if len(given) == 1 else "go"
            raise UsageError(f"{' and '.join(given)} only {verb} with --watch; add --watch")
        from smiquery.cli.display import UNKNOWN_USER, Column, render, use_color
        from smiquery.sources.apps import processes

        ids = parse_gpus(gpus)
        form = choose_format(fmt, sys.stdout)
        with gpu_ids_checked(ids, settings):
            procs = processes(gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        info = proc_info({p.pid: p.process_name for p in procs if p.pid is not None})
        records: list[dict[str, object]] = []
        for p in procs:
            extra = info.get(p.pid, ProcInfo()) if p.pid is not None else ProcInfo()
            records.append(
                {
                    "gpu_index": p.gpu_index,
                    "gpu_uuid": p.gpu_uuid,
                    "pid": p.pid,
                    "user": extra.user,
                    "cpu_percent": extra.cpu_percent,
                    "used_memory": p.used_memory,
                    "process_name": p.process_name,
                    "command": extra.command,
                    **({"_missing": dict(p.missing)} if p.missing else {}),
                }
            )
        table = form == "table"
        columns = [
            Column("gpu_index", "gpu" if table else "gpu_index", right=True),
            *([] if table else [Column("gpu_uuid")]),
            Column("pid", right=True),
            Column("user", missing=UNKNOWN_USER),
            Column("cpu_percent", "cpu" if table else "cpu_percent", unit="%", right=True),
            Column("used_memory", "used_memory" if not table else "gpu mem", unit="MiB", right=True),
            Column("process_name", "process" if table else "process_name"),
            Column("command"),
        ]
        text = render(records, form, columns=columns, color=use_color(sys.stdout), empty="no compute processes")
        sys.stdout.write(text)
        sys.stdout.flush()


def pmon_interval(text: str | None) -> int:
    """``--interval`` as pmon takes it: whole seconds 1 to 10 (else rounded up, with a note); UsageError past 10 s."""
    if text is None:
        return 1
    seconds = parse_seconds(text, "--interval")
    if seconds > 10:
        raise UsageError(f"--interval: nvidia-smi pmon refreshes at most every 10 s, not {text}; use 1 to 10 s")
    whole = max(1, math.ceil(seconds - 1e-9))
    if whole != seconds:
        say(f"smiquery: note: nvidia-smi pmon refreshes every whole second (1 to 10); using {whole} s for {text}")
    return whole
