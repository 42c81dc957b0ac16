"""Writing data rows: the timestamp clock, the row-counting faults, garbage lines and the ``flood``."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, NoReturn

from smiquery.fields import Kind
from smiquery.kinds import FIELD_KINDS
from smiquery.testing._emulator.faults import HANDLE_ERROR, NOTICE_BATCH, Faults
from smiquery.testing._emulator.output import FakeExit, Output, hang
from smiquery.testing._emulator.recording import short_bus_id
from smiquery.testing._emulator.reload import Reload, record_reload

if TYPE_CHECKING:
    import random


def _now_text(now: datetime) -> str:
    return FIELD_KINDS[Kind.TIMESTAMP].format(now)


def _garbage_line(rng: random.Random, ncols: int) -> bytes:
    """A line that can never pass for a row of ``ncols`` cells: random bytes, invalid UTF-8, wrong cell count."""
    # no separators and nothing any reader could take for a line break (str.splitlines() knows eight of them)
    alphabet = bytes(b for b in range(256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    noise = bytes(rng.choice(alphabet) for _ in range(rng.randint(8, 60)))
    cells = ncols + 1 + rng.randint(0, 3)
    return b"\xff\xfe" + noise + b", \xc3(" * (cells - 1)


# The fall-back of `dst-fallback`: 2026-10-25 03:00 CEST (UTC+2) is 02:00 CET (UTC+1), at 01:00 UTC.
_DST_CHANGE_UTC = datetime(2026, 10, 25, 1, 0, 0)


class Clock:
    """The wall clock behind the timestamp cells: the local time, or ``dst-fallback``'s, plus the clock steps."""

    def __init__(self, faults: Faults, keep_time: bool) -> None:
        self.steps = faults.clock_steps
        self.dst_before = faults.dst_before
        self.keep_time = keep_time and self.dst_before is None
        self.start = time.monotonic()

    def now(self) -> datetime:
        """The instant a sweep starts: local time, or (``dst-fallback``) UTC, to be turned by :meth:`text`."""
        if self.dst_before is None:
            return datetime.now()
        return _DST_CHANGE_UTC + timedelta(seconds=time.monotonic() - self.start - self.dst_before)

    def text(self, instant: datetime, rows: int) -> str:
        """The timestamp cell of a row written after ``rows`` rows, at ``instant`` (from :meth:`now`)."""
        shift = sum(seconds for after, seconds in self.steps if rows >= after)
        if shift:
            instant += timedelta(seconds=shift)
        if self.dst_before is not None:  # Europe/Berlin: UTC+2 until the change, UTC+1 after it
            instant += timedelta(hours=2 if instant < _DST_CHANGE_UTC else 1)
        return _now_text(instant)

    def recorded(self, cell: str, rows: int) -> str:
        """A recorded timestamp cell (``SMIQUERY_FAKE_KEEP_TIME``), moved by the clock steps struck so far."""
        if not any(rows >= after for after, _ in self.steps):
            return cell
        try:
            instant = datetime.strptime(cell.strip(), "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            return cell
        return self.text(instant, rows)


class RowWriter:
    """Writes data rows and springs the row-counting faults (``hang-after``, ``crash-after``...)."""

    def __init__(
        self,
        out: Output,
        faults: Faults,
        ncols: int,
        interval: float | None = None,
        reload: Reload | None = None,
    ) -> None:
        self.out = out
        self.faults = faults
        self.ncols = ncols
        self.interval = interval
        self.reload = reload
        self.rows = 0
        self._garbage_done = False
        self._wrong_done = False
        self._rng: random.Random | None = None  # made on the first garbage line: `random` is not imported per call

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            import random

            self._rng = random.Random(20240521)
        return self._rng

    def _due(self, limit: int | None) -> bool:
        return limit is not None and self.rows >= limit

    def check_stop(self, next_bus_id: str) -> None:
        """Hang, crash, exit or turn to notices when their row count is reached."""
        if self._due(self.faults.hang_after):
            hang(self.out)
        if self._due(self.faults.crash_after):
            bus = short_bus_id(next_bus_id) if next_bus_id else "0000:00:00.0"
            self.out.line(HANDLE_ERROR.format(bus=bus, reason="Unknown Error"))
            self.out.flush()
            raise FakeExit(255)
        if self._due(self.faults.exit_after):
            if self.faults.exit_after_message:
                self.out.line(self.faults.exit_after_message)
            self.out.flush()
            raise FakeExit(self.faults.exit_after_code)
        if self._due(self.faults.notices_after):
            self._notices_forever()
        if self.reload is not None and self.rows >= self.reload.after:
            record_reload(self.reload.state, self.reload.struck + 1)
            bus = short_bus_id(next_bus_id) if next_bus_id else "0000:00:00.0"
            self.out.line(HANDLE_ERROR.format(bus=bus, reason="Unknown Error"))
            self.out.flush()
            raise FakeExit(255)

    def _notices_forever(self) -> NoReturn:
        while True:
            for text in NOTICE_BATCH:
                self.out.line(text)
            self.out.flush()
            self.out.sleep(self.interval if self.interval is not None else 1.0)

    def row(self, cells: list[str], *, bus_id: str = "", truncate: bool = False) -> None:
        self.check_stop(bus_id)
        if not self._garbage_done and self._due(self.faults.garbage_after):
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")
            self._garbage_done = True
        if not self._wrong_done and self._due(self.faults.wrong_columns_after):
            cells = cells[:-1]
            self._wrong_done = True
        data = ", ".join(cells).encode("utf-8")
        if truncate:
            self.out.raw(data[: max(1, len(data) // 2)])
        else:
            self.out.raw(data + b"\n")
        self.rows += 1

    def garbage(self, lines: int = 12) -> None:
        for _ in range(lines):
            self.out.raw(_garbage_line(self.rng, self.ncols) + b"\n")


_FLOOD_LINE = 1 << 20  # a loop's flood: lines of 1 MiB, far past any sane row


@functools.cache
def _flood_block() -> bytes:
    """64 KiB of noise with no line break, comma or NUL: what a wrong binary could print."""
    import random

    alphabet = bytes(b for b in range(1, 256) if b not in b"\n\r\x0b\x0c\x1c\x1d\x1e\x85,")
    rng = random.Random(20261025)
    return bytes(rng.choice(alphabet) for _ in range(1 << 16))


def flood(argv: Sequence[str], total: int | None, out: Output) -> int:
    """``flood``: noise on stdout without end (or ``total`` bytes), in a loop as over-long lines."""
    loop = any(a.partition("=")[0] in ("-l", "--loop", "-lms", "--loop-ms") for a in argv) or tuple(argv[:1]) == (
        "pmon",
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
