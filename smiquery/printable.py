r"""``printable()``: untrusted text made safe for a terminal, a log line or a Markdown table.

Process names (any user chooses them), GPU names, pod and job names, label values read back from a server and every
cell of a recording someone sent are text from others. Written raw, ``ESC ] 0 ; ... BEL`` retitles the operator's
terminal, ``ESC [ 2 J`` clears it, ``ESC [ 8 m`` hides what follows, C1 ``\x9b`` does the same on some terminals and
a right-to-left override (``U+202E``) reverses what is shown. Every human-facing output passes such text through
:func:`printable`, which shows each of these characters as a visible escape (``\x1b``, ``\u202e``). HTML escapes as
HTML does; CSV, JSON and Parquet keep the bytes (they are data).
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
