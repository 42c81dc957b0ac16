"""query() and get_gpu_status() (smiquery.sources.query_gpu) against the fake nvidia-smi.

Most tests run the fake in-process (:class:`smiquery.testing.InProcessRunner`: the same engine, faults and output
as the executable, without starting a Python process per call); the tests about the subprocess boundary itself
(a real run end to end, timeouts that kill and reap the child) start the fake executable.
"""

from __future__ import annotations

import os
import stat
import sys
import time
import warnings
from pathlib import Path

import pytest

from smiquery import errors
from smiquery.errors import InfoRomWarning
from smiquery.fields import PRESETS
from smiquery.runner import SubprocessRunner, find_nvidia_smi
from smiquery.sources.query_gpu import get_gpu_status, query, query_df
from smiquery.streams.argv import normalize_gpus
from smiquery.testing import InProcessRunner, fake_nvidia_smi
from tests.leakcheck import no_leaks

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_default_query_returns_typed_records_per_gpu(fake_smi):
    smi = fake_smi()  # a real child process, end to end
    with no_leaks():
        rows = query(nvidia_smi=smi)
    assert [r.index for r in rows] == list(range(8))
    r = rows[0]
    assert isinstance(r.temperature_gpu, int)
    assert isinstance(r.power_draw, float)
    assert r.uuid.startswith("GPU-")
    assert r.timestamp.tzinfo is not None
    assert r.fields == PRESETS["default"]


def test_missing_values_are_none_with_reason_never_zero(fake_inproc):
    rows = query(["index", "fan.speed", "memory.used"], **fake_inproc())
    for r in rows:
        assert r.fan_speed is None  # the H100 recording has no fan
        assert r.missing["fan.speed"] == "not_available"
        assert isinstance(r.memory_used, int)


def test_aliases_and_gpu_selection(fake_inproc):
    rows = query(["gpu_name", "index"], gpus=[1, "3"], **fake_inproc())
    assert [r.index for r in rows] == [1, 3]
    assert rows[0].fields == ("name", "index")
    uuid = rows[1].get("uuid") or query(["uuid"], gpus=3, **fake_inproc())[0].uuid
    assert [r.index for r in query(["index"], gpus=uuid, **fake_inproc())] == [3]


def test_query_df_has_nullable_columns(fake_inproc):
    df = query_df(["index", "fan.speed", "temperature.gpu"], **fake_inproc())
    assert len(df) == 8
    assert str(df["fan_speed"].dtype) == "Int64"
    assert df["fan_speed"].isna().all()
    assert df.attrs["units"]["temperature_gpu"] == "C"


@pytest.mark.parametrize(
    ("fault", "error", "advice"),
    [
        ("driver-not-loaded", errors.DriverNotLoadedError, "driver"),
        ("nvml-not-found", errors.NvmlNotFoundError, "--gpus all"),
        ("version-mismatch", errors.DriverVersionMismatchError, "reboot"),
        ("no-devices", errors.NoDevicesFoundError, "NVIDIA_VISIBLE_DEVICES"),
        ("no-supported-gpus", errors.NoDevicesFoundError, "nvidia-smi -L"),
        ("gpu-lost-start", errors.GpuLostError, "reset"),
        ("permission", errors.InsufficientPermissionsError, "/dev/nvidia"),
        ("not-supported", errors.NotSupportedError, "smiquery fields"),
        ("unknown-error", errors.NvidiaSmiFailedError, "smiquery doctor"),
        ("exit:42", errors.NvidiaSmiFailedError, "code 42"),
    ],
)
def test_each_failure_is_a_typed_error_with_advice(fake_inproc, fault, error, advice):
    with no_leaks(), pytest.raises(error) as info:
        query(**fake_inproc(fault=fault))
    exc = info.value
    assert type(exc) is error
    assert advice in str(exc)
    assert exc.returncode != 0
    assert "\n" not in str(exc)


def test_inforom_warning_returns_rows(fake_inproc):
    with pytest.warns(InfoRomWarning, match="infoROM"):
        rows = query(**fake_inproc(fault="inforom"))
    assert len(rows) == 8


def test_hang_times_out_and_kills_the_child(fake_smi):
    smi = fake_smi(fault="hang")
    with no_leaks():
        t0 = time.monotonic()
        with pytest.raises(errors.NvidiaSmiTimeoutError, match="did not answer within 1 s"):
            query(nvidia_smi=smi, timeout=1.0)
        assert time.monotonic() - t0 < 1.5


def test_hang_ignoring_sigterm_is_killed(fake_smi):
    with no_leaks():
        t0 = time.monotonic()
        with pytest.raises(errors.NvidiaSmiTimeoutError):
            query(nvidia_smi=fake_smi(fault="hang,ignore-term"), timeout=1.0)
        assert time.monotonic() - t0 < 1.5


def test_path_lookup_follows_path_changes_and_removed_files(tmp_path, monkeypatch):
    monkeypatch.delenv("SMIQUERY_NVIDIA_SMI", raising=False)
    first, second = fake_nvidia_smi(tmp_path / "first"), fake_nvidia_smi(tmp_path / "second")
    monkeypatch.setenv("PATH", f"{first.parent}{os.pathsep}{second.parent}")
    assert find_nvidia_smi() == str(first)
    assert find_nvidia_smi() == str(first)  # remembered, and still right
    first.unlink()
    assert find_nvidia_smi() == str(second)  # the remembered file is gone: searched again
    third = fake_nvidia_smi(tmp_path / "third")
    monkeypatch.setenv("PATH", str(third.parent))
    assert find_nvidia_smi() == str(third)


@pytest.mark.parametrize("fault", ["garbage", "truncated", "wrong-columns-after:3"])
def test_bad_output_raises_parse_error_never_half_rows(fake_inproc, fault):
    with no_leaks(), pytest.raises(errors.ParseError) as info:
        query(**fake_inproc(fault=fault))
    assert info.value.lineno >= 1


def test_missing_binary(tmp_path):
    with pytest.raises(errors.NvidiaSmiNotFoundError, match="not found"):
        query(nvidia_smi=tmp_path / "nope" / "nvidia-smi")


def test_binary_without_exec_permission(fake_smi):
    smi = fake_smi()
    smi.chmod(stat.S_IRUSR | stat.S_IWUSR)
    if os.access(smi, os.X_OK):  # root may execute anything with any x bit; we removed them all
        pytest.skip("this user can execute files without an x bit")
    with pytest.raises(errors.NvidiaSmiNotFoundError, match="not an executable"):
        query(nvidia_smi=smi)


def test_binary_resolution_order(fake_smi, tmp_path, monkeypatch):
    smi = fake_smi()
    monkeypatch.setenv("SMIQUERY_NVIDIA_SMI", str(smi))
    assert find_nvidia_smi() == str(smi)
    other = tmp_path / "other"
    other.mkdir()
    explicit = fake_nvidia_smi(other)
    assert find_nvidia_smi(explicit) == str(explicit)
    monkeypatch.delenv("SMIQUERY_NVIDIA_SMI")
    monkeypatch.setenv("PATH", str(other))
    assert find_nvidia_smi() == str(explicit)
    monkeypatch.setenv("SMIQUERY_NVIDIA_SMI", str(tmp_path / "missing"))
    with pytest.raises(errors.NvidiaSmiNotFoundError, match="SMIQUERY_NVIDIA_SMI"):
        find_nvidia_smi()


def test_invalid_field_and_gpu_id_rejected_before_running(fake_inproc):
    smi = fake_inproc()
    with pytest.raises(errors.InvalidFieldError, match="did you mean"):
        query(["temperature.gpuu"], **smi)
    with pytest.raises(errors.InvalidFieldError):
        query(["index;rm -rf /"], **smi)
    for bad in ["0; reboot", "-1", -1, "GPU-xyz", "../etc", "", True]:
        with pytest.raises(errors.InvalidGpuIdError):
            query(gpus=bad, **smi)
    assert smi["runner"].calls == []


def test_gpu_id_forms():
    assert normalize_gpus([0, "2,3"]) == ("0", "2", "3")
    assert normalize_gpus("00000000:18:00.0") == ("00000000:18:00.0",)
    assert normalize_gpus("GPU-0a1b2c3d-0000-1111-2222-333344445555") == ("GPU-0a1b2c3d-0000-1111-2222-333344445555",)


@pytest.mark.parametrize("runner", [SubprocessRunner, InProcessRunner])
def test_driver_rejecting_a_field_maps_to_invalid_argument(fake_smi, runner):
    done = runner().run([str(fake_smi()), "--query-gpu=device_minor", "--format=csv"], 20)
    err = errors.failure_from_exit(done.argv, done.returncode, done.output)
    assert isinstance(err, errors.InvalidArgumentError)
    assert "device_minor" in str(err)
    assert not err.retryable


# ------------------------------------------------------------------------------------------- get_gpu_status


def test_gpu_status_success_contract(fake_inproc):
    status = get_gpu_status(**fake_inproc())
    assert status["success"] is True
    assert len(status["data"]) == 8
    for item in status["data"]:
        assert set(item) == {"index", "name", "temperature_c", "gpu_util_percent", "memory_util_percent", "timestamp"}
        assert isinstance(item["index"], int)
        assert isinstance(item["name"], str)
        assert item["temperature_c"] is None or isinstance(item["temperature_c"], int)
        assert "T" in item["timestamp"]
        assert item["timestamp"][-6] in "+-"  # ISO 8601 with offset


def test_gpu_status_extra_fields(fake_inproc):
    status = get_gpu_status(["power.draw", "fan.speed"], **fake_inproc())
    item = status["data"][0]
    assert isinstance(item["power_draw"], float)
    assert item["fan_speed"] is None


@pytest.mark.parametrize(
    ("fault", "error_type"),
    [
        ("driver-not-loaded", "DriverNotLoadedError"),
        ("nvml-not-found", "NvmlNotFoundError"),
        ("version-mismatch", "DriverVersionMismatchError"),
        ("no-devices", "NoDevicesFoundError"),
        ("gpu-lost-start", "GpuLostError"),
        ("permission", "InsufficientPermissionsError"),
        ("hang", "NvidiaSmiTimeoutError"),
        ("start-delay:3600", "NvidiaSmiTimeoutError"),
        ("garbage", "ParseError"),
        ("truncated", "ParseError"),
        ("exit:255", "NvidiaSmiFailedError"),
    ],
)
def test_gpu_status_failure_contract(fake_inproc, fault, error_type):
    with no_leaks():
        # a hang is cut at the timeout; every other fault answers long before it
        status = get_gpu_status(**fake_inproc(fault=fault), timeout=0.3 if "NvidiaSmiTimeout" in error_type else 30)
    assert status["success"] is False
    assert status["error_type"] == error_type
    assert status["error"] and "\n" not in status["error"]
    assert set(status) == {"success", "error", "error_type"}


def test_gpu_status_of_a_real_child_that_hangs_ignoring_sigterm(fake_smi):
    with no_leaks():
        t0 = time.monotonic()
        status = get_gpu_status(nvidia_smi=fake_smi(fault="hang,ignore-term"), timeout=1.0)
        assert time.monotonic() - t0 < 1.5
    assert (status["success"], status["error_type"]) == (False, "NvidiaSmiTimeoutError")


def test_gpu_status_missing_binary(tmp_path):
    status = get_gpu_status(nvidia_smi=tmp_path / "none")
    assert status == {"success": False, "error": status["error"], "error_type": "NvidiaSmiNotFoundError"}


def test_gpu_status_bad_field_is_reported_not_raised(fake_inproc):
    status = get_gpu_status(["nope"], **fake_inproc())
    assert status["error_type"] == "InvalidFieldError"


def test_inforom_does_not_warn_twice(fake_inproc):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        query(**fake_inproc(fault="inforom"))
    assert sum(issubclass(w.category, InfoRomWarning) for w in seen) == 1


def pre535_nvidia_smi(tmp_path: Path, recording: Path) -> Path:
    """A fake for a driver before the 535 branch: it rejects the clocks_event_reasons.* names as R470 does."""
    inner = fake_nvidia_smi(tmp_path / "inner", recording=recording)
    script = tmp_path / "r470" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "for arg in sys.argv[1:]:\n"
        "    if arg.startswith('--query-gpu='):\n"
        "        for name in arg.split('=', 1)[1].split(','):\n"
        "            if name.startswith('clocks_event_reasons'):\n"
        "                print(f'Field \"{name}\" is not a valid field to query.')\n"
        "                print()\n"
        "                sys.exit(2)\n"
        f"os.execv({str(inner)!r}, [{str(inner)!r}, *sys.argv[1:]])\n",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("preset", ["health", "throttle"])
def test_throttle_fields_work_on_a_pre_535_driver_under_their_new_names(tmp_path, preset):
    smi = pre535_nvidia_smi(tmp_path, FIXTURES / "t4-470-old-tokens.csv")
    # the stand-in really is an old driver: the new spelling is refused the way R470 refuses it
    done = SubprocessRunner().run([str(smi), "--query-gpu=index,clocks_event_reasons.active", "--format=csv"], 10)
    assert done.returncode == 2
    assert 'Field "clocks_event_reasons.active" is not a valid field to query.' in done.output
    with no_leaks():
        rows = query(preset, nvidia_smi=smi)
    assert [r.index for r in rows] == [0, 1]
    assert rows[0].fields == PRESETS[preset]
    assert rows[0]["clocks_event_reasons.active"] == 4  # 0x...04 in the recording: sw power cap
    assert rows[1].clocks_event_reasons_active == 1
    assert "clocks_throttle_reasons.active" not in rows[0].fields


def test_argv_sends_throttle_reasons_under_the_spelling_every_driver_accepts():
    from smiquery.fields import resolve_fields
    from smiquery.streams.argv import build_argv

    argv = build_argv("nvidia-smi", resolve_fields("health"), interval=1)
    names = argv[1].removeprefix("--query-gpu=").split(",")
    assert "clocks_throttle_reasons.hw_thermal_slowdown" in names
    assert not [n for n in names if n.startswith("clocks_event_reasons.")]
    assert len(names) == len(PRESETS["health"])
