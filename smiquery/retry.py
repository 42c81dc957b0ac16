"""The one retry policy of every long-lived source: the CSV stream, the pmon stream and the asyncio stream.

A :class:`RetryPolicy` is a set of tenacity strategies, which the stream engine (:mod:`smiquery.streams.engine`) asks
how long to wait before the next start and whether to give up.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from smiquery.errors import SmiqueryError
from smiquery.source import StreamStats

__all__ = ["DEFAULT_PERMANENT_RETRY", "FAIL_FAST_ATTEMPTS", "RetryPolicy", "is_permanent", "one_line"]

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


def _failure(state: RetryCallState) -> BaseException | None:
    return state.outcome.exception() if state.outcome is not None else None


@dataclass(frozen=True)
class RetryPolicy:
    """How a long-lived source waits between starts and when it gives up.

    A transient fault (crash, hang, a child that ends) waits ``backoff_initial * 2 ** (attempt - 1)``, capped at
    ``backoff_max``; ``jitter`` adds up to ``backoff_initial`` at random (and spreads permanent waits by +-10 %), so a
    fleet does not restart in step. A fault that needs a person (driver/library mismatch, NVML missing, no devices, a
    rejected field, the binary gone) waits ``permanent_retry`` seconds, so the source recovers once it is fixed; None
    ends the source at once on such a fault (for a caller that retries in its own way). Only a failure after
    ``healthy_after`` seconds of good data starts a fresh streak (restarted at once). ``max_attempts`` (failed starts
    in one streak) and ``max_restarts`` (in all) give up when reached (None: never). ``fail_fast``: until the first
    row, give up on a fault that needs a person at once, on a transient one after :data:`FAIL_FAST_ATTEMPTS` starts.
    ValueError for a negative delay or count, a non-positive ``permanent_retry`` or ``max_attempts`` below 1.
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
        for name in ("backoff_initial", "backoff_max", "healthy_after", "max_restarts"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.permanent_retry is not None and self.permanent_retry <= 0:
            raise ValueError("permanent_retry must be positive")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")

    def retrying(self, stats: StreamStats) -> Retrying:
        """The policy as tenacity strategies for a source keeping ``stats`` (asked, never run: nothing sleeps in it)."""
        return Retrying(
            stop=self._stop(stats), wait=self._wait(), retry=retry_if_exception_type(SmiqueryError), reraise=True
        )

    def _wait(self) -> Callable[[RetryCallState], float]:
        initial, permanent = self.backoff_initial, self.permanent_retry
        # tenacity's doubling starts at 1 s (its name for a first wait differs across versions): in units of it
        unit = wait_exponential_jitter(max=self.backoff_max / initial if initial else 0.0, jitter=float(self.jitter))

        def wait(state: RetryCallState) -> float:
            if permanent is not None and is_permanent(_failure(state)):
                return random.uniform(0.9 * permanent, 1.1 * permanent) if self.jitter else permanent
            return initial * unit(state)

        return wait

    def _stop(self, stats: StreamStats) -> Callable[[RetryCallState], bool]:
        def stop(state: RetryCallState) -> bool:
            permanent = is_permanent(_failure(state))
            attempt = state.attempt_number
            return (
                (self.max_attempts is not None and attempt >= self.max_attempts)
                or (self.max_restarts is not None and stats.restarts >= self.max_restarts)
                or (self.permanent_retry is None and permanent)
                or (self.fail_fast and stats.rows == 0 and (permanent or attempt >= FAIL_FAST_ATTEMPTS))
            )

        return stop

    def _ask(self, error: BaseException | None, attempt: int, stats: StreamStats) -> tuple[Retrying, RetryCallState]:
        retrying = self.retrying(stats)
        state = RetryCallState(retrying, fn=None, args=(), kwargs={})
        state.attempt_number = max(attempt, 1)
        if error is not None:
            state.set_exception((type(error), error, error.__traceback__))
        return retrying, state

    def delay(self, error: BaseException | None, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th failed start of a streak (counting from 1)."""
        retrying, state = self._ask(error, attempt, StreamStats())
        return float(retrying.wait(state))

    def gives_up(self, error: BaseException | None, attempt: int, stats: StreamStats) -> bool:
        """True when the source should stop after this failure and raise it."""
        retrying, state = self._ask(error, attempt, stats)
        return bool(retrying.stop(state))
