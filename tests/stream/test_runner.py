"""The runner at the process boundary: helpers holding pipes, binaries that cannot start, one-shot edge cases."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from smiquery import errors
from smiquery.errors import InfoRomWarning
from smiquery.runner import LineStream, SubprocessRunner, live_children
from smiquery.sources.apps import processes
from smiquery.sources.query_gpu import query
from tests.leakcheck import no_leaks
from tests.scripted import FIELDS, scripted_smi

HELPER_HOLDS_PIPE = """
# a helper in nvidia-smi's process group inherits stdout and outlives it (a wrapper script's background job)
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
open(STATE, "w").write(str(helper.pid))
sweep([0, 1], pause=False)
sys.exit(0)
"""


def assert_killed(pid: int) -> None:
    """The helper is gone (or a zombie waiting for init): the group was signalled although its leader had exited."""
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return
        time.sleep(0.02)
    raise AssertionError(f"helper {pid} still runs")


def test_finished_child_whose_helper_holds_the_pipe_is_data_not_a_timeout(tmp_path):
    smi = scripted_smi(tmp_path, HELPER_HOLDS_PIPE)
    with no_leaks():
        t0 = time.monotonic()
        rows = query(FIELDS, nvidia_smi=smi, timeout=30)
        took = time.monotonic() - t0
    assert [r.index for r in rows] == [0, 1]
    assert took < 15  # not the 30 s timeout
    assert_killed(int((tmp_path / "state").read_text()))


def test_loop_child_whose_helper_holds_the_pipe_ends_and_the_helper_dies(tmp_path):
    smi = scripted_smi(tmp_path, HELPER_HOLDS_PIPE)
    with no_leaks(), LineStream([str(smi), "-lms", "50"]) as lines:
        got = [lines.readline(10), lines.readline(10)]
        with pytest.raises(errors.StreamEndedError):
            lines.readline(30)
    assert got == ["0, 40", "1, 41"]
    assert_killed(int((tmp_path / "state").read_text()))


def test_readline_reports_silence_without_killing(tmp_path):
    smi = scripted_smi(tmp_path, "sweep([0]); time.sleep(3600)")
    with no_leaks(), LineStream([str(smi)]) as lines:
        assert lines.readline(30) == "0, 40"
        assert lines.readline(0.2) is None
        assert psutil.Process(lines.pid).is_running()
        assert lines.pid in live_children()
    assert lines.closed


def test_interrupt_wakes_a_blocked_readline(tmp_path):
    import threading

    smi = scripted_smi(tmp_path, "time.sleep(3600)")
    with no_leaks(), LineStream([str(smi)]) as lines:
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(lines.readline(60)))
        t.start()
        lines.interrupt()
        t.join(30)
        assert not t.is_alive() and got == [None]


def write_exe(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("loop", [False, True], ids=["one-shot", "loop"])
def test_binary_that_exists_but_cannot_start_says_so(tmp_path, loop):
    cases = {
        "no-loader": (b"#!/nonexistent/loader/ld-linux.so\n", "exists but cannot start"),
        "wrong-format": (b"\x7fELF\x02\x01\x01" + b"\x00" * 60, "exec format error"),
    }
    for name, (data, said) in cases.items():
        (tmp_path / name).mkdir()
        exe = write_exe(tmp_path / name / "nvidia-smi", data)
        start = (
            (lambda exe=exe: LineStream([str(exe), "-l", "1"]).close())
            if loop
            else (lambda exe=exe: SubprocessRunner().run([str(exe)], 10))
        )
        with pytest.raises(errors.NvidiaSmiNotFoundError, match=said) as info:
            start()
        assert "does not exist" not in str(info.value)
    with pytest.raises(errors.NvidiaSmiNotFoundError, match="does not exist"):
        SubprocessRunner().run([str(tmp_path / "missing")], 10)


def test_exit_0_without_rows_is_an_error(tmp_path):
    smi = scripted_smi(tmp_path, "sys.exit(0)")
    with pytest.raises(errors.NvidiaSmiFailedError, match="printed no GPU rows"):
        query(FIELDS, nvidia_smi=smi)


def test_single_column_rows_are_data_not_the_error_message(tmp_path):
    smi = scripted_smi(tmp_path, 'out("NVIDIA H100 80GB HBM3"); out("No devices were found"); sys.exit(6)')
    with pytest.raises(errors.NoDevicesFoundError) as info:
        query(["name"], nvidia_smi=smi)
    assert "No devices were found" in str(info.value)
    assert "H100" not in str(info.value)


APPS_14 = """
if "--query-compute-apps" in " ".join(argv):
    out("1234, python, GPU-11111111-2222-3333-4444-555555555555, 1024")
    out("WARNING: infoROM is corrupted at gpu 0000:0B:00.0")
    sys.exit(14)
out("0, GPU-11111111-2222-3333-4444-555555555555")
"""


def test_processes_keep_rows_on_exit_14_and_skip_the_warning(tmp_path):
    smi = scripted_smi(tmp_path, APPS_14)
    with pytest.warns(InfoRomWarning):
        procs = processes(nvidia_smi=smi)
    assert [(p.pid, p.process_name, p.gpu_index, p.used_memory) for p in procs] == [(1234, "python", 0, 1024)]


@pytest.fixture(params=["pidfd", "no-pidfd"])
def exit_watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the leader's exit seen through a pidfd, and again as on a kernel without them."""
    if request.param == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("this kernel or Python has no pidfd_open")
    if request.param == "no-pidfd":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    return str(request.param)


def test_one_shot_waits_for_the_exit_of_a_child_that_closed_its_output_first(tmp_path, exit_watch):
    # The exit code decides success, so output that ended before the exit is not the end of the run
    smi = scripted_smi(tmp_path, "sweep([0], pause=False); os.close(1); os.close(2); time.sleep(1); os._exit(3)")
    with no_leaks():
        done = SubprocessRunner().run([str(smi)], 30)
    assert (done.returncode, done.stdout) == (3, "0, 40\n")


def test_one_shot_helper_holding_the_pipe_and_a_hang_on_either_exit_watch(tmp_path, exit_watch):
    smi = scripted_smi(tmp_path / "helper", HELPER_HOLDS_PIPE)
    with no_leaks():
        done = SubprocessRunner().run([str(smi)], 30)
    assert (done.returncode, done.stdout, done.seconds < 15) == (0, "0, 40\n1, 41\n", True)
    assert_killed(int((tmp_path / "helper" / "state").read_text()))
    hung = scripted_smi(tmp_path / "hung", "sweep([0], pause=False); time.sleep(3600)")
    with no_leaks(), pytest.raises(errors.NvidiaSmiTimeoutError, match="did not answer within 1 s"):
        SubprocessRunner().run([str(hung)], 1.0)


def test_every_child_of_this_module_was_reaped():
    assert live_children() == []


EMFILE_SCRIPT = r"""
import resource, sys
import smiquery.runner, smiquery.runner.children, smiquery.sources.query_gpu
from smiquery.sources.query_gpu import query
from smiquery.errors import ResourceLimitError, NvidiaSmiNotFoundError
from smiquery.fields import resolve_fields
resolve_fields(["index"])  # the catalogue is read before the descriptors run out
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(open("/dev/null"))
except OSError:
    pass
try:
    query(["index"], nvidia_smi=sys.argv[1], timeout=30)
except ResourceLimitError as exc:
    print("limit:", exc)
except NvidiaSmiNotFoundError as exc:
    print("not found:", exc)
for f in held:
    f.close()
print("after:", len(query(["index"], nvidia_smi=sys.argv[1], timeout=30)))
"""


def test_a_process_out_of_file_descriptors_is_told_to_raise_the_limit(fake_smi):
    fake = fake_smi()
    done = subprocess.run(
        [sys.executable, "-c", EMFILE_SCRIPT, str(fake)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-800:]
    first, after = done.stdout.splitlines()
    assert first.startswith("limit: cannot start") and "too many open files" in first and "ulimit -n" in first
    assert after.startswith("after: ") and int(after.split()[1]) > 0  # the same call works once descriptors free up
