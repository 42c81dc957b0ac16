"""Keys for the live views (``stream``, ``ps --watch``, ``top``): read in a thread, and what they scroll."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import select
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["KEY_HELP", "KeyReader", "Viewport", "parse_keys"]

K = TypeVar("K")

#: The keys every live view takes, as its legend says them.
KEY_HELP = "↑↓ PgUp PgDn Home End scroll · / filter"

_SEQUENCES = {
    **dict.fromkeys(("\x1b[A", "\x1bOA"), "up"),
    **dict.fromkeys(("\x1b[B", "\x1bOB"), "down"),
    "\x1b[5~": "pgup",
    "\x1b[6~": "pgdn",
    **dict.fromkeys(("\x1b[H", "\x1bOH", "\x1b[1~", "\x1b[7~"), "home"),
    **dict.fromkeys(("\x1b[F", "\x1bOF", "\x1b[4~", "\x1b[8~"), "end"),
    "\x1b": "esc",
    **dict.fromkeys("\r\n", "enter"),
    **dict.fromkeys("\x7f\x08", "backspace"),
}
# An escape sequence (up to its final letter or ~, to the end when it has none), or one character.
_TOKEN = re.compile(r"\x1b[\[O].*?(?:[^\W\d_]|~|\Z)|.", re.DOTALL)


def parse_keys(data: str) -> list[str]:
    """Key names in what a terminal sent (an escape sequence not known here is skipped whole).

    The names: ``up``, ``down``, ``pgup``, ``pgdn``, ``home``, ``end``, ``enter``, ``backspace``, ``esc``, or
    the character typed.
    """
    keys: list[str] = []
    for token in _TOKEN.findall(data):
        name = _SEQUENCES.get(token)
        if name is not None or (len(token) == 1 and token >= " "):
            keys.append(name or token)
    return keys


class KeyReader:
    """Hands each key (:func:`parse_keys`) typed on stdin to ``on_key``, from a thread.

    A context manager: the terminal is in cbreak mode (Ctrl-C still sends SIGINT) until it is left; nothing
    happens when stdin is no terminal (a pipe).
    """

    def __init__(self, on_key: Callable[[str], None]) -> None:
        self.on_key = on_key
        self._saved: list[Any] | None = None
        self._fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> KeyReader:
        try:
            import termios
            import tty

            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return self
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
        except (ImportError, OSError, ValueError, AttributeError):
            return self
        self._fd = fd
        self._thread = threading.Thread(target=self._run, name="smiquery-keys", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # keeps half a character for the next read
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(self._fd, 64)
            except (OSError, ValueError):
                return
            if not data:
                return
            for key in parse_keys(decoder.decode(data)):
                self.on_key(key)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._saved is not None:
            import termios

            with contextlib.suppress(OSError, ValueError):
                termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._saved = None


class Viewport:
    """The part of a long list a live view shows: the scroll offset, the sort order and a filter.

    ``sorts`` maps sort keys to sort names (``{"u": "util"}``); ``sort`` is the one to start with.
    """

    def __init__(self, sorts: Mapping[str, str], sort: str) -> None:
        self.sorts = dict(sorts)
        self.sort = sort
        self.offset = 0
        self.filter = ""
        self.typing = False  # the filter is being typed after ``/``
        self.page = 1  # rows the last frame had room for (PgDn moves by this)

    def key(self, key: str) -> bool:
        """Take one key; True when the view changed (redraw now)."""
        if self.typing:
            if key == "enter":
                self.typing = False
            elif key == "esc":
                self.typing, self.filter = False, ""
            elif key == "backspace":
                self.filter = self.filter[:-1]
            elif len(key) == 1:
                self.filter += key
            else:
                return False
            self.offset = 0
            return True
        far = 1 << 30  # End: clamped by the next frame
        moves = {"up": -1, "down": 1, "pgup": -max(1, self.page), "pgdn": max(1, self.page), "home": -far, "end": far}
        if key in moves:
            self.offset = max(0, self.offset + moves[key])
        elif key == "/":
            self.typing, self.filter, self.offset = True, "", 0
        elif key == "esc" and self.filter:
            self.filter, self.offset = "", 0
        elif key in self.sorts:
            self.sort, self.offset = self.sorts[key], 0
        else:
            return False
        return True

    def matches(self, text: str) -> bool:
        """Whether a row whose words are ``text`` passes the filter (case-insensitive substring)."""
        return not self.filter or self.filter.lower() in text.lower()

    def window(self, keys: Sequence[K], room: int, pinned: Callable[[K], bool]) -> list[K]:
        """The rows shown in ``room`` lines, in their order: pinned ones (in trouble) always, the rest scrolled.

        The offset is clamped so that the last page is full.
        """
        keep = [k for k in keys if pinned(k)][: max(1, room)]
        kept = set(map(id, keep))
        rest = [k for k in keys if id(k) not in kept]
        fit = max(0, room - len(keep))
        self.page = max(1, fit)
        self.offset = max(0, min(self.offset, len(rest) - fit))
        chosen = kept | set(map(id, rest[self.offset : self.offset + fit]))
        return [k for k in keys if id(k) in chosen]

    def status(self, what: str, shown: int, matching: int, total: int) -> str:
        """The footer's words: ``rows 16-30 of 64 shown · filter 'a100' · sorted by util`` (empty: nothing to say)."""
        parts: list[str] = []
        if shown < matching or matching < total:
            first = self.offset + 1 if shown else 0
            parts.append(f"{shown} of {matching} {what} shown" + (f" (from {first})" if self.offset else ""))
        if self.typing or self.filter:
            parts.append(f"filter: {self.filter}" + ("▏" if self.typing else "") + f" ({matching} of {total})")
        return " · ".join(parts)
