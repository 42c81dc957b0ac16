r"""``printable()``: untrusted text made safe for a terminal, a log line or a Markdown table; ``text_table()``.

Process, GPU, pod and job names and every cell of a recording are text from others: written raw, escape sequences
retitle, clear or hide the operator's terminal and a right-to-left override reverses what is shown. Every
human-facing output passes such text through :func:`printable`; CSV, JSON and Parquet keep the bytes (they are data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["printable", "text_table"]

#: Bidirectional embeddings, overrides, isolates and marks: they reorder what a terminal shows.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_TABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {c: f"\\u{c:04x}" for c in _BIDI}


def printable(text: object) -> str:
    """``text`` (``str()`` of it) with C0/C1 control characters, DEL and bidi controls shown as visible escapes.

    Tabs and newlines are escaped too: one value stays on one line. A backslash is left as it is, so the result is
    meant to be read, not decoded.
    """
    return str(text).translate(_TABLE)


def text_table(
    head: Sequence[object],
    rows: Sequence[Sequence[object]],
    right: Sequence[bool] | None = None,
    paint: Callable[[str, int, int], str] | None = None,
) -> list[str]:
    """``head`` and ``rows`` as lines of :func:`printable` cells aligned in columns two spaces apart, right-stripped.

    ``right[i]`` right-aligns column ``i`` (numbers); ``paint(cell, row, column)`` wraps each padded cell of a row.
    """
    cells = [[printable(c) for c in line] for line in [head, *rows]]
    widths = [max(map(len, column)) for column in zip(*cells)]
    align = right or [False] * len(widths)

    def line(r: int) -> str:
        fitted = [c.rjust(w) if a else c.ljust(w) for c, w, a in zip(cells[r], widths, align)]
        return "  ".join(paint(c, r - 1, i) for i, c in enumerate(fitted)) if paint and r else "  ".join(fitted)

    return [line(r).rstrip() for r in range(len(cells))]
