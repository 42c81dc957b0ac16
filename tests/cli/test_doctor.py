"""smiquery.doctor: each check's status, diagnosis and single fix, against the in-process fake nvidia-smi.

The doctor runs whatever nvidia-smi the default runner serves: here `inproc` (no process). The CLI tests run
`smiquery doctor` against the fake executable too (hang, grandchild, a missing binary).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from smiquery import doctor
from smiquery.doctor import CHECK_NAMES, CheckResult, exit_code, run_checks
from smiquery.runner import SubprocessRunner
from smiquery.testing import InProcessRunner, use_runner

#: The nvidia-smi the checks are given; the in-process fake looks nothing up.
FAKE_PATH = "/opt/fake-driver/bin/nvidia-smi"


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "in_container", lambda: None)


@pytest.fixture
def container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "in_container", lambda: "/.dockerenv exists")
    monkeypatch.delenv("NVIDIA_DRIVER_CAPABILITIES", raising=False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)


def test_healthy_machine_reports_every_check_in_order(inproc: InProcessRunner, host: None) -> None:
    results = run_checks(FAKE_PATH, timeout=20)
    assert [r.name for r in results] == [n for n in CHECK_NAMES if n != "infoROM" and not n.startswith("NVIDIA_")]
    assert {r.status for r in results} <= {"ok", "skip"}
    checks = by_name(results)
    assert checks["driver/library match"].diagnosis == "NVML 590.48 matches driver 590.48.01"
    assert exit_code(results) == exit_code(results, gate=True) == 0
    assert checks["nvidia-smi found"].status == "ok" and FAKE_PATH in checks["nvidia-smi found"].diagnosis
    assert [c[1:] for c in inproc.calls][:1] == [("--version",)]  # the binary's version is asked first


def test_no_nvidia_smi_fails_once_with_one_fix(tmp_path: Path, container: None) -> None:
    with use_runner(SubprocessRunner()):  # the real lookup
        results = run_checks(tmp_path / "nvidia-smi", timeout=5)
    checks = by_name(results)
    found = checks["nvidia-smi found"]
    assert found.status == "fail" and found.code == 3 and "--gpus all" in found.fix
    caps = checks["NVIDIA_DRIVER_CAPABILITIES"]
    assert caps.status == "warn" and "nvidia-smi is not mounted" in caps.diagnosis
    fixes = [r.fix for r in results if r.fix]
    assert len(fixes) - len(set(fixes)) <= 1  # the container fix is shared; the CLI prints it once
    assert "nvidia_smi=" not in found.diagnosis + found.fix
    assert exit_code(results) == exit_code(results, gate=True) == 3


def test_nvml_missing_does_not_contradict_nvidia_smi_found(inproc: InProcessRunner, container: None) -> None:
    inproc.fault = "nvml-not-found"
    checks = by_name(run_checks(FAKE_PATH, timeout=20))
    assert checks["nvidia-smi found"].status == "ok"
    assert checks["driver reachable"].status == "fail" and checks["driver reachable"].code == 4
    caps = checks["NVIDIA_DRIVER_CAPABILITIES"]
    assert "libnvidia-ml.so is not mounted" in caps.diagnosis and "nvidia-smi is not mounted" not in caps.diagnosis


def test_nvml_init_failure_gets_init_advice_not_field_advice(inproc: InProcessRunner, host: None) -> None:
    inproc.fault = "not-supported"
    checks = by_name(run_checks(FAKE_PATH, timeout=20))
    reach = checks["driver reachable"]
    assert reach.status == "fail" and "Failed to initialize NVML" in reach.diagnosis
    assert "fields" not in reach.fix and "NVML could not start" in reach.fix


def test_unknown_nvml_version_is_not_reported_as_matching(host: None) -> None:
    # `nvidia-smi --version` failing (exit 9) while the query works: no NVML version to compare
    from smiquery.doctor import _gpu_checks
    from smiquery.sources.query_gpu import query

    samples = query(["index", "name", "driver_version"], runner=InProcessRunner(), timeout=20)
    match = by_name(_gpu_checks(samples, {}, []))["driver/library match"]
    assert match.status == "ok" and "matches" not in match.diagnosis and "NVML version not shown" in match.diagnosis
    mismatch = by_name(_gpu_checks(samples, {"nvml": "550.54", "driver": "590.48.01"}, []))["driver/library match"]
    assert mismatch.status == "fail" and mismatch.code == 4


@pytest.mark.parametrize(("fault", "gate"), [("inforom", 0), ("driver-not-loaded", 4), ("hang", 5)])
def test_gate_fails_only_on_what_stops_monitoring(inproc: InProcessRunner, host: None, fault: str, gate: int) -> None:
    inproc.fault = fault
    results = run_checks(FAKE_PATH, timeout=1 if fault == "hang" else 20)
    assert exit_code(results, gate=True) == gate
    assert exit_code(results) == (1 if fault == "inforom" else gate)


def test_persistence_mode_off_is_a_warning(host: None) -> None:
    from smiquery.doctor import _gpu_checks
    from smiquery.sources.query_gpu import CsvParser

    rows = list(CsvParser(["index", "name", "persistence_mode"]).parse(["0, NVIDIA H100, Disabled"]))
    pm = by_name(_gpu_checks(rows, {}, []))["persistence mode"]
    assert pm.status == "warn" and "nvidia-smi -pm 1" in pm.fix
    assert exit_code([pm], gate=True) == 0 and exit_code([pm]) == 1


def test_container_variables_warn_only_when_they_explain_a_failure(
    inproc: InProcessRunner, container: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVIDIA_DRIVER_CAPABILITIES", "compute")
    inproc.fault = "nvml-not-found"
    broken = by_name(run_checks(FAKE_PATH, timeout=20))
    assert broken["NVIDIA_DRIVER_CAPABILITIES"].status == "warn"
    assert "utility" in broken["NVIDIA_DRIVER_CAPABILITIES"].fix
    inproc.fault = None
    fine = by_name(run_checks(FAKE_PATH, timeout=20))
    assert fine["NVIDIA_DRIVER_CAPABILITIES"].status == "ok"
    assert fine["NVIDIA_VISIBLE_DEVICES"].status == "ok"


DETAILS_XML = Path(__file__).resolve().parents[1] / "fixtures" / "details-2gpu-mig.xml"


def test_memory_and_clock_health_comes_from_the_parsed_details(inproc: InProcessRunner, host: None) -> None:
    # GPU 0: a row remap pending and a hardware thermal slowdown; GPU 1: a page retirement pending
    inproc.env = {"SMIQUERY_FAKE_XML": str(DETAILS_XML)}
    check = by_name(run_checks(FAKE_PATH, timeout=20))["memory and clock health"]
    assert check.status == "warn"
    assert (
        "waits for a reset on GPU 0, 1" in check.diagnosis and "GPU 0 slowed by hw_thermal_slowdown" in check.diagnosis
    )
    assert "nvidia-smi -r" in check.fix and "cooling" in check.fix
    assert any(c[1:3] == ("-q", "-x") for c in inproc.calls)


def test_a_failed_row_remap_fails_the_health_check(inproc: InProcessRunner, host: None, tmp_path: Path) -> None:
    xml = tmp_path / "q.xml"
    xml.write_text(
        DETAILS_XML.read_text(encoding="utf-8").replace(
            "<remapped_row_failure>No</remapped_row_failure>", "<remapped_row_failure>Yes</remapped_row_failure>"
        ),
        encoding="utf-8",
    )
    inproc.env = {"SMIQUERY_FAKE_XML": str(xml)}
    results = run_checks(FAKE_PATH, timeout=20)
    check = by_name(results)["memory and clock health"]
    assert check.status == "fail" and "GPU 0" in check.diagnosis and "RMA" in check.fix
    assert exit_code(results, gate=True) == 1


def test_a_healthy_gpu_passes_the_health_check_and_counts_mig_instances(inproc: InProcessRunner, host: None) -> None:
    from tests.corpus import require_corpus

    inproc.env = {"SMIQUERY_FAKE_XML": str(require_corpus() / "xml" / "netdata__a100-sxm4-mig.xml")}
    check = by_name(run_checks(FAKE_PATH, timeout=20))["memory and clock health"]
    assert check.status == "ok" and "2 MIG instances" in check.diagnosis


@pytest.mark.parametrize(
    ("fault", "check", "fix"),
    [
        ("version-mismatch", "driver/library match", "reboot (or reload the nvidia kernel modules)"),
        ("permission", "driver reachable", "NVIDIA_MIG_MONITOR_DEVICES=all"),
    ],
)
def test_the_fix_is_the_one_the_typed_error_carries(
    inproc: InProcessRunner, host: None, fault: str, check: str, fix: str
) -> None:
    # nvidia-smi says "Failed to initialize NVML: ..." for both: the error's own hint wins over that text
    inproc.fault = fault
    result = by_name(run_checks(FAKE_PATH, timeout=20))[check]
    assert result.status == "fail" and result.code == 4
    assert fix in result.fix and "NVML could not start" not in result.fix
