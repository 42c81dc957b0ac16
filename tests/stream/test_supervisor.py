"""The stream supervisor under the faults that break long-running monitors, one behaviour per test.

Every test here runs real nvidia-smi stand-ins (scripted executables or the fake), because the process boundary
(pipes, exit codes, signals, timing) is the subject. Waits are events and generous deadlines, never short sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from smiquery import errors
from smiquery.retry import RetryPolicy
from smiquery.source import SampleSource, StreamEvent, Sweep
from smiquery.streams.sync import Stream, stream
from tests.leakcheck import no_leaks
from tests.scripted import FIELDS, scripted_smi


def one_instant(sweep: Sweep) -> bool:
    """Rows of one instant: increasing GPU indices, and the same sweep number in every temperature."""
    idx = [s.index for s in sweep]
    phase = {(s.temperature_gpu - 40 - s.index) for s in sweep}
    return idx == sorted(set(idx)) and len(phase) == 1


def kinds(events: list[StreamEvent], kind: str) -> list[StreamEvent]:
    return [e for e in events if e.kind == kind]


# ------------------------------------------------------------------------------------ 1. sweeps, one instant


def test_first_sweep_cut_short_does_not_skew_later_sweeps(tmp_path):
    # 4 GPUs; the first child dies after printing 2 rows, the next ones run normally.
    smi = scripted_smi(
        tmp_path,
        """
        if starts() == 0:
            sweep([0, 1], pause=False)
            sys.exit(255)
        while True:
            sweep([0, 1, 2, 3])
        """,
    )
    with no_leaks(), stream(FIELDS, interval=0.05, nvidia_smi=smi, retry=RetryPolicy(backoff_initial=0.01)) as s:
        sweeps = list(s.sweeps(count=8))
    first, rest = sweeps[0], sweeps[1:]
    assert [x.index for x in first] == [0, 1] and first.damaged and not first.complete
    assert all([x.index for x in sw] == [0, 1, 2, 3] and sw.complete for sw in rest)
    assert all(one_instant(sw) for sw in sweeps)
    assert s.stats.short_sweeps == 1


def test_bad_row_in_first_sweep_is_flagged_and_later_sweeps_are_whole(tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        out("0, 40"); out("\\x00garbage"); out("2, 42"); out("3, 43"); time.sleep(DT)
        while True:
            sweep([0, 1, 2, 3])
        """,
    )
    with stream(FIELDS, interval=0.05, nvidia_smi=smi) as s:
        sweeps = list(s.sweeps(count=6))
    assert sweeps[0].damaged and [x.index for x in sweeps[0]] == [0, 2, 3]
    assert all(sw.complete and len(sw) == 4 for sw in sweeps[1:])
    assert s.stats.dropped_rows == 1 and s.stats.short_sweeps == 1
    assert s.stats.lost_gpus == set()  # a dropped row is not a lost GPU


# Rows an interval apart are two instants: the engine's logic, tests/stream/test_engine.py.


# ------------------------------------------------------------------------------- 2. only data proves life


def test_child_printing_only_notices_is_restarted(fake_smi, tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        sweep([0, 1])
        sweep([0, 1])
        out("WARNING: infoROM is corrupted at gpu 0000:0B:00.0")
        while True:  # one notice per line written, so the last line before a kill is always this one
            out("Unable to determine the device handle for GPU 0000:02:00.0: Unknown Error")
            time.sleep(DT)
        """,
    )
    events: list[StreamEvent] = []
    with (
        no_leaks(),
        stream(
            FIELDS,
            interval=0.05,
            nvidia_smi=smi,
            stall_timeout=0.5,
            retry=RetryPolicy(backoff_initial=0.05),
            on_event=events.append,
        ) as s,
    ):
        got = [x for _, x in zip(range(10), s)]
    assert len(got) == 10
    assert s.stats.starts >= 3
    assert s.stats.errors["NvidiaSmiTimeoutError"] >= 2
    assert s.stats.dropped_rows == 0  # messages are not data rows
    # the child is killed while it prints only notices: a hang, quoting its last message
    assert (s.stats.last_error or "").startswith("nvidia-smi printed no data row for 0.5 s")
    assert "Unknown Error" in (s.stats.last_error or "")


def test_max_samples_is_reached_despite_notices(tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        while True:
            sweep([0])
            out("WARNING: infoROM is corrupted at gpu 0000:0B:00.0")
        """,
    )
    with stream(FIELDS, interval=0.05, nvidia_smi=smi, max_samples=5) as s:
        assert len(list(s)) == 5


# ------------------------------------------------------------------------------------ 3. duration, a deadline


@pytest.mark.parametrize("fault", ["hang", "hang-after:8"])
def test_duration_is_a_deadline_even_when_hung(fake_smi, fault):
    with no_leaks():
        s = stream(interval=0.05, nvidia_smi=fake_smi(fault=fault), duration=1.0, stall_timeout=30)
        t0 = time.monotonic()
        list(s)
        took = time.monotonic() - t0
    assert took < 1.0 + 5.0  # 1 s, plus killing and reaping; never the 30 s stall timeout
    assert s.stats.state == "ended"


def test_duration_cuts_the_wait_between_attempts(fake_smi):
    with no_leaks():
        s = stream(nvidia_smi=fake_smi(fault="version-mismatch"), duration=1.0, retry=RetryPolicy(permanent_retry=60))
        t0 = time.monotonic()
        assert list(s) == []
        assert time.monotonic() - t0 < 1.0 + 5.0
    assert s.stats.errors["DriverVersionMismatchError"] == 1


# ---------------------------------------------------------------------------------- 4. close(), a deadline


def test_close_from_another_thread_stops_a_child_ignoring_sigterm(fake_smi):
    s = stream(interval=0.02, nvidia_smi=fake_smi(fault="ignore-term"))
    after_close: list[object] = []
    closed = threading.Event()
    first = threading.Event()

    def consume() -> None:
        for x in s:
            first.set()
            if closed.is_set():
                after_close.append(x)

    with no_leaks(reap_timeout=5):
        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        pid = s.child_pid
        s.close(timeout=3)
        closed.set()
        t.join(10)
        assert not t.is_alive()
        assert pid is not None and not psutil.pid_exists(pid)  # killed and reaped
    assert after_close == []


def test_close_of_a_started_stream_honours_its_timeout(fake_smi):
    with no_leaks(reap_timeout=5):
        s = stream(interval=0.02, nvidia_smi=fake_smi(fault="ignore-term")).start()
        deadline = time.monotonic() + 30
        while s.latest()[0] is None and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        s.close(timeout=3)
        assert time.monotonic() - t0 < 3 + 2
        assert not s.running
    assert s.stats.state == "closed"


def test_close_during_backoff_returns_at_once(fake_smi):
    with no_leaks():
        s = stream(
            nvidia_smi=fake_smi(fault="driver-not-loaded"), retry=RetryPolicy(backoff_initial=60, backoff_max=120)
        ).start()
        deadline = time.monotonic() + 30
        while s.stats.state != "retrying" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.stats.next_retry_at is not None and s.stats.next_retry_at > time.time() + 30
        t0 = time.monotonic()
        s.close(timeout=5)
        assert time.monotonic() - t0 < 5
        assert not s.running


# ------------------------------------------------------------------------------ 5, 6. parent death, forks

PARENT = """
import sys, time
from smiquery.streams.sync import stream
s = stream(interval=0.05, nvidia_smi=sys.argv[1]).start()
while s.child_pid is None or s.latest()[0] is None:
    time.sleep(0.01)
print(s.child_pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_loop_child_dies_with_its_parent(fake_smi, sig):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(fake_smi(fault="hang-after:16,ignore-term"))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
        parent.send_signal(sig)
        parent.wait(30)
        _, alive = psutil.wait_procs([child], timeout=2)  # the bound: within 2 s of its parent
        assert alive == [], f"nvidia-smi {child.pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()


FORKER = """
import os, sys, time
from smiquery.streams.sync import stream
s = stream(interval=0.05, nvidia_smi=sys.argv[1]).start()
while s.child_pid is None or s.latest()[0] is None:
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    sys.exit(0)          # a forked worker ending normally runs atexit handlers and finalizers
os.waitpid(pid, 0)
time.sleep(0.5)
child = s.child_pid
print("alive" if child is not None and os.path.exists(f"/proc/{child}") else "dead", flush=True)
s.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_the_parents_nvidia_smi_alone(fake_smi):
    done = subprocess.run(
        [sys.executable, "-c", FORKER, str(fake_smi())], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "alive", done.stderr


# ------------------------------------------------------------------------------------ 8. one retry policy


def test_rows_then_exit_is_backed_off_not_a_storm(tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        sweep([0, 1], pause=False)
        out("Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. Reboot the system")
        sys.exit(15)
        """,
    )
    naps: list[float] = []
    attempts: list[int] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        attempts.append(s.stats.attempt)

    s = stream(
        FIELDS,
        interval=0.05,
        nvidia_smi=smi,
        retry=RetryPolicy(max_attempts=6, backoff_initial=0.1, backoff_max=1.0),
        sleep=nap,
    )
    with pytest.raises(errors.GpuLostError), s:
        for _ in s:
            pass
    assert s.stats.starts == 6
    assert len(naps) == 5
    assert naps[1] > naps[0] and naps[2] > naps[1]  # exponential, not a fixed delay after each burst of rows
    assert max(naps) <= 1.0  # capped
    assert attempts == [1, 2, 3, 4, 5]  # the state is visible while waiting
    assert s.stats.errors["GpuLostError"] == 6


def test_backoff_resets_only_after_a_healthy_period(tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        for _ in range(4):
            sweep([0, 1])
        sys.exit(255)
        """,
    )
    naps: list[float] = []
    with stream(FIELDS, interval=0.02, nvidia_smi=smi, sleep=naps.append, retry=RetryPolicy(healthy_after=3600)) as s:
        for _ in zip(range(60), s):
            pass
    assert len(naps) >= 5 and naps == sorted(naps)  # short healthy spells do not reset the backoff
    naps.clear()
    with stream(FIELDS, interval=0.02, nvidia_smi=smi, sleep=naps.append, retry=RetryPolicy(healthy_after=0.0)) as s:
        for _ in zip(range(60), s):
            pass
    assert s.stats.restarts >= 5
    assert naps == []  # each failure came after a healthy period: restarted at once, a fresh streak


# ------------------------------------------------------------------------- 9. permanent errors, slow retries


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("version-mismatch", "DriverVersionMismatchError"),
        ("nvml-not-found", "NvmlNotFoundError"),
        ("no-devices", "NoDevicesFoundError"),
        ("permission", "InsufficientPermissionsError"),
    ],
)
def test_permanent_error_is_retried_slowly_and_recovers(fake_smi, tmp_path, fault, error):
    smi = fake_smi(fault=fault)
    events: list[StreamEvent] = []
    naps: list[float] = []
    states: list[tuple[str, bool, str | None]] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        states.append((s.stats.state, s.stats.permanent, s.stats.last_error_type))
        if len(naps) == 2:  # the cause is fixed (say, the node rebooted into the new driver)
            smi.write_text(fake_smi(fault=None).read_text())

    s = stream(interval=0.05, nvidia_smi=smi, retry=RetryPolicy(permanent_retry=40), sleep=nap, on_event=events.append)
    with s:
        sweeps = list(s.sweeps(count=2))
    assert len(sweeps) == 2 and all(len(sw) == 8 for sw in sweeps)
    assert len(naps) == 2 and all(36 <= n <= 44 for n in naps)  # the slow cadence, with jitter
    assert states == [("retrying", True, error)] * 2
    assert s.stats.errors[error] == 2
    assert kinds(events, "recovered")
    assert s.stats.permanent is False and s.stats.attempt == 0


def test_one_shot_query_still_fails_fast_on_permanent_errors(fake_smi):
    from smiquery.sources.query_gpu import query

    t0 = time.monotonic()
    with pytest.raises(errors.DriverVersionMismatchError):
        query(nvidia_smi=fake_smi(fault="version-mismatch"))
    assert time.monotonic() - t0 < 30


def test_binary_that_disappears_mid_life_is_retried(fake_smi, tmp_path):
    smi = fake_smi()
    naps: list[float] = []
    body = smi.read_text()

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:  # the upgrade is over: the binary is back
            smi.write_text(body)
            smi.chmod(0o755)

    s = stream(interval=0.05, nvidia_smi=smi, sleep=nap, stall_timeout=5)
    with s:
        it = s.sweeps()
        next(it)
        smi.unlink()  # a driver upgrade removes the binary; the running child is then killed
        proc = psutil.Process(s.child_pid)
        proc.kill()
        got = [next(it) for _ in range(2)]
    assert len(got) == 2
    assert s.stats.errors["NvidiaSmiNotFoundError"] == 1
    assert len(naps) == 2 and naps[1] >= 27  # a missing binary needs a person: the slow cadence


# --------------------------------------------------------------------------------------- 10. slow start


def test_slow_first_row_is_not_a_stall(fake_smi, tmp_path):
    log = tmp_path / "calls.jsonl"
    with stream(
        interval=0.05, nvidia_smi=fake_smi(start_delay=2.0, log=log), stall_timeout=0.5, startup_timeout=60
    ) as s:
        sweeps = list(s.sweeps(count=2))
    assert len(sweeps) == 2
    assert s.stats.starts == 1 and s.stats.restarts == 0


def test_startup_timeout_bounds_a_child_that_never_starts(fake_smi):
    s = stream(
        interval=0.05,
        nvidia_smi=fake_smi(fault="hang"),
        startup_timeout=0.5,
        retry=RetryPolicy(max_attempts=2),
        sleep=lambda _t: None,
    )
    with no_leaks(), pytest.raises(errors.NvidiaSmiTimeoutError, match=r"no row within 0\.5 s of starting"):
        list(s)
    assert s.stats.starts == 2


# ---------------------------------------------------------------------------------- 11. GPUs dropping out


@pytest.mark.parametrize("message", [False, True], ids=["silent", "with-message"])
def test_gpu_that_drops_out_is_reported_lost_once(tmp_path, message):
    say = (
        'out("Unable to determine the device handle for GPU 00000000:03:00.0: GPU is lost. '
        'Reboot the system to recover this GPU")'
        if message
        else "pass"
    )
    smi = scripted_smi(
        tmp_path,
        f"""
        for _ in range(3):
            sweep([0, 1, 2, 3])
        while True:
            out("0, 40"); out("1, 41"); {say}; out("3, 43")
            time.sleep(DT)
        """,
    )
    events: list[StreamEvent] = []
    with stream(FIELDS, interval=0.05, nvidia_smi=smi, on_event=events.append) as s:
        sweeps = list(s.sweeps(count=8))
    lost = kinds(events, "gpu_lost")
    assert [e.gpu for e in lost] == [2]
    assert s.stats.lost_gpus == {2} and s.stats.gpu_lost_events == 1
    assert s.stats.dropped_rows == 0  # the message line is not a dropped data row
    assert s.stats.short_sweeps == 0  # the loss is counted once, as a loss
    assert all(sw.missing == {2} for sw in sweeps[3:])
    assert all(one_instant(sw) for sw in sweeps)


def test_gpu_that_comes_back_is_reported_back(tmp_path):
    smi = scripted_smi(
        tmp_path,
        """
        for _ in range(2):
            sweep([0, 1])
        for _ in range(3):
            sweep([0])
        while True:
            sweep([0, 1])
        """,
    )
    events: list[StreamEvent] = []
    with stream(FIELDS, interval=0.05, nvidia_smi=smi, on_event=events.append) as s:
        sweeps = list(s.sweeps(count=8))
    assert [e.kind for e in events if e.kind in ("gpu_lost", "gpu_back")] == ["gpu_lost", "gpu_back"]
    assert s.stats.lost_gpus == set()
    assert sweeps[-1].complete


# ----------------------------------------------------------------------------------- the one source type


def test_stream_is_a_sample_source(fake_smi):
    s = stream(nvidia_smi=fake_smi())
    try:
        assert isinstance(s, SampleSource)
    finally:
        s.close()


def test_subscribers_hear_events_and_can_leave(tmp_path):
    smi = scripted_smi(tmp_path, "sweep([0]); sweep([0]); sys.exit(255)")
    heard: list[str] = []
    s = stream(FIELDS, interval=0.05, nvidia_smi=smi, retry=RetryPolicy(backoff_initial=0.01))
    leave = s.subscribe(lambda e: heard.append(e.kind))
    with s:
        it = iter(s)
        for _ in range(3):
            next(it)
        leave()
        count = len(heard)
        for _ in range(4):
            next(it)
    assert "error" in heard and "restart" in heard
    assert len(heard) == count


def alive_fake(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE and "nvidia-smi" in " ".join(p.cmdline())
    except psutil.Error:
        return False  # it ended while we looked


def test_a_stream_never_has_two_children(fake_smi):
    seen: set[int] = set()
    with stream(
        interval=0.02, nvidia_smi=fake_smi(fault="crash-after:10"), retry=RetryPolicy(backoff_initial=0.01)
    ) as s:
        for _ in zip(range(80), s):
            kids = [p.pid for p in psutil.Process().children(recursive=True) if alive_fake(p)]
            assert len(kids) <= 1
            seen.update(kids)
    assert len(seen) >= 2


def test_stream_checks_its_arguments():
    with pytest.raises(ValueError, match="startup_timeout"):
        Stream(nvidia_smi=sys.executable, startup_timeout=0)
    with pytest.raises(ValueError, match="max_attempts"):
        Stream(nvidia_smi=sys.executable, retry=RetryPolicy(max_attempts=0))


def test_fail_fast_gives_up_at_start_but_not_once_rows_flowed(fake_smi, tmp_path):
    naps: list[float] = []
    s = stream(nvidia_smi=fake_smi(fault="version-mismatch"), retry=RetryPolicy(fail_fast=True), sleep=naps.append)
    with pytest.raises(errors.DriverVersionMismatchError):
        list(s)
    assert s.stats.starts == 1 and naps == []
    # once rows have flowed, the same fault is retried (a driver upgrade mid-run)
    smi = scripted_smi(
        tmp_path,
        """
        if starts() == 0:
            sweep([0]); sweep([0])
            out("Failed to initialize NVML: Driver/library version mismatch")
            sys.exit(18)
        while True:
            sweep([0])
        """,
    )
    with stream(FIELDS, interval=0.05, nvidia_smi=smi, retry=RetryPolicy(fail_fast=True), sleep=naps.append) as s:
        got = [x for _, x in zip(range(5), s)]
    assert len(got) == 5 and len(naps) == 1 and s.stats.errors["DriverVersionMismatchError"] == 1


def test_close_while_nvidia_smi_is_still_starting(fake_smi):
    with no_leaks(reap_timeout=5):
        s = stream(interval=0.05, nvidia_smi=fake_smi(start_delay=60, fault="ignore-term")).start()
        deadline = time.monotonic() + 30
        while s.child_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.child_pid is not None and s.stats.state == "starting"
        t0 = time.monotonic()
        s.close(timeout=3)
        assert time.monotonic() - t0 < 3 + 2
        assert not s.running and s.latest() == (None, None)
