"""``smiquery stream``: watch the GPUs live (one long-lived nvidia-smi, or a recording) and record it (``--output``).

``smiquery record``, the word users type first, is no command of its own: it says to use ``stream --output``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smiquery.cli._boundary import ExitCode, as_usage, boundary, cli_text, quiet_stdout, say
from smiquery.cli._common import GpusOpt, StreamFormatOpt, app, fields_option, settings_of
from smiquery.cli._options import (
    Settings,
    choose_format,
    gpu_ids_checked,
    is_tty,
    parse_fields,
    parse_gpus,
    parse_seconds,
    unknown_gpus,
)
from smiquery.cli._signals import END, Failure, Signals, SourceEvent, start_pump
from smiquery.errors import KernelLogError, NoDevicesFoundError, RecordingError, SmiqueryError, UsageError
from smiquery.fields import Field, get_field
from smiquery.retry import RetryPolicy

if TYPE_CHECKING:
    from smiquery.alerts import AlertEvaluator, Notifier, Rule
    from smiquery.cli.gpuview import LiveTable
    from smiquery.recordings import SampleWriter
    from smiquery.sample import GpuSample
    from smiquery.source import SampleSource, StreamEvent, Sweep
    from smiquery.sources.latest import Latest
    from smiquery.sources.xid import XidEvent

__all__ = ["EventPrinter", "XidNotes", "parse_rotate", "recording_options", "reopen_on_hup", "stream"]


class EventPrinter:
    """One line (to ``emit``) per restart, error, lost or returning GPU, recovery and dropped row.

    An error and the restart it causes make one line (``restarting nvidia-smi in 0.2 s after: ...``); an error that
    ends the stream is left to the command's error line; a row dropped just before an error (the error's own
    message, printed where a row was expected) is not reported twice.
    """

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self._pending: tuple[str, BaseException | None, str] | None = None  # (kind, error, line) held back

    def flush(self) -> None:
        """Print what is held back (data arrived, or another event came)."""
        if self._pending is not None:
            self.emit(self._pending[2])
            self._pending = None

    def discard(self) -> None:
        """Forget what is held back (the error that ends the stream is reported by the command)."""
        self._pending = None

    def __call__(self, event: StreamEvent) -> None:
        """Take one event."""
        detail = cli_text(event.detail or (str(event.error) if event.error is not None else event.kind))
        kind = event.kind
        if kind == "dropped_row":
            self.flush()
            self._pending = ("dropped_row", None, f"smiquery: warning: dropped a line nvidia-smi printed: {detail}")
        elif kind == "error":
            if self._pending is not None and self._pending[0] == "dropped_row":
                self._pending = None  # the dropped line was this error's message
            self.flush()
            self._pending = ("error", event.error, f"smiquery: error: {detail}")
        elif kind == "restart":
            held, self._pending = self._pending, None
            if held is not None and held[0] == "error" and event.error is None:
                what = detail.split(" after")[0]
                self.emit(f"smiquery: {what} after: {held[2].removeprefix('smiquery: error: ')}")
            else:
                if held is not None and (held[0] != "error" or event.error is not held[1]):
                    self.emit(held[2])
                self.emit(f"smiquery: {detail}")
        elif kind in ("gpu_lost", "gpu_back", "recovered"):
            self.flush()
            self.emit(f"smiquery: {'error: ' if kind == 'gpu_lost' else ''}{detail}")


class XidNotes:
    """``--kernel-log``: a writer keeping each GPU's newest sample, that turns the kernel log's Xids into lines.

    nvidia-smi never reports Xids; an Xid names its GPU by the PCI address of a sample. It follows ``path`` from its
    end (KernelLogError when it cannot be opened) until closed.
    """

    def __init__(self, note: Callable[[str], None], path: str) -> None:
        from smiquery.sources.xid import XidWatcher

        self.note = note
        self._gpus: dict[str, GpuSample] = {}  # PCI address -> the newest sample from there
        self._lock = threading.Lock()
        self._watcher = XidWatcher(
            path,
            on_event=self._event,
            on_error=self._failed,
            from_start=False,
            on_refused=lambda text: note(f"smiquery: {text}"),
        ).start()

    def write(self, sample: GpuSample) -> None:
        """Remember the GPU at the sample's PCI address."""
        bus = sample.get("pci.bus_id")
        if isinstance(bus, str):
            with self._lock:
                self._gpus[bus] = sample

    def _event(self, event: XidEvent) -> None:
        from smiquery.sources.xid import describe, gpu_for

        with self._lock:
            gpu = gpu_for(event, self._gpus.values())
        self.note(f"smiquery: {describe(event, gpu.index, gpu.uuid) if gpu is not None else describe(event)}")

    def _failed(self, exc: BaseException, _opened: bool) -> None:
        self.note(f"smiquery: reading the kernel log stopped ({exc}); the stream goes on without Xid errors")

    def close(self) -> None:
        """Stop following."""
        self._watcher.close()


_TICK = 0.1  # seconds the main thread waits for a sweep before it looks at the clock, signals and the table


@dataclass
class _Run:
    """One ``smiquery stream`` run: its source, everything it writes to, and how it ended."""

    source: SampleSource
    writers: list[SampleWriter]
    live: LiveTable | None
    static_table: bool
    fields: tuple[Field, ...]
    evaluator: AlertEvaluator | None
    exit_on_alert: bool = False
    #: stderr is the live table's terminal: events and alerts go to its footer, never as lines that tear it
    events_in_footer: bool = False
    events: EventPrinter = field(init=False)
    #: turns a source error into the error that ends the command (a GPU id this machine lacks), or None
    check_error: Callable[[BaseException], BaseException | None] | None = None
    sweeps: int = 0
    last_draw: float = 0.0
    notifier: Notifier | None = None  # --on-alert
    #: live: alert holds are timed by the sweeps' monotonic arrival, not the timestamps (a replay has only those)
    live_time: bool = False
    processes: Latest[dict[int, list[str]]] | None = None
    items: queue.SimpleQueue[object] = field(default_factory=queue.SimpleQueue)
    code: int = 0
    failure: BaseException | None = None  # raised once the outputs are closed

    def __post_init__(self) -> None:
        self.events = EventPrinter(self.note)

    def note(self, line: str) -> None:
        """A notice (a restart, a full disk): the live table's footer when it owns stderr, else stderr."""
        if self.live is not None and self.events_in_footer:
            self.live.note(line.removeprefix("smiquery: "))
        else:
            say(line)

    def pump(self, *, count: int | None, stop_after: float | None, interval: float) -> int:
        """Consume the sweeps until the source ends, ``--count``/``--duration`` is reached, an alert exits, or a signal.

        Returns the exit code (0, 6, 130 or 143); a source failure is raised after the outputs are closed.
        """
        from smiquery.cli.keys import KeyReader

        unsubscribe = self.source.subscribe(lambda ev: self.items.put(SourceEvent(ev)))
        deadline = time.monotonic() + stop_after if stop_after is not None else None
        keys = KeyReader(self.items.put) if self.live is not None else contextlib.nullcontext()
        thread: threading.Thread | None = None
        stop = threading.Event()
        with Signals() as sigs, keys:
            try:
                for w in self.writers:  # a recording has its header even if it ends before its first row
                    getattr(w, "header", lambda: None)()
                thread = start_pump(self.source.sweeps, self.items, name="smiquery-pump", stop=stop)
                if self.live is not None:
                    self.draw(self.live)
                while self.step(sigs, deadline, count):
                    pass
            except BrokenPipeError:
                quiet_stdout()
            finally:
                sigs.closing = True  # from here on a signal changes nothing: the outputs are finished first
                stop.set()
                with contextlib.suppress(Exception):
                    self.source.close()  # reaps nvidia-smi
                if thread is not None:
                    thread.join(max(5.0, 2 * interval))
                unsubscribe()
                self.finish()
                if sigs.signum is not None and self.code == 0 and self.failure is None:
                    self.code = sigs.exit_code
        if self.failure is not None:
            raise self.failure
        return self.code

    def draw(self, live: LiveTable) -> None:
        """Redraw, the footer showing the source's counters (a copy: its thread goes on) and this run's sweeps."""
        live.redraw({**dataclasses.asdict(self.source.stats), "sweeps": self.sweeps})
        self.last_draw = time.monotonic()

    def step(self, sigs: Signals, deadline: float | None, count: int | None) -> bool:
        """Take one item from the reader (or redraw while none comes); False when the loop ends."""
        wait = _TICK if deadline is None else min(_TICK, deadline - time.monotonic())
        if sigs.signum is not None or wait <= 0:
            return False  # pump() sets the signal's exit code
        try:
            item = self.items.get(timeout=wait)
        except queue.Empty:
            if self.live is not None and time.monotonic() - self.last_draw >= 0.5:
                self.draw(self.live)
            return True
        if isinstance(item, str):  # a key typed
            if self.live is not None and self.live.view.key(item):
                self.draw(self.live)
            return True
        if item is END:
            return False
        if isinstance(item, SourceEvent):
            ev = item.event
            fatal = self.check_error(ev.error) if self.check_error and ev.error is not None else None
            if fatal is None:
                self.events(ev)
                return True
            self.failure = fatal
        elif isinstance(item, Failure):
            self.failure = item.exc
        else:
            if self.take_sweep(item) and self.exit_on_alert:  # type: ignore[arg-type]
                self.code = ExitCode.ALERT
                return False
            return count is None or self.sweeps < count
        self.events.discard()
        return False

    def finish(self) -> None:
        """Tell the events that came with the end, close the alert handlers, writers and the live table."""
        if self.processes is not None:
            self.processes.close(2.0)
        while not self.items.empty():  # events that came with the end (the error that ended it is raised instead)
            left_over = self.items.get_nowait()
            if isinstance(left_over, SourceEvent):
                self.events(left_over.event)
        if self.failure is None:
            self.events.flush()
        self.events.discard()
        if self.notifier is not None:
            self.notifier.close()  # bounded: a dead webhook or a snapshot in progress gets ~2 s
        for w in self.writers:
            try:
                w.close()
            except BrokenPipeError:
                quiet_stdout()
            except Exception as exc:
                self.failure = self.failure or exc
        if self.live is not None:
            with contextlib.suppress(OSError, ValueError):
                if self.code == 0 and self.failure is None:
                    self.draw(self.live)
            self.live.close()

    def take_sweep(self, sweep: Sweep) -> bool:
        """Write one sweep everywhere, evaluate the alerts and draw; True when an alert fired."""
        self.events.flush()
        now = None
        if self.live_time and (self.evaluator is not None or self.live is not None):
            from smiquery.alerts import arrival

            now = arrival(sweep)
        fired = False
        for sample in sweep:  # written everywhere, then its alerts evaluated (``now``: its arrival, live)
            for w in self.writers:
                w.write(sample)
            if self.notifier is not None:
                self.notifier.observe(sample)
            for ev in self.evaluator.update(sample, now) if self.evaluator is not None else ():
                if self.notifier is not None:
                    self.notifier.dispatch(ev, {"source": "smiquery stream"})
                if self.live is not None:
                    self.live.note(ev)
                if self.live is None or not self.events_in_footer:
                    say(f"smiquery: {ev.message()}")
                fired = fired or ev.state == "firing"
        self.sweeps += 1
        if self.processes is not None:
            self.processes.start()  # once, with the first sweep: its nvidia-smi calls do not slow the start
        if self.live is not None:
            self.live.update(sweep, now)
            if time.monotonic() - self.last_draw >= 0.1:
                self.draw(self.live)
        elif self.static_table:
            from smiquery.cli.display import sample_table, use_color

            sys.stdout.write("\n".join(sample_table(list(sweep), self.fields, color=use_color(sys.stdout))) + "\n\n")
            sys.stdout.flush()
        return fired


_EPILOG = """\b
--count N stops after N sweeps (one row per GPU each). --duration takes
30s, 10m, 1h or plain seconds; --interval takes 1, 0.5, 250ms or 2s.

\b
Alerts: FIELD OP VALUE [for N | for DURATION], OP one of > >= < <= == !=.
'for 3' (or 'for 3 samples') fires when 3 consecutive samples of a GPU
pass the threshold; 'for 30s', 'for 5m' when it holds that long, timed
live by when the rows arrive (a monotonic clock: a DST or NTP step of
nvidia-smi's timestamps changes nothing), in --replay by the samples'
timestamps; no 'for' fires on one sample. One line goes to stderr when
an alert fires and when it clears.

\b
Restarts of nvidia-smi, lost GPUs and errors print one line each on
stderr (in the live table's footer when stderr is that terminal).
--output records while displaying: .csv (nvidia-smi's format, read back by
--replay and smiquery.read_csv), .jsonl, or .parquet (a folder of closed
part files plus a journal of the open one). Every row is written as it
comes: a killed smiquery loses none; --flush-every bounds what a machine
crash can lose (fsync). An existing recording is refused unless --force
(replace) or --append (continue; same fields). A full disk drops rows
until there is space and says how many. --rotate 100MB or 1h renames the
file run.20261204T065000.csv and starts a new one (Parquet: a new part),
--keep N keeps N of those; SIGHUP reopens the file (logrotate's create),
a file truncated under it (copytruncate) is written on at its new end.
Read a rotated set as one: smiquery report 'run*.csv'.
Ctrl-C stops cleanly (exit 130) and every file ends on a whole row.

\b
Examples:
  smiquery stream
  smiquery stream --fields health --interval 250ms --output run.csv
  smiquery stream -o run.csv --append --rotate 100MB --keep 20
  smiquery stream --format jsonl | jq '."temperature.gpu"'
  smiquery stream --alert 'temperature.gpu > 85 for 3' --alert 'utilization.gpu < 20 for 5m'
  smiquery stream --replay run.csv --speed 10
  smiquery stream --replay log.csv --tz Europe/Berlin --format jsonl
  smiquery stream --replay noheader.csv --fields timestamp,index,power.draw
  smiquery stream --count 10 --format csv > snapshot.csv
"""


@app.command(epilog=_EPILOG)
def stream(
    ctx: typer.Context,
    fields: Annotated[
        str | None,
        fields_option(
            " With --replay: fields the recording holds; for a headerless (noheader) CSV log, its columns in order."
        ),
    ] = None,
    interval: Annotated[
        str, typer.Option("--interval", "-l", metavar="DURATION", help="Time between samples: 1, 0.5, 250ms, 2s.")
    ] = "1",
    gpus: GpusOpt = None,
    fmt: StreamFormatOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Also record to FILE (.csv, .jsonl, or .parquet: a folder of parts); an existing one needs "
            "--force or --append.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="--output: replace an existing recording.")] = False,
    append: Annotated[
        bool, typer.Option("--append", help="--output: go on writing an existing recording (same fields).")
    ] = False,
    rotate: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE|DURATION",
            help="--output: start a new file at this size (100MB, 1GB) or after this long (1h, 1d is 24h).",
        ),
    ] = None,
    keep: Annotated[
        int | None, typer.Option(min=1, metavar="N", help="--rotate: keep the N newest rotated files.")
    ] = None,
    flush_every: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="--output: fsync this often (what a machine crash can lose; a killed smiquery loses no row).",
        ),
    ] = "10s",
    count: Annotated[int | None, typer.Option("--count", "-n", min=1, metavar="N", help="Stop after N sweeps.")] = None,
    duration: Annotated[
        str | None, typer.Option("--duration", "-d", metavar="DURATION", help="Stop after this long: 30s, 10m, 1h.")
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Play a recording (.csv, .jsonl, .parquet) instead of running nvidia-smi; a quoted glob "
            "('run*.csv') plays a rotated set as one.",
        ),
    ] = None,
    speed: Annotated[
        float, typer.Option(min=0.0, metavar="X", help="Replay speed: 2 is twice as fast, 0 as fast as possible.")
    ] = 1.0,
    loop: Annotated[bool, typer.Option("--loop", help="Replay: start again at the end.")] = False,
    tz: Annotated[
        str | None,
        typer.Option(
            metavar="ZONE",
            help="Replay: the zone the recording was made in (Europe/Berlin, UTC). Times recorded without a zone "
            "(nvidia-smi's CSV) are shown as recorded unless ZONE names it; ones with a zone are converted to ZONE.",
        ),
    ] = None,
    alert: Annotated[
        list[str] | None,
        typer.Option(
            "--alert",
            "-a",
            metavar="EXPR",
            help="Alert rule; repeatable. 'temperature.gpu > 85 for 3' holds for 3 samples, "
            "'... for 30s' for 30 seconds.",
        ),
    ] = None,
    exit_on_alert: Annotated[
        bool, typer.Option("--exit-on-alert", help="Exit with code 6 as soon as an alert fires.")
    ] = False,
    toggle_processes: Annotated[
        bool,
        typer.Option(
            "--processes",
            "-p",
            help="Toggle the processes of each GPU in the live table (user/command(memory)); they are "
            "shown by default where the terminal has room.",
        ),
    ] = False,
    on_alert: Annotated[
        list[str] | None,
        typer.Option(
            metavar="SPEC",
            help="Also hand each alert event to: log, webhook:URL (a POST of JSON), or snapshot:DIR (a folder per "
            "firing with nvidia-smi -q -x, the processes, the last minutes of samples and the alert); repeatable.",
        ),
    ] = None,
    kernel_log: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="Also follow the kernel log (/dev/kmsg, needs root or CAP_SYSLOG; or a file such as "
            "/var/log/kern.log) and print each NVIDIA Xid error logged from now on: the GPU, the code, what it means "
            "and what to do; only lines the kernel wrote count. Adds pci.bus_id to the queried fields.",
        ),
    ] = None,
) -> None:
    """Watch the GPUs live: one long-lived nvidia-smi (or a recording).

    On a terminal: a live table, one row per GPU, redrawn in place and fitted to the terminal's width (units in
    the header, missing values as n/a, LOST GPUs in red, values past an alert threshold in colour, hidden
    columns, sample age and restarts in the footer). Piped: CSV in nvidia-smi's format, flushed sweep by sweep
    (so `| tail -f`, `| grep`, `| jq` work live).
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        seconds = parse_seconds(interval, "--interval")
        stop_after = parse_seconds(duration, "--duration") if duration is not None else None
        rules, rule_fields = _rules(alert or [])
        if output is not None and fields is None and replay is None:
            from smiquery.analysis.analyze import report_fields  # what `smiquery report` of the recording needs

            rule_fields = (*rule_fields, *(get_field(n) for n in report_fields()))
        if kernel_log and replay is not None:
            raise UsageError("--kernel-log goes with a live stream, not --replay: the kernel log is this machine's now")
        if kernel_log:  # the Xid lines name the GPU at the PCI address the kernel gives
            rule_fields = (*rule_fields, *(get_field(n) for n in ("index", "uuid", "pci.bus_id")))
        ids = parse_gpus(gpus)
        record = recording_options(
            output, force=force, append=append, rotate=rotate, keep=keep, flush_every=flush_every
        )
        if tz is not None and replay is None:
            raise UsageError("--tz goes with --replay: live samples carry this machine's own time zone")
        if replay is not None:
            source, flds, title = _open_replay(replay, fields, rule_fields, ids, speed=speed, loop=loop, tz=tz)
        else:  # one long-lived nvidia-smi (its restart backoff ends when it is closed)
            from smiquery.streams.sync import Stream

            names = [f.name for f in parse_fields(fields, rule_fields)]
            stall = max(settings.timeout, 3 * seconds)
            retry = RetryPolicy(fail_fast=True)
            source = Stream(
                names, interval=seconds, gpus=ids, nvidia_smi=settings.nvidia_smi, stall_timeout=stall, retry=retry
            )
            flds, title = source.fields, f"smiquery stream · every {seconds:g} s · {source.argv[0]}"
        run = _open_outputs(source, flds, fmt, title, rules, stale_after=max(5.0, 3 * seconds))
        run.exit_on_alert = exit_on_alert
        if output is not None:  # the recorder, every failure one line naming the file
            from smiquery.recordings import open_recording

            try:
                recorder = open_recording(output, flds, say=run.note, rules=[str(r) for r in rules], **record)
            except OSError as exc:
                why = (exc.strerror or str(exc)).lower()
                raise SmiqueryError(f"cannot write {output}: {why}; choose another --output") from None
            except RuntimeError as exc:
                raise SmiqueryError(str(exc)) from None
            run.writers.insert(0, recorder)
        if run.live is not None and fields is not None and "uuid" in (f.strip() for f in fields.split(",")):
            run.live.uuid = True  # asked for: shown at any width
        if kernel_log:
            try:
                run.writers.append(XidNotes(run.note, kernel_log))  # closed with them
            except KernelLogError as exc:
                run.note(f"smiquery: {exc}; the stream goes on without Xid errors")
        run.live_time = replay is None
        if run.live is not None and replay is None and not toggle_processes:
            run.processes = _live_processes(run.live, settings, ids, seconds)
        if on_alert:
            from smiquery.alerts import Notifier, handler_from_spec

            if run.evaluator is None:
                raise UsageError("--on-alert needs at least one --alert rule")
            with as_usage("--on-alert: {}", ValueError):
                handlers = [handler_from_spec(spec, nvidia_smi=settings.nvidia_smi) for spec in on_alert]
            run.notifier = Notifier(run.evaluator, handlers)
        if ids and replay is None:
            # a live source retries "No devices were found" forever: asked once, the answer is kept
            wrong = functools.cache(lambda: unknown_gpus(ids, settings))
            run.check_error = lambda exc: wrong() if isinstance(exc, NoDevicesFoundError) else None
        with gpu_ids_checked(ids if replay is None else None, settings), reopen_on_hup(run.writers):
            raise typer.Exit(run.pump(count=count, stop_after=stop_after, interval=seconds))


def _rules(alerts: Sequence[str]) -> tuple[list[Rule], tuple[Field, ...]]:
    """The ``--alert`` rules, and the fields they need queried besides the shown ones."""
    from smiquery.alerts import Rule
    from smiquery.errors import InvalidRuleError

    with as_usage("--alert: {}", InvalidRuleError):
        rules = [Rule.parse(a) for a in alerts]
    needed = [f for r in rules for f in r.fields]  # `while` fields too
    if any(r.hold_seconds is not None for r in rules):
        needed.insert(0, get_field("timestamp"))  # `for 5m` is measured by the samples' own timestamps
    return rules, tuple({f.name: f for f in needed}.values())


def _open_replay(
    path: Path,
    fields: str | None,
    rule_fields: tuple[Field, ...],
    ids: tuple[str, ...] | None,
    *,
    speed: float,
    loop: bool,
    tz: str | None,
) -> tuple[SampleSource, tuple[Field, ...], str]:
    """``--replay``: the recording as a source, its fields, and the live table's title."""
    from smiquery.cli.analysis import check_zone
    from smiquery.errors import ReplayError
    from smiquery.recordings import Replay, csv_header, detect_format
    from smiquery.recordings.recorder import META_SUFFIX, read_meta

    check_zone(tz)
    wanted: tuple[Field, ...] | None = parse_fields(fields, rule_fields) if fields is not None else None
    columns = None  # a header names them (and Replay reports a missing file)
    if path.is_file() and path.stat().st_size > 0 and detect_format(path) == "csv" and not csv_header(path):
        if fields is None:
            raise RecordingError(
                f"{path} has no nvidia-smi CSV header line; for a headerless (noheader) log, pass its columns "
                "in order with --fields, e.g. --fields timestamp,index,utilization.gpu"
            )
        columns = [f.name for f in parse_fields(fields)]
    common: dict[str, Any] = {"speed": speed, "gpus": ids, "loop": loop, "tz": tz}
    if wanted is None:
        # What `stream --output` recorded; else the default preset when the recording has it, else every column.
        probe = Replay(path, **common)
        have = {f.name for f in probe.recorded_fields}
        default = parse_fields("default", rule_fields)
        made = read_meta(f"{path}{META_SUFFIX}").get("fields")  # what `stream --output` recorded, if it made it
        if isinstance(made, list) and made and all(isinstance(n, str) and n in have for n in made):
            wanted = parse_fields(",".join(made), rule_fields)
        elif all(f.name in have for f in default):
            wanted = default
        else:
            lacking = [f.name for f in rule_fields if f.name not in have]
            if lacking:
                raise ReplayError(f"recording {path} has no {', '.join(lacking)} for --alert")
    with as_usage("{}", ValueError):
        replayed = Replay(path, fields=[f.name for f in wanted] if wanted else None, columns=columns, **common)
    title = f"smiquery stream · replay {path.name} at {speed:g}x" if speed else f"replay {path.name}"
    return replayed, replayed.fields, title


def _open_outputs(
    source: SampleSource,
    flds: tuple[Field, ...],
    fmt: str | None,
    title: str,
    rules: Sequence[Rule],
    *,
    stale_after: float,
) -> _Run:
    """stdout as CSV, JSONL, the live table or a static table (the recorder of ``--output`` joins later)."""
    from smiquery.alerts import BUILTIN_RULES, AlertEvaluator, Rule
    from smiquery.cli.display import use_color
    from smiquery.cli.gpuview import LiveTable
    from smiquery.recordings import CsvWriter, JsonlWriter

    out = sys.stdout
    form = choose_format(fmt, out)
    writers: list[SampleWriter] = []
    live: LiveTable | None = None
    evaluator = AlertEvaluator(rules) if rules else None
    if form == "csv":
        writers.append(CsvWriter(out, flds))
    elif form == "jsonl":
        writers.append(JsonlWriter(out))
    elif is_tty(out):
        # health colours without any --alert: the built-in rules, uncorrected ECC errors, pending pages
        live_health = ("ecc.errors.uncorrected.volatile.total > 0", "retired_pages.pending == Yes")
        health = AlertEvaluator([Rule.parse(r) for r in (*BUILTIN_RULES, *live_health)])
        live = LiveTable(
            out, flds, title=title, color=use_color(out), evaluator=evaluator, health=health, stale_after=stale_after
        )
    # stderr on the live table's terminal: a line there would tear the table, so events go to its footer
    in_footer = live is not None and is_tty(sys.stderr)
    return _Run(source, writers, live, form == "table" and live is None, flds, evaluator, events_in_footer=in_footer)


def _live_processes(
    live: LiveTable, settings: Settings, ids: Sequence[str] | None, seconds: float
) -> Latest[dict[int, list[str]]]:
    """The poller of the live table's processes: ``--query-compute-apps`` every 2 s (or the interval if longer)."""
    from smiquery.cli.gpuview import process_label
    from smiquery.cli.ps import ProcCache
    from smiquery.sources.apps import processes
    from smiquery.sources.latest import Latest

    users = ProcCache()  # /proc, checked to be the process nvidia-smi named (PID namespaces)

    def labels() -> dict[int, list[str]]:
        procs = processes(nvidia_smi=settings.nvidia_smi, gpus=ids or None, timeout=settings.timeout)
        by_gpu: dict[int, list[str]] = {}
        for p in procs:
            if p.gpu_index is not None:
                user = users.lookup(p.pid, p.process_name).user
                by_gpu.setdefault(p.gpu_index, []).append(process_label(p, user))
        users.keep({(p.pid, p.process_name) for p in procs})
        return by_gpu

    live.show_processes = True
    every = max(2.0, seconds)
    return Latest(labels, every, name="listing the live table's processes", on_value=live.set_processes)


@app.command("record", hidden=True, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(ctx: typer.Context) -> None:
    """Not a command: recording is ``smiquery stream --output FILE``; says so, with the arguments given."""
    from smiquery.printable import printable

    args = [printable(a) for a in ctx.args]
    has_output = any(a in ("-o", "--output") or a.startswith("--output=") for a in args)
    command = " ".join(["smiquery stream", *([] if has_output else ["--output run.csv"]), *args])
    with boundary(settings_of(ctx).debug):
        raise UsageError(f"there is no `smiquery record`: record with `{command}`, then `smiquery report` the file")


def parse_rotate(text: str) -> tuple[int | None, float | None]:
    """``--rotate``: (bytes, None) for ``100MB`` (``64MiB``: 1024s), (None, seconds) for ``1h``; else UsageError."""
    wrong = UsageError(f"--rotate {text!r}: give a size such as 100MB or 1GB, or a duration such as 1h or 30m")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", text, re.IGNORECASE)
    if m is None or not (m.group(4) or m.group(2).lower() in ("k", "g", "t")):  # no size: 10m is ten minutes
        try:
            return None, parse_seconds(text, "--rotate")
        except UsageError:
            raise wrong from None
    if float(m.group(1)) <= 0:
        raise wrong
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power), None


def recording_options(
    output: Path | None, *, force: bool, append: bool, rotate: str | None, keep: int | None, flush_every: str
) -> dict[str, Any]:
    """``open_recording``'s keyword arguments from ``--output``'s options; a UsageError before anything starts."""
    given = (("--force", force), ("--append", append), ("--rotate", rotate), ("--keep", keep))
    named = [n for n, value in given if value]  # --keep is at least 1
    if output is None and named:
        raise UsageError(f"{named[0]} goes with --output FILE")
    if force and append:
        raise UsageError("--force replaces the recording and --append continues it: pass one of them")
    if keep is not None and rotate is None:
        raise UsageError("--keep N keeps N rotated files: pass --rotate SIZE|DURATION too")
    rotate_bytes, rotate_seconds = parse_rotate(rotate) if rotate is not None else (None, None)
    text = flush_every.strip()
    return {
        "policy": "force" if force else "append" if append else "new",
        "rotate_bytes": rotate_bytes,
        "rotate_seconds": rotate_seconds,
        "keep": keep,
        "flush_every": 0.0 if text in ("0", "0s") or output is None else parse_seconds(text, "--flush-every"),
    }


@contextlib.contextmanager
def reopen_on_hup(recorders: Sequence[object]) -> Iterator[None]:
    """While inside, SIGHUP makes each recorder reopen its file before its next row (logrotate's create mode).

    Outside the main thread (no handler can be set there) it does nothing.
    """
    targets = [r for r in recorders if callable(getattr(r, "reopen", None))]
    if not targets or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        yield
        return

    def on_hup(signum: int, frame: object) -> None:
        for r in targets:
            r.reopen()  # type: ignore[attr-defined]

    saved = signal.signal(signal.SIGHUP, on_hup)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, saved)
