"""Text from others (a recording someone sent, label values from a server) never writes a control character."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

from smiquery.cli.top import render_screen
from smiquery.fleet.instant import FleetGpu

DEMO = Path(str(resources.files("smiquery") / "data" / "demo-8gpu.csv"))
HOSTILE = "H100\x1b]0;pwned\x07\x1b[2J\x1b[8m\x9b2J\u202egpu"
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def hostile_recording(path: Path, sweeps: int = 5) -> Path:
    head, *rows = DEMO.read_text(encoding="utf-8").splitlines()
    out = [head]
    for row in rows[: sweeps * 8]:
        cells = row.split(", ")
        cells[2] = HOSTILE
        out.append(", ".join(cells))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def test_a_replayed_table_shows_a_hostile_gpu_name_escaped(tmp_path: Path):
    recording = hostile_recording(tmp_path / "sent.csv")
    done = subprocess.run(
        [sys.executable, "-m", "smiquery", "stream", "--replay", str(recording), "--speed", "0", "--format", "table"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-600:]
    assert "H100\\x1b]0;pwned\\x07\\x1b[2J" in done.stdout
    assert not [ch for ch in RAW if ch in done.stdout + done.stderr]


def test_fleet_label_values_are_escaped_in_top():
    gpu = FleetGpu(
        instance=f"node\x1b[2J{HOSTILE}",
        gpu="0\x1b[8m",
        uuid="GPU-1",
        name=HOSTILE,
        naming="smiquery",
        utilization=50.0,
        memory_used=1.0,
        memory_total=2.0,
        temperature=40.0,
        power=100.0,
        namespace="ns\u202e",
        pod="pod\x07",
    )
    screen = "\n".join(render_screen([gpu], 0, 0, "fleet"))
    assert "\\x1b[2J" in screen and "ns\\u202e/pod\\x07" in screen
    assert not [ch for ch in RAW if ch in screen]


def test_messages_and_log_lines_show_control_and_bidi_characters_escaped():
    import logging

    from smiquery.cli._boundary import cli_text
    from smiquery.exporter.events import configure_logging

    assert (
        cli_text(f"process {HOSTILE} failed")
        == "process H100\\x1b]0;pwned\\x07\\x1b[2J\\x1b[8m\\x9b2J\\u202egpu failed"
    )
    handler = configure_logging("text")
    try:
        record = logging.LogRecord("smiquery.exporter", logging.WARNING, __file__, 1, "pod %s", (HOSTILE,), None)
        line = handler.format(record)
    finally:
        logging.getLogger("smiquery").removeHandler(handler)
    assert "\\u202egpu" in line and not [ch for ch in RAW if ch in line]
