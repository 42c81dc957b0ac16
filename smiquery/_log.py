"""smiquery's loggers: quiet (a NullHandler, set when the first module that logs is imported) unless configured."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

logging.getLogger("smiquery").addHandler(logging.NullHandler())


def get_logger(name: str = "smiquery") -> logging.Logger:
    """The logger ``name`` (``smiquery`` or a child of it), with the package logger's NullHandler in place."""
    return logging.getLogger(name)


class RateLimiter:
    """Token buckets by key: a burst of ``burst`` lines, then one per ``period`` seconds; counts what it holds back."""

    def __init__(self, burst: int = 1, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = float(burst)
        self.period = period
        self.clock = clock
        self.suppressed = 0
        self._buckets: dict[Hashable, tuple[float, float, int]] = {}  # key -> (tokens, updated, held back)
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> int | None:
        """None when ``key`` is over its rate (the line is held back), else how many were held back before it."""
        now = self.clock()
        with self._lock:
            tokens, updated, held = self._buckets.get(key, (self.burst, now, 0))
            tokens = min(self.burst, tokens + (now - updated) / self.period)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now, held + 1)
                self.suppressed += 1
                return None
            self._buckets[key] = (tokens - 1.0, now, 0)
            return held
