"""`smiquery ps --watch`: the real CLI process against the fake nvidia-smi in pmon mode.

Piped blocks per refresh in every format, sorting with missing values last (and shown as n/a, never 0), user and
command line from /proc, usage errors, a pmon child that crashes mid-way, `| head`, Ctrl-C, the live table on a
terminal, and a driver without pmon.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli.test_cli import argv, cli_env, finish_pty, one_line_error, read_pty, run, spawn_in_pty
from tests.conftest import MakeFake
from tests.helpers import wait_for

HEADER = (
    "# gpu         pid   type     sm    mem    enc    dec    jpg    ofa     fb    command \n"
    "# Idx           #    C/G      %      %      %      %      %      %     MB    name \n"
)
# pids above the kernel's largest pid_max (2**22): no process here can have them, so /proc never answers
NOBODY = 4194401


def capture(tmp_path: Path, *rows: str) -> Path:
    path = tmp_path / "pmon.txt"
    path.write_text(HEADER + "".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def row(gpu: int | str, pid: int | str, type_: str, sm: str, mem: str, fb: str, name: str) -> str:
    return f"{gpu:>5}{pid:>11}{type_:>6}{sm:>7}{mem:>7}      -      -      -      -{fb:>7}    {name}"


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def pmon_pids(log: Path) -> list[int]:
    calls = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return [c["pid"] for c in calls if "pmon" in c["argv"]]


def gone(pids: list[int], within: float = 15.0) -> bool:
    return wait_for(lambda: not any(_alive(p) for p in pids), within, f"pmon children {pids} to be reaped")


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """One instant: a busy trainer, a watchdog without SM/MEM values, a server without fb, an idle GPU."""
    return capture(
        tmp_path,
        row(0, NOBODY, "C", "97", "31", "70312", "trainer"),
        row(0, NOBODY + 1, "C", "-", "-", "1024", "nccl-watchdog"),
        row(1, NOBODY + 2, "M+C", "4", "1", "-", "tritonserver"),
        row(2, "-", "-", "-", "-", "-", "-"),
        row(3, NOBODY + 3, "C", "12", "0", "5120", "decoder"),
    )


# ------------------------------------------------------------------------------------------------ piped


def test_piped_csv_one_header_then_each_refresh_busiest_first_and_child_reaped(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    proc = run("ps", "--watch", "--count", "2", smi=fake_smi(log=log))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].split(", ") == [
        "time", "gpu_index", "pid", "type", "user", "sm [%]", "mem [%]", "used_memory [MiB]", "process_name",
        "command",
    ]  # fmt: skip
    body = [ln.split(", ") for ln in lines[1:]]
    assert len(body) == 16  # two refreshes of the 8 GPUs (two pmon children of 4), one process each
    first, second = body[:8], body[8:]
    assert len({r[0] for r in first}) == 1 and first[0][0] != second[0][0]  # one instant per block
    for block in (first, second):
        sm = [int(r[5].removesuffix(" %")) for r in block]
        assert sm == sorted(sm, reverse=True)
        assert sorted(r[1] for r in block) == [str(i) for i in range(8)]
    assert all(r[7].endswith(" MiB") and int(r[7].split()[0]) > 60000 for r in body)  # pmon's fb column
    pids = pmon_pids(log)
    assert len(pids) == 2 and gone(pids)  # one pmon per 4 GPUs


def test_sorting_and_missing_values_never_zero(fake_smi: MakeFake, mixed):
    smi = fake_smi()

    def records(*extra: str) -> list[dict[str, object]]:
        # one pmon child (4 GPUs): the capture is what it prints
        proc = run(
            "ps", "--watch", "-n", "1", "-i", "0,1,2,3", "-F", "json", *extra, smi=smi, SMIQUERY_FAKE_PMON=str(mixed)
        )
        assert proc.returncode == 0, proc.stderr
        blocks = [json.loads(x) for x in proc.stdout.splitlines()]
        assert len(blocks) == 1
        return list(blocks[0])

    by_sm = records()
    assert [r["process_name"] for r in by_sm] == ["trainer", "decoder", "tritonserver", "nccl-watchdog"]
    watchdog = by_sm[-1]
    assert watchdog["sm"] is None and watchdog["mem"] is None and watchdog["used_memory"] == 1024
    assert [r["used_memory"] for r in records("--sort", "fb")] == [70312, 5120, 1024, None]
    assert [r["pid"] for r in records("--sort", "pid")] == [NOBODY, NOBODY + 1, NOBODY + 2, NOBODY + 3]
    by_gpu = records("-s", "GPU")
    assert [r["gpu_index"] for r in by_gpu] == [0, 0, 1, 3]  # the idle GPU 2 has no process row
    assert {r["user"] for r in by_gpu} == {None}  # /proc cannot know these pids
    assert [r["command"] for r in by_gpu] == ["trainer", "nccl-watchdog", "tritonserver", "decoder"]

    table = run("ps", "--watch", "-n", "1", "-i", "0,1,2,3", "-F", "table", smi=smi, SMIQUERY_FAKE_PMON=str(mixed))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("# ") and lines[0].endswith("idle GPU 2")
    assert lines[1].split() == ["gpu", "pid", "user", "sm", "[%]", "mem", "[%]", "gpu", "mem", "[MiB]", "command"]
    cells = {ln.split()[-1]: ln.split() for ln in lines[2:] if ln.strip()}
    assert cells["nccl-watchdog"][3:5] == ["n/a", "n/a"]  # missing: n/a, never 0
    assert cells["tritonserver"][5] == "n/a"
    csv = run("ps", "--watch", "-n", "1", "-i", "0,1,2,3", smi=smi, SMIQUERY_FAKE_PMON=str(mixed)).stdout.splitlines()
    watchdog_csv = next(ln for ln in csv if "nccl-watchdog" in ln).split(", ")
    assert watchdog_csv[5:7] == ["[N/A]", "[N/A]"]


def test_user_and_full_command_line_come_from_proc(fake_smi: MakeFake, tmp_path):
    name = os.path.basename(sys.executable)[:15]
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "ps-watch-marker"])
    try:
        pmon = capture(
            tmp_path, row(0, busy.pid, "C", "50", "10", "300", name), row(0, NOBODY, "C", "1", "0", "10", name)
        )
        proc = run("ps", "--watch", "-n", "1", "-i", "0", "-F", "jsonl", smi=fake_smi(), SMIQUERY_FAKE_PMON=str(pmon))
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr
    mine, unknown = [json.loads(x) for x in proc.stdout.splitlines()]
    assert mine["pid"] == busy.pid and mine["user"] == getpass.getuser()
    assert mine["command"].endswith("ps-watch-marker") and mine["process_name"] == name
    assert unknown["user"] is None and unknown["command"] == name  # pmon's name where /proc cannot tell


# ------------------------------------------------------------------------------------------------ usage


def test_bad_sort_interval_and_options_without_watch_are_usage_errors(smi_path: Path):
    one_line_error(run("ps", "--watch", "--sort", "cpu", smi=smi_path), 2, "'cpu' is not one of")
    one_line_error(run("ps", "--watch", "--interval", "11", smi=smi_path), 2, "--interval")
    one_line_error(run("ps", "--sort", "sm", smi=smi_path), 2, "--sort only goes with --watch")
    one_line_error(run("ps", "--watch", "--interval", "fast", smi=smi_path), 2, "--interval")
    one_line_error(run("ps", "--duration", "1m", smi=smi_path), 2, "--duration only goes with --watch")


def test_a_gpu_this_machine_lacks_is_a_usage_error(smi_path: Path):
    one_line_error(run("ps", "--watch", "-n", "1", "-i", "9", smi=smi_path), 2, "no GPU 9; this machine has 0-7")


@pytest.fixture
def smi_path(fake_smi: MakeFake) -> Path:
    return fake_smi()


# ------------------------------------------------------------------------------------------------ failures


def test_a_pmon_child_that_crashes_is_restarted_with_one_stderr_line(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    # each child prints one whole refresh and half of the next, then dies
    proc = run("ps", "--watch", "-n", "3", "-F", "jsonl", smi=fake_smi(fault="crash-after:6", log=log))
    assert proc.returncode == 0, proc.stderr
    restarts = [ln for ln in proc.stderr.splitlines() if "restarting" in ln]
    assert restarts, proc.stderr
    assert restarts[0].startswith("smiquery: restarting nvidia-smi pmon")
    assert "Unable to determine the device handle" in restarts[0]  # nvidia-smi's words, not its header line
    assert all(ln.startswith("smiquery: ") for ln in proc.stderr.splitlines())
    records = [json.loads(x) for x in proc.stdout.splitlines()]
    per_instant: dict[str, int] = {}
    for r in records:
        per_instant[r["time"]] = per_instant.get(r["time"], 0) + 1
    assert list(per_instant.values()) == [4, 4, 4]  # the half refresh a crash cut short is not shown
    pids = pmon_pids(log)
    assert len(pids) >= 2 and gone(pids)


def test_a_hung_pmon_is_killed_and_restarted(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    # --timeout 1: silence longer than max(--timeout, 3 intervals) = 3 s counts as a hang
    cmd = ["--timeout", "1", "ps", "--watch", "-n", "2", "-F", "jsonl"]
    proc = run(*cmd, smi=fake_smi(fault="hang-after:6", log=log))
    assert proc.returncode == 0, proc.stderr
    assert "smiquery: restarting nvidia-smi pmon" in proc.stderr and "printed no data row for 3 s" in proc.stderr
    assert len(proc.stdout.splitlines()) == 8
    pids = pmon_pids(log)
    assert len(pids) >= 2 and gone(pids)


@pytest.mark.parametrize(
    "fault",
    # the fake's exit 3; GeForce R415's message, with either exit status
    ["not-supported", "exit:255:Not supported on the device(s)", "exit:0:Not supported on the device(s)"],
)
def test_pmon_unsupported_is_one_line_saying_what_to_do(fake_smi: MakeFake, fault):
    line = one_line_error(run("ps", "--watch", "-n", "2", smi=fake_smi(fault=fault)), 1, "not supported")
    assert "nvidia-smi pmon" in line and "without --watch" in line


def test_a_permanent_driver_error_is_reported_once_with_its_exit_code(fake_smi: MakeFake):
    line = one_line_error(run("ps", "--watch", smi=fake_smi(fault="nvml-not-found")), 4, "libnvidia-ml.so")
    assert "# gpu" not in line


def test_a_pmon_that_never_starts_gives_up_after_a_few_starts_with_its_error(fake_smi: MakeFake, tmp_path):
    from smiquery.retry import FAIL_FAST_ATTEMPTS

    log = tmp_path / "calls.jsonl"
    proc = run("ps", "--watch", "-F", "jsonl", smi=fake_smi(fault="unknown-error", log=log))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert all(ln.startswith("smiquery: ") for ln in lines) and "Traceback" not in proc.stderr
    assert sum("restarting nvidia-smi pmon" in ln for ln in lines) == FAIL_FAST_ATTEMPTS - 1
    assert "Unknown Error" in lines[-1] and proc.stdout == ""
    pids = pmon_pids(log)
    assert len(pids) == FAIL_FAST_ATTEMPTS and gone(pids)


# ------------------------------------------------------------------------------------------------ endings


def test_early_close_of_the_pipe_ends_cleanly_and_reaps_pmon(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    cmd = argv("ps", "--watch", "-F", "csv", smi=fake_smi(log=log))
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = [proc.stdout.readline() for _ in range(3)]  # like `| head -3`
        assert first[0].startswith(b"time, gpu_index")
        proc.stdout.close()
        code = proc.wait(30)
        err = proc.stderr.read()
    assert code == 0, err
    assert err == b""
    pids = pmon_pids(log)
    assert len(pids) == 2 and gone(pids)  # one pmon per 4 GPUs


def test_ctrl_c_exits_130_and_reaps_pmon(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    cmd = argv("ps", "--watch", "-F", "csv", smi=fake_smi(log=log))
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()
        proc.stdout.readline()  # a refresh is on its way: pmon runs
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err == b""
    pids = pmon_pids(log)
    assert len(pids) == 2 and gone(pids)  # one pmon per 4 GPUs


def test_sigterm_exits_143_and_reaps_pmon(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    cmd = argv("ps", "--watch", "-F", "jsonl", smi=fake_smi(log=log))
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["pid"] is not None
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert err == b""
    pids = pmon_pids(log)
    assert len(pids) == 2 and gone(pids)  # one pmon per 4 GPUs


def test_live_table_on_a_terminal_redraws_in_place(smi_path: Path):
    pid, fd = spawn_in_pty(["--nvidia-smi", smi_path, "ps", "--watch"], columns=120)
    out = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and out.count(b"gpu mem [MiB]") < 2:
        out += read_pty(fd, 0.5)
    code, out = finish_pty(pid, fd, out, interrupt=True)
    assert code == 130
    text = out.decode("utf-8", "replace")
    assert text.count("gpu mem [MiB]") >= 2  # two refreshes ...
    assert text.count("\x1b[H") >= 3 and "\x1b[J" in text  # ... drawn over the same place
    assert "smiquery ps --watch" in text and "sorted by sm" in text and "Ctrl-C to stop" in text
    assert "python3.11" in text
    assert text.rstrip().endswith("\x1b[?25h")  # the cursor is back


def test_help_documents_watch_and_its_options():
    proc = run("ps", "--help")
    assert proc.returncode == 0
    for word in ("--watch", "--interval", "--count", "--sort", "sm, mem, fb", "1 to 10", "nvidia-smi pmon"):
        assert word in proc.stdout, word


# ------------------------------------------------------------------------------------- consistency, many GPUs


def test_more_than_4_gpus_get_one_pmon_child_per_4_and_all_are_watched(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    proc = run("ps", "--watch", "-n", "1", "-i", "0,1,2,3,4", "-F", "jsonl", smi=fake_smi(log=log))
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(x)["gpu_index"] for x in proc.stdout.splitlines()) == [0, 1, 2, 3, 4]
    calls = [json.loads(x)["argv"] for x in log.read_text().splitlines() if "pmon" in x]
    assert sorted(c[c.index("-i") + 1] for c in calls) == ["0,1,2,3", "4"]


def test_interval_takes_durations_like_stream_and_d_is_duration(fake_smi: MakeFake, tmp_path):
    log = tmp_path / "calls.jsonl"
    start = time.monotonic()
    proc = run("ps", "--watch", "--interval", "2s", "-d", "5s", "-i", "0", "-F", "jsonl", smi=fake_smi(log=log))
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start >= 5  # -d is the duration: it ran until then, then stopped by itself
    calls = [json.loads(x)["argv"] for x in log.read_text().splitlines() if "pmon" in x]
    assert calls and all(c[c.index("-d") + 1] == "2" for c in calls)  # pmon's own -d is its interval
    half = run("ps", "--watch", "-l", "0.5", "-n", "1", "-i", "0", "-F", "jsonl", smi=fake_smi())
    assert half.returncode == 0, half.stderr
    assert half.stderr == "smiquery: note: nvidia-smi pmon refreshes every whole second (1 to 10); using 1 s for 0.5\n"


def test_a_newline_in_a_command_line_does_not_break_the_table(fake_smi: MakeFake, tmp_path):
    name = os.path.basename(sys.executable)[:15]
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "two\nlines"])
    try:
        pmon = capture(tmp_path, row(0, busy.pid, "C", "50", "10", "300", name))
        proc = run("ps", "--watch", "-n", "1", "-i", "0", "-F", "table", smi=fake_smi(), SMIQUERY_FAKE_PMON=str(pmon))
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 3  # the instant, the titles, one row
    assert lines[2].endswith("two?lines")


def test_64_processes_at_80x24_keep_the_footer_say_what_is_shown_and_scroll(monkeypatch):
    import io
    import re

    from smiquery.cli import display
    from smiquery.cli.ps import _Live

    monkeypatch.setattr(display, "terminal_size", lambda: (80, 24))
    out = io.StringIO()
    live = _Live(out, "smiquery ps --watch")
    records = [
        {"gpu_index": i % 8, "pid": 1000 + i, "user": None, "sm": 50, "mem": 10, "used_memory": 100, "command": "x"}
        for i in range(64)
    ]

    def screen() -> list[str]:
        frame = out.getvalue().rsplit("\x1b[H", 1)[1]
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame).splitlines()

    live.show([], records)
    lines = screen()
    assert len(lines) <= 23 and lines[-1].endswith("Ctrl-C to stop"), lines  # the footer stays
    pids = [int(x.split()[1]) for x in lines if re.match(r"^\s*\d+\s+\d{4}\s", x)]
    assert re.search(rf"{len(pids)} of 64 processes shown · PgDn", "\n".join(lines))  # says what it dropped
    assert pids == list(range(1000, 1000 + len(pids))) and all(" ? " in x for x in lines if "  x" in x)
    assert live.view.key("pgdn")
    live.draw()
    later = [int(x.split()[1]) for x in screen() if re.match(r"^\s*\d+\s+\d{4}\s", x)]
    assert min(later) == 1000 + len(pids)
