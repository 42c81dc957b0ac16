"""smiquery.aio on the fake nvidia-smi: results like the sync API, restarts, and no child left behind by
cancellation at any await point or by asyncio.wait_for."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import smiquery
from smiquery import aio, errors, runner
from smiquery.retry import RetryPolicy
from smiquery.source import Sweep
from tests.conftest import MakeFake

FIXTURES = Path(__file__).parents[1] / "fixtures"
SWEEP = FIXTURES / "h100x8-590-sweep.csv"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SMIQUERY_FAKE_FAULT", "SMIQUERY_FAKE_RECORDING", "SMIQUERY_NVIDIA_SMI", "SMIQUERY_FAKE_SWEEP"):
        monkeypatch.delenv(var, raising=False)


def _pids(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [json.loads(line)["pid"] for line in log.read_text(encoding="utf-8").splitlines()]


def _gone(pid: int) -> bool:
    """True when ``pid`` is neither running nor a zombie (a zombie still answers signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_all_reaped(log: Path) -> None:
    assert aio.live_children() == []
    for pid in _pids(log):
        assert _gone(pid), f"child {pid} was left behind"


# ------------------------------------------------------------------------------------------------- query


def test_query_returns_what_the_sync_query_returns(fake_smi: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMIQUERY_FAKE_KEEP_TIME", "1")  # recorded timestamps, so both calls print the same
    fake = fake_smi(recording=SWEEP)
    mine = asyncio.run(aio.query("health", nvidia_smi=fake))
    theirs = smiquery.query("health", nvidia_smi=fake)
    assert [s.values() for s in mine] == [s.values() for s in theirs]
    assert len(mine) == 8


def test_query_raises_typed_errors(fake_smi: MakeFake) -> None:
    with pytest.raises(errors.DriverVersionMismatchError):
        asyncio.run(aio.query(nvidia_smi=fake_smi(fault="version-mismatch")))
    with pytest.raises(errors.InvalidFieldError):
        asyncio.run(aio.query("no.such.field", nvidia_smi=fake_smi()))


def test_query_times_out_and_reaps_a_hung_child(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="hang,ignore-term", log=log)
    with pytest.raises(errors.NvidiaSmiTimeoutError, match="did not answer within 1 s"):
        asyncio.run(aio.query(nvidia_smi=fake, timeout=1.0))
    assert len(_pids(log)) == 1
    _assert_all_reaped(log)


def test_query_under_wait_for_reaps_the_child(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="hang", log=log)

    async def main() -> None:
        await asyncio.wait_for(aio.query(nvidia_smi=fake, timeout=60), 1.0)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(main())
    _assert_all_reaped(log)


# ------------------------------------------------------------------------------------------------ stream


def test_stream_sweeps_match_the_recording(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(recording=SWEEP, log=log)

    async def main() -> list[Sweep]:
        async with aio.stream("health", interval=0.05, nvidia_smi=fake) as s:
            got = [sweep async for sweep in s.sweeps(count=3)]
            assert s.latest()[0] is got[-1]
            return got

    sweeps = asyncio.run(main())
    assert [len(s) for s in sweeps] == [8, 8, 8]
    assert [x.index for x in sweeps[0]] == list(range(8))
    assert len(_pids(log)) == 1  # one child for the whole stream
    _assert_all_reaped(log)


def test_stream_restarts_after_a_crash(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="crash-after:3", log=log)
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)

    async def main() -> aio.AsyncStream:
        async with aio.stream(interval=0.05, nvidia_smi=fake, sleep=nap, retry=RetryPolicy(backoff_initial=0.01)) as s:
            n = 0
            async for _ in s:
                assert len(aio.live_children()) <= 1
                n += 1
                if n == 8:
                    break
            return s

    s = asyncio.run(main())
    assert s.stats.restarts == 2 and s.stats.starts == 3
    # three rows do not make a child healthy (healthy_after): the backoff keeps growing, with jitter
    assert len(naps) == 2 and 0.01 <= naps[0] <= 0.02 and 0.02 <= naps[1] <= 0.03
    assert s.stats.errors and s.stats.last_error_type is not None
    _assert_all_reaped(log)


def test_stream_hang_is_a_timeout_and_a_restart(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="hang-after:2", log=log)

    async def nap(seconds: float) -> None:
        return None

    async def main() -> aio.AsyncStream:
        async with aio.stream(interval=0.05, nvidia_smi=fake, stall_timeout=1.0, sleep=nap) as s:
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    break
            return s

    t0 = time.monotonic()
    s = asyncio.run(main())
    assert s.stats.errors["NvidiaSmiTimeoutError"] == 1 and s.stats.restarts == 1
    # the hang came after the first rows: the 1 s stall deadline holds, not the 45 s start-up one (the watchdog
    # once slept on until the start-up deadline); generous for a busy machine
    assert time.monotonic() - t0 < 30
    _assert_all_reaped(log)


def test_a_slow_consumer_is_not_a_hung_child(fake_smi: MakeFake) -> None:
    """The stall deadline counts only while waiting for output, not while the consumer is busy."""
    fake = fake_smi()

    async def main() -> aio.AsyncStream:
        async with aio.stream(interval=0.05, nvidia_smi=fake, stall_timeout=0.5) as s:
            async for _ in s.sweeps(count=3):
                await asyncio.sleep(1.5)  # three times the stall timeout, between reads
            return s

    s = asyncio.run(main())
    assert s.stats.errors == {} and s.stats.restarts == 0


def test_permanent_error_raises_without_restarting_with_fail_fast(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="nvml-not-found", log=log)

    async def main() -> None:
        async with aio.stream(nvidia_smi=fake, retry=RetryPolicy(fail_fast=True)) as s:
            async for _ in s:
                pass

    with pytest.raises(errors.NvmlNotFoundError):
        asyncio.run(main())
    assert len(_pids(log)) == 1
    _assert_all_reaped(log)


def test_one_iteration_at_a_time(fake_smi: MakeFake) -> None:
    fake = fake_smi()

    async def main() -> None:
        async with aio.stream(interval=0.05, nvidia_smi=fake) as s:
            first = s.__aiter__()
            await first.__anext__()
            with pytest.raises(RuntimeError, match="one child per stream"):
                await s.__aiter__().__anext__()
            await first.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    assert aio.live_children() == []


# ------------------------------------------------------------------------------------------- cancellation


async def _consume(fake: Path, fault_sleep: asyncio.Event | None = None) -> None:
    async def nap(seconds: float) -> None:
        if fault_sleep is not None:
            fault_sleep.set()
        await asyncio.sleep(3600)

    async with aio.stream(interval=0.05, nvidia_smi=fake, sleep=nap, retry=RetryPolicy(backoff_initial=0.01)) as s:
        async for _ in s.sweeps():
            pass


@pytest.mark.parametrize("ticks", [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233])
def test_cancel_at_any_await_point_leaves_no_child(fake_smi: MakeFake, tmp_path: Path, ticks: int) -> None:
    """Cancel after a growing number of loop iterations: spawning, first line, mid-sweep, between sweeps."""
    log = tmp_path / "log.jsonl"
    fake = fake_smi(log=log)

    async def main() -> None:
        task = asyncio.create_task(_consume(fake))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _assert_all_reaped(log)


def test_cancel_while_reading_a_silent_child(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="hang-after:4,ignore-term", log=log)  # the child must be SIGKILLed

    async def main() -> None:
        task = asyncio.create_task(_consume(fake))
        for _ in range(2000):
            await asyncio.sleep(0.01)
            if _pids(log):
                break
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _pids(log)
    _assert_all_reaped(log)


def test_cancel_during_the_restart_backoff(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(fault="crash-after:2", log=log)

    async def main() -> None:
        sleeping = asyncio.Event()
        task = asyncio.create_task(_consume(fake, sleeping))
        await asyncio.wait_for(sleeping.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _assert_all_reaped(log)


@pytest.mark.parametrize("limit", [0.001, 0.05, 0.3, 1.0])
def test_stream_under_wait_for_leaves_no_child(fake_smi: MakeFake, tmp_path: Path, limit: float) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(log=log)
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(_consume(fake), limit))
    _assert_all_reaped(log)


def test_breaking_out_and_leaving_the_context_reaps(fake_smi: MakeFake, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    fake = fake_smi(log=log)

    async def main() -> Any:
        async with aio.stream(interval=0.05, nvidia_smi=fake) as s:
            async for sweep in s.sweeps():  # noqa: B007  (kept after the loop)
                break
        # the context closed the child although the generator was never closed by hand
        assert aio.live_children() == []
        return sweep

    assert len(asyncio.run(main())) == 8
    _assert_all_reaped(log)


# ---------------------------------------------------------------------------- parent death, exec failures

# The child falls silent after two sweeps but keeps running: a child that kept writing would die of a broken pipe
# once its parent died, with or without a parent-death signal, and prove nothing.
PARENT = """
import asyncio, sys
from smiquery import aio

async def main():
    async with aio.stream(interval=0.05, nvidia_smi=sys.argv[1], stall_timeout=600) as s:
        seen = 0
        async for _ in s.sweeps():  # the child lives while this iteration runs
            seen += 1
            if seen == 2:
                print(aio.live_children()[0], flush=True)  # it has written all it ever will
                await asyncio.sleep(600)

asyncio.run(main())
"""


def _wait_gone(pid: int, seconds: float) -> bool:
    """Poll until ``pid`` is gone or a zombie waiting for init; False when it still runs at the deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_stream_child_dies_with_its_parent(fake_smi: MakeFake, sig: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(fake_smi(recording=SWEEP, fault="hang-after:16,ignore-term"))],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.Process(child).is_running()
        parent.send_signal(sig)  # SIGTERM's default action ends Python without atexit handlers, like SIGKILL
        parent.wait(30)
        # the bound is 2 s; the deadline is generous for a busy machine (the signal itself is immediate)
        assert _wait_gone(child, 10), f"nvidia-smi {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()
        if child is not None and not _wait_gone(child, 0):  # a failed run leaves nothing behind
            psutil.Process(child).kill()


def test_a_stream_outlives_the_thread_that_started_it(fake_smi: MakeFake, tmp_path: Path) -> None:
    """The loop child is forked by the spawner thread, not the loop's: a loop thread ending does not kill it."""
    log = tmp_path / "log.jsonl"
    fake = fake_smi(log=log)
    loop = asyncio.new_event_loop()
    s = aio.stream(interval=0.05, nvidia_smi=fake)
    sweeps = s.sweeps()

    def step(count: int) -> None:
        for _ in range(count):
            loop.run_until_complete(sweeps.__anext__())

    first = threading.Thread(target=step, args=(1,))
    first.start()
    first.join()  # that thread is gone; the stream goes on in another one
    second = threading.Thread(target=step, args=(20,))
    second.start()
    second.join()
    try:
        assert s.stats.starts == 1 and s.stats.restarts == 0 and s.stats.errors == {}
        assert len(_pids(log)) == 1
    finally:
        loop.run_until_complete(sweeps.aclose())  # type: ignore[attr-defined]
        loop.run_until_complete(s.aclose())
        loop.close()
    _assert_all_reaped(log)


def _break(path: Path, how: str) -> str:
    """Make the binary at ``path`` unusable; returns the message expected from starting it."""
    if how == "missing":
        path.unlink()
        return "does not exist"
    if how == "permission":
        path.chmod(0o644)
        return "permission denied"
    path.write_bytes(b"\x00\x01 not a program\n")  # no #! line, no ELF header
    path.chmod(0o755)
    return "exec format error"


@pytest.mark.skipif(os.name == "nt", reason="POSIX exec errors")
@pytest.mark.parametrize("how", ["missing", "permission", "format"])
def test_stream_of_a_binary_that_cannot_start_raises_the_typed_error(fake_smi: MakeFake, how: str) -> None:
    fake = fake_smi()
    s = aio.stream(interval=0.05, nvidia_smi=fake, retry=RetryPolicy(fail_fast=True))  # the path is resolved here
    expected = _break(fake, how)

    async def main() -> None:
        async with s:
            async for _ in s:
                pass

    with pytest.raises(errors.NvidiaSmiNotFoundError, match=expected) as caught:
        asyncio.run(main())
    assert str(fake) in str(caught.value) and "\n" not in str(caught.value)
    assert s.stats.starts == 1
    assert aio.live_children() == [] and runner.live_children() == []


@pytest.mark.skipif(os.name == "nt", reason="POSIX exec errors")
def test_query_of_a_binary_that_cannot_start_raises_the_typed_error(fake_smi: MakeFake) -> None:
    fake = fake_smi()
    expected = _break(fake, "format")
    with pytest.raises(errors.NvidiaSmiNotFoundError, match=expected):
        asyncio.run(aio.query(nvidia_smi=fake))
    assert aio.live_children() == []
