"""What a reader thread hands the main thread of a long-running command: items, events, keys, a failure, the end.

The reader thread blocks on nvidia-smi; the main thread stays free to redraw, keep time and react to signals.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, TypeVar

if TYPE_CHECKING:
    from smiquery.source import StreamEvent

__all__ = ["END", "Failure", "Key", "SourceEvent", "start_pump"]

T = TypeVar("T")


class Failure(NamedTuple):
    """The error that ended the reader thread."""

    exc: BaseException


class SourceEvent(NamedTuple):
    """A source event (restart, error, lost GPU, ...), heard on the source's thread."""

    event: StreamEvent


class Key(NamedTuple):
    """A key typed on a live view's terminal."""

    name: str


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
