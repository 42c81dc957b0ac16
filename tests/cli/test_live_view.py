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

from smiquery.cli.gpuview import LiveTable
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


GPU_LINE = re.compile(r"^\s*(LOST|stale \d+s)?\s+(\d+)\s+H100 80GB\s")


def shown_gpus(text: str) -> list[int]:
    return [int(m.group(2)) for line in text.splitlines() if (m := GPU_LINE.match(line))]


def test_64_gpus_on_200x50_keep_the_footer_and_show_the_lost_gpu(fake_smi, tmp_path):
    rec = many_gpus(tmp_path / "g64.csv", 64)
    smi = fake_smi(recording=rec, fault=f"drop-gpu-after:{64 * 3}:60", apps="")
    with Screen(cli("--nvidia-smi", smi, "stream", "-l", "200ms"), columns=200, rows=50, env=env()) as screen:
        text = screen.wait_for(lambda t: "LOST GPU 60" in t and "GPUs shown" in t)
        lines = text.splitlines()
        assert len(lines) <= 50 and all(len(line) <= 200 for line in lines)
        shown = shown_gpus(text)
        where = re.search(r"(\d+) of 64 GPUs shown \(GPU ([\d,-]+)\)", text)
        assert where is not None and int(where.group(1)) == len(shown), text  # the footer counts what is shown
        assert 60 in shown  # the lost GPU is kept on screen although it is past the rows that fit
        assert next(r for r in lines if re.search(r"\s60\s+H100", r)).lstrip().startswith("LOST")
        assert re.search(r"^64 GPUs · \d+ busy · \d+ idle · 1 lost · mean util \d+ %", text, re.M), text
        assert "sample age" in text and "Ctrl-C to stop" in text  # the footer and legend stay
        screen.keys("C-c")
        assert screen.exit_status() == 130


def test_8_gpus_at_80x24_one_line_each_with_its_name(fake_smi):
    argv = cli("--nvidia-smi", fake_smi(), "stream", "-l", "200ms")
    with Screen(argv, columns=80, rows=24, env=env()) as screen:
        text = screen.wait_for(lambda t: len(shown_gpus(t)) == 8 and "PWR W" in t)
        lines = text.splitlines()
        assert all(len(line) <= 80 for line in lines) and len(lines) <= 24
        head = next(line for line in lines if line.lstrip().startswith("GPU"))
        assert head.split()[:8] == ["GPU", "NAME", "TEMP", "C", "UTIL", "%", "MUTIL", "%"], head
        assert "MEM MiB" in head and "[" not in head  # short titles, units once
        for g in range(8):  # each GPU's name, temperature, utilization, memory and power on its one line
            line = next(x for x in lines if re.match(rf"^\s+{g}\s+H100 80GB\s", x))
            assert re.search(r"H100 80GB\s+\d+\s+\d+\s+[█░]{10}\s+\d+\s+\d+/81559\s+\d+\.\d\d", line), line
        assert "GPU-" not in text  # no UUID at 80 columns
        assert "8 GPUs ·" in text
        screen.keys("C-c")
        assert screen.exit_status() == 130


def test_64_gpus_at_80x24_summary_line_and_pgdn_scrolls_to_later_gpus(tmp_path):
    rec = many_gpus(tmp_path / "g64.csv", 64)
    argv = cli("stream", "--replay", rec, "--speed", "0.5", "--loop")
    with Screen(argv, columns=80, rows=24, env=env()) as screen:
        text = screen.wait_for(lambda t: "of 64 GPUs shown" in t)
        assert re.search(r"^64 GPUs · \d+ busy · \d+ idle · 0 lost · mean util \d+ % · hottest GPU \d+", text, re.M)
        first = shown_gpus(text)
        assert first == list(range(len(first))) and 8 <= len(first) < 64, text
        assert len(text.splitlines()) <= 24
        screen.keys("NPage")
        text = screen.wait_for(lambda t: shown_gpus(t) and min(shown_gpus(t)) >= len(first))
        assert shown_gpus(text) == list(range(len(first), 2 * len(first)))
        screen.keys("End")
        text = screen.wait_for(lambda t: 63 in shown_gpus(t))
        screen.keys("Home")
        screen.wait_for(lambda t: 0 in shown_gpus(t))
        screen.keys("/", "6", "3", "Enter")  # the filter: GPUs whose index, name, UUID or processes hold "63"
        # one frame with both (a screen read mid-redraw can hold the row before the footer is drawn)
        screen.wait_for(lambda t: shown_gpus(t) == [63] and "filter: 63 (1 of 64)" in t)
        screen.keys("Escape", "t")  # no filter, hottest first
        text = screen.wait_for(lambda t: "sorted by temp" in t and len(shown_gpus(t)) > 1)
        screen.keys("C-c")
        assert screen.exit_status() == 130
    stty = subprocess.run(["stty", "-a"], capture_output=True, text=True, check=False)
    assert stty.returncode != 0 or "icanon" in stty.stdout  # (this terminal was never changed)


def test_alerts_never_scroll_the_screen_at_80x24():
    # two rules that fire and clear on the demo: their lines go to the footer, never as lines that scroll
    rules = ("--alert", "temperature.gpu > 85 for 3", "--alert", "utilization.gpu > 90 for 2")
    argv = cli("stream", "--replay", DEMO, "--speed", "0", "--loop", *rules)
    with Screen(argv, columns=80, rows=24, env=env()) as screen:

        def both_alerts_seen(t: str) -> bool:  # the footer keeps the latest alert lines; wait for a screen with both
            sweeps = int((re.findall(r"sweeps (\d+)", t) or ["0"])[0])
            return sweeps > 600 and "ALERT firing" in t and "ALERT cleared" in t

        text = screen.wait_for(both_alerts_seen, timeout=120)
        assert screen.scrollback() == 0, screen.final_text()
        assert "replay demo-8gpu.csv" in text.splitlines()[0]  # the title is still the first line
        screen.keys("C-c")
        assert screen.exit_status() == 130


def test_a_stream_that_went_quiet_marks_every_row_stale(fake_smi):
    smi = fake_smi(fault="hang-after:16", apps="")
    argv = cli("--nvidia-smi", smi, "--timeout", "60", "stream", "-l", "200ms")
    with Screen(argv, columns=120, rows=30, env=env()) as screen:
        text = screen.wait_for(lambda t: t.count("stale") >= 8, timeout=60)
        rows = [line for line in text.splitlines() if "H100 80GB" in line]
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
    assert lines[0].startswith("2 GPUs · ") and lines[1].split() == ["STATE", "GPU", "TEMP", "C"]
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
        want = f"{getpass.getuser()}/sleep(1234MiB)"
        argv = cli("--nvidia-smi", smi, "stream", "-l", "200ms")
        with Screen(argv, columns=120, rows=30, env=env()) as screen:  # wide: on the GPU's own line
            text = screen.wait_for(lambda t: want in t)
            line = next(x for x in text.splitlines() if want in x)
            assert re.match(r"^\s+0\s+H100 80GB\s.*\d\s+" + re.escape(want) + "$", line), text
            assert "PROCESSES" in text
        with Screen(argv, columns=80, rows=30, env=env()) as screen:  # narrow: indented under it
            text = screen.wait_for(lambda t: want in t)
            lines = text.splitlines()
            at = next(i for i, line in enumerate(lines) if want in line)
            assert re.match(r"^\s+0\s+H100 80GB", lines[at - 1]) and lines[at] == f"    {want}", text
        with Screen([*argv, "-p"], columns=120, rows=30, env=env()) as screen:
            text = screen.wait_for(lambda t: int((re.findall(r"sweeps (\d+)", t) or ["0"])[0]) >= 15)
            assert want not in text and "PROCESSES" not in text and "processes not shown" not in text
        # the bundled processes (one per GPU) on a terminal too short for them: the GPUs stay, the processes go,
        # and the footer says so
        argv = cli("--nvidia-smi", fake_smi(), "stream", "-l", "200ms")
        with Screen(argv, columns=80, rows=20, env=env()) as screen:
            text = screen.wait_for(lambda t: "processes not shown: terminal too short" in t)
            assert len(shown_gpus(text)) == 8
            assert "MiB)" not in text
    finally:
        sleeper.kill()
        sleeper.wait()
