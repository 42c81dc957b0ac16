"""The engine of every supervised nvidia-smi source, without I/O.

A driver (thread, asyncio) runs this loop and nothing else::

    engine.begin(now)
    while engine.starting(now):              # False once closed or past ``duration``
        child = start the child              # on a typed error: items, delay = engine.failed(exc, now)
        engine.started(now)
        while not engine.done and not engine.stopped(now):
            lines = read lines until engine.deadline()
            if none came by the deadline:
                read once more without waiting     # a paused parent: rows wait in the pipe
                if still none: raise engine.expired(now)   # None: the deadline was the end of the stream
            deliver engine.feed(lines, now, idle)
        on a typed error: got = engine.failed(exc, now); None: stop; else deliver the items, sleep the delay

The engine owns everything that must not differ between drivers: deadlines (start-up, stall, duration),
counters and events (:class:`~smiquery.source.StreamStats`), the rows' meaning (a :class:`Rows`: CSV sweeps and
GPU identity, or pmon instants) and the retry decision, which drives tenacity's ``Retrying.iter()`` (it does no
I/O either) under one :class:`~smiquery.retry.RetryPolicy`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from tenacity import DoSleep, RetryCallState

from smiquery.errors import NvidiaSmiTimeoutError, SmiqueryError
from smiquery.retry import RetryPolicy, Supervision
from smiquery.source import StreamEvent, StreamStats

__all__ = ["Engine", "Rows"]

Item = TypeVar("Item")


class Rows(Protocol[Item]):
    """What a source's lines mean: the CSV rows of ``--query-gpu`` or the lines of ``pmon``.

    Attributes:
        what: the command named in events and messages (``"nvidia-smi"``, ``"nvidia-smi pmon"``).
        messages: the newest lines that were not rows (driver messages), for error messages.
    """

    what: str

    def child_started(self) -> None:
        """A new child starts: what the previous one left unfinished is gone."""
        ...

    def feed(self, lines: Sequence[str], now: float, idle: float | None, out: list[Item]) -> int:
        """Parse ``lines`` (arrived at monotonic ``now`` after waiting ``idle`` s); append items; return rows."""
        ...

    def cut(self, out: list[Item], now: float) -> None:
        """The child failed: append what its unfinished output still makes (a short sweep), if anything."""
        ...

    def last_message(self) -> str | None:
        """The newest line that was not a row, if any."""
        ...


class Engine(Generic[Item]):
    """Deadlines, counters, events and the retry decision of one supervised source (see the module docstring).

    Args:
        rows: the meaning of the lines.
        argv: the child's command (named in timeout errors).
        policy: the retry policy.
        startup_timeout: seconds a new child may take to print its first row.
        stall_timeout: seconds without a row, once rows flow, before the child counts as hung.
        duration: seconds the whole stream may run (None: no limit).
        max_rows: stop after this many rows (None: no limit).
        stats: the counters to keep (shared with the rows' interpreter).
        emit: hands an event to the source's listeners.
    """

    def __init__(
        self,
        rows: Rows[Item],
        argv: Sequence[str],
        policy: RetryPolicy,
        *,
        startup_timeout: float,
        stall_timeout: float,
        duration: float | None = None,
        max_rows: int | None = None,
        stats: StreamStats,
        emit: Callable[[StreamEvent], None],
    ) -> None:
        self.rows = rows
        self.argv = tuple(argv)
        self.policy = policy
        self.startup_timeout = float(startup_timeout)
        self.stall_timeout = float(stall_timeout)
        self.duration = duration
        self.stats = stats
        self.supervision = Supervision(policy, stats, emit, what=rows.what)
        self._retrying = self.supervision.retrying(_no_sleep)
        self._streak: RetryCallState | None = None
        self._budget = max_rows
        self._end: float | None = None
        self._row_deadline = 0.0
        self._delivered = False
        self._closed = threading.Event()

    # ------------------------------------------------------------------------------------------- lifecycle

    def begin(self, now: float) -> None:
        """The stream starts (its ``duration`` counts from here)."""
        self._end = None if self.duration is None else now + self.duration

    def starting(self, now: float) -> bool:
        """A child is about to start: counted. False (nothing counted) once the stream is stopped."""
        if self.stopped(now):
            return False
        self.supervision.started()
        self.rows.child_started()
        self._delivered = False
        self._row_deadline = now + self.startup_timeout
        return True

    def started(self, now: float) -> None:
        """The child runs; the start-up deadline counts from now."""
        self._row_deadline = now + self.startup_timeout

    def stopped(self, now: float) -> bool:
        """True when the stream is closed or past its duration (``now`` 0 asks about the close alone)."""
        return self._closed.is_set() or (self._end is not None and now >= self._end)

    def close(self) -> None:
        """End the stream at its next step. Any thread."""
        self._closed.set()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed.is_set()

    @property
    def done(self) -> bool:
        """True when ``max_rows`` rows have been delivered."""
        return self._budget is not None and self._budget <= 0

    def finish(self) -> None:
        """The stream is over without a failure: ``closed`` or ``ended``."""
        self.supervision.finished(self._closed.is_set())

    # --------------------------------------------------------------------------------------------- data

    def deadline(self) -> float:
        """The monotonic time by which the next row must arrive (or the stream ends)."""
        return self._row_deadline if self._end is None else min(self._row_deadline, self._end)

    def feed(self, lines: Sequence[str], now: float, idle: float | None = None) -> list[Item]:
        """Take lines read at ``now`` (after waiting ``idle`` s for them); returns the items they make."""
        out: list[Item] = []
        n = self.rows.feed(lines, now, idle, out)
        if n:
            if not self._delivered:
                self._delivered = True
                self.supervision.first_row()
            self._row_deadline = now + self.stall_timeout
            self.stats.rows += n
            if self._budget is not None:
                self._budget -= n
        return out

    def expired(self, now: float) -> SmiqueryError | None:
        """The deadline passed without a row (even after one more look at the pipe): the child is hung.

        Returns:
            The timeout error to fail the child with; None when the deadline was the end of the stream.
        """
        if self.stopped(now):
            return None
        if not self._delivered:
            return NvidiaSmiTimeoutError(
                f"{self.rows.what} printed no row within {self.startup_timeout:g} s of starting and was killed; a "
                "cold start without persistence mode can be this slow (`nvidia-smi -pm 1`), or the driver hangs "
                "(check `dmesg` for Xid errors)",
                argv=self.argv,
                timeout=self.startup_timeout,
            )
        said = self.rows.last_message()
        said = f" (it printed: {said})" if said else ""
        return NvidiaSmiTimeoutError(
            f"{self.rows.what} printed no data row for {self.stall_timeout:g} s{said} and was killed (hung "
            "driver?); check `dmesg` for Xid errors and whether plain `nvidia-smi` answers",
            argv=self.argv,
            timeout=self.stall_timeout,
        )

    # --------------------------------------------------------------------------------------------- retry

    def failed(self, exc: SmiqueryError, now: float) -> tuple[list[Item], float] | None:
        """The child failed (or could not start): what its cut output still makes, and how long to wait.

        Returns:
            The items (a short sweep) and the seconds to wait before the next start; None when the stream was
            closed meanwhile (the failure was the close).

        Raises:
            SmiqueryError: ``exc`` itself, when the policy gives up.
        """
        if self._closed.is_set():
            return None
        out: list[Item] = []
        self.rows.cut(out, now)
        if self.supervision.failure(exc):
            self._streak = None
            return out, 0.0
        return out, self._decide(exc)

    def _decide(self, exc: SmiqueryError) -> float:
        retrying = self._retrying
        if self._streak is None:
            retrying.begin()
            self._streak = RetryCallState(retrying, fn=None, args=(), kwargs={})
            retrying.iter(self._streak)  # the first attempt, which just failed
        state = self._streak
        state.set_exception((type(exc), exc, exc.__traceback__))
        try:
            action = retrying.iter(state)  # raises exc when the policy gives up
        except BaseException:
            self._streak = None
            raise
        state.prepare_for_next_attempt()
        return float(action) if isinstance(action, DoSleep) else 0.0


def _no_sleep(seconds: float) -> None:
    """The engine never sleeps: the driver waits the delay that :meth:`Engine.failed` returns."""
