"""Xid errors: the NVIDIA kernel driver's error events, read from the kernel log.

nvidia-smi never reports Xids; the driver writes them to the kernel log as
``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., GPU has fallen off the bus.``. :func:`follow` reads
``/dev/kmsg`` (or a plain file, followed like ``tail -F``) and yields one :class:`XidEvent` per Xid line;
:func:`parse_line` reads one line in any of the formats (``/dev/kmsg`` records, ``dmesg`` with or without
``[seconds]`` stamps, syslog and journal lines) and takes it only when the kernel wrote it: anyone can log a line
that looks like an Xid, and :func:`refusal` says why such a line is refused. :data:`XID_CATALOGUE` gives each
common code a short meaning and what to do, from NVIDIA's public Xid catalogue.

``/dev/kmsg`` replays its whole ring buffer to every new reader: each record carries a sequence number, and a
follower yields each sequence number once (give ``after_seq=`` the last one you handled to resume without
counting twice); any other line is known by its own stamp and text. :meth:`XidFollower.close` may be called from
any other thread and ends the iteration within ``poll`` seconds. :class:`XidWatcher` is the one thread that follows
a log, for the exporter, the training monitor and the stream CLI alike: it counts the events per GPU and code
(bounded) and the refused lines by reason, and hands each event to its listener.
"""

from __future__ import annotations

import contextlib
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
from typing import Literal, TypeVar

from smiquery._log import get_logger
from smiquery.errors import KernelLogError, UsageError
from smiquery.printable import printable
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

    Attributes:
        code: the Xid number.
        meaning: a few words.
        action: ``application`` (a bug in the program, the GPU is fine), ``reset`` (reset the GPU when it is
            idle), ``drain`` (take the node out of service now, then reset or reboot), ``rma`` (repeated:
            hardware service), ``info`` (recorded, nothing to do).
        advice: one sentence saying what to do.
    """

    code: int
    meaning: str
    action: XidAction
    advice: str


def _info(code: int, meaning: str, action: XidAction, advice: str) -> tuple[int, XidInfo]:
    return code, XidInfo(code, meaning, action, advice)


#: The common Xid codes (NVIDIA's public "Xid Errors" catalogue, summarised).
XID_CATALOGUE: dict[int, XidInfo] = dict(
    [
        _info(8, "GPU stopped responding to a channel (driver or application)", "reset",
              "Restart the job; reset the GPU if it repeats."),
        _info(13, "graphics engine exception (an illegal instruction or address in a kernel)", "application",
              "Debug the application (compute-sanitizer); the GPU is fine unless other Xids follow."),
        _info(31, "GPU memory page fault (illegal memory access)", "application",
              "Debug the application (compute-sanitizer); the GPU is fine unless it repeats across jobs."),
        _info(32, "invalid or corrupted push buffer stream (PCIe or driver)", "reset",
              "Check PCIe errors and the driver; reset the GPU if it repeats."),
        _info(38, "driver firmware error", "reset", "Reset the GPU; update the driver if it repeats."),
        _info(43, "GPU stopped processing (the application faulted)", "application",
              "The faulting process was stopped; the GPU keeps working. Debug the application."),
        _info(45, "preemptive cleanup after a previous error or a killed process", "info",
              "Nothing by itself; look at the Xid before it."),
        _info(48, "double-bit ECC error (uncorrectable)", "drain",
              "Drain the node and reset the GPU; RMA if it repeats or pages cannot be retired."),
        _info(61, "internal micro-controller breakpoint or warning", "reset", "Reset the GPU; report if it repeats."),
        _info(62, "internal micro-controller halt", "drain", "Drain and reset the GPU; RMA if it repeats."),
        _info(63, "ECC page retirement or row remapping recorded", "info",
              "Reset the GPU when convenient so the retirement or remap takes effect."),
        _info(64, "ECC page retirement or row remapping failed", "drain",
              "Drain the node, reset the GPU; RMA if the remap keeps failing."),
        _info(68, "video decoder (NVDEC) exception", "application", "Check the application using the decoder."),
        _info(69, "graphics engine class error", "application", "Debug the application; reset if it repeats."),
        _info(74, "NVLink error", "drain", "Drain, reset the GPUs on the link; check the link and RMA if it repeats."),
        _info(79, "GPU has fallen off the bus", "drain",
              "Drain the node and reboot it; check PCIe, power and cooling; RMA if it repeats."),
        _info(92, "high single-bit ECC error rate", "rma", "Watch the GPU; RMA if the rate stays high."),
        _info(94, "contained ECC error (only the affected application was stopped)", "reset",
              "Restart the job; reset the GPU when idle to remap the row."),
        _info(95, "uncontained ECC error (all applications on the GPU are affected)", "drain",
              "Drain the node and reset the GPU now; RMA if it repeats."),
        _info(109, "context switch timeout", "application", "Check the application; reset the GPU if it repeats."),
        _info(119, "GSP firmware RPC timeout", "reset", "Reset the GPU (or reboot); update the driver if it repeats."),
        _info(120, "GSP firmware error", "reset", "Reset the GPU (or reboot); update the driver if it repeats."),
        _info(140, "unrecovered ECC error", "drain", "Drain the node and reset the GPU; RMA if it repeats."),
    ]
)  # fmt: skip


@dataclass(frozen=True)
class XidEvent:
    """One Xid line from the kernel log.

    Attributes:
        xid: the code.
        pci_bus_id: the GPU's PCI address as the driver printed it (``0000:3b:00``); match it to a GPU with
            :func:`bus_key` or :func:`gpu_for`.
        message: the text after the code.
        pid: the process the driver named (``pid=``), None when none.
        process_name: the ``name=`` the driver printed, None when none.
        seq: the ``/dev/kmsg`` sequence number, None for other formats.
        uptime: seconds since boot when the kernel logged it, None when the line has no stamp.
        raw: the whole line.
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

#: Why a line with an Xid in it is refused: ``not_kernel`` (its format names another writer: a syslog tag or
#: RFC 5424 app name other than ``kernel``, a syslog priority or ``/dev/kmsg`` facility other than the kernel's, a
#: ``dmesg -x`` facility other than ``kern``), ``unknown_format`` (no kernel-log line format, or the Xid is not where
#: the kernel's message starts), ``malformed`` (the kernel's line, but its bus id or code does not parse).
REJECT_REASONS = ("not_kernel", "unknown_format", "malformed")
RejectReason = Literal["not_kernel", "unknown_format", "malformed"]


def parse_line(line: str) -> XidEvent | None:
    """The Xid event in one kernel-log line, or None when the line is no Xid written by the kernel.

    Only the kernel writes Xid lines; anyone can write a line that looks like one (``logger 'NVRM: Xid ...'``).
    A line counts only when the Xid text starts the kernel's own message in one of these formats:

    * ``/dev/kmsg`` records (``4,1234,5678901,-;NVRM: Xid ...``) of the kernel facility (what a program writes to
      ``/dev/kmsg`` gets the user facility);
    * ``dmesg`` lines: ``[ 5.678901] NVRM: Xid ...``, ``dmesg -T``'s ``[Sat Dec  5 10:00:00 2026] NVRM: Xid ...``,
      ``dmesg -x``'s ``kern  :warn  : [...]``;
    * syslog and journal lines whose tag is exactly ``kernel``: ``Dec  5 10:00:00 host kernel: [5.67] NVRM: Xid
      ...``, rsyslog's ISO stamps, the ``journalctl -k`` (``-o short*``) formats, RFC 5424 with app name ``kernel``.

    :func:`refusal` says why a line with an Xid in it is refused.
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
    """The GPU the event is about, matched by PCI address; None when none of ``gpus`` is at it.

    Args:
        event: the event.
        gpus: :class:`~smiquery.sources.details.GpuDetails`, samples that queried ``pci.bus_id``, or anything else
            with a ``pci_bus_id`` attribute (one without it, or whose address is None, matches nothing).
    """
    key = bus_key(event.pci_bus_id)
    for gpu in gpus:
        bus = getattr(gpu, "pci_bus_id", None)
        if key is not None and isinstance(bus, str) and bus_key(bus) == key:
            return gpu
    return None


# ------------------------------------------------------------------------------------------------ following

_DEDUPE_KEEP = 4096  # lines remembered, to skip them when a followed file is read again (rewritten, rotated)


class XidFollower(Iterator[XidEvent]):
    """An iterator of Xid events from a kernel log, open until :meth:`close` (see :func:`follow`)."""

    def __init__(
        self,
        path: str,
        *,
        after_seq: int | None,
        from_start: bool,
        poll: float,
        on_reject: Callable[[RejectReason, str], object] | None = None,
    ) -> None:
        self.path = path
        self.poll = poll
        self.on_reject = on_reject
        #: the highest ``/dev/kmsg`` sequence number handed out (pass it as ``after_seq`` to resume)
        self.last_seq = after_seq if after_seq is not None else -1
        self._closed = threading.Event()
        self._seen: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # (line digest, its occurrence)
        self._pass: OrderedDict[bytes, int] = OrderedDict()  # line digest -> times read since the file was opened
        self._fd = -1
        self._buf = b""
        self._pos = 0
        self._ino: tuple[int, int] | None = None
        self._chardev = False
        self._open(first=True, from_start=from_start)
        self._gen = self._events()

    # ---- public

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

    # ---- reading

    def _open(self, *, first: bool, from_start: bool = True) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except PermissionError:
            if first:
                raise KernelLogError(self.path, "permission denied") from None
            return False
        except FileNotFoundError:
            if first:
                raise KernelLogError(self.path, "no such file") from None
            return False
        except OSError as exc:
            if first:
                raise KernelLogError(self.path, exc.strerror or str(exc)) from None
            return False
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise KernelLogError(self.path, "is a directory")
        self._chardev = stat.S_ISCHR(st.st_mode)
        self._fd = fd
        self._ino = (st.st_dev, st.st_ino)
        self._buf = b""
        self._pos = 0
        self._pass.clear()
        if not from_start:
            # /dev/kmsg: SEEK_END skips the ring buffer's replay; a plain file: read on from its end
            self._pos = os.lseek(fd, 0, os.SEEK_END)
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
        """Follow a plain file like ``tail -F``: re-open it when it is replaced (rotated) or truncated.

        As with ``tail -F``, truncation is seen when the file is found shorter than what was read: one truncated
        and refilled past that point between two polls reads on from the old position.
        """
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

        A ``/dev/kmsg`` record is known by its sequence number. Any other line carries its own stamp (the kernel's
        ``[seconds]`` or the wall-clock one of ``dmesg -T`` and syslog), so the same line read again is the same
        record: a line is known by its text and by how many times that text was read since the file was opened or
        truncated (the same text twice in one reading is two events; read again after a rewrite, it is none).
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


def follow(
    path: str | os.PathLike[str] = DEFAULT_KERNEL_LOG,
    *,
    after_seq: int | None = None,
    from_start: bool = True,
    poll: float = 0.5,
    on_reject: Callable[[RejectReason, str], object] | None = None,
) -> XidFollower:
    """Follow a kernel log and yield each Xid event once, until the follower is closed.

    Args:
        path: ``/dev/kmsg`` (the default; replays the ring buffer, then waits for new records) or a plain file
            (``/var/log/kern.log``, a saved ``dmesg``), followed like ``tail -F`` across rotation.
        after_seq: skip ``/dev/kmsg`` records up to this sequence number (a restart that remembers
            ``follower.last_seq`` counts nothing twice).
        from_start: read a plain file from its beginning, replay ``/dev/kmsg``'s ring buffer (False: only what is
            logged from now on).
        poll: seconds between checks for new data and for :meth:`XidFollower.close`.
        on_reject: called on the reading thread with the reason and the line for each line with an Xid in it that
            :func:`parse_line` refuses (see :func:`refusal`).

    Returns:
        The follower: iterate it for :class:`XidEvent`; ``close()`` from any thread.

    Raises:
        KernelLogError: the log cannot be opened (no permission: run as root or with CAP_SYSLOG; missing).
        UsageError: ``poll`` is not a positive number.
    """
    if not poll > 0:
        raise UsageError(f"poll must be a positive number of seconds, not {poll!r}")
    return XidFollower(os.fspath(path), after_seq=after_seq, from_start=from_start, poll=poll, on_reject=on_reject)


def describe(event: XidEvent, gpu: int | None = None, uuid: str | None = None) -> str:
    """One line for people: the code, the GPU, the catalogue's meaning and action.

    For example ``Xid 79 on GPU 1 (GPU-5d..., PCI 0000:5d:00): GPU has fallen off the bus; action drain: Drain
    the node and reboot it; ...``. A code the catalogue lacks is shown with the driver's own text.

    Args:
        event: the event.
        gpu: the nvidia-smi index of the GPU at its PCI address, None when unknown.
        uuid: that GPU's UUID, None when unknown.
    """
    where = ", ".join(x for x in (uuid, f"PCI {event.pci_bus_id}") if x)
    who = f"GPU {gpu} ({where})" if gpu is not None else f"the GPU at {where}"
    proc = f" [pid {event.pid}{' ' + event.process_name if event.process_name else ''}]" if event.pid else ""
    info = event.info
    if info is None:
        return f"Xid {event.xid} on {who}{proc}: {event.message} (not in smiquery's Xid catalogue: see NVIDIA's)"
    return f"Xid {event.xid} on {who}{proc}: {info.meaning}; action {info.action}: {info.advice}"


_REFUSED = {
    "not_kernel": "was not written by the kernel",
    "unknown_format": "is in no kernel-log format smiquery reads",
    "malformed": "does not parse",
}


class XidWatcher:
    """A kernel log followed on a daemon thread: each new Xid event is counted by GPU and code, then handed on.

    The one follower thread of the exporter (which retries a log it cannot read and serves the counts), the
    training monitor and the stream CLI (which follow from the log's end and stop at the first failure).

    What it keeps is bounded whatever the log holds: counts for the :attr:`MAX_SERIES` (bus, code) pairs with the
    newest events (an older pair's count moves to :attr:`other`), and one count per refusal reason. Lines with an
    Xid that the kernel did not write (see :func:`parse_line`) are counted by reason (:meth:`rejected`) and noted
    at most once a minute, with how many were refused since the last note.

    Args:
        path: ``/dev/kmsg`` or a plain file followed like ``tail -F``.
        on_event: called with each new event, on the thread, after it was counted; what it raises is logged and
            the following goes on.
        on_error: called on the thread with the error and whether the log had been opened: each time reading
            fails, and (with ``retry``) the first time the log cannot be opened; later attempts are quiet.
        from_start: see :func:`follow` (False: only events logged from now on).
        retry: seconds before the log is opened again after it could not be, or after reading failed (resuming
            after the last event counted, so a replayed record is not counted twice). None: :meth:`start` opens
            the log, raising when it cannot, and a failure ends the following.
        poll: see :func:`follow`.
        on_refused: called on the thread with one line about a refused line (the reason, the line with control
            characters escaped, how many more were refused since the last note), at most once a minute; None
            (the default) logs it as a WARNING.
        clock: a monotonic clock for that minute (tests inject one).

    Attributes:
        up: True while the log is open and read.
        last_error: the last failure, one line (None while ``up``).
        events: events counted so far.
        other: events no longer counted under their (bus, code) pair, to keep at most :attr:`MAX_SERIES` pairs.
        attempts: times the log was opened or tried.
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
        self.on_refused = on_refused
        self.clock = clock
        self.events = 0
        self.other = 0
        self.attempts = 0
        # (bus key, code) -> [events, the bus id as the kernel printed it], least recently counted first
        self._series: OrderedDict[tuple[BusKey, int], tuple[int, str]] = OrderedDict()
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._refused_at: float | None = None  # when the last note about a refused line went out
        self._refused_held = 0  # lines refused since then
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
        """Start the thread (without ``retry``, open the log first, here). Returns self.

        Raises:
            KernelLogError: without ``retry``, the log cannot be opened.
        """
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
            try:
                self.on_event(event)
            except Exception:  # a listener's bug must not stop the counting
                log.exception("smiquery: an Xid listener failed")

    def _reject(self, reason: RejectReason, line: str) -> None:
        now = self.clock()
        with self._lock:
            self._rejected[reason] += 1
            if self._refused_at is not None and now - self._refused_at < self.REFUSED_EVERY:
                self._refused_held += 1
                return
            held, self._refused_held, self._refused_at = self._refused_held, 0, now
        shown = line.rstrip("\r\n")
        shown = printable(shown if len(shown) <= 200 else shown[:200] + "...")
        more = f"; {held} more refused since the last note" if held else ""
        text = f"ignored a line that looks like an Xid but {_REFUSED[reason]} ({reason}): {shown}{more}"
        if self.on_refused is None:
            log.warning("smiquery: %s", text)
            return
        try:
            self.on_refused(text)
        except Exception:  # a listener's bug must not stop the following
            log.exception("smiquery: an Xid listener failed")

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
                text = str(exc)
                self.up, self.last_error = False, text.splitlines()[0] if text else type(exc).__name__
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
