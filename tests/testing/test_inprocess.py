"""The in-process fake: InProcessRunner and its line source match the executable, stop and time out."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from smiquery import errors
from smiquery.errors import StreamEndedError
from smiquery.testing import InProcessLines, InProcessRunner

if TYPE_CHECKING:
    from conftest import MakeFake
from tests.helpers import wait_for
from tests.testing.support import FIXTURES, GPU_LOST, LOOP_ARGS, SOME, Child, run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake is a POSIX executable")


T4 = FIXTURES / "t4-470-old-tokens.csv"
LOST_LINE = f"Unable to determine the device handle for GPU 0000:02:00.0: {GPU_LOST}"
# (fault, recording, arguments): each runs through the executable and through InProcessRunner
PARITY: list[tuple[str | None, Path | None, tuple[str, ...]]] = [
    (None, None, (f"--query-gpu={SOME}", "--format=csv")),
    (None, None, ("--query-gpu=timestamp,index,power.draw", "--format=csv,noheader,nounits", "-i", "1,5")),
    (None, T4, ("--query-gpu=index,name,clocks_throttle_reasons.active,temperature.memory", "--format=csv")),
    (None, None, ("--query-gpu=index,device_minor", "--format=csv")),
    (None, None, ("--query-gpu=index", "--format=csv", "-i", "42")),
    (None, None, ("--query-gpu=index", "--format=csv", "-loop", "1")),
    (None, None, ("--query-compute-apps=pid,process_name,gpu_uuid,used_memory", "--format=csv")),
    (None, None, ("-L",)),
    (None, None, ("--version",)),
    (None, T4, ("--help-query-gpu",)),
    (None, None, ("--help",)),
    ("driver-not-loaded", None, ("--query-gpu=index", "--format=csv")),
    ("version-mismatch", T4, ("--query-gpu=index", "--format=csv")),
    (f"exit:15:{LOST_LINE}", None, ("-L",)),
    ("inforom", None, ("--query-gpu=index,memory.used", "--format=csv")),
    ("crash-after:5", None, ("--query-gpu=index", "--format=csv,noheader")),
    ("gpu-lost-after:3:1", None, ("--query-gpu=index,uuid,power.draw", "--format=csv")),
    ("drop-gpu-after:2:1:message", None, ("--query-gpu=index,pci.bus_id", "--format=csv")),
    ("garbage", None, ("--query-gpu=index,name", "--format=csv")),
    ("garbage-after:3", None, ("--query-gpu=index,name", "--format=csv")),
    ("truncated", None, ("--query-gpu=index,uuid,memory.used", "--format=csv")),
    ("wrong-columns-after:2", None, ("--query-gpu=index,uuid", "--format=csv")),
    ("melt", None, ("-L",)),
    # loops that end by themselves: N counts across sweeps, the interval really passes
    (f"exit-after:20:15:{LOST_LINE}", None, ("--query-gpu=timestamp,index", "--format=csv", "-lms", "10")),
    ("crash-after:19,inforom", None, ("--query-gpu=index,power.draw", "--format=csv,noheader", "-lms", "10")),
    ("drop-gpu-after:4:2,exit-after:30:3", None, ("--query-gpu=index", "--format=csv", "-lms", "10")),
    # `-l` counts whole seconds: two sweeps of T4's two GPUs, one interval (twelve took 12 s per run)
    ("start-delay:0.1,gpu-lost-after:2:7,exit-after:4:0", T4, ("--query-gpu=index,name", "--format=csv", "-l", "1")),
    # time and identity: recorded timestamps move by the steps; the slow row's delay shows in no cell
    ("clock-step:12:-3600,clock-step:20:90,exit-after:28:0", None, ("--query-gpu=timestamp,index", *LOOP_ARGS)),
    ("slow-row:2:0.5,exit-after:24:0", None, ("--query-gpu=timestamp,index", *LOOP_ARGS)),
    ("reenumerate:11:swap", None, ("--query-gpu=index,uuid,pci.bus_id", *LOOP_ARGS)),
    ("flood:100000", None, ("--query-gpu=index", "--format=csv")),
    ("flood:2500000", None, ("--query-gpu=index", "--format=csv", "-lms", "10")),
]


@pytest.mark.parametrize(
    ("fault", "recording", "args"),
    PARITY,
    ids=[f"{i}-{(p[0] or 'ok').split(':Unable')[0]}" for i, p in enumerate(PARITY)],
)
def test_in_process_runner_matches_the_executable(
    fake_smi: MakeFake, fault: str | None, recording: Path | None, args: tuple[str, ...]
) -> None:
    exe = fake_smi(recording=recording)
    real = run(exe, *args, SMIQUERY_FAKE_KEEP_TIME="1", SMIQUERY_FAKE_FAULT=fault or "", timeout=30)
    runner = InProcessRunner(
        recording=recording, env={"SMIQUERY_FAKE_KEEP_TIME": "1", "SMIQUERY_FAKE_FAULT": fault or ""}
    )
    done = runner.run([str(exe), *args], timeout=30)
    assert done.stdout == real.stdout.decode("utf-8", "replace")
    assert (done.returncode, done.stderr) == (real.returncode, real.stderr.decode())
    assert done.argv == (str(exe), *args)
    assert runner.calls == [(str(exe), *args)]
    assert runner.running() == 0


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def drain(src: InProcessLines) -> None:
    """Read until the source raises its end."""
    while True:
        src.readline(20)


LOOP = ("nvidia-smi", "--query-gpu=index", "--format=csv,noheader", "-lms", "10")


def test_lines_of_a_loop_come_sweep_by_sweep_and_close_stops_the_thread() -> None:
    runner = InProcessRunner()
    before = thread_names()
    src = runner.lines(LOOP)
    assert src.pid is None
    assert [src.readline(20) for _ in range(20)] == [str(i % 8) for i in range(20)]
    assert src.returncode is None
    assert not src.closed
    assert runner.running() == 1
    src.close()
    src.close()  # idempotent
    assert src.closed
    assert runner.running() == 0
    assert thread_names() <= before
    left = [src.readline(1) for _ in range(4)]  # the rest of the sweep that was already read, as a pipe keeps it
    assert left == ["4", "5", "6", "7"]
    with pytest.raises(StreamEndedError, match="closed"):
        src.readline(1)


def test_idle_is_the_wait_for_data_and_zero_for_buffered_lines() -> None:
    with InProcessRunner(start_delay=0.2).lines(LOOP) as src:
        assert src.readline(20) == "0"
        assert src.idle > 0
        assert src.readline(20) == "1"  # the whole sweep was flushed at once
        assert src.idle == 0.0


def test_readline_times_out_with_none_while_the_fake_hangs_and_terminate_ends_it() -> None:
    runner = InProcessRunner(fault="hang-after:3")
    with runner.lines(LOOP) as src:
        assert [src.readline(20) for _ in range(3)] == ["0", "1", "2"]
        assert src.readline(0.05) is None
        assert runner.running() == 1
        src.terminate()
        with pytest.raises(StreamEndedError) as info:  # a terminated stream ends without a typed failure
            drain(src)
        assert info.value.returncode == -signal.SIGTERM
        assert src.returncode == -signal.SIGTERM
        assert src.closed
    assert runner.running() == 0


def test_ignore_term_makes_terminate_ineffective_but_kill_works() -> None:
    runner = InProcessRunner(fault="ignore-term")
    with runner.lines(LOOP) as src:
        assert src.readline(20) == "0"
        src.terminate()
        assert [src.readline(20) for _ in range(9)] == [str(i % 8) for i in range(1, 10)]  # still looping
        assert src.returncode is None
        src.kill()
        with pytest.raises(StreamEndedError):
            drain(src)
        assert src.returncode == -signal.SIGKILL
    assert runner.running() == 0


def test_close_interrupts_a_blocked_readline_and_a_start_delay() -> None:
    runner = InProcessRunner(fault="start-delay:3600")
    src = runner.lines(LOOP)
    got: list[object] = []

    def read() -> None:
        # a readline blocked when close() comes returns None, the next one ends; one begun after close() ends at once
        try:
            while True:
                got.append(src.readline(60))
        except StreamEndedError as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: runner.running() == 1, what="the engine thread")
    src.close()
    reader.join(20)
    assert not reader.is_alive()
    assert isinstance(got[-1], StreamEndedError)
    assert all(line is None for line in got[:-1])  # the start delay never ended: no line came
    assert runner.running() == 0


def test_interrupt_wakes_a_blocked_reader() -> None:
    with InProcessRunner(fault="hang").lines(LOOP) as src:
        got: list[str | None] = []
        reader = threading.Thread(target=lambda: got.append(src.readline(60)))
        reader.start()
        src.interrupt()
        reader.join(20)
        assert got == [None]
        assert src.returncode is None


@pytest.mark.parametrize(
    ("fault", "args", "lines", "error"),
    [
        (None, ("--query-gpu=index", "--format=csv,noheader"), [str(i) for i in range(8)], StreamEndedError),
        (
            "crash-after:2",
            LOOP[1:],
            ["0", "1", "Unable to determine the device handle for GPU 0000:3A:00.0: Unknown Error"],
            errors.NvidiaSmiFailedError,
        ),
        (f"exit-after:9:15:{LOST_LINE}", LOOP[1:], [*map(str, range(8)), "0", LOST_LINE], errors.GpuLostError),
        (
            None,
            ("--query-gpu=index,bogus", "--format=csv"),
            ['Field "bogus" is not a valid field to query.'],
            errors.InvalidArgumentError,
        ),
        ("no-devices", LOOP[1:], ["No devices were found"], errors.NoDevicesFoundError),
    ],
    ids=["exit-0", "crash", "gpu-lost", "bad-field", "no-devices"],
)
def test_lines_end_with_the_typed_error_of_the_exit(
    fault: str | None, args: tuple[str, ...], lines: list[str], error: type[Exception]
) -> None:
    runner = InProcessRunner(fault=fault)
    with runner.lines(("nvidia-smi", *args)) as src:
        assert [src.readline(20) for _ in lines] == lines  # blank lines are skipped
        with pytest.raises(error) as info:
            src.readline(20)
        assert type(info.value) is error
        assert src.closed
        with pytest.raises(error):  # and again on every later call
            src.readline(20)


def test_a_truncated_last_line_comes_before_the_end() -> None:
    with InProcessRunner(fault="truncated").lines(("nvidia-smi", "--query-gpu=index,uuid", "--format=csv")) as src:
        got = [src.readline(20) for _ in range(9)]
        with pytest.raises(StreamEndedError):
            src.readline(20)
    assert got[0] == "index, uuid"
    assert got[-1] is not None
    assert len(got[-1]) < len(got[-2] or "")


def test_run_times_out_and_stops_the_engine() -> None:
    runner = InProcessRunner(fault="hang,ignore-term")
    with pytest.raises(errors.NvidiaSmiTimeoutError, match=r"did not answer within 0\.1 s"):
        runner.run(("nvidia-smi", "-L"), timeout=0.1)
    assert runner.running() == 0


def test_settings_change_between_calls_and_calls_are_logged(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    runner = InProcessRunner(fault="driver-not-loaded", log=log)
    assert runner.run(("nvidia-smi", "-L"), 20).returncode == 9
    runner.fault = None
    assert len(runner.run(("nvidia-smi", "-L"), 20).stdout.splitlines()) == 8
    runner.recording = T4
    runner.env["SMIQUERY_FAKE_SWEEP"] = "0"
    assert runner.run(("nvidia-smi", "--query-gpu=name", "--format=csv,noheader"), 20).stdout == "Tesla T4\nTesla T4\n"
    runner.fault = "melt"  # set wrongly after construction: the fake reports it as the executable does
    done = runner.run(("nvidia-smi", "-L"), 20)
    assert (done.returncode, done.stdout) == (70, "")
    assert "unknown fault 'melt'" in done.stderr
    assert [c[1:] for c in runner.calls] == [("-L",), ("-L",), ("--query-gpu=name", "--format=csv,noheader"), ("-L",)]
    assert [json.loads(line)["argv"] for line in log.read_text().splitlines()][:3] == [
        ["-L"],
        ["-L"],
        ["--query-gpu=name", "--format=csv,noheader"],
    ]
    with pytest.raises(ValueError, match="unknown fault"):
        InProcessRunner(fault="melt")
    with pytest.raises(ValueError, match="negative"):
        InProcessRunner(start_delay=-1)


def test_the_process_environment_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMIQUERY_FAKE_FAULT", "no-devices")
    assert InProcessRunner().run(("nvidia-smi", "-L"), 20).returncode == 0
    assert InProcessRunner(env={"SMIQUERY_FAKE_FAULT": "no-devices"}).run(("nvidia-smi", "-L"), 20).returncode == 6


def test_runner_close_stops_every_source_it_started() -> None:
    before = thread_names()
    with InProcessRunner(fault="ignore-term") as runner:
        sources = [runner.lines(LOOP) for _ in range(3)]
        assert all(s.readline(20) == "0" for s in sources)
        assert runner.running() == 3
    assert runner.running() == 0
    assert thread_names() <= before
    assert all(s.returncode == -signal.SIGKILL for s in sources)


@pytest.mark.parametrize("fault", ["notices-after:12", "drop-gpu-after:10:3:message", "gpu-lost-after:5:1", "inforom"])
def test_lines_of_an_endless_loop_match_the_executable(fake_smi: MakeFake, fault: str) -> None:
    args = ("--query-gpu=timestamp,index,power.draw", "--format=csv", "-lms", "10")
    with Child(fake_smi(fault=fault), *args, SMIQUERY_FAKE_KEEP_TIME="1") as child:
        real = child.readlines(30, timeout=20)
    runner = InProcessRunner(fault=fault, env={"SMIQUERY_FAKE_KEEP_TIME": "1"})
    with runner.lines(("nvidia-smi", *args)) as src:
        assert [src.readline(20) for _ in range(30)] == real
        assert src.returncode is None  # still looping, like the process
    assert runner.running() == 0
