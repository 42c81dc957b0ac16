"""Helpers shared by the test suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 20.0,
    what: str = "condition",
    *,
    poll: float = 0.02,
    check: Callable[[], None] | None = None,
) -> T:
    """Wait until ``predicate()`` returns something true and return it; fail the test after ``timeout`` seconds.

    Tests wait on conditions with generous deadlines, never on short sleeps: the suite runs on busy 2-core
    machines.

    Args:
        predicate: what to wait for.
        timeout: seconds before the test fails.
        what: named in the failure message.
        poll: seconds between looks.
        check: called between looks; it raises to fail at once (e.g. a server process that died).

    Raises:
        AssertionError: the deadline passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)
