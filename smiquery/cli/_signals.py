"""What the long-running commands (``stream``, ``ps --watch``, ``export``) share: signals and a reader thread.

A reader thread blocks on nvidia-smi and hands its items over through a queue (with the keys typed on a live view,
as str), so the main thread stays free to redraw, keep time and react to signals.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from smiquery.cli._boundary import ExitCode

if TYPE_CHECKING:
    from smiquery.source import StreamEvent

__all__ = ["END", "Failure", "Signals", "SourceEvent", "exit_code_of", "start_pump"]

T = TypeVar("T")


def exit_code_of(signum: int) -> ExitCode:
    """The documented exit code for a stop by ``signum``: 130 for SIGINT (Ctrl-C), 143 for SIGTERM."""
    return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED


class Signals:
    """Turns SIGINT/SIGTERM into :attr:`signum` (the first), which the command's loop checks; :attr:`wake` is set.

    A second Ctrl-C interrupts at once, unless :attr:`closing` is set (the outputs are being finished): then a
    signal only records itself. Outside the main thread no handler can be installed and the flag stays unset.
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
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
                self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)


class Failure(NamedTuple):
    """The error that ended the reader thread."""

    exc: BaseException


class SourceEvent(NamedTuple):
    """A source event (restart, error, lost GPU, ...), heard on the source's thread."""

    event: StreamEvent


#: The source ended by itself.
END = object()


def start_pump(
    open_items: Callable[[], Iterator[T]],
    into: queue.SimpleQueue[object],
    *,
    name: str,
    wrap: Callable[[T], object] = lambda item: item,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Start a daemon thread that puts each item of ``open_items()`` (wrapped) into ``into``, then END or a Failure.

    ``open_items`` is called in the thread; the iterator is closed at the end; a set ``stop`` ends the reading.
    """

    def run() -> None:
        items = open_items()
        try:
            for item in items:
                if stop is not None and stop.is_set():
                    break
                into.put(wrap(item))
        except BaseException as exc:  # handed to the main thread, which reports it
            into.put(Failure(exc))
        else:
            into.put(END)
        finally:
            with contextlib.suppress(Exception):
                items.close()  # type: ignore[attr-defined]

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
