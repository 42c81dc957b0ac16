"""``smiquery ps``: the compute processes on each GPU, with their user, command line and CPU use from /proc.

``--watch`` (in :mod:`smiquery.cli.ps.watch`) shows which of them keep each GPU busy, live, from ``nvidia-smi pmon``.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated

import typer

from smiquery.cli._boundary import boundary, say
from smiquery.cli._common import FormatOpt, GpusOpt, app, settings_of
from smiquery.cli._options import choose_format, gpu_ids_checked, parse_gpus, parse_seconds
from smiquery.cli.ps.proc import ProcInfo, proc_info
from smiquery.cli.ps.watch import PsSort
from smiquery.cli.ps.watch import watch as run_watch
from smiquery.errors import UsageError

__all__ = ["ps"]


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
            show_default=False,
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
            show_default=False,
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
            code = run_watch(
                settings,
                gpus=gpus,
                interval=pmon_interval(interval),
                count=count,
                duration=parse_seconds(duration, "--duration") if duration is not None else None,
                sort=sort or "sm",
                fmt=fmt,
            )
            if code:
                raise typer.Exit(code)
            return
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
            rec: dict[str, object] = {
                "gpu_index": p.gpu_index,
                "gpu_uuid": p.gpu_uuid,
                "pid": p.pid,
                "user": extra.user,
                "cpu_percent": extra.cpu_percent,
                "used_memory": p.used_memory,
                "process_name": p.process_name,
                "command": extra.command,
            }
            if p.missing:
                rec["_missing"] = dict(p.missing)
            records.append(rec)
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
    """``--interval`` as pmon takes it: whole seconds, 1 to 10 (shorter or fractional: rounded up, with a note).

    Raises:
        UsageError: not a duration, or longer than 10 s.
    """
    if text is None:
        return 1
    seconds = parse_seconds(text, "--interval")
    if seconds > 10:
        raise UsageError(f"--interval: nvidia-smi pmon refreshes at most every 10 s, not {text}; use 1 to 10 s")
    whole = max(1, math.ceil(seconds - 1e-9))
    if whole != seconds:
        say(f"smiquery: note: nvidia-smi pmon refreshes every whole second (1 to 10); using {whole} s for {text}")
    return whole
