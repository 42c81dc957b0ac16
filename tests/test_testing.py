"""The fake nvidia-smi, driven as a real process: output format, selection, loops, signals and every fault."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from smiquery import errors
from smiquery.errors import StreamEndedError
from smiquery.fields import CATALOGUE, PRESETS, get_field, parse_help_query_gpu
from smiquery.parsing import CsvParser, header_line
from smiquery.sample import GpuSample
from smiquery.testing import ENV_VARS, FAULTS, InProcessLines, InProcessRunner, fake_nvidia_smi

if TYPE_CHECKING:
    from conftest import MakeFake

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake is a POSIX executable")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "smiquery" / "data" / "demo-8gpu.csv"
DEMO_APPS = ROOT / "smiquery" / "data" / "demo-8gpu-apps.csv"
SOME = "index,uuid,name,memory.used,power.draw,temperature.gpu,fan.speed,clocks_event_reasons.active,driver_version"
HELP = "Please run 'nvidia-smi -h' for help."
GPU_LOST = "GPU is lost. Reboot the system to recover this GPU"


# ------------------------------------------------------------------------------------------------- helpers


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMIQUERY_FAKE_")}
    env.update(extra)
    return env


def run(exe: Path, *args: str, timeout: float = 20.0, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(exe), *args], capture_output=True, env=child_env(**env), timeout=timeout, check=False)


def lines_of(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines()


@cache
def demo_rows() -> tuple[GpuSample, ...]:
    return tuple(CsvParser().parse(DEMO.read_text(encoding="utf-8").splitlines()))


class Child:
    """A fake started with pipes; reads lines with deadlines; always killed and reaped on exit."""

    def __init__(self, exe: Path, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(**env)
        )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.buf = b""

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        finally:
            self.proc.wait(timeout=10)
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()

    def _fill(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.fd], [], [], left)[0]:
            return False
        chunk = os.read(self.fd, 65536)
        if not chunk:
            raise EOFError
        self.buf += chunk
        return True

    def readline(self, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if not self._fill(deadline):
                raise TimeoutError(f"no line within {timeout} s")
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8")

    def readlines(self, n: int, timeout: float = 5.0) -> list[str]:
        return [self.readline(timeout) for _ in range(n)]

    def silent_for(self, seconds: float) -> bool:
        """True when nothing at all arrives within ``seconds``."""
        before = len(self.buf)
        try:
            self._fill(time.monotonic() + seconds)
        except EOFError:
            return True
        return len(self.buf) == before

    def stopped_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stderr(self) -> bytes:
        assert self.proc.stderr is not None and self.proc.poll() is not None
        return self.proc.stderr.read()


# ------------------------------------------------------------------------------------------- format, values


def test_one_shot_matches_the_first_sweep_of_the_recording(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), f"--query-gpu={SOME}", "--format=csv")
    assert res.returncode == 0
    assert res.stderr == b""
    out = lines_of(res.stdout)
    fields = [get_field(n) for n in SOME.split(",")]
    assert out[0] == header_line(fields)
    assert len(out) == 9
    assert out[1].split(", ")[3] == "1 MiB"  # units in the values without nounits
    samples = list(CsvParser(SOME.split(",")).parse(out))
    for got, want in zip(samples, demo_rows()[:8], strict=True):
        for name in SOME.split(","):
            assert got[name] == want[name], name
        assert got.missing == {"fan.speed": "not_available"}


def test_nounits_noheader_in_any_order(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "--query-gpu=index,memory.used,power.draw,fan.speed", "--format=nounits,csv,noheader")
    out = lines_of(res.stdout)
    assert res.returncode == 0
    assert len(out) == 8
    assert out[0] == f"0, 1, {demo_rows()[0].power_draw:.2f}, [N/A]"
    samples = list(CsvParser(["index", "memory.used", "power.draw", "fan.speed"]).parse(out))
    assert [s.index for s in samples] == list(range(8))


def test_query_gpu_with_a_separate_value_and_format_value(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "--query-gpu", "index,pstate", "--format", "csv,noheader")
    assert lines_of(res.stdout)[:2] == ["0, P0", "1, P0"]


def test_aliases_print_canonical_header_names(fake_smi: MakeFake) -> None:
    query = "gpu_name,clocks.sm,gpu_uuid,clocks_throttle_reasons.hw_thermal_slowdown,gpu_bus_id,index,index"
    out = lines_of(run(fake_smi(), f"--query-gpu={query}", "--format=csv").stdout)
    assert out[0] == (
        "name, clocks.current.sm [MHz], uuid, clocks_event_reasons.hw_thermal_slowdown, pci.bus_id, index, index"
    )
    assert out[1].endswith(", 00000000:18:00.0, 0, 0")


def test_a_catalogue_field_missing_from_the_recording_is_na_without_unit(fake_smi: MakeFake) -> None:
    out = lines_of(run(fake_smi(), "--query-gpu=index,clocks.max.sm,serial", "--format=csv").stdout)
    assert out[0] == "index, clocks.max.sm [MHz], serial"
    assert out[1] == "0, [N/A], [N/A]"


def test_timestamps_are_rewritten_to_now_about_a_millisecond_apart(fake_smi: MakeFake) -> None:
    before = datetime.now().replace(microsecond=0)
    out = lines_of(run(fake_smi(), "--query-gpu=timestamp,index", "--format=csv,noheader").stdout)
    stamps = [datetime.strptime(line.split(", ")[0], "%Y/%m/%d %H:%M:%S.%f") for line in out]
    assert all(before <= s <= datetime.now() for s in stamps)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
    assert all(0 < g < 0.01 for g in gaps)


def test_keep_time_and_sweep_choice(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    out = lines_of(
        run(
            exe,
            "--query-gpu=timestamp,index,power.draw",
            "--format=csv,noheader",
            SMIQUERY_FAKE_KEEP_TIME="1",
            SMIQUERY_FAKE_SWEEP="2",
        ).stdout
    )
    raw = DEMO.read_text(encoding="utf-8").splitlines()
    assert [line.split(", ")[0] for line in out] == [r.split(", ")[0] for r in raw[17:25]]
    wrapped = lines_of(run(exe, "--query-gpu=power.draw", "--format=csv,noheader", SMIQUERY_FAKE_SWEEP="601").stdout)
    assert wrapped == [f"{s.power_draw:.2f} W" for s in demo_rows()[8:16]]


def test_unknown_field_fails_the_whole_call_on_stdout(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "--query-gpu=index,device_minor,name", "--format=csv")
    assert res.returncode == 2
    assert res.stdout == b'Field "device_minor" is not a valid field to query.\n\n'
    assert res.stderr == b""
    with pytest.raises(errors.InvalidArgumentError):
        raise errors.failure_from_exit(["nvidia-smi"], res.returncode, res.stdout.decode())


def test_a_space_after_a_comma_is_part_of_the_name(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "--query-gpu=index, name", "--format=csv")
    assert (res.returncode, lines_of(res.stdout)[0]) == (2, 'Field " name" is not a valid field to query.')


def test_bad_options(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    res = run(exe, "--query-gpu=index", "--format=csv", "-loop", "1")
    assert (res.returncode, res.stdout.decode()) == (255, f"ERROR: Option -loop is not recognized. {HELP}\n")
    res = run(exe, "--query-gpu=index", "--format=csv", "-i")
    assert (res.returncode, res.stdout.decode()) == (255, f"ERROR: Option -i is missing its value. {HELP}\n")
    res = run(exe, "--format=csv")
    assert res.returncode != 0
    assert res.stdout.decode().startswith("Invalid combination of input arguments.")


# ---------------------------------------------------------------------------------------------- selection


def test_select_by_index_uuid_and_bus_id_in_index_order(fake_smi: MakeFake) -> None:
    rows = demo_rows()
    ids = f"6,{str(rows[1].uuid).upper()},0000:3a:00.0"
    out = lines_of(run(fake_smi(), "--query-gpu=index", "--format=csv,noheader", "-i", ids).stdout)
    assert out == ["1", "2", "6"]
    out = lines_of(run(fake_smi(), "--query-gpu=index", "--format=csv,noheader", "--id=7").stdout)
    assert out == ["7"]


@pytest.mark.parametrize("ident", ["8", "42", "GPU-00000000-0000-0000-0000-000000000000", "random,string"])
def test_unknown_id_finds_no_devices(fake_smi: MakeFake, ident: str) -> None:
    res = run(fake_smi(), "--query-gpu=index", "--format=csv", "-i", ident)
    assert (res.returncode, res.stdout) == (6, b"No devices were found\n")


def test_list_gpus_and_version(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    listing = lines_of(run(exe, "-L").stdout)
    assert len(listing) == 8
    assert re.fullmatch(
        r"GPU 0: NVIDIA H100 80GB HBM3 \(UUID: GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\)", listing[0]
    )
    assert lines_of(run(exe, "--list-gpus", "-i", "5").stdout) == [listing[5]]
    assert lines_of(run(exe, "--version").stdout) == [
        "NVIDIA-SMI version  : 590.48.01",
        "NVML version        : 590.48",
        "DRIVER version      : 590.48.01",
        "CUDA Version        : 13.1",
        "",
    ]


def test_no_arguments_print_the_human_table(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "-i", "0,1")
    out = lines_of(res.stdout)
    assert res.returncode == 0
    assert "Driver Version: 590.48.01" in out[2]
    assert all(len(line) == 91 for line in out[1:])
    assert sum("NVIDIA H100 80GB HBM3" in line for line in out) == 2


# ------------------------------------------------------------------------------------------ loops, signals


def test_loop_prints_the_header_once_then_successive_sweeps(fake_smi: MakeFake) -> None:
    with Child(
        fake_smi(),
        "--query-gpu=timestamp,index,uuid,power.draw",
        "--format=csv",
        "-lms",
        "20",
        SMIQUERY_FAKE_KEEP_TIME="1",
    ) as child:
        header = child.readline()
        lines = child.readlines(8 * 3)
        child.proc.send_signal(signal.SIGTERM)
        assert child.stopped_within(5)
        assert child.proc.returncode == -signal.SIGTERM
        assert child.stderr() == b""
    assert header == "timestamp, index, uuid, power.draw [W]"
    samples = list(CsvParser(["timestamp", "index", "uuid", "power.draw"]).parse(lines))
    want = demo_rows()[:24]
    assert [(s.timestamp, s.uuid, s.power_draw) for s in samples] == [(w.timestamp, w.uuid, w.power_draw) for w in want]


def test_loop_with_l_seconds_and_selection(fake_smi: MakeFake) -> None:
    with Child(fake_smi(), "--query-gpu=index", "--format=csv,noheader", "-l", "1", "-i", "3") as child:
        start = time.monotonic()
        assert child.readlines(2, timeout=5) == ["3", "3"]
        assert 0.9 < time.monotonic() - start < 4


def test_sigint_ends_the_loop_without_a_traceback(fake_smi: MakeFake) -> None:
    with Child(fake_smi(), "--query-gpu=index", "--format=csv", "--loop-ms=50") as child:
        child.readline()
        child.proc.send_signal(signal.SIGINT)
        assert child.stopped_within(5)
        assert child.stderr() == b""


def test_a_closed_pipe_ends_the_loop_quietly(fake_smi: MakeFake) -> None:
    with Child(fake_smi(), "--query-gpu=index", "--format=csv", "-lms", "10") as child:
        child.readline()
        assert child.proc.stdout is not None
        child.proc.stdout.close()
        assert child.stopped_within(5)
        assert child.stderr() == b""


def test_ignore_term_needs_sigkill(fake_smi: MakeFake) -> None:
    with Child(fake_smi(fault="ignore-term"), "--query-gpu=index", "--format=csv", "-lms", "50") as child:
        child.readline()
        child.proc.send_signal(signal.SIGTERM)
        assert not child.stopped_within(0.4)
        child.readline()  # still looping
        child.proc.kill()
        assert child.stopped_within(5)
        assert child.proc.returncode == -signal.SIGKILL


# ------------------------------------------------------------------------------------------------- faults

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
        deadline = time.monotonic() + 10
        while not (log.exists() and log.read_text()):  # logged once SIGTERM is ignored
            assert time.monotonic() < deadline, "the fake never started"
            time.sleep(0.02)
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


# ------------------------------------------------------------------------------ faults of time and identity


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


def test_an_endless_flood_times_out_in_process_without_filling_the_memory() -> None:
    runner = InProcessRunner(fault="flood")
    with pytest.raises(errors.NvidiaSmiTimeoutError):
        runner.run(("nvidia-smi", "--query-gpu=index", "--format=csv"), timeout=1)
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


# ------------------------------------------------------------------------------------ environment, logging


def test_environment_overrides_baked_settings(fake_smi: MakeFake) -> None:
    exe = fake_smi(fault="no-devices")
    assert run(exe, "-L").returncode == 6
    assert run(exe, "-L", SMIQUERY_FAKE_FAULT="").returncode == 0
    assert run(exe, "-L", SMIQUERY_FAKE_FAULT="permission").returncode == 4
    res = run(
        exe,
        "--query-gpu=name",
        "--format=csv,noheader",
        SMIQUERY_FAKE_FAULT="",
        SMIQUERY_FAKE_RECORDING=str(FIXTURES / "t4-470-old-tokens.csv"),
    )
    assert lines_of(res.stdout) == ["Tesla T4", "Tesla T4"]


def test_invocation_log_counts_starts(tmp_path: Path, fake_smi: MakeFake) -> None:
    log = tmp_path / "calls.jsonl"
    exe = fake_smi(log=log)
    run(exe, "--version")
    run(exe, "--query-gpu=index", "--format=csv")
    run(exe, "--query-gpu=bogus", "--format=csv")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["argv"] for c in calls] == [
        ["--version"],
        ["--query-gpu=index", "--format=csv"],
        ["--query-gpu=bogus", "--format=csv"],
    ]
    assert all(isinstance(c["pid"], int) and isinstance(c["time"], float) for c in calls)
    other = tmp_path / "other.jsonl"
    run(exe, "-L", SMIQUERY_FAKE_LOG=str(other))
    assert len(other.read_text().splitlines()) == 1


def test_the_script_runs_from_any_directory(tmp_path: Path, fake_smi: MakeFake) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exe = fake_smi(recording=FIXTURES / "h100x8-590-sweep.csv")
    res = subprocess.run([str(exe), "-L"], cwd=elsewhere, capture_output=True, env=child_env(), timeout=20, check=False)
    assert len(lines_of(res.stdout)) == 8


def test_interpreter_path_with_spaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe_path = Path(sys.executable)
    if not exe_path.is_relative_to(sys.prefix):
        pytest.skip("the interpreter is outside sys.prefix")
    linked_prefix = tmp_path / "python env with spaces"
    linked_prefix.symlink_to(sys.prefix, target_is_directory=True)
    monkeypatch.setattr(sys, "executable", str(linked_prefix / exe_path.relative_to(sys.prefix)))
    exe = fake_nvidia_smi(tmp_path / "bin")
    assert exe.read_text().startswith("#!/bin/sh\n")
    res = run(exe, "--query-gpu=index", "--format=csv,noheader", "-i", "4")
    assert (res.returncode, res.stdout) == (0, b"4\n")


def test_module_entry_point_and_bundled_data() -> None:
    assert (resources.files("smiquery") / "data" / "demo-8gpu.csv").is_file()
    assert (resources.files("smiquery") / "data" / "demo-8gpu-apps.csv").is_file()
    res = subprocess.run(
        [sys.executable, "-m", "smiquery.testing", "--version"],
        capture_output=True,
        env=child_env(),
        timeout=20,
        check=False,
    )
    assert lines_of(res.stdout)[0] == "NVIDIA-SMI version  : 590.48.01"


# -------------------------------------------------------------------------------------------------- help


def test_help_query_gpu_round_trips(fake_smi: MakeFake) -> None:
    res = run(fake_smi(), "--help-query-gpu")
    text = res.stdout.decode()
    assert text.startswith('List of valid properties to query for the switch "--query-gpu":\n\n')
    entries = parse_help_query_gpu(text)
    recorded = {get_field(cell.split(" [")[0]).name for cell in DEMO.read_text().splitlines()[0].split(", ")}
    order = [f.name for f in CATALOGUE if f.name in recorded | {"timestamp"}]
    assert [e.name for e in entries] == order
    for entry in entries:
        fld = get_field(entry.name)
        assert entry.aliases == fld.aliases
        assert entry.description == fld.help
    assert set(PRESETS["health"]) <= {e.name for e in entries}


def test_help_query_gpu_of_an_old_recording_lists_canonical_names(fake_smi: MakeFake) -> None:
    res = run(fake_smi(recording=FIXTURES / "t4-470-old-tokens.csv"), "--help-query-gpu")
    entries = {e.name: e for e in parse_help_query_gpu(res.stdout.decode())}
    assert entries["clocks_event_reasons.active"].aliases == ("clocks_throttle_reasons.active",)
    assert "compute_cap" not in entries


# ---------------------------------------------------------------------------------------------- compute apps


def test_compute_apps_default_and_aliases(fake_smi: MakeFake) -> None:
    exe = fake_smi()
    out = lines_of(run(exe, "--query-compute-apps=pid,name,gpu_uuid,used_memory", "--format=csv").stdout)
    assert out[0] == "pid, process_name, gpu_uuid, used_gpu_memory [MiB]"
    assert out[1:] == DEMO_APPS.read_text().splitlines()[1:]
    out = lines_of(
        run(
            exe, "--query-compute-apps=gpu_bus_id,gpu_name,used_gpu_memory", "--format=csv,nounits,noheader", "-i", "2"
        ).stdout
    )
    assert len(out) == 1
    bus, name, used = out[0].split(", ")
    assert (bus, name) == ("00000000:3A:00.0", "NVIDIA H100 80GB HBM3")
    assert used.isdigit()


def test_compute_apps_none(fake_smi: MakeFake) -> None:
    exe = fake_smi(apps="")
    res = run(exe, "--query-compute-apps=pid,used_gpu_memory", "--format=csv")
    assert (res.returncode, res.stdout) == (0, b"pid, used_gpu_memory [MiB]\n")
    res = run(exe, "--query-compute-apps=pid", "--format=csv,noheader")
    assert (res.returncode, res.stdout) == (0, b"")
    res = run(exe, "--query-compute-apps=pid,gpu_index", "--format=csv")
    assert (res.returncode, lines_of(res.stdout)[0]) == (2, 'Field "gpu_index" is not a valid field to query.')


def test_compute_apps_from_a_file(tmp_path: Path, fake_smi: MakeFake) -> None:
    apps = tmp_path / "apps.csv"
    uuid = demo_rows()[1].uuid
    apps.write_text(f"pid, process_name, gpu_uuid, used_gpu_memory [MiB]\n77, ./gpu_burn, {uuid}, 1542 MiB\n")
    res = run(
        fake_smi(),
        "--query-compute-apps=pid,process_name,used_gpu_memory",
        "--format=csv,noheader",
        SMIQUERY_FAKE_APPS=str(apps),
    )
    assert res.stdout == b"77, ./gpu_burn, 1542 MiB\n"


# ----------------------------------------------------------------------------------- fixtures, demo data


def fixture_files() -> Iterator[Path]:
    yield from sorted(FIXTURES.glob("*.csv"))


def fixture_fields(path: Path) -> list[str] | None:
    side = path.with_suffix(".fields")
    return side.read_text().strip().split(",") if side.exists() else None


@pytest.mark.parametrize("path", list(fixture_files()), ids=lambda p: p.stem)
def test_fixture_parses_and_replays(fake_smi: MakeFake, path: Path) -> None:
    given = fixture_fields(path)
    parser = CsvParser(given)
    recorded = list(parser.parse(path.read_text().splitlines()))
    assert recorded
    names: Sequence[str] = given or [f.name for f in parser.fields]
    res = run(fake_smi(recording=path), f"--query-gpu={','.join(names)}", "--format=csv", SMIQUERY_FAKE_KEEP_TIME="1")
    assert res.returncode == 0
    replayed = list(CsvParser(names).parse(lines_of(res.stdout)))
    first_sweep = recorded[: len(replayed)]
    assert [s.values() for s in replayed] == [s.values() for s in first_sweep]
    assert [dict(s.missing) for s in replayed] == [dict(s.missing) for s in first_sweep]


def num(sample: GpuSample, name: str) -> float:
    value = sample[name]
    assert isinstance(value, (int, float)), (name, value)
    return value


def test_demo_recording_tells_its_story() -> None:
    rows = demo_rows()
    assert len(rows) == 4800
    assert DEMO.stat().st_size < 1_600_000
    sweeps = [rows[i : i + 8] for i in range(0, 4800, 8)]
    assert all([s.index for s in sweep] == list(range(8)) for sweep in sweeps)
    assert all(s.fan_speed is None and s.missing["fan.speed"] == "not_available" for s in rows)
    stall = [s for sweep in sweeps[310:380] for s in sweep]
    assert all(num(s, "utilization.gpu") < 20 and num(s, "memory.used") > 60_000 for s in stall)
    hot = [s for s in rows if num(s, "temperature.gpu") > 85]
    assert {s.index for s in hot} == {5}
    assert all(s.clocks_event_reasons_hw_thermal_slowdown is True for s in hot)
    assert len(hot) > 120  # a few minutes
    steady = [num(s, "temperature.gpu") for sweep in sweeps[90:300] for s in sweep]
    assert min(steady) >= 68
    assert max(steady) <= 80
    assert all(isinstance(s.temperature_memory, int) for s in rows[:100])
    reasons = {r for s in rows for r in s.missing.values()}
    assert {"not_available", "unknown_error"} <= reasons


def test_demo_recording_is_reproducible(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "make_demo_recording.py"
    subprocess.run([sys.executable, str(script), "--out-dir", str(tmp_path)], check=True, timeout=60, env=child_env())
    assert (tmp_path / "demo-8gpu.csv").read_bytes() == DEMO.read_bytes()
    assert (tmp_path / "demo-8gpu-apps.csv").read_bytes() == DEMO_APPS.read_bytes()


# ------------------------------------------------------------------------------------------ in-process fake

T4 = FIXTURES / "t4-470-old-tokens.csv"
LOST_LINE = f"Unable to determine the device handle for GPU 0000:02:00.0: {GPU_LOST}"
LOOP_ARGS = ("--format=csv,noheader", "-lms", "10")
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


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


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
        try:
            got.append(src.readline(60))
        except StreamEndedError as exc:  # close() came before readline() began
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_until(lambda: runner.running() == 1)
    src.close()
    reader.join(20)
    assert not reader.is_alive()
    assert got == [None] or isinstance(got[0], StreamEndedError)
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
