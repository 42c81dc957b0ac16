"""SIGINT and SIGTERM for the long-running commands (``stream``, ``ps --watch``, ``export``): one flag, one code."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

from smiquery.cli._boundary import ExitCode

__all__ = ["Signals", "exit_code_of"]


def exit_code_of(signum: int) -> ExitCode:
    """The documented exit code for a stop by ``signum``: 130 for SIGINT (Ctrl-C), 143 for SIGTERM.

    Args:
        signum: the signal that stopped the command.

    Returns:
        INTERRUPTED or TERMINATED.
    """
    return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED


class Signals:
    """Turns SIGINT/SIGTERM into a flag the command's loop checks; a second Ctrl-C interrupts at once.

    Once :attr:`closing` is set (the outputs are being finished), a signal only records itself. Outside the main
    thread no handler can be installed and the flag stays unset.

    Attributes:
        signum: the first signal received, or None.
        closing: set while the command finishes its outputs.
        wake: set when a signal arrives, for loops that wait on it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.closing = False
        self.wake = threading.Event()
        self._saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        self.wake.set()
        if self.closing:
            self.signum = self.signum or signum
            return
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def exit_code(self) -> ExitCode:
        """The exit code for the signal received (OK when none was)."""
        return exit_code_of(self.signum) if self.signum is not None else ExitCode.OK

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ValueError, OSError):
                    self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
