"""The fake's faults, driven through the executable (and in-process where a fault is about time)."""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from smiquery import errors
from smiquery.sources.query_gpu import CsvParser
from smiquery.testing import ENV_VARS, FAULTS, InProcessLines, InProcessRunner, fake_nvidia_smi

if TYPE_CHECKING:
    from conftest import MakeFake
from tests.helpers import wait_for
from tests.testing.support import DEMO, LOOP_ARGS, Child, child_env, demo_rows, lines_of, run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake is a POSIX executable")


STARTUP_FAULTS = [
    (
        "driver-not-loaded",
        9,
        [
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running."
        ],
        errors.DriverNotLoadedError,
    ),
    (
        "nvml-not-found",
        12,
        [
            "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that "
            "the NVIDIA Display Driver is properly installed and present in your system.",
            "Please also try adding directory that contains libnvidia-ml.so to your system PATH.",
        ],
        errors.NvmlNotFoundError,
    ),
    (
        "version-mismatch",
        18,
        ["Failed to initialize NVML: Driver/library version mismatch", "NVML library version: 590.48"],
        errors.DriverVersionMismatchError,
    ),
    ("no-devices", 6, ["No devices were found"], errors.NoDevicesFoundError),
    (
        "no-supported-gpus",
        255,
        ["Failed to initialize NVML: No supported GPUs were found", "Unable to determine the number of GPUs"],
        errors.NoDevicesFoundError,
    ),
    (
        "gpu-lost-start",
        15,
        [
            "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. "
            "Reboot the system to recover this GPU"
        ],
        errors.GpuLostError,
    ),
    ("permission", 4, ["Failed to initialize NVML: Insufficient Permissions"], errors.InsufficientPermissionsError),
    ("not-supported", 3, ["Failed to initialize NVML: Not Supported"], errors.NotSupportedError),
    ("unknown-error", 255, ["Failed to initialize NVML: Unknown Error"], errors.NvidiaSmiFailedError),
    ("exit:42", 42, [], errors.NvidiaSmiFailedError),
    ("exit:9:Driver Not Loaded", 9, ["Driver Not Loaded"], errors.DriverNotLoadedError),
]


@pytest.mark.parametrize(("fault", "code", "message", "error"), STARTUP_FAULTS, ids=[f[0] for f in STARTUP_FAULTS])
def test_startup_faults(
    fake_smi: MakeFake, fault: str, code: int, message: list[str], error: type[errors.NvidiaSmiFailedError]
) -> None:
    res = run(fake_smi(fault=fault), "--query-gpu=index,name", "--format=csv")
    assert (res.returncode, lines_of(res.stdout), res.stderr) == (code, message, b"")
    assert type(errors.failure_from_exit(["nvidia-smi"], res.returncode, res.stdout.decode())) is error


def test_startup_faults_hit_listing_but_not_help(fake_smi: MakeFake) -> None:
    exe = fake_smi(fault="driver-not-loaded")
    assert run(exe, "-L").returncode == 9
    assert run(exe, "--help-query-gpu").returncode == 0


def test_inforom_prints_rows_then_a_warning_and_exits_14(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="inforom"), "--query-gpu=index,memory.used", "--format=csv")
    out = lines_of(res.stdout)
    assert res.returncode == 14
    assert out[-1] == "WARNING: infoROM is corrupted at gpu 0000:0B:00.0"
    parser = CsvParser(["index", "memory.used"])
    assert len(list(parser.parse(out))) == 8
    assert parser.notices == [out[-1]]


def test_hang_prints_nothing_and_never_ends(fake_smi: MakeFake) -> None:
    with Child(fake_smi(fault="hang"), "--query-gpu=index", "--format=csv") as child:
        assert child.silent_for(0.5)
        assert child.proc.poll() is None
        child.proc.send_signal(signal.SIGTERM)
        assert child.stopped_within(5)


def test_hang_with_ignore_term_survives_sigterm(tmp_path: Path, fake_smi: MakeFake) -> None:
    log = tmp_path / "calls.jsonl"
    with Child(fake_smi(fault="hang,ignore-term", log=log), "--query-gpu=index", "--format=csv") as child:
        wait_for(lambda: log.exists() and log.read_text(), what="the fake's start (logged once SIGTERM is ignored)")
        child.proc.send_signal(signal.SIGTERM)
        assert not child.stopped_within(0.4)
        child.proc.kill()
        assert child.stopped_within(5)
        assert child.proc.returncode == -signal.SIGKILL


def test_hang_after_n_rows(fake_smi: MakeFake) -> None:
    with Child(fake_smi(fault="hang-after:3"), "--query-gpu=index", "--format=csv") as child:
        assert child.readlines(4) == ["index", "0", "1", "2"]
        assert child.silent_for(0.5)
        assert child.proc.poll() is None


def test_hang_after_counts_rows_across_loop_sweeps(fake_smi: MakeFake) -> None:
    with Child(fake_smi(fault="hang-after:10"), "--query-gpu=index", "--format=csv,noheader", "-lms", "10") as child:
        assert child.readlines(10)[-2:] == ["0", "1"]
        assert child.silent_for(0.4)
        assert child.proc.poll() is None


def test_crash_after_n_rows(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="crash-after:5"), "--query-gpu=index", "--format=csv,noheader")
    out = lines_of(res.stdout)
    assert res.returncode == 255
    assert out == ["0", "1", "2", "3", "4", "Unable to determine the device handle for GPU 0000:AB:00.0: Unknown Error"]


def test_crash_after_more_rows_than_a_one_shot_has_exits_normally(fake_smi: MakeFake) -> None:
    assert run(fake_smi(fault="crash-after:9"), "--query-gpu=index", "--format=csv").returncode == 0


def test_gpu_lost_mid_loop(fake_smi: MakeFake) -> None:
    query = ["timestamp", "index", "uuid", "name", "pci.bus_id", "power.draw", "memory.used"]
    with Child(
        fake_smi(fault="gpu-lost-after:8:2"), f"--query-gpu={','.join(query)}", "--format=csv,noheader", "-lms", "10"
    ) as child:
        lines = child.readlines(24)
        assert child.proc.poll() is None
    samples = list(CsvParser(query).parse(lines))
    lost = [(i // 8, s.index) for i, s in enumerate(samples) if s.gpu_lost]
    assert lost == [(1, 2), (2, 2)]
    cells = lines[10].split(", ")
    assert cells[1:5] == ["2", demo_rows()[2].uuid, "NVIDIA H100 80GB HBM3", "00000000:3A:00.0"]
    assert cells[5:] == ["[GPU is lost]", "[GPU is lost]"]


def test_exit_after_counts_rows_across_sweeps_then_prints_its_message(fake_smi: MakeFake) -> None:
    lost = (
        "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. Reboot the system to recover this GPU"
    )
    exe = fake_smi(fault=f"exit-after:10:15:{lost}")
    with Child(exe, "--query-gpu=index", "--format=csv,noheader", "-lms", "10") as child:
        assert child.readlines(11)[-3:] == ["0", "1", lost]
        assert child.stopped_within(10)
        assert child.proc.returncode == 15
    res = run(fake_smi(fault="exit-after:3:7"), "--query-gpu=index", "--format=csv,noheader")
    assert (res.returncode, lines_of(res.stdout)) == (7, ["0", "1", "2"])
    res = run(fake_smi(fault="exit-after:8:7"), "--query-gpu=index", "--format=csv,noheader")
    assert (res.returncode, len(lines_of(res.stdout))) == (7, 8)


def test_notices_after_n_rows_replace_the_rows_and_never_end(fake_smi: MakeFake) -> None:
    warning = "WARNING: infoROM is corrupted at gpu 0000:0B:00.0"
    handle = "Unable to determine the device handle for GPU 0000:02:00.0: Unknown Error"
    with Child(fake_smi(fault="notices-after:10"), "--query-gpu=index,uuid", "--format=csv", "-lms", "10") as child:
        lines = child.readlines(1 + 10 + 3 * 2)
        assert child.proc.poll() is None
    assert lines[0] == "index, uuid"
    assert [line.split(", ")[0] for line in lines[1:11]] == [str(i % 8) for i in range(10)]
    assert lines[11:] == [warning, handle] * 3


def test_notices_after_in_a_one_shot_keep_the_process_alive(fake_smi: MakeFake) -> None:
    with Child(fake_smi(fault="notices-after:2"), "--query-gpu=index", "--format=csv,noheader") as child:
        assert child.readlines(3) == ["0", "1", "WARNING: infoROM is corrupted at gpu 0000:0B:00.0"]
        assert not child.stopped_within(0.3)


def test_drop_gpu_after_n_rows_keeps_the_other_gpus_in_order(fake_smi: MakeFake) -> None:
    with Child(
        fake_smi(fault="drop-gpu-after:10:1"), "--query-gpu=index", "--format=csv,noheader", "-lms", "10"
    ) as child:
        lines = child.readlines(8 + 8 + 7 * 3)
        assert child.proc.poll() is None
    after = [str(i) for i in range(8) if i != 1]
    assert lines == [str(i) for i in range(8)] * 2 + after * 3


def test_drop_gpu_with_message_prints_gpu_lost_in_its_place(fake_smi: MakeFake) -> None:
    lost = (
        "Unable to determine the device handle for GPU 0000:3A:00.0: GPU is lost. Reboot the system to recover this GPU"
    )
    with Child(
        fake_smi(fault="drop-gpu-after:0:2:message"), "--query-gpu=index", "--format=csv,noheader", "-lms", "10"
    ) as child:
        lines = child.readlines(16)
    sweep = ["0", "1", lost, "3", "4", "5", "6", "7"]
    assert lines == sweep * 2
    res = run(fake_smi(fault="drop-gpu-after:0:0"), "--query-gpu=index", "--format=csv,noheader")
    assert (res.returncode, lines_of(res.stdout)) == (0, [str(i) for i in range(1, 8)])
    with pytest.raises(ValueError, match="':message'"):
        fake_nvidia_smi(fake_smi().parent, fault="drop-gpu-after:1:2:loud")


def test_grandchild_holds_the_pipes_after_the_fake_exits(fake_smi: MakeFake) -> None:
    proc = subprocess.Popen(
        [str(fake_smi(fault="grandchild")), "--query-gpu=index", "--format=csv,noheader"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
    )
    try:
        assert proc.wait(timeout=20) == 0
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        data = b""
        deadline = time.monotonic() + 20
        while data.count(b"\n") < 8:
            assert select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0], "no rows"
            chunk = os.read(fd, 65536)
            assert chunk, "stdout closed: no grandchild holds it"
            data += chunk
        assert lines_of(data) == [str(i) for i in range(8)]
        # the fake is gone, yet its process group lives on and stdout does not reach EOF
        os.killpg(proc.pid, 0)
        assert not select.select([fd], [], [], 0.3)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_start_delay_as_a_fault_spec_combines_with_others(fake_smi: MakeFake) -> None:
    start = time.monotonic()
    with Child(fake_smi(fault="start-delay:0.3,hang-after:2"), "--query-gpu=index", "--format=csv") as child:
        assert child.readlines(3, timeout=20) == ["index", "0", "1"]
        assert time.monotonic() - start >= 0.3
        assert child.silent_for(0.3)
        assert child.proc.poll() is None
    for bad in ("start-delay:soon", "start-delay:-1", "start-delay:nan"):
        with pytest.raises(ValueError, match="number of seconds"):
            fake_nvidia_smi(fake_smi().parent, fault=bad)


@pytest.mark.parametrize("option", ["--help", "-h", "--fake-help"])
def test_help_lists_every_fault_and_variable(fake_smi: MakeFake, option: str) -> None:
    res = run(fake_smi(), option)
    out = lines_of(res.stdout)
    assert res.returncode == 0
    for spec in FAULTS:
        assert sum(line.split()[:1] == [spec] for line in out) == 1, spec
    for name in ENV_VARS:
        assert sum(line.split()[:1] == [name] for line in out) == 1, name


def test_garbage(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="garbage"), "--query-gpu=index,name,memory.used", "--format=csv")
    assert res.returncode == 0
    with pytest.raises(UnicodeDecodeError):
        res.stdout.decode("utf-8")
    parser = CsvParser(["index", "name", "memory.used"], strict=False)
    assert list(parser.parse(lines_of(res.stdout))) == []
    assert parser.dropped >= 10


def test_garbage_after_n_rows_then_normal_rows(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="garbage-after:3"), "--query-gpu=index,name,memory.used", "--format=csv")
    assert res.returncode == 0
    with pytest.raises(errors.ParseError) as info:
        list(CsvParser().parse(lines_of(res.stdout)))
    assert info.value.lineno == 5
    parser = CsvParser(strict=False)
    assert [s.index for s in parser.parse(lines_of(res.stdout))] == list(range(8))
    assert parser.dropped == 1


def test_truncated_last_row(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="truncated"), "--query-gpu=index,uuid,memory.used", "--format=csv")
    assert res.returncode == 0
    assert not res.stdout.endswith(b"\n")
    parser = CsvParser(strict=False)
    assert len(list(parser.parse(lines_of(res.stdout)))) == 7
    assert parser.dropped == 1


def test_wrong_columns_after_n_rows(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="wrong-columns-after:2"), "--query-gpu=index,uuid,memory.used", "--format=csv")
    out = lines_of(res.stdout)
    assert len(out[3].split(", ")) == 2
    assert all(len(line.split(", ")) == 3 for line in out[:3] + out[4:])
    with pytest.raises(errors.ParseError) as info:
        list(CsvParser().parse(out))
    assert info.value.lineno == 4


def test_start_delay(fake_smi: MakeFake) -> None:
    start = time.monotonic()
    assert run(fake_smi(start_delay=0.3), "--query-gpu=index", "--format=csv").returncode == 0
    assert time.monotonic() - start >= 0.3


def test_fault_names_are_checked(tmp_path: Path, fake_smi: MakeFake) -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        fake_nvidia_smi(tmp_path, fault="hang-after")
    with pytest.raises(ValueError, match="unknown fault"):
        fake_nvidia_smi(tmp_path, fault="melt")
    res = run(fake_smi(), "-L", SMIQUERY_FAKE_FAULT="melt")
    assert res.returncode == 70
    assert b"unknown fault 'melt'" in res.stderr
    assert {f.split(":")[0] for f in FAULTS} >= {"hang", "hang-after", "gpu-lost-after", "exit", "ignore-term"}


def stamp(line: str) -> datetime:
    return datetime.strptime(line.split(", ")[0], "%Y/%m/%d %H:%M:%S.%f")


def recorded_stamps(n: int) -> list[datetime]:
    """The first ``n`` timestamps of the demo recording, the sweeps replayed in order."""
    rows = DEMO.read_text(encoding="utf-8").splitlines()[1:]
    return [stamp(r) for r in rows[:n]]


def test_clock_step_moves_the_timestamps_from_row_n_on_between_two_gpus_of_one_sweep(fake_smi: MakeFake) -> None:
    exe = fake_smi(fault="clock-step:12:-3600,clock-step:20:90")
    with Child(exe, "--query-gpu=timestamp,index", *LOOP_ARGS, SMIQUERY_FAKE_KEEP_TIME="1") as child:
        kept = child.readlines(32, timeout=20)
    shift = [(a - b).total_seconds() for a, b in zip(map(stamp, kept), recorded_stamps(32))]
    assert shift == [0.0] * 12 + [-3600.0] * 8 + [-3510.0] * 12
    assert [line.split(", ")[1] for line in kept[8:16]] == [str(i) for i in range(8)]  # one sweep, GPU 3 | GPU 4
    with Child(exe, "--query-gpu=timestamp,index", *LOOP_ARGS) as child:
        live = [stamp(line) for line in child.readlines(24, timeout=20)]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(live)]
    assert -3600 < gaps[11] < -3599  # row 11 (GPU 3) to row 12 (GPU 4) of the second sweep
    assert 90 < gaps[19] < 91
    assert all(0 < g < 5 for i, g in enumerate(gaps) if i not in (11, 19))


def test_clock_step_in_process_steps_back_mid_sweep() -> None:
    runner = InProcessRunner(fault="clock-step:5:-30")
    with runner.lines(("nvidia-smi", "--query-gpu=timestamp,index", *LOOP_ARGS)) as src:
        got = [src.readline(20) or "" for _ in range(16)]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(map(stamp, got))]
    assert -30 < gaps[4] < -29
    assert all(0 < g < 5 for i, g in enumerate(gaps) if i != 4)


def check_fall_back(lines: list[str]) -> None:
    """Berlin local time: 02:59:5x CEST, then once back to 02:00:0x CET, rising otherwise."""
    stamps = [stamp(line) for line in lines]
    assert stamps[0].strftime("%Y/%m/%d %H:%M") == "2026/10/25 02:59"
    back = [i for i, (a, b) in enumerate(itertools.pairwise(stamps)) if b < a]
    assert len(back) == 1
    before, after = stamps[back[0]], stamps[back[0] + 1]
    assert before.strftime("%H:%M:%S") == "02:59:59"
    assert after.strftime("%H:%M:%S") == "02:00:00"
    assert -3600 < (after - before).total_seconds() < -3599
    assert stamps[-1].hour == 2


def test_dst_fallback_repeats_the_hour_from_two_to_three(fake_smi: MakeFake) -> None:
    args = ("--query-gpu=timestamp,index", "--format=csv,noheader", "-lms", "100")
    with Child(fake_smi(fault="dst-fallback:0.5"), *args) as child:
        check_fall_back(child.readlines(8 * 12, timeout=20))
    with InProcessRunner(fault="dst-fallback:0.5").lines(("nvidia-smi", *args)) as src:
        check_fall_back([src.readline(20) or "" for _ in range(8 * 12)])


def test_slow_row_comes_late_inside_its_sweep(fake_smi: MakeFake) -> None:
    args = ("--query-gpu=timestamp,index", "--format=csv,noheader", "-lms", "2000")
    with Child(fake_smi(fault="slow-row:2:0.5"), *args) as child:
        first = child.readlines(8 + 3, timeout=20)
        assert child.silent_for(0.2)  # GPU 3's row of the second sweep is a second late; rows 0-2 came before it
        rest = child.readlines(5, timeout=20)
    sweep = [stamp(line) for line in first[8:] + rest]
    assert [line.split(", ")[1] for line in first[8:] + rest] == [str(i) for i in range(8)]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(sweep)]
    assert 0 < gaps[2] < 0.5  # the slow row's timestamp is on time
    assert 1.0 <= gaps[3] < 1.5  # the rows after it carry the delay (0.5 of 2 s)
    assert all(0 < gaps[i] < 0.5 for i in (0, 1, 4, 5, 6))
    first_sweep = [stamp(line) for line in first[:8]]
    assert (first_sweep[-1] - first_sweep[0]).total_seconds() < 0.5  # sweep 1 is not slow
    runner = InProcessRunner(fault="slow-row:1:0.5:0")
    with runner.lines(("nvidia-smi", "--query-gpu=index", "--format=csv,noheader", "-lms", "2000")) as src:
        assert src.readline(0.2) is None  # GPU 0 is first: nothing of the sweep comes before it
        assert [src.readline(20) for _ in range(8)] == [str(i) for i in range(8)]


DEMO_IDS = [(str(s.index), str(s.uuid), str(s.pci_bus_id)) for s in demo_rows()[:8]]


def identities(text: str) -> list[tuple[str, str, str]]:
    return [(a, b, c) for a, b, c in (line.split(", ") for line in text.splitlines())]


def test_reenumerate_swap_cuts_the_sweep_and_the_next_start_has_gpus_0_and_1_swapped(fake_smi: MakeFake) -> None:
    exe = fake_smi(fault="reenumerate:11")
    query = ("--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader")
    with Child(exe, *query, "-lms", "10") as child:
        lines = child.readlines(12, timeout=20)
        assert child.stopped_within(20)
        assert child.proc.returncode == 255
    assert identities("\n".join(lines[:11])) == DEMO_IDS + DEMO_IDS[:3]
    assert lines[11] == "Unable to determine the device handle for GPU 0000:5D:00.0: Unknown Error"
    assert (exe.parent / "nvidia-smi.state").read_text() == "1\n"
    swapped = [("0", *DEMO_IDS[1][1:]), ("1", *DEMO_IDS[0][1:]), *DEMO_IDS[2:]]
    res = run(exe, *query)  # a one-shot has fewer rows than N: it runs on
    assert (res.returncode, identities(res.stdout.decode())) == (0, swapped)
    with Child(exe, *query, "-lms", "10") as child:  # the reload struck once: this start loops on
        assert identities("\n".join(child.readlines(24, timeout=20))) == swapped * 3
        assert child.proc.poll() is None
    listed = lines_of(run(exe, "-L").stdout)
    assert [line.split("UUID: ")[1].rstrip(")") for line in listed[:2]] == [DEMO_IDS[1][1], DEMO_IDS[0][1]]
    assert lines_of(run(exe, "--query-gpu=index", "--format=csv,noheader", "-i", DEMO_IDS[0][1]).stdout) == ["1"]
    (exe.parent / "nvidia-smi.state").unlink()  # start over
    assert identities(run(exe, *query).stdout.decode()) == DEMO_IDS
    other = exe.parent / "elsewhere.state"
    res = run(exe, *query, "-lms", "10", SMIQUERY_FAKE_STATE=str(other), SMIQUERY_FAKE_FAULT="reenumerate:3:remove")
    assert res.returncode == 255
    assert other.read_text() == "1\n"


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("swap", [DEMO_IDS[1][1], DEMO_IDS[0][1], *(g[1] for g in DEMO_IDS[2:])]),
        ("remove", [DEMO_IDS[0][1], *(g[1] for g in DEMO_IDS[2:])]),
        ("add", [*(g[1] for g in DEMO_IDS), "new"]),
    ],
)
def test_reenumerate_modes_in_process(mode: str, want: list[str]) -> None:
    runner = InProcessRunner(fault=f"reenumerate:2:{mode}")
    query = ("nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader")
    assert runner.reloads == 0
    done = runner.run(query, 20)
    assert (done.returncode, done.stdout.splitlines()[2:]) == (
        255,
        ["Unable to determine the device handle for GPU 0000:3A:00.0: Unknown Error"],
    )
    assert runner.reloads == 1
    got = identities(runner.run(query, 20).stdout)
    assert [g[0] for g in got] == [str(i) for i in range(len(want))]  # renumbered from 0
    assert [g[1] for g in got][: len(want) - (mode == "add")] == want[: len(want) - (mode == "add")]
    if mode == "add":
        new = got[-1]
        assert new[1].startswith("GPU-") and new[1] not in {g[1] for g in DEMO_IDS}
        assert new[2] not in {g[2] for g in DEMO_IDS}
        assert len(new[1]) == len(DEMO_IDS[0][1])
    if mode == "remove":
        assert [g[2] for g in got] == [DEMO_IDS[0][2], *(g[2] for g in DEMO_IDS[2:])]
    assert len(runner.run(("nvidia-smi", "-L"), 20).stdout.splitlines()) == len(want)
    runner.reloads = 0  # undo: the original set again, and the reload is due again
    again = runner.run(query, 20)
    assert (again.returncode, identities("\n".join(again.stdout.splitlines()[:2]))) == (255, DEMO_IDS[:2])
    runner.fault = None
    assert runner.reloads == 1
    assert identities(runner.run(query, 20).stdout) == DEMO_IDS  # no fault: no reload, the set as recorded


def read_to_end(src: InProcessLines) -> tuple[list[str], Exception]:
    got: list[str] = []
    while True:
        try:
            got.append(src.readline(20) or "")
        except Exception as exc:  # the end is what the caller looks at
            return got, exc


def test_reenumerate_specs_chain_one_reload_per_start() -> None:
    runner = InProcessRunner(fault="reenumerate:3:swap,reenumerate:10:remove")
    query = ("nvidia-smi", "--query-gpu=uuid", *LOOP_ARGS)
    ends: list[int] = []
    sets: list[list[str]] = []
    for _ in range(2):
        with runner.lines(query) as src:
            got, end = read_to_end(src)
            assert isinstance(end, errors.NvidiaSmiFailedError)
            ends.append(end.returncode)
            sets.append([u for u in got if u.startswith("GPU-")])
    with runner.lines(query) as src:
        last = [src.readline(20) for _ in range(21)]
        assert src.returncode is None
    uuids = [g[1] for g in DEMO_IDS]
    assert ends == [255, 255]
    assert sets == [uuids[:3], [uuids[1], uuids[0], *uuids[2:], uuids[1], uuids[0]]]
    assert last == [uuids[1], *uuids[2:]] * 3
    assert runner.reloads == 2


def test_reenumerate_needs_a_state_and_a_known_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MODE is one of swap, remove, add"):
        fake_nvidia_smi(tmp_path, fault="reenumerate:3:shuffle")
    res = subprocess.run(
        [sys.executable, "-m", "smiquery.testing", "--query-gpu=index", "--format=csv"],
        capture_output=True,
        env=child_env(SMIQUERY_FAKE_FAULT="reenumerate:3"),
        timeout=60,
        check=False,
    )
    assert res.returncode == 70
    assert b"needs a state file: set SMIQUERY_FAKE_STATE" in res.stderr


def test_flood_one_shot_writes_noise_without_a_newline(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="flood:100000"), "--query-gpu=index,uuid", "--format=csv")
    assert res.returncode == 0
    assert len(res.stdout) == 100000
    assert b"\n" not in res.stdout
    assert b"," not in res.stdout
    with Child(fake_smi(fault="flood"), "-L") as child:  # no end
        got = 0
        while got < 4 << 20:
            assert child._fill(time.monotonic() + 20)
            got += len(child.buf)
            child.buf = b""
        assert child.proc.poll() is None


def test_flood_in_a_loop_writes_endless_over_long_lines(fake_smi: MakeFake) -> None:
    res = run(fake_smi(fault="flood:2500000"), "--query-gpu=index", *LOOP_ARGS)
    assert res.returncode == 0
    assert [len(line) for line in res.stdout.split(b"\n")] == [1 << 20, 1 << 20, 2500000 - 2 * (1 << 20) - 2]
    runner = InProcessRunner(fault="flood")
    with runner.lines(("nvidia-smi", "--query-gpu=index", *LOOP_ARGS)) as src:
        assert all(len(src.readline(20) or "") >= 1 << 19 for _ in range(5))  # replacement chars: 1 MiB of bytes
        time.sleep(0.3)  # the engine writes until the "pipe" is full, then waits for the reader
        assert len(src._ch.out) <= 3 << 20
        assert src.returncode is None


def test_an_endless_flood_fails_in_process_as_the_real_runner_does() -> None:
    runner = InProcessRunner(fault="flood")
    with pytest.raises(errors.OutputTooLargeError):
        runner.run(("nvidia-smi", "--query-gpu=index", "--format=csv"), timeout=60)
    assert runner.running() == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("clock-step:3", "unknown fault"),
        ("clock-step:x:5", "not a non-negative integer"),
        ("clock-step:3:soon", "not a number"),
        ("dst-fallback:-1", "must not be negative"),
        ("slow-row:0:0.5", "starts at 1"),
        ("slow-row:2:1.5", "between 0 and 1"),
        ("slow-row:2:0.5:x", "not a non-negative integer"),
        ("reenumerate", "unknown fault"),
        ("flood:0", "at least 1"),
        ("flood:lots", "not a non-negative integer"),
    ],
)
def test_time_and_identity_fault_specs_are_checked(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fake_nvidia_smi(tmp_path, fault=spec)
    with pytest.raises(ValueError, match=message):
        InProcessRunner(fault=spec)
