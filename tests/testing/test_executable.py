"""The fake nvidia-smi as a real executable: output format, selection, loops, signals, settings and data."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from smiquery import errors
from smiquery.fields import CATALOGUE, PRESETS, get_field, parse_help_query_gpu
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser, header_line
from smiquery.testing import fake_nvidia_smi

if TYPE_CHECKING:
    from conftest import MakeFake
from tests.testing.support import (
    DEMO,
    DEMO_APPS,
    FIXTURES,
    HELP,
    ROOT,
    SOME,
    Child,
    child_env,
    demo_rows,
    lines_of,
    run,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake is a POSIX executable")


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
