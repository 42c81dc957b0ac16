"""Untrusted text never writes a control character to the operator's terminal."""

from __future__ import annotations

import pytest

from smiquery.printable import printable

HOSTILE = "H100\x1b]0;pwned\x07\x1b[2J\x1b[8m\x9b2J\u202egpu\x00\x7f"


def test_terminal_controls_become_visible_escapes():
    shown = printable(HOSTILE)
    assert shown == "H100\\x1b]0;pwned\\x07\\x1b[2J\\x1b[8m\\x9b2J\\u202egpu\\x00\\x7f"
    assert all(ch.isprintable() for ch in shown)


@pytest.mark.parametrize("code", [*range(0x20), *range(0x7F, 0xA0), 0x202A, 0x202E, 0x2066, 0x2069, 0x200F])
def test_every_control_and_bidi_character_is_escaped(code: int):
    assert chr(code) not in printable(f"a{chr(code)}b")


def test_ordinary_text_is_unchanged():
    text = "NVIDIA H100 80GB HBM3 · 温度 · café/python3(1234MiB) \\x1b"
    assert printable(text) == text
    assert printable(42) == "42"


def test_one_value_stays_on_one_line():
    assert printable("train\nfake row\tx\r") == "train\\x0afake row\\x09x\\x0d"
