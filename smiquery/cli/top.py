"""``smiquery top``: every GPU of the fleet, read from Prometheus, in one terminal screen."""

from __future__ import annotations

import contextlib
import csv
import json
import queue
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from smiquery.cli._boundary import boundary
from smiquery.cli._common import app, settings_of
from smiquery.cli._signals import Signals
from smiquery.cli.analysis import MaxAnswerOpt, NamespaceOpt
from smiquery.cli.keys import KeyReader, Viewport

if TYPE_CHECKING:
    from smiquery.fleet import FleetGpu

__all__ = ["TOP_KEYS", "TopFormat", "TopSort", "render_screen", "top"]

#: The sort keys of the live screen: utilization, memory, temperature, power, and back to node order.
TOP_KEYS = {"u": "util", "m": "mem", "t": "temp", "p": "power", "i": "node", "n": "node"}


#: ``--sort``: by node, or by a value, largest first.
TopSort = Literal["node", "util", "mem", "temp", "power"]
#: ``--format``: a screen for people, or every GPU as JSON or CSV.
TopFormat = Literal["table", "json", "csv"]


_EPILOG = """\b
Examples:
  smiquery top --prometheus http://prometheus:9090
  smiquery top --prometheus http://prometheus:9090 --sort util --node 'gpu-a.*'
  smiquery top --prometheus http://prometheus:9090 --idle --once
  smiquery top --prometheus https://prom.example --http-config auth.yml --once --format json
"""


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _row(g: FleetGpu, with_name: bool, with_pod: bool) -> list[str]:
    mem = "n/a" if g.memory_used is None else f"{_num(g.memory_used)}/{_num(g.memory_total)}"
    cells = [g.instance, g.gpu or "?"]
    if with_name:
        cells.append(g.name)
    cells += [_num(g.utilization), mem, _num(g.temperature), _num(g.power)]
    if with_pod:
        cells.append(f"{g.namespace}/{g.pod}" if g.pod else "")
    flags = [] if g.state == "ok" else [g.state.upper()]
    cells.append(" ".join([*flags, *g.alerts]))
    return cells


def render_screen(
    gpus: Sequence[FleetGpu], cols: int, lines: int, title: str, total: int | None = None, view: Viewport | None = None
) -> list[str]:
    """One screen: ``title``, the table cut to ``lines`` and ``cols`` (0: no limit), and what was left out.

    GPUs in trouble (lost, down, stale, with an alert firing) are never the ones left out; the others scroll
    (``view``: None for the first rows, no filter). ``total``: GPUs in the fleet before filters, for the footer.
    """
    from smiquery.cli.display import clip, render_table

    view = view or Viewport(TOP_KEYS, "node")
    matching = [g for g in gpus if view.matches(" ".join((g.instance, g.gpu or "", g.name, g.pod, *g.alerts)))]
    with_pod = any(g.pod for g in gpus)
    # rows for the table: the title, the header, a line saying what is shown and the summary stay
    room = max(1, lines - 5) if lines > 0 else len(matching)
    shown = view.window(matching, room, lambda g: g.state not in ("ok", "idle") or bool(g.alerts))
    table: list[str] = []
    for with_name in (True, False):
        titles = ["NODE", "GPU", *(["NAME"] if with_name else []), "UTIL %", "MEM MiB", "TEMP C", "PWR W"]
        titles += [*(["POD"] if with_pod else []), "STATE"]
        rows = [_row(g, with_name, with_pod) for g in shown]
        table = render_table(rows, titles, right=[t in ("UTIL %", "MEM MiB", "TEMP C", "PWR W") for t in titles])
        if cols <= 0 or max(len(x) for x in table) <= cols:
            break
    out = [title, *table]
    if not matching:
        out.append("no GPU matches")
    where = view.status("GPUs", len(shown), len(matching), len(gpus))
    if len(shown) < len(matching):
        where += " · PgDn/↓ for more (--format json shows all)"
    if where:
        out.append(where)
    summary = f"{len(gpus)} GPUs" + (f" of {total}" if total is not None and total != len(gpus) else "")
    summary += f", {sum(g.idle for g in gpus)} idle, {sum(g.lost for g in gpus)} lost"
    out.append(summary + "".join(f", {k} {s}" for s in ("down", "stale") if (k := sum(g.state == s for g in gpus))))
    return [clip(x, cols) for x in out] if cols > 0 else out


def _write_csv(gpus: Sequence[FleetGpu]) -> None:
    from smiquery.fleet.instant import COLUMNS

    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(COLUMNS)
    for d in (g.to_dict() for g in gpus):
        w.writerow(["" if d[c] is None else (";".join(d[c]) if c == "alerts" else d[c]) for c in COLUMNS])


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
    sort: Annotated[TopSort, typer.Option("--sort", "-s", case_sensitive=False, help="Order of rows.")] = "node",
    node: Annotated[
        str | None, typer.Option(metavar="REGEX", help="Only instances matching (anchored, as PromQL).")
    ] = None,
    namespace: NamespaceOpt = None,
    pod: Annotated[str | None, typer.Option(metavar="REGEX", help="Only GPUs of these pods.")] = None,
    idle: Annotated[
        bool, typer.Option("--idle", help="Only GPUs under 5% utilization for the last 30 min while holding memory.")
    ] = False,
    once: Annotated[
        bool, typer.Option("--once", help="One screen, then exit (piped, or --format csv/json: always one).")
    ] = False,
    fmt: Annotated[TopFormat, typer.Option("--format", "-F", case_sensitive=False, help="Output.")] = "table",
    interval: Annotated[float, typer.Option(min=0.5, metavar="SECONDS", help="Seconds between refreshes.")] = 5.0,
    naming: Annotated[
        list[str] | None,
        typer.Option(metavar="NAME", help="Read only this naming: smiquery, dcgm, nvidia_smi (default: detected)."),
    ] = None,
    http_config: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            dir_okay=False,
            help="Credentials and TLS as promtool's --http.config.file: authorization (bearer), basic_auth, "
            "tls_config (ca_file).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.1, metavar="SECONDS", help="Seconds for each whole answer (connect, headers and body together)."
        ),
    ] = 10.0,
    max_answer: MaxAnswerOpt = None,
    at: Annotated[
        str | None, typer.Option(metavar="TIME", help="Look at a past moment (Unix seconds, RFC 3339).")
    ] = None,
) -> None:
    """Every GPU of the fleet from Prometheus: node, GPU, model, utilization, memory, temperature, power, alerts.

    Reads what `smiquery export`, dcgm-exporter or nvidia_gpu_exporter put in Prometheus (all three namings,
    detected). With Kubernetes attribution the pod shows too. IDLE: under 5% utilization for the last 30 minutes
    while holding at least 1 GiB; LOST: reported in the last 30 minutes but not now; DOWN: its target's `up` is 0;
    STALE: its newest sample is over 3 scrape intervals (at least 60 s) old. DOWN and STALE show no values.
    """
    with boundary(settings_of(ctx).debug):
        from smiquery.errors import PrometheusError
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
        live = not once and fmt == "table" and sys.stdout.isatty()
        view = Viewport(TOP_KEYS, sort)
        keys: queue.SimpleQueue[str] = queue.SimpleQueue()
        reader = KeyReader(keys.put) if live else contextlib.nullcontext()
        error = ""
        with Signals() as sigs, reader:
            try:
                while sigs.signum is None:
                    try:
                        every = snapshot(client, namings=naming, at=when, node=node)
                        error = ""
                    except PrometheusError as exc:
                        if not live:
                            raise
                        every, error = [], str(exc)
                    filtered = filter_gpus(every, namespace=namespace, pod=pod, idle=idle)
                    while True:
                        gpus = sort_gpus(filtered, view.sort)
                        if fmt == "json":
                            sys.stdout.write(json.dumps([g.to_dict() for g in gpus], indent=None if live else 2) + "\n")
                        elif fmt == "csv":
                            _write_csv(gpus)
                        else:
                            stamp = time.strftime("%H:%M:%S", time.localtime(when) if when else time.localtime())
                            title = f"smiquery top  {client.url}  {stamp}" + ("  (idle only)" if idle else "")
                            _show(gpus, title, len(every), error, view, live)
                        sys.stdout.flush()
                        if not live or not _wait(keys, view, sigs, interval):
                            break  # a new snapshot is due (or --once)
                    if not live:
                        return
            except KeyboardInterrupt:  # a second Ctrl-C while Prometheus answers slowly
                sigs.signum = sigs.signum or signal.SIGINT
            finally:
                with contextlib.suppress(OSError):
                    sys.stdout.flush()
        raise typer.Exit(sigs.exit_code)


def _show(gpus: Sequence[FleetGpu], title: str, total: int, error: str, view: Viewport, tty: bool) -> None:
    """One screen: on a terminal drawn in place, never scrolled (the cursor's line stays free)."""
    from smiquery.cli.display import frame_text, terminal_size

    cols, lines = terminal_size()
    screen = render_screen(gpus, cols, lines - (1 if error else 0), title, total, view)
    if error:
        screen.append(f"last error: {error}")
    if not tty:
        sys.stdout.write("\n".join(screen) + "\n")
    else:
        sys.stdout.write(frame_text(screen[: max(1, lines - 1)] if lines > 0 else screen, cols, first=False))


def _wait(keys: queue.SimpleQueue[str], view: Viewport, sigs: Signals, interval: float) -> bool:
    """Wait ``interval`` seconds for a key; True when one changed the view (redraw now), False when time is up."""
    end = time.monotonic() + interval
    while sigs.signum is None and (left := end - time.monotonic()) > 0:
        with contextlib.suppress(queue.Empty):
            if view.key(keys.get(timeout=min(left, 0.1))):
                return True
    return False
