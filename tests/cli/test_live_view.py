"""The live table of ``smiquery stream`` as a person sees it: a real terminal (tmux) of a fixed size, the fake."""

from __future__ import annotations

import getpass
import io
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

from smiquery.cli.display import LiveTable
from smiquery.fields import resolve_fields
from smiquery.sources.query_gpu import CsvParser
from tests.cli.screen import Screen

DEMO = Path(str(resources.files("smiquery") / "data" / "demo-8gpu.csv"))
SAFE = ("SMIQUERY_", "NVIDIA_")


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(SAFE)}
    out.update(TERM="xterm-256color", NVIDIA_DRIVER_CAPABILITIES="compute,utility")
    out.pop("NO_COLOR", None)
    out.update(extra)
    return out


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "smiquery", *(str(a) for a in args)]


def many_gpus(path: Path, gpus: int, sweeps: int = 50) -> Path:
    """A recording of ``gpus`` GPUs made from the demo's 8 (new index, UUID and bus id for each)."""
    head, *rows = DEMO.read_text(encoding="utf-8").splitlines()
    out = [head]
    for s in range(sweeps):
        for g in range(gpus):
            cells = rows[s * 8 + g % 8].split(", ")
            cells[1], cells[3], cells[10] = str(g), f"{cells[3][:-4]}{g:04x}", f"00000000:{g + 16:02X}:00.0"
            out.append(", ".join(cells))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def test_64_gpus_on_200x50_keep_the_footer_and_show_the_lost_gpu(fake_smi, tmp_path):
    rec = many_gpus(tmp_path / "g64.csv", 64)
    smi = fake_smi(recording=rec, fault=f"drop-gpu-after:{64 * 3}:60", apps="")
    with Screen(cli("--nvidia-smi", smi, "stream", "-l", "200ms"), columns=200, rows=50, env=env()) as screen:
        text = screen.wait_for(lambda t: "LOST GPU 60" in t and "GPUs not shown" in t)
        lines = text.splitlines()
        assert len(lines) <= 50 and all(len(line) <= 200 for line in lines)
        rows = [line for line in lines if re.match(r"^\s*(LOST|stale \d+s)?\s+\d+\s+NVIDIA", line)]
        shown = [int(re.sub(r"^\s*(LOST|stale \d+s)?\s+", "", r).split()[0]) for r in rows]
        not_shown = re.search(r"\+(\d+) GPUs not shown \(GPU ([\d,-]+)\): terminal too short", text)
        assert not_shown is not None, text
        assert len(shown) + int(not_shown.group(1)) == 64  # every GPU is either a row or counted
        assert 60 in shown  # the lost GPU is kept on screen although it is past the rows that fit
        assert next(r for r in rows if re.search(r"\s60\s", r)).lstrip().startswith("LOST")
        assert "sample age" in text and "Ctrl-C to stop" in text  # the footer and legend stay
        screen.keys("C-c")
        assert screen.exit_status() == 130


def test_a_stream_that_went_quiet_marks_every_row_stale(fake_smi):
    smi = fake_smi(fault="hang-after:16", apps="")
    argv = cli("--nvidia-smi", smi, "--timeout", "60", "stream", "-l", "200ms")
    with Screen(argv, columns=120, rows=30, env=env()) as screen:
        text = screen.wait_for(lambda t: t.count("stale") >= 8, timeout=60)
        rows = [line for line in text.splitlines() if "NVIDIA H100" in line]
        assert len(rows) == 8 and all(re.match(r"^stale \d+s\s+\d", r) for r in rows), text
        assert re.search(r"sample age ([5-9]|\d\d+)\.\d s", text)
        screen.keys("C-c")
        assert screen.exit_status() == 130


def test_a_gpu_missing_from_the_sweeps_is_marked_stale_in_its_row():
    flds = resolve_fields("index,temperature.gpu")
    table = LiveTable(io.StringIO(), flds, color=False, size=lambda: (80, 20))
    table.update(list(CsvParser(flds).parse(["0, 40", "1, 41"])))
    for _ in range(2):
        table.update(list(CsvParser(flds).parse(["0, 42"])))
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", table.frame()).splitlines()
    assert lines[0].split() == ["state", "index", "temperature.gpu", "[C]"]
    gpu0 = next(x for x in lines if re.match(r"^\s+0\s", x))
    gpu1 = next(x for x in lines if re.search(r"\s1\s+41", x))
    assert gpu1.startswith("stale ") and "42" in gpu0 and not gpu0.lstrip().startswith("stale")


def test_health_colours_without_any_alert_option():
    # GPU 5 of the demo runs past 85 C from sweep 432 on: the built-in rule `temperature.gpu > 85 for 3` fires
    argv = cli("stream", "--replay", DEMO, "--speed", "0", "--count", "440", "-f", "index,temperature.gpu")
    with Screen(argv, columns=100, rows=30, env=env()) as screen:
        assert screen.exit_status(timeout=60) == 0
        styled = screen.styled()
        text = screen.text()
    assert "FIRING GPU 5: temperature.gpu > 85 for 3" in text
    gpu5 = next(line for line in styled.splitlines() if re.match(r"^(\x1b\[[0-9;]*m)*\s+5\s", line))
    gpu4 = next(line for line in styled.splitlines() if re.match(r"^(\x1b\[[0-9;]*m)*\s+4\s", line))
    assert re.search(r"\x1b\[[0-9;]*31[0-9;]*m\s*89", gpu5), repr(gpu5)  # red, from the built-in rule
    assert "31m" not in gpu4 and "31;" not in gpu4  # a normal GPU is not coloured


def test_processes_show_under_their_gpu_and_p_hides_them(fake_smi, tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        uuid0 = DEMO.read_text(encoding="utf-8").splitlines()[1].split(", ")[3]
        apps = tmp_path / "apps.csv"
        apps.write_text(
            f"pid, process_name, gpu_uuid, used_gpu_memory [MiB]\n{sleeper.pid}, /usr/bin/sleep, {uuid0}, 1234 MiB\n",
            encoding="utf-8",
        )
        smi = fake_smi(apps=apps)
        want = f"{getpass.getuser()}:sleep/{sleeper.pid}(1234MiB)"
        argv = cli("--nvidia-smi", smi, "stream", "-l", "200ms")
        with Screen(argv, columns=120, rows=30, env=env()) as screen:
            text = screen.wait_for(lambda t: want in t)
            lines = text.splitlines()
            at = next(i for i, line in enumerate(lines) if want in line)
            assert re.match(r"^\s+0\s+NVIDIA", lines[at - 1]), text  # right under GPU 0
            assert lines[at].strip() == f"└ {want}"
        with Screen([*argv, "-p"], columns=120, rows=30, env=env()) as screen:
            text = screen.wait_for(lambda t: int((re.findall(r"sweeps (\d+)", t) or ["0"])[0]) >= 15)
            assert "└" not in text and "processes not shown" not in text
        # the bundled processes (one per GPU) on a terminal too short for them: the GPUs stay, the processes go,
        # and the footer says so
        argv = cli("--nvidia-smi", fake_smi(), "stream", "-l", "200ms")
        with Screen(argv, columns=120, rows=20, env=env()) as screen:
            text = screen.wait_for(lambda t: "processes not shown: terminal too short" in t)
            assert len([line for line in text.splitlines() if "NVIDIA H100" in line]) == 8
            assert "└" not in text
    finally:
        sleeper.kill()
        sleeper.wait()
