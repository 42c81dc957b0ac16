"""The command line, driven as users drive it, in-process against the in-process fake nvidia-smi.

Most tests call :func:`smiquery.cli.main` in this process with stdout and stderr captured and
:func:`smiquery.testing.use_runner` serving nvidia-smi on a thread: every command and format, usage errors, the exit
code and one-line message of each failure, doctor against every fault the fake can play, replay and alerts. The
process boundary keeps real processes: the exit status of a real `python -m smiquery` against the fake executable,
rows flushed through a pipe, `| head`, Ctrl-C and SIGTERM (exit 130/143, no child left, whole rows in the output
file), the live table under a pseudo-terminal, and the no-pandas start-up of `query --format csv`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from smiquery.cli import app, exit_code_for, main
from smiquery.fields import PRESETS
from smiquery.recordings import replay
from smiquery.runner import Runner, SubprocessRunner
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser
from smiquery.testing import FAULTS, InProcessRunner, use_runner
from tests.conftest import assert_stopped

DEMO = Path(str(resources.files("smiquery") / "data" / "demo-8gpu.csv"))
SAFE = ("NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_VISIBLE_DEVICES", "SMIQUERY_NVIDIA_SMI", "SMIQUERY_FAKE_")
#: What `--nvidia-smi` names in in-process tests: the in-process runner looks nothing up, so no file is needed.
FAKE_PATH = "/opt/fake-driver/bin/nvidia-smi"


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SAFE)}
    # the container checks of `doctor` pass whether or not the tests run in a container
    env.update(NO_COLOR="1", NVIDIA_DRIVER_CAPABILITIES="compute,utility", NVIDIA_VISIBLE_DEVICES="all")
    env.update(extra)
    return env


def argv(*args: object, smi: Path | str | None = None) -> list[str]:
    pre = ["--nvidia-smi", str(smi)] if smi is not None else []
    return [sys.executable, "-m", "smiquery", *pre, *(str(a) for a in args)]


def run_process(
    *args: object, smi: Path | str | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """A real `python -m smiquery` process (for tests of the process boundary)."""
    return subprocess.run(
        argv(*args, smi=smi), env=cli_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )


@contextlib.contextmanager
def _as_a_fresh_process(env: dict[str, str]) -> Iterator[None]:
    """The environment, working directory and `smiquery` logger of a new process, put back afterwards."""
    saved_env = dict(os.environ)
    cwd = os.getcwd()
    logger = logging.getLogger("smiquery")
    saved_log = (list(logger.handlers), logger.propagate, logger.level)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)
        logger.handlers[:], logger.propagate, logger.level = saved_log[0], saved_log[1], saved_log[2]


def run(
    *args: object,
    smi: Path | str | None = None,
    runner: Runner | None = None,
    cwd: Path | None = None,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """`smiquery ARGS` in this process: ``main()`` with stdout and stderr captured, its exit status returned.

    nvidia-smi is whatever runner is installed (the ``inproc`` fixture's in-process fake); ``runner`` installs
    another for this call (``SubprocessRunner()``: the real lookup, for "not found" cases). ``env`` and ``cwd`` are
    what a child process would get (:func:`cli_env`).
    """
    out, err = io.StringIO(), io.StringIO()
    code: object = None
    cmd = [*(["--nvidia-smi", str(smi)] if smi is not None else []), *(str(a) for a in args)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_as_a_fresh_process(cli_env(**env)))
        if cwd is not None:
            os.chdir(cwd)
        if runner is not None:
            stack.enter_context(use_runner(runner))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            main(cmd)
        except SystemExit as exc:
            code = exc.code
    assert isinstance(code, int), code  # main() always exits with a number
    return subprocess.CompletedProcess(["smiquery", *cmd], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess[str], code: int, says: str = "") -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("smiquery: ")
    assert says in lines[0], lines[0]
    return lines[0]


def csv_rows(text: str) -> list[GpuSample]:
    return list(CsvParser().parse(text.splitlines()))


def starts(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []


@pytest.fixture
def smi(inproc: InProcessRunner) -> str:
    """The `--nvidia-smi` of in-process tests; ``inproc`` (the fake serving it) takes the faults."""
    return FAKE_PATH


# ------------------------------------------------------------------------------------------- help, version


def test_help_lists_commands_exit_codes_and_examples():
    proc = run("--help")
    assert proc.returncode == 0
    out = proc.stdout
    for word in ("stream", "query", "ps", "fields", "doctor", "--nvidia-smi", "--timeout", "--version"):
        assert word in out
    assert "Exit codes:" in out and "130  Ctrl-C" in out and "5    nvidia-smi timed out" in out
    assert out.index("  stream ") < out.index("  query ")
    for cmd in ("stream", "query", "ps", "fields", "doctor"):
        sub = run(cmd, "--help")
        assert sub.returncode == 0 and "Examples:" in sub.stdout, cmd
        assert f"smiquery {cmd}" in sub.stdout


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("smiquery ")


def test_no_arguments_prints_help():
    proc = run()
    assert proc.returncode == 0 and "Commands:" in proc.stdout


# --------------------------------------------------------------------------------------------------- query


def test_query_csv_is_nvidia_smi_format(smi):
    proc = run("query", "--format", "csv", smi=smi)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        lines[0] == "timestamp, index, name, uuid, temperature.gpu, utilization.gpu [%], utilization.memory [%], "
        "memory.used [MiB], memory.total [MiB], power.draw [W]"
    )
    rows = csv_rows(proc.stdout)
    assert [r.index for r in rows] == list(range(8))
    assert rows[0].fields == PRESETS["default"]


def test_query_formats(smi):
    fields = "index,temperature.gpu,fan.speed,power.draw"
    j = json.loads(run("query", "-f", fields, "--format", "json", smi=smi).stdout)
    assert len(j) == 8 and j[0]["fan.speed"] is None and j[0]["_missing"] == {"fan.speed": "not_available"}
    assert isinstance(j[0]["power.draw"], float)
    lines = run("query", "-f", fields, "-F", "jsonl", "--gpus", "1,3", smi=smi).stdout.splitlines()
    assert [json.loads(x)["index"] for x in lines] == [1, 3]
    table = run("query", "-f", fields, "--format", "table", smi=smi).stdout.splitlines()
    assert table[0].split() == ["index", "temperature.gpu", "[C]", "fan.speed", "[%]", "power.draw", "[W]"]
    assert len(table) == 9 and all(" n/a " in row for row in table[1:])
    assert " 0 " not in table[1].replace("    0  ", "")  # missing is never 0
    with_time = run("query", "--format", "table", smi=smi).stdout.splitlines()
    assert with_time[1].split()[3:6] == ["NVIDIA", "H100", "80GB"]


def test_query_selects_gpus_by_uuid_and_bus_id(smi):
    first = json.loads(run("query", "-f", "index,uuid,pci.bus_id", "-F", "json", smi=smi).stdout)
    got = run("query", "-f", "index", "-F", "json", "--gpus", f"{first[2]['uuid']},{first[4]['pci.bus_id']}", smi=smi)
    assert [x["index"] for x in json.loads(got.stdout)] == [2, 4]


def test_query_csv_imports_neither_pandas_nor_typer(fake_smi):
    smi = fake_smi()  # a fresh interpreter: what it imports is the subject
    probe = (
        "import sys, runpy\n"
        f"sys.argv = ['smiquery', '--nvidia-smi', {str(smi)!r}, 'query', '--format', 'csv']\n"
        "try:\n    runpy.run_module('smiquery', run_name='__main__')\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        "heavy = sorted(m for m in ('pandas', 'pyarrow', 'numpy', 'rich', 'pydantic', 'typer') if m in sys.modules)\n"
        "sys.stderr.write('HEAVY=%s CODE=%s\\n' % (','.join(heavy), code))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, check=False)
    assert "HEAVY= CODE=0" in proc.stderr, proc.stderr
    assert len(csv_rows(proc.stdout)) == 8


def test_query_in_process_with_typer_runner(smi):
    result = CliRunner().invoke(app, ["--nvidia-smi", str(smi), "query", "--format", "jsonl", "--gpus", "0"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["index"] == 0
    bad = CliRunner().invoke(app, ["--nvidia-smi", str(smi), "query", "--fields", "temp"])
    assert bad.exit_code == 2 and "unknown field 'temp'" in bad.stderr


def test_main_fast_path_and_typer_path_agree(smi, capsys):
    for args in (["query", "-F", "jsonl", "-i", "0"], ["query", "--format=jsonl", "--gpus=0", "--fields=default"]):
        with pytest.raises(SystemExit) as info:
            main(["--nvidia-smi", str(smi), *args])
        assert info.value.code == 0
        fast = capsys.readouterr().out
        result = CliRunner().invoke(app, ["--nvidia-smi", str(smi), *args])
        assert json.loads(fast).keys() == json.loads(result.stdout).keys()


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["query", "--fields", "temp"], "--fields: unknown field 'temp'; did you mean"),
        (["query", "--gpus", "GPU-nope"], "--gpus: invalid GPU id 'GPU-nope'"),
        (["query", "--format", "xml"], "'xml' is not one of"),
        (["query", "--bogus"], "No such option: --bogus"),
        (["stream", "--interval", "0"], "invalid --interval '0': must be more than 0"),
        (["stream", "-l", "fast"], "invalid --interval 'fast': use seconds (1, 0.5) or a unit: 250ms"),
        (["stream", "--duration", "5 parsecs"], "invalid --duration"),
        (["stream", "--alert", "temperature.gpu >"], "invalid alert"),
        (["stream", "--alert", "temp > 85 for 3"], "unknown field 'temp'"),
        (["stream", "--format", "json"], "'json' is not one of 'table', 'csv', 'jsonl'"),
        (["stream", "--output", "x.txt"], "name it .csv, .jsonl or .parquet"),
        (["stream", "--count", "0"], "--count"),
        (["fields", "--preset", "nope"], "unknown preset 'nope'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["--timeout", "abc", "query"], "--timeout"),
    ],
)
def test_usage_errors_exit_2_with_one_line(smi, tmp_path, args, says):
    proc = run(*args, smi=smi, cwd=tmp_path)
    line = one_line_error(proc, 2, says)
    assert line.startswith("smiquery: usage error: ")
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("fault", "code", "says"),
    [
        ("driver-not-loaded", 4, "couldn't communicate with the NVIDIA driver"),
        ("nvml-not-found", 4, "libnvidia-ml.so"),
        ("version-mismatch", 4, "reboot"),
        ("no-devices", 4, "No devices were found"),
        ("gpu-lost-start", 4, "GPU is lost"),
        ("permission", 4, "Insufficient Permissions"),
        ("hang", 5, "did not answer within 1 s"),
        ("unknown-error", 1, "run `smiquery doctor`"),
        ("garbage", 1, "run `smiquery doctor`"),
    ],
)
def test_each_failure_has_its_exit_code_and_one_line(inproc, fault, code, says):
    inproc.fault = fault
    proc = run("--timeout", "1", "query", smi=FAKE_PATH)
    line = one_line_error(proc, code, says)
    assert line.startswith("smiquery: error: ")


@pytest.mark.parametrize(
    ("fault", "code", "says"),
    [
        ("driver-not-loaded", 4, "couldn't communicate with the NVIDIA driver"),
        ("hang", 5, "did not answer within 1 s"),
    ],
)
def test_a_real_process_exits_with_the_code_of_a_real_failure(fake_smi, fault, code, says):
    # end to end: the exit status of `python -m smiquery`, its one stderr line, a real child killed at the timeout
    proc = run_process("--timeout", "1", "query", smi=fake_smi(fault=fault))
    line = one_line_error(proc, code, says)
    assert line.startswith("smiquery: error: ") and proc.stdout == ""


def test_nvidia_smi_missing_exits_3(tmp_path):
    real = SubprocessRunner()  # the real lookup of the binary
    one_line_error(run("query", smi=tmp_path / "nvidia-smi", runner=real), 3, "nvidia-smi not found")
    one_line_error(run("ps", smi=tmp_path / "nvidia-smi", runner=real), 3, "nvidia-smi not found")
    one_line_error(run("stream", smi=tmp_path / "nvidia-smi", runner=real), 3, "nvidia-smi not found")
    env_only = run("query", runner=real, SMIQUERY_NVIDIA_SMI=str(tmp_path / "gone"))
    one_line_error(env_only, 3, "$SMIQUERY_NVIDIA_SMI")
    missing = run_process("query", smi=tmp_path / "nvidia-smi")  # end to end: the status of a real process
    one_line_error(missing, 3, "nvidia-smi not found")


def test_inforom_warning_is_one_line_and_rows_are_kept(inproc, smi):
    inproc.fault = "inforom"
    proc = run("query", "-F", "csv", smi=smi)
    assert proc.returncode == 0
    assert proc.stderr.startswith("smiquery: warning: nvidia-smi exited 14") and proc.stderr.count("\n") == 1
    assert len(csv_rows(proc.stdout)) == 8


def test_debug_shows_the_traceback(inproc, smi):
    inproc.fault = "driver-not-loaded"
    proc = run("--debug", "query", smi=smi)
    assert proc.returncode == 4
    assert "Traceback" in proc.stderr and "DriverNotLoadedError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("smiquery: error: ")


def test_exit_code_table():
    from smiquery import errors
    from smiquery.errors import InvalidRuleError

    assert exit_code_for(errors.NvidiaSmiNotFoundError()) == 3
    assert exit_code_for(errors.NvidiaSmiTimeoutError("x")) == 5
    for cls in (
        errors.DriverNotLoadedError,
        errors.NvmlNotFoundError,
        errors.DriverVersionMismatchError,
        errors.NoDevicesFoundError,
        errors.GpuLostError,
        errors.InsufficientPermissionsError,
    ):
        assert exit_code_for(cls(["nvidia-smi"], 9, "")) == 4
    assert exit_code_for(errors.NvidiaSmiFailedError(["nvidia-smi"], 255, "")) == 1
    assert exit_code_for(InvalidRuleError("x", "y")) == 2
    assert exit_code_for(errors.InvalidFieldError("x")) == 2
    assert exit_code_for(KeyboardInterrupt()) == 130


# ------------------------------------------------------------------------------------------------- ps, fields


def test_ps_every_format(inproc, smi):
    rows = json.loads(run("ps", "--format", "json", smi=smi).stdout)
    assert [r["gpu_index"] for r in rows] == list(range(8))
    assert rows[0]["pid"] == 48213 and rows[0]["used_memory"] == 69126
    # pid 48213 is not this machine's python: user, command and CPU are missing, never guessed
    assert rows[0]["user"] is None and rows[0]["command"] is None and rows[0]["cpu_percent"] is None
    csv = run("ps", "-F", "csv", "--gpus", "1", smi=smi).stdout.splitlines()
    assert csv[0] == "gpu_index, gpu_uuid, pid, user, cpu_percent [%], used_memory [MiB], process_name, command"
    assert csv[1].startswith("1, GPU-") and ", 70028 MiB, " in csv[1] and len(csv) == 2
    assert len(run("ps", "-F", "jsonl", smi=smi).stdout.splitlines()) == 8
    table = run("ps", "-F", "table", smi=smi).stdout.splitlines()
    assert table[0].split()[:4] == ["gpu", "pid", "user", "cpu"] and len(table) == 9
    assert table[1].split()[2:4] == ["?", "n/a"]  # an unknown user: the same mark as in stream's live table
    inproc.apps = ""
    empty = run("ps", "-F", "table", smi=smi).stdout
    assert empty == "no compute processes\n"


def test_ps_shows_user_command_and_cpu_from_proc(inproc, smi, tmp_path):
    import getpass

    busy = subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: pass", "spin-marker"])
    try:
        apps = tmp_path / "apps.csv"
        uuid = "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b"
        apps.write_text(
            f"pid, process_name, gpu_uuid, used_gpu_memory [MiB]\n{busy.pid}, {sys.executable}, {uuid}, 10 MiB\n"
        )
        inproc.apps = apps
        rows = json.loads(run("ps", "-F", "json", smi=smi).stdout)
    finally:
        busy.kill()
        busy.wait()
    assert len(rows) == 1
    assert rows[0]["user"] == getpass.getuser()
    assert rows[0]["command"].endswith("spin-marker")
    assert isinstance(rows[0]["cpu_percent"], float) and rows[0]["cpu_percent"] > 0


def test_fields_catalogue_presets_search_and_supported(smi):
    table = run("fields", "--preset", "memory", "-F", "table").stdout.splitlines()
    assert table[0].split() == ["name", "kind", "unit", "help"]
    assert [ln.split()[0] for ln in table[1:]] == list(PRESETS["memory"])
    found = json.loads(run("fields", "--search", "fan", "-F", "json").stdout)
    assert "fan.speed" in [f["name"] for f in found] and found[0]["unit"] == "%"
    sup = json.loads(run("fields", "--supported", "-F", "json", smi=smi).stdout)
    by_name = {f["name"]: f["supported"] for f in sup}
    assert by_name["temperature.gpu"] is True and by_name["fan.speed"] is True
    assert by_name["clocks.max.sm"] is False  # the recording's driver does not list it
    text = run("fields", "--supported", "--search", "clocks.max", "-F", "table", smi=smi).stdout
    assert " NO " in text and "not supported by this driver" in text
    assert run("fields", "-F", "csv").stdout.startswith("name, kind, unit, aliases, help\n")
    one_line_error(run("fields", "--supported", smi=Path("/nonexistent/nvidia-smi"), runner=SubprocessRunner()), 3)


# ------------------------------------------------------------------------------------------------- doctor


def test_doctor_passes_on_a_healthy_machine(smi):
    proc = run("doctor", smi=smi)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[-1] == "all checks passed"
    names = [ln[6:].split(":")[0] for ln in lines[:-1]]
    assert names[:4] == ["nvidia-smi found", "driver reachable", "driver/library match", "GPU count"]
    assert {"persistence mode", "MIG mode", "container", "default fields supported"} <= set(names)
    assert "590.48.01" in lines[0] and str(smi) in lines[0]
    assert "8 GPUs" in proc.stdout
    doc = json.loads(run("doctor", "--json", smi=smi).stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0
    assert {c["status"] for c in doc["checks"]} <= {"ok", "skip"}


# Every fault spec the fake knows (smiquery.testing.FAULTS), instantiated: the doctor's exit code, its exit code
# with --gate (only what stops monitoring fails), and the first check that is not ok.
DOCTOR_FAULTS = {
    "driver-not-loaded": ("driver-not-loaded", 4, 4, "driver reachable"),
    "nvml-not-found": ("nvml-not-found", 4, 4, "driver reachable"),
    "version-mismatch": ("version-mismatch", 4, 4, "driver/library match"),
    "no-devices": ("no-devices", 4, 4, "GPU count"),
    "no-supported-gpus": ("no-supported-gpus", 4, 4, "GPU count"),
    "gpu-lost-start": ("gpu-lost-start", 4, 4, "driver reachable"),
    "permission": ("permission", 4, 4, "driver reachable"),
    "not-supported": ("not-supported", 1, 1, "driver reachable"),
    "unknown-error": ("unknown-error", 1, 1, "driver reachable"),
    "exit:CODE[:MESSAGE]": ("exit:9", 4, 4, "driver reachable"),
    "inforom": ("inforom", 1, 0, "infoROM"),
    "hang": ("hang", 5, 5, "driver reachable"),
    "hang-after:N": ("hang-after:0", 5, 5, "driver reachable"),
    "crash-after:N": ("crash-after:8", 1, 1, "driver reachable"),
    "gpu-lost-after:N[:INDEX]": ("gpu-lost-after:0:3", 4, 4, "GPU count"),
    "garbage": ("garbage", 1, 1, "driver reachable"),
    "garbage-after:N": ("garbage-after:0", 1, 1, "driver reachable"),
    "truncated": ("truncated", 1, 1, "driver reachable"),
    "wrong-columns-after:N": ("wrong-columns-after:0", 1, 1, "driver reachable"),
    "ignore-term": ("ignore-term", 0, 0, None),
    "notices-after:N": ("notices-after:0", 5, 5, "driver reachable"),
    "exit-after:N:CODE[:MESSAGE]": ("exit-after:0:15", 4, 4, "driver reachable"),
    "drop-gpu-after:N[:INDEX[:message]]": ("drop-gpu-after:0:3", 0, 0, None),  # one snapshot cannot tell
    "start-delay:SECONDS": ("start-delay:0.5", 0, 0, None),
    "grandchild": ("grandchild", 0, 0, None),  # a helper holding the pipe is killed; the answer is data
    "clock-step:N:SECONDS": ("clock-step:3:-3600", 0, 0, None),  # one snapshot: its times are its times
    "dst-fallback[:SECONDS]": ("dst-fallback", 0, 0, None),
    "slow-row:N:FRACTION[:INDEX]": ("slow-row:1:0.5", 0, 0, None),
    "reenumerate:N[:MODE]": ("reenumerate:1000:remove", 0, 0, None),  # no snapshot prints that many rows
    "flood[:BYTES]": ("flood", 1, 1, "driver reachable"),  # the cap stops it: OutputTooLargeError
}


def test_doctor_covers_every_fault_of_the_fake():
    assert set(DOCTOR_FAULTS) == set(FAULTS)


# Faults whose subject is the process itself: played by the fake executable as a real child. `grandchild` leaves a
# helper holding the pipe; `hang` is a child killed at the deadline.
PROCESS_FAULTS = {"grandchild", "hang"}


@pytest.mark.parametrize("spec", sorted(DOCTOR_FAULTS))
def test_doctor_against_each_fault(fake_smi, spec):
    fault, code, gate_code, first = DOCTOR_FAULTS[spec]
    if fault in PROCESS_FAULTS:
        smi: Path | str = fake_smi(fault=fault)
        runner: Runner = SubprocessRunner()
    else:
        smi, runner = FAKE_PATH, InProcessRunner(fault=fault)
    # only a hang (or a child printing notices but no rows) may time out, however loaded the machine
    limit = "1" if fault.startswith(("hang", "notices")) else "20"
    proc = run("--timeout", limit, "doctor", smi=smi, runner=runner)
    assert proc.returncode == code, proc.stdout
    assert proc.stderr == ""
    assert all(ln.isprintable() for ln in proc.stdout.splitlines())  # no raw bytes
    lines = proc.stdout.splitlines()
    checks = lines[:-1]
    assert all(ln.split()[0] in ("ok", "WARN", "FAIL", "skip") for ln in checks), lines
    problems = [ln for ln in checks if ln.startswith(("FAIL", "WARN"))]
    if first is None:
        assert not problems and lines[-1] == "all checks passed"
        if isinstance(runner, InProcessRunner):
            assert_stopped(runner)
        return
    assert problems[0][6:].startswith(f"{first}: "), problems
    assert all(" -> fix: " in ln for ln in problems)
    fixes = [ln.split(" -> fix: ", 1)[1] for ln in problems]
    assert len(fixes) == len(set(fixes)), fixes  # each fix printed once
    doc = json.loads(run("--timeout", limit, "doctor", "--json", "--gate", smi=smi, runner=runner).stdout)
    assert doc["exit_code"] == gate_code
    assert doc["ok"] is (gate_code == 0)
    assert next(c["name"] for c in doc["checks"] if c["status"] in ("fail", "warn")) == first
    if isinstance(runner, InProcessRunner):
        assert_stopped(runner)


def test_doctor_without_nvidia_smi(tmp_path):
    proc = run("doctor", smi=tmp_path / "nvidia-smi", runner=SubprocessRunner())
    assert proc.returncode == 3
    assert proc.stdout.splitlines()[0].startswith("FAIL  nvidia-smi found: nvidia-smi not found at ")
    assert "skip  driver reachable: nvidia-smi not found" in proc.stdout
    assert proc.stdout.count("--gpus all") <= 1 and proc.stdout.count("install the NVIDIA driver") <= 1
    assert "nvidia_smi=" not in proc.stdout
    assert run_process("doctor", "--gate", smi=tmp_path / "nvidia-smi").returncode == 3  # end to end


def test_doctor_gate_passes_on_warnings_only(inproc, smi):
    inproc.fault = "inforom"
    plain = run("doctor", smi=smi)
    assert plain.returncode == 1 and "WARN  infoROM: " in plain.stdout and plain.stdout.endswith("1 warning\n")
    assert run("doctor", "--gate", smi=smi).returncode == 0


# ------------------------------------------------------------------------------------------------- stream


def test_stream_csv_jsonl_and_table_when_piped(smi):
    csv = run("stream", "-l", "50ms", "--count", "3", smi=smi)
    assert csv.returncode == 0, csv.stderr
    rows = csv_rows(csv.stdout)
    assert len(rows) == 24 and [r.index for r in rows[:8]] == list(range(8))
    assert csv.stdout.splitlines()[0].startswith("timestamp, index, name, uuid")
    jl = run("stream", "-l", "50ms", "--count", "2", "--format", "jsonl", "--gpus", "0,1", smi=smi)
    assert [json.loads(x)["index"] for x in jl.stdout.splitlines()] == [0, 1, 0, 1]
    tb = run("stream", "-l", "50ms", "--count", "2", "--format", "table", "-f", "index,fan.speed", smi=smi)
    blocks = [b for b in tb.stdout.split("\n\n") if b.strip()]
    assert len(blocks) == 2 and blocks[0].splitlines()[0].split() == ["index", "fan.speed", "[%]"]
    assert blocks[1].count("n/a") == 8


def test_stream_rows_are_flushed_as_they_arrive(fake_smi):
    # one sweep per second: a sweep is whole when the next one starts, so the first rows come through the pipe
    # about a second before the last; rows held back until the end would arrive only moments before the process
    # exits. Only a lower bound on time is asserted: a loaded machine makes it longer, never shorter.
    smi = fake_smi()
    with subprocess.Popen(
        argv("stream", "-l", "1", "--count", "3", smi=smi), env=cli_env(), stdout=subprocess.PIPE
    ) as p:
        assert p.stdout is not None
        header = p.stdout.readline()
        first = p.stdout.readline()
        got_first = time.monotonic()
        assert header.startswith(b"timestamp, index") and first.startswith(b"20")
        rest = p.stdout.read()
        p.wait(30)
        ended = time.monotonic()
    assert p.returncode == 0
    assert len(csv_rows((header + first + rest).decode())) == 24
    assert ended - got_first >= 0.75, ended - got_first


def test_stream_duration_stops_it(smi):
    t0 = time.monotonic()
    proc = run("stream", "-l", "100ms", "--duration", "1s", smi=smi)
    took = time.monotonic() - t0
    assert proc.returncode == 0 and 1.0 < took < 6
    assert 16 <= len(csv_rows(proc.stdout)) <= 120


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_stream_output_records_while_displaying(smi, tmp_path, suffix):
    rec = tmp_path / f"rec.{suffix}"
    proc = run("stream", "-l", "50ms", "--count", "4", "-F", "jsonl", "--output", rec, smi=smi)
    assert proc.returncode == 0, proc.stderr
    shown = [json.loads(x) for x in proc.stdout.splitlines()]
    played = list(replay(rec, speed=0))
    assert len(played) == len(shown) == 32
    assert [s.index for s in played] == [x["index"] for x in shown]
    assert [s["temperature.gpu"] for s in played] == [x["temperature.gpu"] for x in shown]
    if suffix == "csv":
        from smiquery.recordings import read_csv

        assert len(read_csv(rec)) == 32
        back = run("stream", "--replay", rec, "--speed", "0", "-F", "csv")
        assert back.stdout == rec.read_text()


def test_stream_replay_needs_no_nvidia_smi(tmp_path):
    # the real lookup: a replay that looked for nvidia-smi would fail on the absent path
    real = SubprocessRunner()
    proc = run("stream", "--replay", DEMO, "--speed", "0", "--count", "5", smi=tmp_path / "absent", runner=real)
    assert proc.returncode == 0, proc.stderr
    rows = csv_rows(proc.stdout)
    assert len(rows) == 40 and rows[0].fields == PRESETS["default"]
    assert proc.stdout.splitlines()[1].startswith("2026/03/14 09:30:00.117, 0, NVIDIA H100 80GB HBM3")
    few = run("stream", "--replay", DEMO, "--speed", "0", "--count", "2", "-f", "fan.speed", "--gpus", "5")
    assert [(r.index, r["fan.speed"]) for r in csv_rows(few.stdout)] == [(5, None), (5, None)]
    one_line_error(run("stream", "--replay", tmp_path / "none.csv"), 1, "not found; record one")
    one_line_error(run("stream", "--replay", DEMO, "-f", "clocks.max.sm"), 1, "has no clocks.max.sm")


def test_alert_fires_on_the_hot_gpu_and_clears_once(tmp_path):
    proc = run("stream", "--replay", DEMO, "--speed", "0", "--alert", "temperature.gpu > 85 for 3", "-F", "csv")
    assert proc.returncode == 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("smiquery: ALERT firing GPU 5: temperature.gpu > 85 for 3 (value 8")
    assert lines[1].startswith("smiquery: ALERT cleared GPU 5: temperature.gpu > 85 for 3")
    assert len(csv_rows(proc.stdout)) == 4800


def test_exit_on_alert(tmp_path):
    rec = tmp_path / "until-alert.csv"
    proc = run(
        "stream", "--replay", DEMO, "--speed", "0", "-a", "temperature.gpu > 85 for 3", "--exit-on-alert", "-o", rec
    )
    assert proc.returncode == 6
    assert "ALERT firing GPU 5" in proc.stderr
    rows = csv_rows(rec.read_text())
    last_sweep = rows[-8:]
    assert [r.index for r in last_sweep] == list(range(8))  # the file ends on the whole sweep that fired
    assert last_sweep[5].temperature_gpu > 85  # type: ignore[operator]
    assert len(rows) < 4800 and rec.read_text().endswith("\n")


def test_alert_on_a_field_not_displayed_is_queried_too(smi):
    proc = run("stream", "-l", "50ms", "--count", "1", "-f", "index", "-a", "power.draw > 0", smi=smi)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0] == "index, power.draw [W]"
    assert proc.stderr.count("ALERT firing") == 8


def test_time_held_alert_on_a_replay_uses_recorded_time():
    # `for 30s` at --speed 0 is measured by the recorded timestamps, which are queried for it
    proc = run(
        "stream",
        "--replay",
        DEMO,
        "--speed",
        "0",
        "-f",
        "index,utilization.gpu",
        "-a",
        "utilization.gpu < 20 for 30s while memory.used > 1024",
        "-F",
        "csv",
    )
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0] == "index, utilization.gpu [%], timestamp, memory.used [MiB]"
    firing = [ln for ln in proc.stderr.splitlines() if "ALERT firing" in ln]
    assert len(firing) == 8 and "held 30." in firing[0]


def test_stream_failure_exits_with_its_code_and_the_file_is_whole(inproc, smi, tmp_path):
    rec = tmp_path / "rec.csv"
    inproc.fault = "permission"
    proc = run("stream", "-l", "50ms", "-o", rec, smi=smi)
    one_line_error(proc, 4, "Insufficient Permissions")
    assert rec.read_text().endswith("\n") and rec.read_text().count("\n") == 1  # the header, whole
    jl = tmp_path / "rec.jsonl"
    # a crash mid-stream is restarted; --count still ends it with every row whole
    inproc.fault = "crash-after:20"
    proc = run("stream", "-l", "50ms", "--count", "6", "-o", jl, "-F", "jsonl", smi=smi)
    assert proc.returncode == 0, proc.stderr
    assert all(json.loads(x) for x in jl.read_text().splitlines())


def test_stream_gives_up_after_retries_with_one_line_per_restart(inproc, smi, monkeypatch):
    # piped, each restart is one line on stderr (with its cause); the final failure is one line too.
    # Three starts, not six: the backoff between them is real time (0.5 s doubling), 16 s for six.
    monkeypatch.setattr("smiquery.retry.FAIL_FAST_ATTEMPTS", 3)
    inproc.fault = "driver-not-loaded"
    proc = run("stream", "-l", "50ms", smi=smi)
    assert proc.returncode == 4
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and "Traceback" not in proc.stderr  # two restarts, then the error
    assert all(ln.startswith("smiquery: restarting nvidia-smi in ") for ln in lines[:-1]), lines
    assert all("couldn't communicate with the NVIDIA driver" in ln for ln in lines), lines
    assert lines[-1].startswith("smiquery: error: ")
    assert not any("dropped" in ln for ln in lines)  # the error's own message is not also a dropped row


def test_piped_stream_reports_restarts_and_lost_gpus_on_stderr(inproc, smi):
    inproc.fault = "crash-after:20"
    crash = run("stream", "-l", "50ms", "--count", "6", smi=smi)
    assert crash.returncode == 0, crash.stderr
    restarts = crash.stderr.splitlines()
    assert restarts and all(ln.startswith("smiquery: restarting nvidia-smi ") for ln in restarts), restarts
    inproc.fault = "gpu-lost-after:10:3"
    lost = run("stream", "-l", "50ms", "--count", "4", smi=smi)
    assert lost.returncode == 0, lost.stderr
    assert re.fullmatch(r"smiquery: error: GPU 3 \(GPU-[0-9a-f-]+\) is lost \(fell off the bus\)\n", lost.stderr)


def test_closed_pipe_ends_quietly(fake_smi):
    smi = fake_smi()
    cmd = argv("stream", "-l", "50ms", smi=smi)
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout is not None and p.stderr is not None
        p.stdout.readline()
        p.stdout.close()  # like `| head -1`
        assert p.wait(10) == 0
        assert p.stderr.read() == b""


def _children_of(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_ctrl_c_exits_130_reaps_nvidia_smi_and_leaves_whole_rows(fake_smi, tmp_path, suffix):
    log = tmp_path / "calls.jsonl"
    rec = tmp_path / f"rec.{suffix}"
    cmd = argv("stream", "--interval", "100ms", "--output", rec, smi=fake_smi(log=log))
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        for _ in range(20):  # header + a couple of sweeps on stdout
            proc.stdout.readline()
        kids = _children_of(proc.pid)
        assert len(starts(log)) == 1 and kids
        fake_pid = starts(log)[0]["pid"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 130, err
    assert err == b""
    assert not _alive(fake_pid)
    assert not any(_alive(k.pid) for k in kids)
    if suffix == "csv":
        text = rec.read_text()
        assert text.endswith("\n")
        rows = csv_rows(text)  # strict: every row whole
        assert len(rows) >= 16
    else:
        import pandas as pd

        assert len(pd.read_parquet(rec)) >= 16


def test_ctrl_c_during_replay_exits_130(tmp_path):
    cmd = argv("stream", "--replay", DEMO, "-o", tmp_path / "r.csv")
    with subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert (tmp_path / "r.csv").read_text().endswith("\n")


def test_sigterm_also_finishes_the_file(fake_smi, tmp_path):
    smi = fake_smi()
    rec = tmp_path / "rec.jsonl"
    with subprocess.Popen(argv("stream", "-l", "50ms", "-o", rec, smi=smi), env=cli_env(), stdout=subprocess.PIPE) as p:
        assert p.stdout is not None
        for _ in range(9):
            p.stdout.readline()
        p.terminate()
        p.communicate(timeout=10)
    assert p.returncode == 143
    assert all(json.loads(x) for x in rec.read_text().splitlines())


# ------------------------------------------------------------------------------------------------ terminal


def read_pty(fd: int, seconds: float, until: Callable[[bytes], bool] | None = None) -> bytes:
    """What the terminal shows within ``seconds``, or until ``until(output)`` holds."""
    buf = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until is not None and until(buf)):
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def spawn_in_pty(args: Sequence[object], *, columns: int = 200, rows: int = 50) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: sizes its terminal, then becomes the CLI with the pty as its terminal
        import fcntl
        import struct
        import termios

        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        os.execve(sys.executable, argv(*args), cli_env(NO_COLOR="", TERM="xterm"))
    return pid, fd


def finish_pty(pid: int, fd: int, out: bytes, *, interrupt: bool) -> tuple[int, bytes]:
    try:
        if interrupt:
            os.kill(pid, signal.SIGINT)
        out += read_pty(fd, 5)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out


def test_live_table_redraws_in_place_and_shows_missing_values(fake_smi):
    smi = fake_smi()
    fields = "index,temperature.gpu,fan.speed,power.draw"
    pid, fd = spawn_in_pty(["--nvidia-smi", smi, "stream", "-l", "100ms", "-f", fields, "-a", "power.draw > 60"])
    shown = read_pty(fd, 60, until=lambda out: out.count(b"\x1b[H") >= 4)  # the first frame and three redraws
    code, out = finish_pty(pid, fd, shown, interrupt=True)
    assert code == 130
    text = out.decode("utf-8", "replace")
    assert text.count("\x1b[H") >= 3  # cursor home: redrawn in place, many times
    assert "\x1b[2J" in text and text.rstrip().endswith("\x1b[?25h")  # cleared once; cursor shown at the end
    last = text.rsplit("\x1b[H", 1)[1]
    assert "GPU  TEMP C  FAN %  PWR W" in last
    assert last.count("n/a") >= 8  # fan.speed is missing: shown as missing, never 0 or blank
    assert "\x1b[1;31m" in last  # power past the alert threshold, in red
    assert "sample age" in last and "restarts 0" in last and "Ctrl-C to stop" in last


@pytest.mark.parametrize("columns", [80, 120])
def test_live_table_fits_the_terminal(columns):
    import re

    pid, fd = spawn_in_pty(["stream", "--replay", DEMO, "--speed", "0", "--count", "30"], columns=columns, rows=30)
    code, out = finish_pty(pid, fd, read_pty(fd, 15), interrupt=False)
    assert code == 0
    last = out.decode("utf-8", "replace").rsplit("\x1b[H", 1)[1]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", last).replace("\r", "")
    lines = plain.splitlines()
    assert all(len(line) <= columns for line in lines), plain
    assert not any(line.endswith("…") for line in lines), plain  # nothing cut off silently
    assert lines[2].split() == [
        "GPU", "NAME", "TEMP", "C", "UTIL", "%", "MUTIL", "%", "MEM", "MiB", "PWR", "W",
    ]  # fmt: skip
    assert "hidden" not in plain and "GPU-" not in plain  # the UUID only when asked or 200 columns wide
    assert "sweeps 30" in plain


# ------------------------------------------------------------------------------------ fast path, structure


def _typer_spellings(command: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Value options and flags of a click command built by typer: spelling -> parameter name (eager ones left out)."""
    values: dict[str, str] = {}
    flags: dict[str, str] = {}
    for p in command.params:
        if p.is_eager or p.param_type_name != "option":
            continue
        for spelling in (*p.opts, *p.secondary_opts):
            (flags if p.is_flag else values)[spelling] = p.name
    return values, flags


def _typer_parse(argv: list[str]) -> dict[str, object]:
    import typer.main

    group = typer.main.get_command(app)
    ctx = group.make_context("smiquery", list(argv))
    name, cmd, rest = group.resolve_command(ctx, [*getattr(ctx, "_protected_args", []), *ctx.args])
    assert name == "query" and cmd is not None
    sub = cmd.make_context(name, rest, parent=ctx)
    params = {**ctx.params, **sub.params}
    defaults = {p.name: p.default for p in (*group.params, *cmd.params)}
    return {k: getattr(v, "value", v) for k, v in params.items() if v != defaults[k] and k != "version"}


def test_fast_path_reads_every_query_option_as_typer_does():
    import typer.main

    from smiquery.cli.query import FAST_GLOBAL, FAST_GLOBAL_FLAGS, FAST_QUERY, parse_fast_query

    group = typer.main.get_command(app)
    from smiquery.cli._common import Settings

    # the fast tables are exactly typer's options of the root and of `query`, every spelling, same defaults
    defaults = {p.name: p.default for p in (*group.params, *group.commands["query"].params)}
    assert (defaults["timeout"], defaults["nvidia_smi"], defaults["debug"]) == (Settings().timeout, None, False)
    assert _typer_spellings(group) == (FAST_GLOBAL, FAST_GLOBAL_FLAGS)
    assert _typer_spellings(group.commands["query"]) == (FAST_QUERY, {})
    values = {"nvidia_smi": "/opt/x/nvidia-smi", "timeout": "2.5", "fields": "index,power.draw", "gpus": "0,GPU-1"}
    values["fmt"] = "JSON"
    cases: list[list[str]] = [["query"], ["--debug", "query"]]
    for table, before in ((FAST_GLOBAL, True), (FAST_QUERY, False)):
        for spelling, name in table.items():
            forms = [[spelling, values[name]], [spelling + values[name]] if len(spelling) == 2 else []]
            if spelling.startswith("--"):
                forms.append([f"{spelling}={values[name]}"])
            for form in forms:
                if form:
                    cases.append([*form, "query"] if before else ["query", *form])
    everything = ["--debug", "--timeout", "3", "--nvidia-smi=/y", "query", "-f", "memory", "--id=1", "-F", "csv"]
    cases.append(everything)
    for argv in cases:
        fast = parse_fast_query(argv)
        want = _typer_parse(argv)
        if fast is None:  # left to typer: allowed only for forms the fast path does not claim to read
            attached_short = argv[-1].startswith("-") and not argv[-1].startswith("--") and len(argv[-1]) > 2
            assert attached_short, argv  # `-findex`: the fast path leaves it to typer
            continue
        got = {k: float(v) if k == "timeout" else v for k, v in fast.items()}
        assert got == want, argv
    # what typer rejects, the fast path never accepts
    for bad in (["query", "-F", "xml"], ["query", "--bogus"], ["--timeout", "0", "query"], ["query", "-f"]):
        assert parse_fast_query(bad) is None


def test_exit_codes_are_one_enum_and_documented():
    from smiquery.cli import ExitCode

    assert {int(c) for c in ExitCode} == {0, 1, 2, 3, 4, 5, 6, 130, 143}
    helptext = run("--help").stdout
    for code in ExitCode:
        assert f"  {int(code)} " in helptext, code
    cli_page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "doctor --gate" in cli_page


def test_cli_text_names_options_and_never_prints_raw_bytes():
    from smiquery.cli._boundary import cli_text
    from smiquery.errors import NvidiaSmiNotFoundError

    text = cli_text(str(NvidiaSmiNotFoundError()))
    assert "nvidia_smi=" not in text and "--nvidia-smi PATH" in text
    garbled = cli_text("line 1: expected 5 columns, got 8: '\x00\x1b[2J\ufffd\x0fok\nnext'")
    assert garbled.isprintable() and "\x1b" not in garbled and "next" not in garbled
    assert garbled == "line 1: expected 5 columns, got 8: (binary data, not text)"
    binary_line = "5\x1f\x01??Y\x15LM??3\x05x"
    quoted = cli_text(f"nvidia-smi's header: {binary_line!r} (see `nvidia-smi`)")
    assert quoted == "nvidia-smi's header: (binary data, not text) (see `nvidia-smi`)"
    assert cli_text("bad row: 'GPU 0, 45, 12 %'") == "bad row: 'GPU 0, 45, 12 %'"  # text stays as it is
    assert cli_text("a\x07b") == "a\\x07b"  # a stray control character is escaped
    assert "nvidia_smi" not in cli_text("nvidia-smi not found at /x (nvidia_smi argument); fix the path")
    assert cli_text("no header; pass fields= for noheader output") == "no header; pass --fields for noheader output"


def test_query_unknown_gpu_index_is_a_usage_error(smi):
    one_line_error(run("query", "--id", "99", smi=smi), 2, "no GPU 99; this machine has 0-7")
    one_line_error(run("query", "--id", "3,42", smi=smi), 2, "no GPU 42; this machine has 0-7")
    streamed = run("stream", "--id", "99", "-n", "1", smi=smi)  # a source retrying forever must not hide it
    one_line_error(streamed, 2, "no GPU 99; this machine has 0-7")


def test_export_takes_durations_like_stream():
    ok = CliRunner().invoke(app, ["export", "--interval", "250ms", "--fields", "nosuch"])
    assert ok.exit_code == 2 and "--fields" in ok.output and "--interval" not in ok.output  # 250ms was accepted
    bad = CliRunner().invoke(app, ["export", "--interval", "fast"])
    assert bad.exit_code == 2 and "--interval" in bad.output and "250ms" in bad.output


def test_plot_takes_gpu_ids_like_stream():
    from smiquery.cli.analysis import _gpu_list

    first = replay(DEMO, speed=0)
    uuid = next(iter(first)).get("uuid")
    first.close()
    assert _gpu_list(f"2,{uuid}") == ["2", uuid]  # the plot looks the UUID up in the recording it draws
    with pytest.raises(Exception, match="invalid GPU id"):
        _gpu_list("bogus")


def test_stream_help_matches_alert_holds_and_formats():
    from smiquery.alerts import Rule

    text = run("stream", "--help").stdout
    flat = " ".join(text.split())
    assert "'for 3' (or 'for 3 samples') fires when 3 consecutive samples" in flat
    assert Rule.parse("temperature.gpu > 85 for 3").hold_samples == 3  # what the help says
    assert Rule.parse("temperature.gpu > 85 for 3s").hold_seconds == 3.0
    assert "--format <table|csv|jsonl>" in flat  # json (an array) is not offered for an endless stream


def test_event_printer_one_line_per_restart_error_and_lost_gpu():
    from smiquery.cli.stream import EventPrinter
    from smiquery.errors import DriverNotLoadedError
    from smiquery.source import StreamEvent

    lines: list[str] = []
    printer = EventPrinter(lines.append)
    err = DriverNotLoadedError(["nvidia-smi"], 9, "NVIDIA-SMI has failed")
    printer(StreamEvent("dropped_row", None, "line 1: NVIDIA-SMI has failed"))
    printer(StreamEvent("error", err, "nvidia-smi exited with code 9"))
    printer(StreamEvent("restart", err, "restarting nvidia-smi in 0.10 s after: nvidia-smi exited with code 9"))
    printer(StreamEvent("gpu_lost", None, "GPU 3 is lost (fell off the bus)", 3))
    printer(StreamEvent("dropped_row", None, "line 9: expected 5 columns, got 1: 'x'"))
    printer.flush()
    printer(StreamEvent("error", err, "final"))
    printer.discard()  # the error that ends the stream is the command's own error line
    assert lines == [
        "smiquery: restarting nvidia-smi in 0.10 s after: nvidia-smi exited with code 9",
        "smiquery: error: GPU 3 is lost (fell off the bus)",
        "smiquery: warning: dropped a line nvidia-smi printed: line 9: expected 5 columns, got 1: 'x'",
    ]


def test_live_table_draws_lost_gpus_as_errors_not_dim():
    import io

    from smiquery.cli.gpuview import LiveTable
    from smiquery.fields import resolve_fields

    flds = resolve_fields("index,temperature.gpu,fan.speed")
    rows = list(CsvParser(flds).parse(["0, [GPU is lost], [N/A]", "1, 40, [N/A]"]))
    table = LiveTable(io.StringIO(), flds, color=True, size=lambda: (80, 20))
    table.update(rows)
    frame = table.frame({"lost_gpus": {0}})
    lost_cell = frame.split("LOST")[0].rsplit("\x1b[", 1)[1]
    assert lost_cell.startswith("1;97;41m")  # white on red
    gpu1 = next(line for line in frame.splitlines() if line.lstrip().startswith("1 "))
    assert gpu1.endswith("\x1b[2m  n/a\x1b[0m\x1b[K")  # a merely missing value stays dim
    assert "LOST GPU 0" in frame


def test_live_table_keeps_the_most_useful_fields_longest():
    import io
    import re

    from smiquery.cli.gpuview import LiveTable
    from smiquery.fields import resolve_fields

    flds = resolve_fields("default")
    with replay(DEMO, speed=0, fields=[f.name for f in flds]) as source:
        sweep = next(iter(source.sweeps()))
    shown: dict[int, list[str]] = {}
    for cols in (30, 44, 60):
        table = LiveTable(io.StringIO(), flds, color=False, size=lambda c=cols: (c, 40))  # type: ignore[misc]
        table.update(sweep)
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", table.frame())
        lines = plain.splitlines()
        assert all(len(line) <= cols for line in lines), plain
        titles = lines[1].split()  # after the summary line
        shown[cols] = [t for t in titles if len(t) > 1 and t.isupper()]  # the titles, not their units
        assert "hidden (terminal too narrow): " in " ".join(plain.split())  # wrapped, never cut
    assert shown[30] == ["GPU", "UTIL", "MEM", "PWR"]
    assert shown[44] == ["GPU", "TEMP", "UTIL", "MEM", "PWR"]
    assert shown[60] == ["GPU", "NAME", "TEMP", "UTIL", "MEM", "PWR"]


def test_on_alert_snapshot_saves_the_evidence_once_per_firing(tmp_path):
    # GPU 5 of the demo recording runs hot: the replayed alert fires once and leaves one folder of evidence
    snaps = tmp_path / "snaps"
    proc = run(
        "stream", "--replay", DEMO, "--speed", "0", "--format", "csv",
        "--alert", "temperature.gpu > 83 for 3", "--on-alert", f"snapshot:{snaps}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    folders = sorted(p for p in snaps.iterdir() if p.is_dir())
    assert len(folders) == 1, folders
    saved = {p.name for p in folders[0].iterdir()}
    assert {"alert.json", "samples.csv"} <= saved
    alert = json.loads((folders[0] / "alert.json").read_text())
    assert "temperature.gpu" in json.dumps(alert)
    from smiquery.analysis import load_recording

    assert len(load_recording(folders[0] / "samples.csv")) > 0  # `smiquery report` reads what was saved


def test_on_alert_needs_a_rule_and_a_known_handler(smi):
    proc = run("stream", "--count", "1", "--on-alert", "log", smi=smi)
    one_line_error(proc, 2, "--on-alert needs at least one --alert rule")
    proc = run("stream", "--count", "1", "--alert", "temperature.gpu > 85", "--on-alert", "pager:x", smi=smi)
    one_line_error(proc, 2, "log, webhook:URL, snapshot:DIR")
