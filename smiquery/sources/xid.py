"""Xid errors, the driver's error events (``NVRM: Xid (PCI:0000:3b:00): 79, ...``) nvidia-smi never reports.

:func:`parse_line` reads one kernel-log line, :func:`follow` yields a log's events once each, :class:`XidWatcher`
follows one on a thread and counts, :data:`XID_CATALOGUE` says what the codes mean.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import os
import re
import select
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar, cast

from smiquery._log import RateLimiter, get_logger
from smiquery.errors import KernelLogError, UsageError
from smiquery.printable import printable
from smiquery.retry import one_line
from smiquery.sample import BusKey, bus_key

__all__ = [
    "DEFAULT_KERNEL_LOG",
    "REJECT_REASONS",
    "XID_CATALOGUE",
    "RejectReason",
    "XidAction",
    "XidEvent",
    "XidFollower",
    "XidInfo",
    "XidWatcher",
    "describe",
    "follow",
    "gpu_for",
    "parse_line",
    "refusal",
]

log = get_logger("smiquery.xid")

#: Where the kernel log is read from by default.
DEFAULT_KERNEL_LOG = "/dev/kmsg"

XidAction = Literal["application", "reset", "drain", "rma", "info"]


@dataclass(frozen=True)
class XidInfo:
    """What one Xid code means and what to do about it.

    ``action`` is ``application`` (a bug in the program, the GPU is fine), ``reset`` (reset the GPU when idle),
    ``drain`` (take the node out of service now), ``rma`` (repeated: hardware service) or ``info`` (nothing to do).
    """

    code: int
    meaning: str
    action: XidAction
    advice: str


#: The common Xid codes (NVIDIA's public "Xid Errors" catalogue, summarised; the data is ``xid.csv``).
XID_CATALOGUE: dict[int, XidInfo] = {
    int(r["code"]): XidInfo(int(r["code"]), r["meaning"], cast(XidAction, r["action"]), r["advice"])
    for r in csv.DictReader(Path(__file__).with_name("xid.csv").read_text(encoding="utf-8").splitlines())
}


@dataclass(frozen=True)
class XidEvent:
    """One Xid line from the kernel log.

    ``pci_bus_id`` is the GPU's address as the driver printed it (match it with :func:`gpu_for`); ``message`` the
    text after the code, with its ``pid=`` and ``name=`` in ``pid`` and ``process_name``; ``seq`` the
    ``/dev/kmsg`` sequence number and ``uptime`` the kernel's stamp in seconds since boot (None when absent).
    """

    xid: int
    pci_bus_id: str
    message: str
    pid: int | None
    process_name: str | None
    seq: int | None
    uptime: float | None
    raw: str

    @property
    def info(self) -> XidInfo | None:
        """The catalogue entry for this code, None for a code not in :data:`XID_CATALOGUE`."""
        return XID_CATALOGUE.get(self.xid)


_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (\d+),\s*(.*)"
)
_MARK = "NVRM: Xid"  # a line without it is no Xid line (the fast path)
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_TIME = r"\d\d:\d\d:\d\d(?:\.\d+)?"
# a /dev/kmsg record: "PRI,SEQ,MICROSECONDS,FLAGS[,caller=T1];TEXT"
_KMSG_RE = re.compile(r"(\d+),(\d+),(\d+),[^;]*;")
# a syslog or journal line, up to its tag: an optional "<PRI>", the wall-clock stamp (traditional; ISO from rsyslog
# and journalctl -o short-iso; journalctl -o short-full, short-unix, short-monotonic, short-delta), the host, the tag
_SYSLOG_RE = re.compile(
    rf"(?:<(?P<pri>\d{{1,3}})>)?(?:{_MONTH} [ \d]\d {_TIME}|\d{{4}}-\d\d-\d\dT{_TIME}(?:Z|[+-]\d\d:?\d\d)?"
    rf"|{_DAY} \d{{4}}-\d\d-\d\d {_TIME} \S+|\d+\.\d+|\[\s*\d+\.\d+(?: <\s*\d+\.\d+>)?\]) \S+ (?P<tag>[^\s:]+): "
)
# RFC 5424: "<PRI>1 STAMP HOST APP-NAME PROCID MSGID STRUCTURED-DATA MSG"
_RFC5424_RE = re.compile(r"<(?P<pri>\d{1,3})>1 \S+ \S+ (?P<tag>\S+) \S+ \S+ (?:-|(?:\[(?:[^\]\\]|\\.)*\])+) ?\ufeff?")
# dmesg: "[  123.456789] " or dmesg -T's "[Sat Dec  5 10:00:00 2026] ", after dmesg -x's "kern  :warn  : "
_DMESG_RE = re.compile(
    rf"(?:(?P<fac>[a-z0-9]+) *:[a-z]+ *: )?"
    rf"(?:\[\s*(?P<uptime>\d+\.\d+)\]|\[{_DAY} {_MONTH} [ \d]\d {_TIME} \d{{4}}\]) ?"
)
_UPTIME_RE = re.compile(r"\[\s*(\d+\.\d+)\] ?")  # the kernel's own stamp at the start of a syslog message
_CALLER_RE = re.compile(r"\[\s*[CT]\d+\] ?")  # CONFIG_PRINTK_CALLER's "[    T123] "
_PID_RE = re.compile(r"pid=(\d+)")
_NAME_RE = re.compile(r"name=([^,]*)")

_REFUSED = {  # why a line with an Xid in it is refused
    "not_kernel": "was not written by the kernel",  # a tag, priority or facility names another writer
    "unknown_format": "is in no kernel-log format smiquery reads",  # or the Xid does not start the message
    "malformed": "does not parse",  # the kernel's line, but its bus id or code does not parse
}
#: Why a line with an Xid in it is refused (see :func:`refusal`).
REJECT_REASONS = tuple(_REFUSED)
RejectReason = Literal["not_kernel", "unknown_format", "malformed"]


def parse_line(line: str) -> XidEvent | None:
    """The Xid event in one kernel-log line, or None when the line is no Xid written by the kernel.

    Anyone can log a line that looks like an Xid (``logger 'NVRM: Xid ...'``), so the Xid must start the kernel's
    own message: a ``/dev/kmsg`` record of the kernel facility, a ``dmesg`` line (plain, ``-T``, ``-x`` with
    facility ``kern``), or a syslog, journal (``journalctl -k -o short*``) or RFC 5424 line tagged ``kernel``.
    """
    got = _read(line)
    return got if isinstance(got, XidEvent) else None


def refusal(line: str) -> RejectReason | None:
    """Why :func:`parse_line` refuses a line that has an Xid in it (one of :data:`REJECT_REASONS`); None otherwise."""
    got = _read(line)
    return got if isinstance(got, str) else None


def _read(line: str) -> XidEvent | RejectReason | None:
    """The event, the reason a line with an Xid in it is refused, or None for a line without one."""
    line = line.rstrip("\r\n")
    if _MARK not in line:
        return None
    seq: int | None = None
    uptime: float | None = None
    if m := _KMSG_RE.match(line):
        if int(m.group(1)) >> 3:  # the facility: the kernel's is 0, a write to /dev/kmsg gets at least "user"
            return "not_kernel"
        seq, uptime = int(m.group(2)), int(m.group(3)) / 1e6
    elif m := _RFC5424_RE.match(line) or _SYSLOG_RE.match(line):
        pri = m.group("pri")
        if m.group("tag") != "kernel" or (pri is not None and int(pri) >> 3):
            return "not_kernel"
        if stamp := _UPTIME_RE.match(line, m.end()):
            uptime = float(stamp.group(1))
            m = stamp
    elif m := _DMESG_RE.match(line):
        if m.group("fac") not in (None, "kern"):
            return "not_kernel"
        uptime = float(m.group("uptime")) if m.group("uptime") else None
    else:
        return "unknown_format"
    start = m.end()
    if caller := _CALLER_RE.match(line, start):
        start = caller.end()
    x = _XID_RE.match(line, start)
    if x is None:
        return "malformed" if line.startswith(_MARK, start) else "unknown_format"
    message = x.group(3).strip()
    pid = _PID_RE.search(message)
    name = _NAME_RE.search(message)
    return XidEvent(
        xid=int(x.group(2)),
        pci_bus_id=x.group(1),
        message=message,
        pid=int(pid.group(1)) if pid else None,
        process_name=name.group(1).strip() if name and name.group(1).strip() != "<unknown>" else None,
        seq=seq,
        uptime=uptime,
        raw=line,
    )


_G = TypeVar("_G")


def gpu_for(event: XidEvent, gpus: Iterable[_G]) -> _G | None:
    """The one of ``gpus`` (anything with a ``pci_bus_id``: details, samples) at the event's PCI address, or None."""
    key = bus_key(event.pci_bus_id)
    for gpu in gpus:
        bus = getattr(gpu, "pci_bus_id", None)
        if key is not None and isinstance(bus, str) and bus_key(bus) == key:
            return gpu
    return None


_DEDUPE_KEEP = 4096  # lines remembered, to skip them when a followed file is read again (rewritten, rotated)


class XidFollower(Iterator[XidEvent]):
    """Follow a kernel log and yield each Xid event once, until :meth:`close` (from any thread).

    ``path`` is ``/dev/kmsg`` (its ring buffer replayed, then waited on) or a plain file, followed like ``tail -F``;
    ``after_seq`` skips ``/dev/kmsg`` records up to it (resume after ``last_seq``); ``from_start=False`` reads only
    what comes from now; ``poll``: seconds between checks for data and :meth:`close`; ``on_reject(reason, line)``
    is called on the reading thread for each refused Xid line. Raises KernelLogError when the log cannot be opened
    (no permission: run as root or with CAP_SYSLOG), UsageError for a ``poll`` that is not positive.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_KERNEL_LOG,
        *,
        after_seq: int | None = None,
        from_start: bool = True,
        poll: float = 0.5,
        on_reject: Callable[[RejectReason, str], object] | None = None,
    ) -> None:
        if not poll > 0:
            raise UsageError(f"poll must be a positive number of seconds, not {poll!r}")
        self.path = os.fspath(path)
        self.poll = poll
        self.on_reject = on_reject
        #: the highest ``/dev/kmsg`` sequence number handed out (pass it as ``after_seq`` to resume)
        self.last_seq = after_seq if after_seq is not None else -1
        self._closed = threading.Event()
        self._seen: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # (line digest, its occurrence)
        self._pass: OrderedDict[bytes, int] = OrderedDict()  # line digest -> times read since the file was opened
        self._fd = -1
        self._open(first=True, from_start=from_start)  # sets the descriptor, its kind, identity and position
        self._gen = self._events()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed.is_set()

    def close(self) -> None:
        """End the iteration (thread-safe; the reading thread sees it within ``poll`` seconds)."""
        self._closed.set()

    def __next__(self) -> XidEvent:
        return next(self._gen)

    def __enter__(self) -> XidFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._gen.close()  # in the reading thread: closes the descriptor now (elsewhere it ends within `poll`)

    def _open(self, *, first: bool, from_start: bool = True) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if not first:
                return False
            why = {errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.ENOENT: "no such file"}
            raise KernelLogError(self.path, why.get(exc.errno or 0) or exc.strerror or str(exc)) from None
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise KernelLogError(self.path, "is a directory")
        self._chardev = stat.S_ISCHR(st.st_mode)
        self._fd = fd
        self._ino = (st.st_dev, st.st_ino)
        self._buf = b""
        self._pass.clear()
        # /dev/kmsg: SEEK_END skips the ring buffer's replay; a plain file: read on from its end
        self._pos = 0 if from_start else os.lseek(fd, 0, os.SEEK_END)
        if not self._chardev:
            os.set_blocking(fd, True)
        return True

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def _kmsg_records(self) -> Iterator[str]:
        """Read ``/dev/kmsg``: one record per read; EAGAIN at the end; EPIPE when records were overwritten."""
        while not self._closed.is_set():
            try:
                data = os.read(self._fd, 16384)
            except BlockingIOError:
                with contextlib.suppress(OSError, ValueError):
                    select.select([self._fd], [], [], self.poll)
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring buffer wrapped past us: go on with the next record
                    continue
                raise KernelLogError(self.path, exc.strerror or str(exc)) from None
            if not data:
                self._closed.wait(self.poll)
                continue
            yield data.decode("utf-8", errors="replace").split("\n", 1)[0]

    def _file_lines(self) -> Iterator[str]:
        """Follow a plain file like ``tail -F``: re-open it when replaced, read it again when found shorter."""
        while not self._closed.is_set():
            if self._fd < 0:
                if not self._open(first=False):
                    self._closed.wait(self.poll)
                continue
            data = os.pread(self._fd, 65536, self._pos)
            if data:
                self._pos += len(data)
                self._buf += data
                *lines, self._buf = self._buf.split(b"\n")
                for raw in lines:
                    yield raw.decode("utf-8", errors="replace")
                continue
            if self._replaced():
                self._close_fd()
                continue
            self._closed.wait(self.poll)

    def _replaced(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # gone for now (mid-rotation): keep reading the old one until a new one appears
        if (st.st_dev, st.st_ino) != self._ino:
            return True
        if st.st_size < self._pos:  # truncated in place (copytruncate, or rewritten)
            self._pos = 0
            self._buf = b""
            self._pass.clear()
        return False

    def _fresh(self, event: XidEvent) -> bool:
        """Whether the event was not handed out before.

        A ``/dev/kmsg`` record is known by its sequence number, any other line by its text and how often that text
        was read since the file was opened or truncated (twice in one reading: two events; read again: none).
        """
        if event.seq is not None:
            if event.seq <= self.last_seq:
                return False
            self.last_seq = event.seq
            return True
        digest = hashlib.blake2b(event.raw.encode("utf-8", "replace"), digest_size=16).digest()
        occurrence = self._pass.pop(digest, 0)
        self._pass[digest] = occurrence + 1
        if len(self._pass) > _DEDUPE_KEEP:
            self._pass.popitem(last=False)
        key = (digest, occurrence)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _DEDUPE_KEEP:
            self._seen.popitem(last=False)
        return True

    def _events(self) -> Generator[XidEvent, None, None]:
        try:
            lines = self._kmsg_records() if self._chardev else self._file_lines()
            for line in lines:
                got = _read(line)
                if isinstance(got, XidEvent):
                    if self._fresh(got):
                        yield got
                elif got is not None and self.on_reject is not None:
                    self.on_reject(got, line)
        finally:
            self._close_fd()


#: Follow a kernel log (:class:`XidFollower`).
follow = XidFollower


def describe(event: XidEvent, gpu: int | None = None, uuid: str | None = None) -> str:
    """One line for people: the code, the GPU (its index and UUID when known), the catalogue's meaning and action.

    A code the catalogue lacks is shown with the driver's own text.
    """
    where = ", ".join(x for x in (uuid, f"PCI {event.pci_bus_id}") if x)
    who = f"GPU {gpu} ({where})" if gpu is not None else f"the GPU at {where}"
    proc = f" [pid {event.pid}{' ' + event.process_name if event.process_name else ''}]" if event.pid else ""
    info = event.info
    if info is None:
        return f"Xid {event.xid} on {who}{proc}: {event.message} (not in smiquery's Xid catalogue: see NVIDIA's)"
    return f"Xid {event.xid} on {who}{proc}: {info.meaning}; action {info.action}: {info.advice}"


def _hand_on(listener: Callable[[_G], object], value: _G) -> None:
    try:
        listener(value)
    except Exception:  # a listener's bug must not stop the following
        log.exception("smiquery: an Xid listener failed")


class XidWatcher:
    """A kernel log followed on a daemon thread: each new Xid event is counted by GPU and code, then handed on.

    Counts are kept for the :attr:`MAX_SERIES` (bus, code) pairs with the newest events (older pairs' counts move to
    :attr:`other`) and per refusal reason (:meth:`rejected`); refused lines are noted at most once a minute (through
    ``on_refused``, default a WARNING log; ``clock`` times that minute). ``path``, ``from_start`` and ``poll`` are
    :func:`follow`'s; ``on_event`` is called on the thread with each counted event (what it raises is logged),
    ``on_error`` with a read failure and whether the log had been opened. ``retry``: seconds before the log is opened
    again after it could not be or reading failed, resuming after the last event counted (the first failure to open
    goes to ``on_error``); None: :meth:`start` opens the log, raising when it cannot, and a failure ends the
    following. :attr:`up`: the log is being read (``last_error``: the last failure); :attr:`events` counts events,
    :attr:`attempts` opens tried.
    """

    #: (bus, code) pairs counted at most: the pair whose last event is the oldest gives its count to ``other``
    MAX_SERIES = 256
    #: seconds between two notes about refused lines
    REFUSED_EVERY = 60.0

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_KERNEL_LOG,
        *,
        on_event: Callable[[XidEvent], object] | None = None,
        on_error: Callable[[BaseException, bool], object] | None = None,
        from_start: bool = True,
        retry: float | None = None,
        poll: float = 0.5,
        on_refused: Callable[[str], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = os.fspath(path)
        self.on_event = on_event
        self.on_error = on_error
        self.from_start = from_start
        self.retry = retry
        self.poll = poll
        self.up = False
        self.last_error: str | None = None
        self.on_refused = on_refused or (lambda text: log.warning("smiquery: %s", text))
        self.events = 0
        self.other = 0
        self.attempts = 0
        # (bus key, code) -> [events, the bus id as the kernel printed it], least recently counted first
        self._series: OrderedDict[tuple[BusKey, int], tuple[int, str]] = OrderedDict()
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._notes = RateLimiter(1, self.REFUSED_EVERY, clock)  # notes about refused lines
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._follower: XidFollower | None = None
        self._thread: threading.Thread | None = None

    def counts(self) -> dict[tuple[BusKey, int], int]:
        """A copy of the counts: ``(bus key, xid) -> events`` (at most :attr:`MAX_SERIES` pairs)."""
        with self._lock:
            return {key: n for key, (n, _) in self._series.items()}

    def series(self) -> list[tuple[BusKey, int, str, int]]:
        """The counts with the PCI address as the kernel printed it: ``(bus key, xid, address, events)``, sorted."""
        with self._lock:
            return sorted((key, code, text, n) for (key, code), (n, text) in self._series.items())

    def rejected(self) -> dict[str, int]:
        """Lines with an Xid in them that were refused, by reason (every one of :data:`REJECT_REASONS`)."""
        with self._lock:
            return dict(self._rejected)

    def start(self) -> XidWatcher:
        """Start the thread (without ``retry``, open the log first, here: KernelLogError if it cannot). Returns self."""
        if self._thread is None:
            if self.retry is None:
                self._follower = self._open(None, self.from_start)
            self._thread = threading.Thread(target=self._run, name="smiquery-xid", daemon=True)
            self._thread.start()
        return self

    def _open(self, after_seq: int | None, from_start: bool) -> XidFollower:
        self.attempts += 1
        follower = follow(self.path, after_seq=after_seq, from_start=from_start, poll=self.poll, on_reject=self._reject)
        self.up, self.last_error = True, None
        return follower

    def _count(self, event: XidEvent) -> None:
        key = bus_key(event.pci_bus_id)
        if key is None:
            return
        with self._lock:
            n, text = self._series.pop((key, event.xid), (0, event.pci_bus_id))
            self._series[(key, event.xid)] = (n + 1, text)
            if len(self._series) > self.MAX_SERIES:
                self.other += self._series.popitem(last=False)[1][0]
            self.events += 1
        if self.on_event is not None:
            _hand_on(self.on_event, event)

    def _reject(self, reason: RejectReason, line: str) -> None:
        with self._lock:
            self._rejected[reason] += 1
        held = self._notes.take(None)
        if held is None:
            return
        shown = line.rstrip("\r\n")
        shown = printable(shown if len(shown) <= 200 else shown[:200] + "...")
        more = f"; {held} more refused since the last note" if held else ""
        text = f"ignored a line that looks like an Xid but {_REFUSED[reason]} ({reason}): {shown}{more}"
        _hand_on(self.on_refused, text)

    def _report(self, exc: BaseException, opened: bool) -> None:
        if self.on_error is not None and not self._stop.is_set():
            self.on_error(exc, opened)

    def _run(self) -> None:
        follower = self._follower  # opened by start() without retry
        after_seq: int | None = None
        from_start = self.from_start
        warned = False
        while follower is not None or not self._stop.is_set():
            if follower is None:
                try:
                    follower = self._open(after_seq, from_start)
                except KernelLogError as exc:
                    self.up, self.last_error = False, exc.reason
                    if not warned:
                        warned = True
                        self._report(exc, False)
                    self._stop.wait(self.retry or 0.0)  # retry is set: without it, start() opened the log
                    continue
                self._follower = follower
                if self._stop.is_set():  # close() may have looked before the follower was there
                    follower.close()
            try:
                with follower:  # iterated even when closed: that closes its descriptor
                    for event in follower:
                        self._count(event)
            except Exception as exc:  # a read error (or a bug): resume after what was counted, not from the start
                self.up, self.last_error = False, one_line(exc)
                self._report(exc, True)
                if self.retry is not None:
                    self._stop.wait(self.retry)
            if self.retry is None:
                break
            after_seq = follower.last_seq if follower.last_seq >= 0 else None
            from_start = False  # a plain file: what was read is not read again
            follower = None
        self.up = False

    def close(self, timeout: float = 5.0) -> None:
        """Stop following (the thread sees it within ``poll`` seconds) and wait up to ``timeout`` seconds for it."""
        self._stop.set()
        follower = self._follower
        if follower is not None:
            follower.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
