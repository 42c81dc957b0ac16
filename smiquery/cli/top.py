"""``smiquery top``: every GPU of the fleet, read from Prometheus, in one terminal screen."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smiquery.cli._boundary import boundary
from smiquery.cli._common import app, settings_of
from smiquery.cli.fleet_options import MAX_ANSWER_HELP

if TYPE_CHECKING:
    from smiquery.fleet import FleetGpu

__all__ = ["TopFormat", "TopSort", "render_screen", "top"]


class TopSort(str, Enum):
    """``--sort``: by node, or by a value, largest first."""

    node = "node"
    util = "util"
    mem = "mem"
    temp = "temp"
    power = "power"


class TopFormat(str, Enum):
    """``--format``: a screen for people, or every GPU as JSON or CSV."""

    table = "table"
    json = "json"
    csv = "csv"


_EPILOG = """\b
Examples:
  smiquery top --prometheus http://prometheus:9090
  smiquery top --prometheus http://prometheus:9090 --sort util --node 'gpu-a.*'
  smiquery top --prometheus http://prometheus:9090 --idle --once
  smiquery top --prometheus https://prom.example --http-config auth.yml --once --format json
"""

_CSV_COLUMNS = (
    "instance",
    "gpu",
    "uuid",
    "name",
    "naming",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "namespace",
    "pod",
    "alerts",
    "state",
)


def _num(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _row(g: FleetGpu, with_name: bool, with_pod: bool) -> list[str]:
    mem = "n/a" if g.memory_used is None else f"{g.memory_used:.0f}/{_num(g.memory_total)}"
    cells = [g.instance, g.gpu or "?"]
    if with_name:
        cells.append(g.name)
    cells += [_num(g.utilization), mem, _num(g.temperature), _num(g.power)]
    if with_pod:
        cells.append(f"{g.namespace}/{g.pod}" if g.pod else "")
    flags = [s for s in (("LOST" if g.lost else ""), ("IDLE" if g.idle else "")) if s]
    cells.append(" ".join([*flags, *g.alerts]))
    return cells


def render_screen(gpus: Sequence[FleetGpu], cols: int, lines: int, title: str, total: int | None = None) -> list[str]:
    """One screen: a title, the table cut to ``lines`` (0: no limit) and ``cols``, and what was left out.

    Args:
        gpus: the GPUs to show, in order.
        cols: terminal width (0: no limit).
        lines: terminal height (0: no limit).
        title: the first line.
        total: GPUs in the fleet before filters (for the footer).
    """
    from smiquery.cli.display import clip, render_table

    with_pod = any(g.pod for g in gpus)
    # rows for the table: title, header, footer (at most two lines) stay
    room = max(1, lines - 4) if lines > 0 else len(gpus)
    shown = list(gpus[:room])
    right_of = {"UTIL %": True, "MEM MiB": True, "TEMP C": True, "POWER W": True}
    table: list[str] = []
    for with_name in (True, False):
        titles = ["NODE", "GPU", *(["NAME"] if with_name else []), "UTIL %", "MEM MiB", "TEMP C", "POWER W"]
        titles += [*(["POD"] if with_pod else []), "STATE"]
        rows = [_row(g, with_name, with_pod) for g in shown]
        table = render_table(rows, titles, right=[right_of.get(t, False) for t in titles])
        if cols <= 0 or max(len(x) for x in table) <= cols:
            break
    out = [title, *table]
    if not gpus:
        out.append("no GPU matches")
    footer = []
    if len(shown) < len(gpus):
        footer.append(f"{len(gpus) - len(shown)} more GPUs not shown (a taller terminal or --format json shows all)")
    idle = sum(1 for g in gpus if g.idle)
    lost = sum(1 for g in gpus if g.lost)
    summary = f"{len(gpus)} GPUs" + (f" of {total}" if total is not None and total != len(gpus) else "")
    footer.append(f"{summary}, {idle} idle, {lost} lost")
    out += footer
    return [clip(x, cols) for x in out] if cols > 0 else out


def _csv(gpus: Sequence[FleetGpu]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(_CSV_COLUMNS)
    for g in gpus:
        d = g.to_dict()
        w.writerow(["" if d[c] is None else (";".join(d[c]) if c == "alerts" else d[c]) for c in _CSV_COLUMNS])
    return buf.getvalue()


@app.command(epilog=_EPILOG)
def top(
    ctx: typer.Context,
    prometheus: Annotated[
        str,
        typer.Option(
            "--prometheus",
            "-p",
            metavar="URL",
            envvar="SMIQUERY_PROMETHEUS",
            help="The Prometheus server (or Thanos, Mimir...) that scrapes the exporters, e.g. http://prom:9090.",
        ),
    ],
    sort: Annotated[TopSort, typer.Option("--sort", "-s", case_sensitive=False, help="Order of rows.")] = TopSort.node,
    node: Annotated[
        str | None, typer.Option("--node", metavar="REGEX", help="Only instances matching (anchored, as PromQL).")
    ] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", metavar="REGEX", help="Only GPUs of pods in these namespaces.")
    ] = None,
    pod: Annotated[str | None, typer.Option("--pod", metavar="REGEX", help="Only GPUs of these pods.")] = None,
    idle: Annotated[
        bool,
        typer.Option("--idle", help="Only GPUs under 5% utilization for the last 30 min while holding memory."),
    ] = False,
    once: Annotated[
        bool, typer.Option("--once", help="One screen, then exit (piped, or --format csv/json: always one).")
    ] = False,
    fmt: Annotated[TopFormat, typer.Option("--format", "-F", case_sensitive=False, help="Output.")] = TopFormat.table,
    interval: Annotated[
        float, typer.Option("--interval", min=0.5, metavar="SECONDS", help="Seconds between refreshes.")
    ] = 5.0,
    naming: Annotated[
        list[str] | None,
        typer.Option(
            "--naming", metavar="NAME", help="Read only this naming: smiquery, dcgm, nvidia_smi (default: detected)."
        ),
    ] = None,
    http_config: Annotated[
        Path | None,
        typer.Option(
            "--http-config",
            metavar="FILE",
            dir_okay=False,
            help="Credentials and TLS as promtool's --http.config.file: authorization (bearer), basic_auth, "
            "tls_config (ca_file).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.1,
            metavar="SECONDS",
            help="Seconds for each whole answer (connect, headers and body together).",
        ),
    ] = 10.0,
    max_answer: Annotated[int | None, typer.Option("--max-answer", metavar="MIB", min=1, help=MAX_ANSWER_HELP)] = None,
    at: Annotated[
        str | None, typer.Option("--at", metavar="TIME", help="Look at a past moment (Unix seconds, RFC 3339).")
    ] = None,
) -> None:
    """Every GPU of the fleet from Prometheus: node, GPU, model, utilization, memory, temperature, power, alerts.

    Reads what `smiquery export`, dcgm-exporter or nvidia_gpu_exporter put in Prometheus (all three namings,
    detected). With Kubernetes attribution the pod shows too. IDLE: under 5% utilization for the last 30 minutes
    while holding at least 1 GiB; LOST: reported in the last 30 minutes but not now.
    """
    from smiquery.cli.display import terminal_size

    with boundary(settings_of(ctx).debug):
        from smiquery.fleet import PrometheusClient, filter_gpus, load_http_config, parse_time, snapshot, sort_gpus
        from smiquery.fleet.client import DEFAULT_MAX_ANSWER_BYTES
        from smiquery.fleet.naming import check_regex

        for pattern, what in ((node, "--node"), (namespace, "--namespace"), (pod, "--pod")):
            check_regex(pattern, what)
        config = load_http_config(http_config) if http_config is not None else None
        limit = DEFAULT_MAX_ANSWER_BYTES if max_answer is None else max_answer * 2**20
        client = PrometheusClient(prometheus, config=config, timeout=timeout, max_answer_bytes=limit)
        when = parse_time(at, what="--at") if at is not None else None
        # only a terminal gets the live view: piped, or as csv/json, one document (a file of one CSV, not many)
        live = not once and fmt is TopFormat.table and sys.stdout.isatty()
        error = ""
        try:
            while True:
                try:
                    every = snapshot(client, namings=naming, at=when, node=node)
                    error = ""
                except Exception as exc:
                    from smiquery.errors import PrometheusError

                    if not live or not isinstance(exc, PrometheusError):
                        raise
                    every, error = [], str(exc)
                gpus = sort_gpus(filter_gpus(every, namespace=namespace, pod=pod, idle=idle), sort.value)
                if fmt is TopFormat.json:
                    sys.stdout.write(json.dumps([g.to_dict() for g in gpus], indent=None if live else 2) + "\n")
                elif fmt is TopFormat.csv:
                    sys.stdout.write(_csv(gpus))
                else:
                    cols, lines = terminal_size()
                    stamp = time.strftime("%H:%M:%S", time.localtime(when)) if when else time.strftime("%H:%M:%S")
                    title = f"smiquery top  {client.url}  {stamp}" + ("  (idle only)" if idle else "")
                    screen = render_screen(gpus, cols, lines - (1 if error else 0), title, len(every))
                    if error:
                        screen.append(f"last error: {error}")
                    clear = "\x1b[H\x1b[2J" if live and sys.stdout.isatty() else ""
                    sys.stdout.write(clear + "\n".join(screen) + "\n")
                sys.stdout.flush()
                if not live:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            with contextlib.suppress(OSError):
                sys.stdout.flush()
