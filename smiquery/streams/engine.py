"""The engine of every supervised nvidia-smi source: lines and the time in; items, events and deadlines out.

No I/O, clock, thread or callback: every method takes the monotonic ``now`` from its driver, and its events wait in
:meth:`Engine.take_events`. A driver runs this loop::

    engine.begin(now)
    while not engine.done and engine.starting(now):
        start the child; engine.started(now)
        while not engine.done and not engine.stopped(now):
            read lines until engine.deadline(); none (even after one more look): raise engine.expired(now)
            deliver engine.feed(lines, now, idle)
        on a typed error: got = engine.failed(exc, now, wall): None stops; else deliver the items, wait the delay
    engine.finish()

It owns what must not differ between drivers: deadlines, counters, events, the rows' meaning (a :class:`Rows`) and
the retry decision (the :class:`~smiquery.retry.RetryPolicy`'s tenacity strategies, a ``RetryCallState`` a streak).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from tenacity import RetryCallState

from smiquery._log import get_logger
from smiquery.errors import NvidiaSmiTimeoutError, SmiqueryError
from smiquery.retry import RetryPolicy, is_permanent, one_line
from smiquery.source import StreamEvent, StreamStats

__all__ = ["Engine", "Rows"]

log = get_logger("smiquery")

Item = TypeVar("Item")


class Rows(Protocol[Item]):
    """What a source's lines mean (``--query-gpu`` CSV or ``pmon``); ``what`` names the command in messages."""

    what: str

    def child_started(self) -> None:
        """A new child starts: what the previous one left unfinished is gone."""

    def feed(self, lines: Sequence[str], now: float, idle: float | None, out: list[Item]) -> int:
        """Parse ``lines`` (arrived at monotonic ``now`` after waiting ``idle`` s); append items; return rows."""

    def cut(self, out: list[Item], now: float) -> None:
        """The child failed: append what its unfinished output still makes (a short sweep), if anything."""

    def last_message(self) -> str | None:
        """The newest line that was not a row, if any."""


class Engine(Generic[Item]):
    """Deadlines, counters, events and the retry decision of one supervised source (see the module docstring).

    ``stats`` and ``events`` are shared with the rows' interpreter (which appends events too); ``duration`` and
    ``max_rows`` (None: no limit) end the stream.
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
        events: list[StreamEvent] | None = None,
    ) -> None:
        self.rows = rows
        self.what = rows.what
        self.argv = tuple(argv)
        self.policy = policy
        self.startup_timeout = float(startup_timeout)
        self.stall_timeout = float(stall_timeout)
        self.duration = duration
        self.stats = stats
        self.events: list[StreamEvent] = events if events is not None else []
        self.closed = False  #: True once :meth:`close` was called (from any thread: a plain flag)
        self._retrying = policy.retrying(stats)
        self._streak: RetryCallState | None = None
        self._budget = max_rows
        self._end: float | None = None
        self._row_deadline = 0.0
        self._delivered = False
        self._healthy_since: float | None = None
        self._failing = False

    def take_events(self) -> list[StreamEvent]:
        """The events made since the last call, oldest first, for the driver to hand to the listeners."""
        events = self.events[:]
        self.events.clear()
        return events

    def begin(self, now: float) -> None:
        """The stream starts (its ``duration`` counts from here)."""
        self._end = None if self.duration is None else now + self.duration

    def starting(self, now: float) -> bool:
        """A child is about to start: counted. False (nothing counted) once the stream is stopped."""
        if self.stopped(now):
            return False
        stats = self.stats
        if stats.starts:
            stats.restarts += 1
        stats.starts += 1
        stats.state = "starting"
        stats.next_retry_at = None
        self.rows.child_started()
        self._delivered = False
        self._row_deadline = now + self.startup_timeout
        return True

    def started(self, now: float) -> None:
        """The child runs; the start-up deadline counts from now."""
        self._row_deadline = now + self.startup_timeout

    def stopped(self, now: float) -> bool:
        """True when the stream is closed or past its duration (``now`` 0 asks about the close alone)."""
        return self.closed or (self._end is not None and now >= self._end)

    def close(self) -> None:
        """End the stream at its next step. Any thread."""
        self.closed = True

    @property
    def done(self) -> bool:
        """True when ``max_rows`` rows have been delivered."""
        return self._budget is not None and self._budget <= 0

    def finish(self) -> None:
        """The stream is over: ``closed`` or ``ended`` (unless it ``failed``)."""
        if self.stats.state != "failed":
            self.stats.state = "closed" if self.closed else "ended"
        self.stats.next_retry_at = None

    def deadline(self) -> float:
        """The monotonic time by which the next row must arrive (or the stream ends)."""
        return self._row_deadline if self._end is None else min(self._row_deadline, self._end)

    def feed(self, lines: Sequence[str], now: float, idle: float | None = None) -> list[Item]:
        """Take lines read at ``now`` (after waiting ``idle`` s for them); returns the items they make."""
        out: list[Item] = []
        n = self.rows.feed(lines, now, idle, out)
        if not n:
            return out
        stats = self.stats
        if not self._delivered:  # the child's first row: running
            self._delivered = True
            # A single restart says enough on its own; the end of a longer outage (or of one that needed a
            # person) is news worth one line.
            if self._failing and (stats.attempt >= 2 or stats.permanent):
                self.events.append(StreamEvent("recovered", None, f"{self.what} delivers rows again"))
                log.warning("smiquery: %s delivers rows again", self.what)
            stats.state = "running"
            stats.attempt = 0
            stats.next_retry_at = None
            stats.permanent = False
            self._healthy_since = now
            self._failing = False
        self._row_deadline = now + self.stall_timeout
        stats.rows += n
        if self._budget is not None:
            self._budget -= n
        return out

    def expired(self, now: float) -> SmiqueryError | None:
        """The deadline passed without a row: the timeout error to fail the hung child with (None: the stream's end)."""
        if self.stopped(now):
            return None
        if not self._delivered:
            return NvidiaSmiTimeoutError(
                f"{self.what} printed no row within {self.startup_timeout:g} s of starting and was killed; a "
                "cold start without persistence mode can be this slow (`nvidia-smi -pm 1`), or the driver hangs "
                "(check `dmesg` for Xid errors)",
                argv=self.argv,
                timeout=self.startup_timeout,
            )
        said = self.rows.last_message()
        said = f" (it printed: {said})" if said else ""
        return NvidiaSmiTimeoutError(
            f"{self.what} printed no data row for {self.stall_timeout:g} s{said} and was killed (hung "
            "driver?); check `dmesg` for Xid errors and whether plain `nvidia-smi` answers",
            argv=self.argv,
            timeout=self.stall_timeout,
        )

    def failed(self, exc: SmiqueryError, now: float, wall: float) -> tuple[list[Item], float] | None:
        """The child failed (or could not start): what its cut output still makes, and the seconds to wait.

        ``wall`` is ``time.time()`` (for ``next_retry_at``). None when the stream was closed meanwhile; raises
        ``exc`` itself when the policy gives up.
        """
        if self.closed:
            return None
        out: list[Item] = []
        self.rows.cut(out, now)
        stats = self.stats
        stats.errors[type(exc).__name__] += 1
        stats.last_error = one_line(exc)
        stats.last_error_type = type(exc).__name__
        stats.permanent = is_permanent(exc)
        self._failing = True
        self.events.append(StreamEvent("error", exc, stats.last_error))
        since, self._healthy_since = self._healthy_since, None
        if since is not None and now - since >= self.policy.healthy_after and not stats.permanent:
            detail = f"restarting {self.what} now after: {stats.last_error} (it had run well for a while)"
            log.warning("smiquery: %s", detail)
            self.events.append(StreamEvent("restart", exc, detail))
            self._streak = None  # a fresh streak, restarted at once
            return out, 0.0
        # this failure of the streak to the policy's tenacity strategies: the wait, or give up (raise)
        retrying = self._retrying
        state = self._streak
        if state is None:
            state = self._streak = RetryCallState(retrying, fn=None, args=(), kwargs={})
            state.start_time = now
        else:
            state.prepare_for_next_attempt()
        state.set_exception((type(exc), exc, exc.__traceback__))
        state.outcome_timestamp = now
        if not retrying.retry(state) or retrying.stop(state):
            self._streak = None
            stats.state = "failed"
            raise exc
        wait = float(retrying.wait(state))
        state.idle_for += wait
        stats.state = "retrying"
        stats.attempt = state.attempt_number
        stats.next_retry_at = wall + wait
        slow = " (this needs a person: retrying slowly)" if stats.permanent else ""
        detail = f"restarting {self.what} in {wait:.1f} s after: {stats.last_error}{slow}"
        self.events.append(StreamEvent("restart", exc, detail))
        log.warning("smiquery: %s", detail)
        return out, wait
