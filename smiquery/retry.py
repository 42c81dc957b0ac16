"""The one retry policy of every long-lived source: the CSV stream, the pmon stream and the asyncio stream.

A :class:`RetryPolicy` says how long to wait before the next start and when to give up; a :class:`Supervision`
applies it to one source, keeping that source's :class:`~smiquery.source.StreamStats` and telling its
:class:`~smiquery.source.StreamEvent` listeners. The stream engine (:mod:`smiquery.streams.engine`) drives
the tenacity ``Retrying`` of :meth:`Supervision.retrying` one failure at a time, for every driver alike:

* a transient fault (crash, hang, a child that ends) waits ``backoff_initial * 2 ** (attempt - 1)`` plus up to
  ``backoff_initial`` of jitter, capped at ``backoff_max``;
* a fault that needs a person (driver/library mismatch, NVML missing, no devices, a rejected field, the binary
  gone, an unsupported command) waits ``permanent_retry`` seconds, +-10 %, so the source recovers by itself once
  the cause is fixed;
* one good row does not reset the backoff: only a failure after ``healthy_after`` seconds of good data starts a
  fresh streak (restarted at once);
* ``fail_fast`` (interactive use): until the first row, a fault that needs a person ends the source at once and
  a transient one after :data:`FAIL_FAST_ATTEMPTS` starts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type

from smiquery._log import get_logger
from smiquery.errors import SmiqueryError
from smiquery.source import StreamEvent, StreamStats

__all__ = [
    "DEFAULT_PERMANENT_RETRY",
    "FAIL_FAST_ATTEMPTS",
    "RetryPolicy",
    "Supervision",
    "is_permanent",
    "one_line",
]

log = get_logger("smiquery")

T = TypeVar("T")

#: With ``fail_fast``, how many starts a transient fault gets before any row has arrived.
FAIL_FAST_ATTEMPTS = 6
#: Seconds between attempts while a fault needs a person (driver upgrade pending a reboot, NVML missing...).
DEFAULT_PERMANENT_RETRY = 30.0


def is_permanent(exc: BaseException | None) -> bool:
    """True for a failure that needs a person (a typed error that is not ``retryable``)."""
    return isinstance(exc, SmiqueryError) and not exc.retryable


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (its class name when it has none)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class RetryPolicy:
    """How a long-lived source waits between starts and when it gives up (see the module docstring).

    Attributes:
        backoff_initial: first delay after a transient failure, in seconds; doubles per failure of a streak.
        backoff_max: the longest delay after a transient failure.
        jitter: add up to ``backoff_initial`` at random to transient delays and spread permanent ones by +-10 %
            (so a fleet does not restart in step).
        healthy_after: seconds of good data after which a failure starts a fresh streak.
        permanent_retry: seconds between attempts while the failure needs a person; None ends the source at once
            on such a failure (for a caller that retries in its own way, like the exporter's pmon watcher).
        max_attempts: failed starts in one streak before giving up (None: never).
        max_restarts: restarts in all before giving up (None: never).
        fail_fast: until the first row, give up on a fault that needs a person at once and on a transient one
            after :data:`FAIL_FAST_ATTEMPTS` starts.

    Raises:
        ValueError: a negative delay, a non-positive ``permanent_retry`` or ``max_attempts`` below 1.
    """

    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    jitter: bool = True
    healthy_after: float = 30.0
    permanent_retry: float | None = DEFAULT_PERMANENT_RETRY
    max_attempts: int | None = None
    max_restarts: int | None = None
    fail_fast: bool = False

    def __post_init__(self) -> None:
        for name in ("backoff_initial", "backoff_max", "healthy_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.permanent_retry is not None and self.permanent_retry <= 0:
            raise ValueError("permanent_retry must be positive")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError("max_restarts must not be negative")

    def delay(self, error: BaseException | None, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th failed start of a streak (counting from 1)."""
        if is_permanent(error) and self.permanent_retry is not None:
            return self.permanent_retry * (random.uniform(0.9, 1.1) if self.jitter else 1.0)
        wait = self.backoff_initial * 2.0 ** min(max(attempt, 1) - 1, 32)
        if self.jitter:
            wait += random.uniform(0, self.backoff_initial)
        return min(wait, self.backoff_max)

    def gives_up(self, error: BaseException | None, attempt: int, stats: StreamStats) -> bool:
        """True when the source should stop after this failure and raise it."""
        if self.max_restarts is not None and stats.restarts >= self.max_restarts:
            return True
        if self.permanent_retry is None and is_permanent(error):
            return True
        if self.fail_fast and stats.rows == 0 and (is_permanent(error) or attempt >= FAIL_FAST_ATTEMPTS):
            return True
        return self.max_attempts is not None and attempt >= self.max_attempts


class Supervision:
    """One source's retry state under a :class:`RetryPolicy`: counters, events, log lines, tenacity objects.

    The source calls :meth:`started` before each child, :meth:`first_row` at its first row, :meth:`failure` when
    it fails, and runs each streak of attempts in :meth:`retrying` (or :meth:`async_retrying`).

    Args:
        policy: the policy.
        stats: the source's counters, updated here.
        emit: hands an event to the source's listeners.
        what: the command named in events and log lines (``"nvidia-smi"``, ``"nvidia-smi pmon"``).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        policy: RetryPolicy,
        stats: StreamStats,
        emit: Callable[[StreamEvent], None],
        *,
        what: str = "nvidia-smi",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.stats = stats
        self._emit = emit
        self.what = what
        self._clock = clock
        self._healthy_since: float | None = None
        self._failing = False

    # ------------------------------------------------------------------------------------- the source's calls

    def started(self) -> None:
        """A child is about to start."""
        stats = self.stats
        if stats.starts:
            stats.restarts += 1
        stats.starts += 1
        stats.state = "starting"
        stats.next_retry_at = None

    def first_row(self) -> None:
        """The child delivered its first row: running; after a long outage, say that data flows again."""
        stats = self.stats
        # A single restart says enough on its own; after a longer outage (or one that needed a person) the return
        # of data is news worth one line.
        outage = self._failing and (stats.attempt >= 2 or stats.permanent)
        stats.state = "running"
        stats.attempt = 0
        stats.next_retry_at = None
        stats.permanent = False
        self._healthy_since = self._clock()
        self._failing = False
        if outage:
            self._emit(StreamEvent("recovered", None, f"{self.what} delivers rows again"))
            log.warning("smiquery: %s delivers rows again", self.what)

    def record(self, exc: BaseException) -> None:
        """Count a failure and tell the listeners."""
        stats = self.stats
        stats.errors[type(exc).__name__] += 1
        stats.last_error = one_line(exc)
        stats.last_error_type = type(exc).__name__
        stats.permanent = is_permanent(exc)
        self._failing = True
        self._emit(StreamEvent("error", exc, stats.last_error))

    def failure(self, exc: SmiqueryError) -> bool:
        """Record a failed child.

        Returns:
            True when it had run well for ``healthy_after`` seconds: a transient failure after a healthy period
            starts a fresh streak (restart at once, backoff from the start).
        """
        self.record(exc)
        since, self._healthy_since = self._healthy_since, None
        if since is not None and self._clock() - since >= self.policy.healthy_after and not is_permanent(exc):
            detail = f"restarting {self.what} now after: {one_line(exc)} (it had run well for a while)"
            log.warning("smiquery: %s", detail)
            self._emit(StreamEvent("restart", exc, detail))
            return True
        return False

    def finished(self, closed: bool) -> None:
        """The source is over (not failed): ``closed`` or ``ended``."""
        if self.stats.state != "failed":
            self.stats.state = "closed" if closed else "ended"
        self.stats.next_retry_at = None

    # -------------------------------------------------------------------------------------------- tenacity

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        return self.policy.delay(exc, state.attempt_number)

    def _stop(self, state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        if self.policy.gives_up(exc, state.attempt_number, self.stats):
            self.stats.state = "failed"
            return True
        return False

    def _before_sleep(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        stats = self.stats
        stats.state = "retrying"
        stats.attempt = state.attempt_number
        stats.next_retry_at = time.time() + wait
        slow = " (this needs a person: retrying slowly)" if is_permanent(exc) else ""
        detail = f"restarting {self.what} in {wait:.1f} s after: {one_line(exc) if exc else 'a failure'}{slow}"
        self._emit(StreamEvent("restart", exc, detail))
        log.warning("smiquery: %s", detail)

    def retrying(self, sleep: Callable[[float], None]) -> Retrying:
        """A tenacity ``Retrying`` under this policy; the engine drives its ``iter()`` (no I/O) one failure at a time.

        Args:
            sleep: what tenacity would sleep with; the engine never lets it (its drivers wait).
        """
        return Retrying(
            stop=self._stop,
            wait=self._wait,
            retry=retry_if_exception_type(SmiqueryError),
            reraise=True,
            sleep=sleep,
            before_sleep=self._before_sleep,
        )
