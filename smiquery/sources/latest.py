"""``Latest[T]``, the one background poller: the newest result of a function called on an interval, or of a stream.

It owns the thread, the newest value, its age and the last error; readers never wait on it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from smiquery._log import get_logger
from smiquery.retry import one_line

__all__ = ["FailureLog", "Latest", "Snapshot"]

T = TypeVar("T")
log = get_logger("smiquery.poll")  # not "smiquery": the exporter shows only errors of the stream supervisor's logger


@dataclass(frozen=True)
class Snapshot(Generic[T]):
    """What a :class:`Latest` holds at one moment.

    ``value``, its ``age`` in seconds and wall-clock time ``at`` are None before the first success; ``error`` is
    the last poll's error (one line, None after a success); ``failures`` counts failed polls by exception class.
    """

    value: T | None
    age: float | None
    at: float | None
    error: str | None
    polls: int
    failures: Counter[str]

    def fresh(self, max_age: float) -> T | None:
        """The value while it is at most ``max_age`` seconds old, else None."""
        return self.value if self.age is not None and self.age <= max_age else None


class FailureLog:
    """Failures counted by kind; each new error said by ``failed(why)``, the first success after it by ``again()``."""

    def __init__(self, failed: Callable[[str], None], again: Callable[[], None]) -> None:
        self._say_failed = failed
        self._say_again = again
        self.errors: Counter[str] = Counter()
        self.error: str | None = None

    def failed(self, kind: str, why: str) -> None:
        """Count a failure of this kind; say it unless the last failure said the same."""
        self.errors[kind] += 1
        if why != self.error:
            self._say_failed(why)
        self.error = why

    def worked(self) -> None:
        """A call worked: say so once after failures."""
        if self.error is not None:
            self._say_again()
        self.error = None


class Latest(Generic[T]):
    """Runs ``fetch`` every ``interval`` seconds (from the end of one poll to the next) in a daemon thread.

    :meth:`get` returns the newest result. A failing poll keeps the previous value (its age grows) and records the
    error, logged once per change of message (``smiquery: <name> failed: <why>``, WARNING; ``failures`` says it in
    other words), as is the first success after it (``... works again``, INFO). Exceptions other than ``errors``
    propagate out of :meth:`poll` (a bug is not a poll failure) and stop the thread after being logged. ``name``
    names the thread and the log lines; ``on_value`` is called on the thread with each new value; ``clock``
    (monotonic) and ``wall`` (epoch seconds) are injectable for tests.
    """

    def __init__(
        self,
        fetch: Callable[[], T],
        interval: float,
        *,
        name: str,
        errors: tuple[type[BaseException], ...] = (Exception,),
        on_value: Callable[[T], None] | None = None,
        failures: FailureLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the {name} interval must be positive, got {interval!r}")
        self.fetch = fetch
        self.interval = float(interval)
        self.name = name
        self._errors = errors
        self._on_value = on_value
        self._clock = clock
        self._wall = wall
        self._value: tuple[T, float, float] | None = None
        self._polls = 0
        self.failures = failures or FailureLog(
            lambda why: log.warning("smiquery: %s failed: %s", name, why),
            lambda: log.info("smiquery: %s works again", name),
        )
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self._values: Callable[[], Iterable[T]] | None = None
        self._on_close: Callable[[], None] | None = None

    @classmethod
    def following(
        cls,
        values: Callable[[], Iterable[T]],
        retry_after: float,
        *,
        name: str,
        errors: tuple[type[BaseException], ...] = (Exception,),
        on_close: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> Latest[T]:
        """Keep the newest value of a stream: ``values()`` is iterated in the thread, each value the newest.

        ``values()`` (called in the thread, so a failure to open is a failed poll) is called again ``retry_after``
        seconds after the iteration fails with one of ``errors`` or ends; :attr:`Snapshot.polls` counts the calls.
        ``on_close`` is called by :meth:`close` to end a blocked iteration. The rest is as for :class:`Latest`.
        """

        def unused() -> T:
            raise RuntimeError(f"{name} follows a stream: there is nothing to poll")

        latest = cls(unused, retry_after, name=name, errors=errors, clock=clock, wall=wall)
        latest._values, latest._on_close = values, on_close
        return latest

    def poll(self) -> T | None:
        """Run one poll now, in the caller's thread. Returns the new value, or None when the poll failed."""
        return self._follow(lambda: (self.fetch(),))

    def _follow(self, values: Callable[[], Iterable[T]]) -> T | None:
        """Take each value ``values()`` gives until it ends, fails or :meth:`close`; the last one (None: failed)."""
        self._polls += 1
        value = None
        try:
            for value in values():
                self.failures.worked()
                self._value = (value, self._clock(), self._wall())
                if self._on_value is not None:
                    self._on_value(value)
                self._first.set()
                if self._stop.is_set():
                    break
        except self._errors as exc:
            self.failures.failed(type(exc).__name__, one_line(exc))
            return None
        finally:
            self._first.set()
        return value

    def get(self) -> Snapshot[T]:
        """The newest value, its age and time, and the last error; never waits on a poll."""
        got = self._value
        value, age, at = (None, None, None) if got is None else (got[0], self._clock() - got[1], got[2])
        return Snapshot(value, age, at, self.failures.error, self._polls, Counter(self.failures.errors))

    def wait_first(self, timeout: float | None = None) -> bool:
        """Wait until the first poll has finished (success or failure); False if ``timeout`` ran out first."""
        return self._first.wait(timeout)

    @property
    def running(self) -> bool:
        """Whether the background thread is polling."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Latest[T]:
        """Poll in a background thread until :meth:`close` (the first poll at once). Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"smiquery-{self.name}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow(self._values or (lambda: (self.fetch(),)))
            except BaseException:
                log.exception("smiquery: %s stopped on an unexpected error", self.name)
                raise
            self._stop.wait(self.interval)

    def close(self, timeout: float = 15.0) -> None:
        """Stop polling; wait up to ``timeout`` seconds for a poll under way (each should bound its own time)."""
        self._stop.set()
        if self._on_close is not None:
            self._on_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Latest[T]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
