r"""``printable()``: untrusted text made safe for a terminal, a log line or a Markdown table.

Process, GPU, pod and job names and every cell of a recording are text from others: written raw, escape sequences
retitle, clear or hide the operator's terminal and a right-to-left override reverses what is shown. Every
human-facing output passes such text through :func:`printable`; CSV, JSON and Parquet keep the bytes (they are data).
"""

from __future__ import annotations

__all__ = ["printable"]

#: Bidirectional embeddings, overrides, isolates and marks: they reorder what a terminal shows.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_TABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {c: f"\\u{c:04x}" for c in _BIDI}


def printable(text: object) -> str:
    """``text`` (``str()`` of it) with C0/C1 control characters, DEL and bidi controls shown as visible escapes.

    Tabs and newlines are escaped too: one value stays on one line. A backslash is left as it is, so the result is
    meant to be read, not decoded.
    """
    return str(text).translate(_TABLE)
