"""What a reader thread hands the main thread of a long-running command: sweeps, events, a failure, the end.

The reader thread blocks on nvidia-smi; the main thread stays free to redraw, keep time and react to signals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smiquery.source import StreamEvent

__all__ = ["END", "Failure", "SourceEvent"]


class Failure:
    """The error that ended the reader thread."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class SourceEvent:
    """A source event (restart, error, lost GPU, ...), heard on the source's thread."""

    __slots__ = ("event",)

    def __init__(self, event: StreamEvent) -> None:
        self.event = event


#: The source ended by itself.
END = object()
