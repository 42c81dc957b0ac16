"""The fake's engine (argv in, exit status out; its human-readable answers), run as an executable or on a thread."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pathlib
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from smiquery.errors import NvidiaSmiFailedError, OutputTooLargeError, StreamEndedError
from smiquery.fields import CATALOGUE
from smiquery.testing._emulator.core import (
    ENV_VARS,
    FAULT_HELP,
    HELP_HINT,
    NOISE,
    FakeExit,
    FakeUsageError,
    Faults,
    Output,
    Settings,
    check_settings,
    parse_faults,
    startup,
)
from smiquery.testing._emulator.modes import parse_args, query_apps, query_gpu, run_details, run_pmon, select_gpus
from smiquery.testing._emulator.recording import (
    APP_ALIASES,
    APP_FIELDS,
    Recording,
    Reload,
    is_token,
    load_recording,
    record_reload,
    relayout,
    reloads_struck,
)

if TYPE_CHECKING:
    from smiquery.runner import Completed, Runner

_EX_SOFTWARE = 70  # misuse of the fake itself (bad fault spec, unreadable recording), never an nvidia-smi code
# CUDA version reported by `nvidia-smi --version`, by driver branch (the newest CUDA each branch supports).
_CUDA_BY_BRANCH = {470: "11.4", 535: "12.2", 550: "12.4", 560: "12.6", 570: "12.8", 580: "13.0", 590: "13.1"}
_FLOOD_LINE = 1 << 20  # a loop's flood: lines of 1 MiB, far past any sane row


def execute(argv: Sequence[str], settings: Settings, env: Mapping[str, str], out: Output) -> int:
    """The fake's engine, shared by the executable and :class:`InProcessRunner`: argv in, exit status out."""
    try:
        settings = settings.with_env(env)
        faults = parse_faults(settings.fault)
        out.begin(faults)
        if settings.log:  # after SIGTERM is ignored: a test that sees the line may rely on it
            import json

            record = json.dumps({"pid": os.getpid(), "argv": list(argv), "time": time.time()}) + "\n"
            with open(settings.log, "ab", buffering=0) as file:  # one write on O_APPEND: lines never interleave
                file.write(record.encode("utf-8"))
        code = _dispatch(argv, settings, faults, out)
    except FakeExit as exc:
        code = exc.args[0]
    except FakeUsageError as exc:
        out.flush()
        out.error(f"smiquery-fake-nvidia-smi: {exc}")
        return _EX_SOFTWARE
    out.flush()
    return code


def _dispatch(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    delay = faults.start_delay if faults.start_delay is not None else settings.start_delay
    if delay > 0:
        out.sleep(delay)
    if faults.flood:
        return _flood(argv, faults.flood_bytes, out)
    if {"-q", "--query", "-x", "--xml-format"} & set(argv) or (settings.xml and {"-L", "--list-gpus"} & set(argv)):
        return run_details(argv, settings, faults, out)
    if tuple(argv[:1]) == ("pmon",):  # a tuple from the in-process runner, a list from the executable
        return run_pmon(argv[1:], settings, faults, out)
    opts = parse_args(argv, out)
    rec = load_recording(settings.recording)
    reload: Reload | None = None
    if faults.reloads:
        struck = reloads_struck(settings.state)
        rec = relayout(rec, [mode for _, mode in faults.reloads[:struck]])
        if struck < len(faults.reloads):
            reload = (faults.reloads[struck][0], functools.partial(record_reload, settings.state, struck + 1))
    if opts.action == "help":
        return _usage(out)
    if opts.action == "help-query-gpu":
        return _help_query_gpu(rec, out)
    if opts.action == "help-query-compute-apps":
        return _help_query_apps(out)
    queries = [q for q in (opts.query_gpu, opts.query_apps) if q is not None]
    if len(queries) == 2 or (opts.fmt is not None and not queries):
        out.line(f"Invalid combination of input arguments. {HELP_HINT}")
        return 2
    if opts.query_gpu is not None:
        return query_gpu(opts, rec, settings, faults, out, reload)
    if opts.query_apps is not None:
        return query_apps(opts, rec, settings, faults, out, reload)
    startup(faults, rec.driver_version, out)
    if opts.action == "version":
        return _version(rec, out)
    selected = select_gpus(rec, opts.ids, out)
    if opts.action == "list":
        for gpu in rec.gpus:
            if gpu["index"] in selected:
                out.line(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
        return 0
    return _table(rec, selected, out)


@functools.cache
def _flood_block() -> bytes:
    """64 KiB of noise with no line break, comma or NUL: what a wrong binary could print."""
    import random

    rng = random.Random(20261025)
    return bytes(rng.choice(NOISE) for _ in range(1 << 16))


def _flood(argv: Sequence[str], total: int | None, out: Output) -> int:
    """``flood``: noise on stdout without end (or ``total`` bytes), in a loop as over-long lines."""
    loop = tuple(argv[:1]) == ("pmon",) or any(
        a.partition("=")[0] in ("-l", "--loop", "-lms", "--loop-ms") for a in argv
    )
    block = _flood_block()
    unit = block * (_FLOOD_LINE // len(block)) + b"\n" if loop else block
    left = total
    while left is None or left > 0:
        data = unit if left is None else unit[:left]
        out.raw(data)
        out.flush()
        if left is not None:
            left -= len(data)
    return 0


def _help_query_gpu(rec: Recording, out: Output) -> int:
    out.line('List of valid properties to query for the switch "--query-gpu":')
    present = set(rec.col) | {"timestamp"}
    family = ""
    for fld in CATALOGUE:
        if fld.name not in present:
            continue
        group = fld.name.split(".")[0]
        if group in ("clocks_event_reasons", "ecc", "power", "clocks") and group != family:
            out.line()
            out.line(f"Section about {group} properties")
            out.line(f"Properties of the {group} group.")
        family = group
        _help_entry(out, (fld.name, *fld.aliases), fld.help or "No description.")
    for fld in rec.extra.values():
        _help_entry(out, (fld.name,), "Listed by the driver this recording comes from.")
    out.line()
    return 0


def _help_query_apps(out: Output) -> int:
    out.line('List of valid properties to query for the switch "--query-compute-apps":')
    out.line()
    out.line("Section about Active Compute Processes properties")
    out.line("List of processes having compute context on the device.")
    aliases = {v: k for k, v in APP_ALIASES.items()}
    for name, text in APP_FIELDS.items():
        _help_entry(out, (name, aliases[name]) if name in aliases else (name,), text)
    out.line()
    return 0


def _help_entry(out: Output, names: Sequence[str], text: str) -> None:
    out.line()
    out.line(" or ".join(f'"{n}"' for n in names))
    out.line(text)


def _cuda_version(rec: Recording) -> str:
    return _CUDA_BY_BRANCH[max((b for b in _CUDA_BY_BRANCH if b <= rec.driver_branch), default=470)]


def _version(rec: Recording, out: Output) -> int:
    driver = rec.driver_version
    out.line(f"NVIDIA-SMI version  : {driver}")
    out.line(f"NVML version        : {'.'.join(driver.split('.')[:2])}")
    out.line(f"DRIVER version      : {driver}")
    out.line(f"CUDA Version        : {_cuda_version(rec)}")
    out.line()
    return 0


def _table(rec: Recording, selected: set[str], out: Output) -> int:
    """A short version of the default human-readable table."""

    def get(row: Sequence[str], name: str, suffix: str = "") -> str:
        value = rec.cell(row, name)
        return "N/A" if value is None or is_token(value) else value + suffix

    def watts(row: Sequence[str], name: str) -> str:
        value = get(row, name)
        return value if value == "N/A" else f"{float(value):.0f}W"

    driver = rec.driver_version
    out.line(time.asctime())
    out.line("+" + "-" * 89 + "+")
    title = f" NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}CUDA Version: {_cuda_version(rec):<9}"
    out.line(f"|{title:<89}|")
    out.line("|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    out.line("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.line("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.line("|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|")
    for pos, row in enumerate(rec.sweep(0)):
        key = rec.key_of(row, pos)
        if key not in selected:
            continue
        pers = {"Enabled": "On", "Disabled": "Off"}.get(get(row, "persistence_mode"), "On")
        ecc = get(row, "ecc.errors.uncorrected.volatile.total")
        name = get(row, "name")
        out.line(f"| {key:>3}  {name:<30.30}{pers:>3}  |{get(row, 'pci.bus_id'):>19} Off |{ecc:>21} |")
        temp = get(row, "temperature.gpu", "C")
        power = f"{watts(row, 'power.draw')} / {watts(row, 'power.limit'):>5}"
        left = f" {get(row, 'fan.speed', '%'):>3} {temp:>5}    {get(row, 'pstate'):>2}{power:>24} "
        memory = f"{get(row, 'memory.used', 'MiB')} / {get(row, 'memory.total', 'MiB'):>9}"
        util = get(row, "utilization.gpu", "%")
        out.line(f"|{left:<41}|{memory:>23} |{util:>8}{'Default':>13} |")
        out.line("+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    return 0


def _usage(out: Output) -> int:
    out.line("smiquery fake nvidia-smi: replays a recorded CSV like NVIDIA's System Management Interface.")
    out.line()
    out.line("    nvidia-smi [-i ID] --query-gpu=LIST --format=csv[,noheader][,nounits] [-l SEC | -lms MS]")
    out.line("    nvidia-smi [-i ID] --query-compute-apps=LIST --format=csv[,noheader][,nounits]")
    out.line("    nvidia-smi --help-query-gpu | --help-query-compute-apps | -L | --version | -h | --help")
    out.line()
    out.line("Faults (SMIQUERY_FAKE_FAULT or fault=; combine with commas; N counts data rows, across loop sweeps):")
    out.table(FAULT_HELP)
    out.line()
    out.line("Environment variables (read at every start; they override the settings baked into the script):")
    out.table(ENV_VARS)
    return 0


def main(argv: list[str] | None = None, settings: Mapping[str, Any] | None = None) -> int:
    """Run the fake ``nvidia-smi`` with nvidia-smi's own arguments (``argv``; None: ``sys.argv[1:]``); its exit status.

    Settings come from the ``SMIQUERY_FAKE_*`` variables (:data:`ENV_VARS`) over ``settings`` (what a script
    written by :func:`fake_nvidia_smi` bakes in); without either it replays the bundled 8-GPU demo and fails in no
    way. Exit 70 means the fake itself is misconfigured. Signals are handled like a C program's: quiet on SIGINT,
    SIGTERM and a closed pipe.
    """
    saved: dict[int, object] = {}
    for name in ("SIGINT", "SIGPIPE", "SIGTERM"):
        signum = getattr(signal, name, None)
        if signum is not None:
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                saved[signum] = signal.signal(signum, signal.SIG_DFL)
    stream: BinaryIO = getattr(sys.stdout, "buffer", None) or sys.stdout  # type: ignore[assignment]
    try:
        argv = sys.argv[1:] if argv is None else argv
        return execute(argv, Settings(**(settings or {})), os.environ, Output(stream))
    except BrokenPipeError:
        # the reader went away: end quietly, and keep Python from complaining when it flushes at exit
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, handler)  # type: ignore[arg-type]


def _abs(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else str(pathlib.Path(path).absolute())


def _shebang(python: str) -> str:
    # The kernel splits a #! line at whitespace and truncates it (127 bytes on older kernels): such interpreters
    # are started through /bin/sh, with a first line that sh runs and Python reads as a string literal.
    import shlex

    if python.isascii() and not re.search(r"\s", python) and len(python) < 120:
        return f"#!{python}\n"
    return f"#!/bin/sh\n\"true\" '''\\'\nexec {shlex.quote(python)} \"$0\" \"$@\"\n'''\n"


def fake_nvidia_smi(
    directory: str | os.PathLike[str],
    *,
    recording: str | os.PathLike[str] | None = None,
    fault: str | None = None,
    start_delay: float = 0.0,
    apps: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    name: str = "nvidia-smi",
) -> pathlib.Path:
    """Write an executable fake ``nvidia-smi`` (file ``name``) into ``directory`` (created if missing); its path.

    The script runs this Python interpreter and replays ``recording`` (a ``--format=csv`` file with header; None:
    the bundled 8-GPU demo) in nvidia-smi's exact CSV format, failing as ``fault`` says (comma-separated specs,
    e.g. ``"hang-after:8,ignore-term"``; :data:`FAULT_HELP` has every one). ``start_delay``: seconds before any
    output; ``apps``: the compute-apps CSV (None: the bundled one, ``""``: no processes); ``log``: a file each
    invocation appends one JSON line to (``pid``, ``argv``, ``time``). The ``SMIQUERY_FAKE_*`` environment
    variables (:data:`ENV_VARS`) override these settings when it runs. Raises ValueError for an unknown fault or a
    negative ``start_delay``.
    """
    check_settings(fault, start_delay)
    folder = pathlib.Path(directory)
    path = folder / name
    settings = {
        "recording": _abs(recording),
        "fault": fault,
        "start_delay": float(start_delay),
        "apps": "" if apps == "" else _abs(apps),
        "log": _abs(log),
        "state": _abs(f"{path}.state"),
    }
    package_parent = str(pathlib.Path(__file__).resolve().parents[3])
    script = (
        _shebang(sys.executable)
        + '"""Fake nvidia-smi written by smiquery.testing.fake_nvidia_smi(): replays a recorded CSV."""\n'
        + f"import sys\n\nsys.path.append({package_parent!r})  # used where this interpreter has no smiquery\n"
        + "from smiquery.testing._emulator.engine import main\n\n"
        + f"sys.exit(main(settings={settings!r}))\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path


_R = TypeVar("_R", bound="Runner")

_PIPE_BUFFER = 1 << 20  # unread output at which the in-process engine's flush waits, as a writer on a full pipe


class _Stopped(BaseException):
    """Unwinds the engine thread when its source is terminated or killed (what the signal does to a process)."""


class _Channel(Output):
    """One in-process run on its thread: the engine's output (stdio-like buffer, visible at flush), pipes, signals."""

    def __init__(self, argv: Sequence[str], settings: Settings, env: Mapping[str, str], name: str) -> None:
        # no stream: raw() and flush() below replace it
        self.cond = threading.Condition()
        self.pending = bytearray()  # written by the engine, not flushed yet
        self.out = bytearray()  # flushed stdout the reader has not taken yet
        self.err = bytearray()
        self.returncode: int | None = None
        self.ignore_term = False
        self.stop_signal: int | None = None
        self.thread = threading.Thread(target=self._run, args=(argv, settings, env), name=name, daemon=True)

    def _run(self, argv: Sequence[str], settings: Settings, env: Mapping[str, str]) -> None:
        try:
            code = execute(argv, settings, env, self)
        except _Stopped as stop:
            code = -stop.args[0]  # what the signal leaves; output not yet flushed is lost, as in a killed process
        except Exception as exc:  # a bug in the fake: reported like a crashed interpreter, never swallowed
            self.error(f"smiquery-fake-nvidia-smi: internal error: {exc!r}")
            code = 1
        with self.cond:
            self.returncode = code
            self.cond.notify_all()

    @property
    def done(self) -> bool:
        return self.returncode is not None

    def signal(self, signum: int) -> None:
        """Deliver SIGTERM (ignored under ``ignore-term``) or SIGKILL to the engine."""
        with self.cond:
            if self.done or self.stop_signal == signal.SIGKILL or (signum == signal.SIGTERM and self.ignore_term):
                return
            self.stop_signal = signum
            self.cond.notify_all()

    def join(self, timeout: float) -> bool:
        if self.thread is threading.current_thread():
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.signal(signal.SIGKILL)
        self.join(2.0)

    def take(self) -> bytes:
        """The flushed output not read yet (call with ``cond`` held): the pipe has room again."""
        data = bytes(self.out)
        self.out.clear()
        self.cond.notify_all()
        return data

    # -- the engine's side: the Output it writes to
    def _check(self) -> None:
        if self.stop_signal is not None:
            raise _Stopped(self.stop_signal)

    def raw(self, data: bytes) -> None:
        self._check()
        self.pending += data

    def flush(self) -> None:
        self._check()
        if self.pending:
            with self.cond:
                # a full pipe blocks the writer until the reader takes some (a flood must not fill the memory)
                self.cond.wait_for(lambda: len(self.out) < _PIPE_BUFFER or self.stop_signal is not None)
                self._check()
                self.out += self.pending
                self.cond.notify_all()
            self.pending.clear()

    def sleep(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stop_signal is not None, seconds)
        self._check()

    def error(self, text: str) -> None:
        with self.cond:
            self.err += (text + "\n").encode("utf-8")
            self.cond.notify_all()

    def begin(self, faults: Faults) -> None:
        # `grandchild` needs a process: in-process it does nothing
        with self.cond:
            self.ignore_term = faults.ignore_term


class InProcessLines:
    """The output of one in-process fake run, line by line (:meth:`InProcessRunner.lines`): a ``LineSource``.

    Lines are split, and the output ends and fails, as :class:`~smiquery.runner.LineStream` does; :meth:`terminate`
    (unless ``ignore-term``), :meth:`kill` and :meth:`close` end the engine's waits at once. ``pid`` is None.
    """

    pid: int | None = None

    def __init__(self, argv: Sequence[str], channel: _Channel) -> None:
        from smiquery.runner import LineSplitter

        self.argv = tuple(argv)
        self._ch = channel
        self._split = LineSplitter()
        self._ended: NvidiaSmiFailedError | None = None
        self._stopping = False
        self._interrupted = False
        self.closed = False
        self.idle = 0.0
        self._finalizer = weakref.finalize(self, channel.stop)

    @property
    def returncode(self) -> int | None:
        """The exit status once the engine has finished (negative: the signal that stopped it)."""
        return self._ch.returncode

    def readline(self, timeout: float) -> str | None:
        """The next complete line; None if none came within ``timeout`` s or on :meth:`interrupt`."""
        ch = self._ch
        lines = self._split.lines
        deadline = time.monotonic() + max(timeout, 0.0)
        waited = 0.0
        with ch.cond:
            while True:
                self._split.feed(ch.take())
                if lines:
                    break
                if self._ended is not None:
                    raise self._ended
                if self.closed:
                    raise StreamEndedError(self.argv, 0, "", "the nvidia-smi stream was closed")
                if self._interrupted:
                    self._interrupted = False
                    break
                if ch.done:
                    assert ch.returncode is not None
                    self._split.end()
                    self._ended = self._split.ended(self.argv, ch.returncode, bytes(ch.err), stopping=self._stopping)
                    self.closed = True
                    self._finalizer.detach()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                t0 = time.monotonic()
                ch.cond.wait(remaining)
                waited += time.monotonic() - t0
            self.idle = waited
            return lines.popleft() if lines else None

    def interrupt(self) -> None:
        """Make a :meth:`readline` blocked in another thread return None now. Any thread."""
        with self._ch.cond:
            self._interrupted = True
            self._ch.cond.notify_all()

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM; ignored under ``ignore-term``). Any thread; idempotent."""
        self._stopping = True
        self._ch.signal(signal.SIGTERM)

    def kill(self) -> None:
        """Stop the engine (SIGKILL), whatever its faults. Any thread; idempotent."""
        self._stopping = True
        self._ch.signal(signal.SIGKILL)

    def close(self) -> None:
        """Stop the engine thread and wait for it (about a second at most); idempotent, any thread."""
        self._stopping = True
        self.interrupt()  # a readline blocked in another thread returns None, as the real one does
        self.terminate()
        if not self._ch.join(0.05):
            self.kill()
            self._ch.join(1.0)
        with self._ch.cond:
            self.closed = True
            self._ch.cond.notify_all()
        self._finalizer.detach()

    def __enter__(self) -> InProcessLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessRunner:
    """A runner that serves the fake ``nvidia-smi`` on worker threads: the executable's engine, output and exits.

    Waits are real and cut short by ``terminate``, ``kill`` and ``close``; ``argv[0]`` is ignored and ``grandchild``
    does nothing (keep the executable for tests of pipes, signals and reaping). ``recording``, ``fault``,
    ``start_delay``, ``apps`` and ``log`` are :func:`fake_nvidia_smi`'s, as attributes that may change between calls;
    ``env`` holds the ``SMIQUERY_FAKE_*`` overrides (the process environment is not read). :attr:`calls` holds every
    call's argv. Output waits for the reader past 1 MiB unread, as a pipe does, and :meth:`run` fails past
    :data:`smiquery.runner.MAX_OUTPUT_BYTES`. Raises as :func:`fake_nvidia_smi` does.
    """

    def __init__(
        self,
        *,
        recording: str | os.PathLike[str] | None = None,
        fault: str | None = None,
        start_delay: float = 0.0,
        apps: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        check_settings(fault, start_delay)
        self.recording = recording
        self.fault = fault
        self.start_delay = start_delay
        self.apps = apps
        self.log = log
        self.env: dict[str, str] = dict(env or {})
        self.calls: list[tuple[str, ...]] = []
        self.reloads = 0  #: ``reenumerate`` reloads struck so far: later calls serve the GPU set they left (0: undone)
        self._channels: weakref.WeakSet[_Channel] = weakref.WeakSet()
        self._serial = itertools.count(1)

    def _start(self, argv: Sequence[str]) -> _Channel:
        def path(value: str | os.PathLike[str] | None) -> str | None:
            return None if value is None else os.fspath(value)

        settings = Settings(
            recording=path(self.recording),
            fault=self.fault,
            start_delay=float(self.start_delay),
            apps=path(self.apps),
            log=path(self.log),
            state=self,
        )
        self.calls.append(tuple(argv))
        channel = _Channel(tuple(argv[1:]), settings, dict(self.env), f"smiquery-fake-{next(self._serial)}")
        self._channels.add(channel)
        channel.thread.start()
        return channel

    def run(self, argv: Sequence[str], timeout: float) -> Completed:
        """Run the fake to completion; raises NvidiaSmiTimeoutError (its thread stopped) past ``timeout`` s."""
        from smiquery.runner import MAX_OUTPUT_BYTES, Completed, decode, no_answer

        start = time.monotonic()
        channel = self._start(argv)
        out = bytearray()
        with channel.cond:
            while True:
                out += channel.take()  # read as it comes, as the pipe is read
                left = start + max(timeout, 0.0) - time.monotonic()
                if channel.done or len(out) > MAX_OUTPUT_BYTES or left <= 0:
                    break
                channel.cond.wait(left)
        if len(out) > MAX_OUTPUT_BYTES:  # the real runner's cap, with its error
            channel.stop()
            raise OutputTooLargeError(argv, MAX_OUTPUT_BYTES)
        if not channel.done:
            channel.stop()
            raise no_answer(argv, timeout)
        channel.join(1.0)
        rc = channel.returncode
        assert rc is not None
        return Completed(tuple(argv), rc, decode(bytes(out)), decode(bytes(channel.err)), time.monotonic() - start)

    def lines(self, argv: Sequence[str]) -> InProcessLines:
        """Start the fake and return its output as it comes (for ``-l``/``-lms`` loops); close it when done."""
        return InProcessLines(argv, self._start(argv))

    def locate(self, nvidia_smi: str | os.PathLike[str] | None) -> str:
        """``argv[0]`` for :func:`~smiquery.runner.find_nvidia_smi` (no PATH search): ``nvidia_smi`` or nvidia-smi."""
        return "nvidia-smi" if nvidia_smi is None else os.fspath(nvidia_smi)

    def running(self) -> int:
        """How many engine threads of this runner are still running (0 once every source is closed)."""
        return sum(1 for ch in list(self._channels) if ch.thread.is_alive())

    def close(self) -> None:
        """Stop every engine thread this runner started and wait for them."""
        for channel in list(self._channels):
            channel.stop()

    def __enter__(self) -> InProcessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def use_runner(runner: _R) -> Iterator[_R]:
    """Run every nvidia-smi call that gets no ``runner=`` through ``runner``, in every thread, inside the block.

    For code that builds its own runner: the CLI, the exporter, ``GpuMonitor``, the Keras and Lightning callbacks
    (not :mod:`smiquery.aio`, which starts its children with asyncio). On exit the previous default comes back
    (blocks nest); the runner is not closed.
    """
    from smiquery.runner import install_default

    previous = install_default(runner)
    try:
        yield runner
    finally:
        install_default(previous)
