"""Stream events as ``smiquery stream`` prints them on stderr: one line per restart, lost GPU and error."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from smiquery.cli._boundary import cli_text

if TYPE_CHECKING:
    from smiquery.source import StreamEvent

__all__ = ["EventPrinter"]


class EventPrinter:
    """One line per restart, error, lost or returning GPU, recovery and dropped row.

    An error and the restart it causes make one line (``restarting nvidia-smi in 0.2 s after: ...``); an
    error that ends the stream is left to the command's error line; a row dropped just before an error (the
    error's own message, printed where a row was expected) is not reported twice.

    Args:
        emit: where a line goes (stderr, or the live table's footer).
    """

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self._pending: tuple[str, BaseException | None, str] | None = None  # (kind, error, line) held back

    def flush(self) -> None:
        """Print what is held back (data arrived, or another event came)."""
        if self._pending is not None:
            self.emit(self._pending[2])
            self._pending = None

    def discard(self) -> None:
        """Forget what is held back (the error that ends the stream is reported by the command)."""
        self._pending = None

    def __call__(self, event: StreamEvent) -> None:
        """Take one event."""
        detail = cli_text(event.detail or (str(event.error) if event.error is not None else event.kind))
        kind = event.kind
        if kind == "dropped_row":
            self.flush()
            self._pending = ("dropped_row", None, f"smiquery: warning: dropped a line nvidia-smi printed: {detail}")
        elif kind == "error":
            if self._pending is not None and self._pending[0] == "dropped_row":
                self._pending = None  # the dropped line was this error's message
            self.flush()
            self._pending = ("error", event.error, f"smiquery: error: {detail}")
        elif kind == "restart":
            held = self._pending
            self._pending = None
            if held is not None and held[0] == "error" and event.error is None:
                what = detail.split(" after")[0]
                self.emit(f"smiquery: {what} after: {held[2].removeprefix('smiquery: error: ')}")
            elif held is not None and held[0] == "error" and event.error is not held[1]:
                self.emit(held[2])
                self.emit(f"smiquery: {detail}")
            else:
                if held is not None and held[0] != "error":
                    self.emit(held[2])
                self.emit(f"smiquery: {detail}")
        elif kind == "gpu_lost":
            self.flush()
            self.emit(f"smiquery: error: {detail}")
        elif kind in ("gpu_back", "recovered"):
            self.flush()
            self.emit(f"smiquery: {detail}")
