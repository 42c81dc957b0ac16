"""One retry policy for every long-lived source: pmon and asyncio streams behave as the CSV stream does.

Real fake ``nvidia-smi`` processes; the wait between attempts is an injected sleep that records the delay and
returns at once, so delays are asserted without waiting for them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from smiquery import aio, errors
from smiquery.retry import FAIL_FAST_ATTEMPTS, RetryPolicy
from smiquery.runner import live_children
from smiquery.source import StreamEvent, StreamStats
from smiquery.sources.pmon import PmonRow
from smiquery.streams import pmon
from tests.conftest import MakeFake


@pytest.fixture(autouse=True)
def _no_fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SMIQUERY_FAKE_PMON", "SMIQUERY_FAKE_PMON_UNSUPPORTED", "SMIQUERY_FAKE_FAULT", "SMIQUERY_NVIDIA_SMI"):
        monkeypatch.delenv(var, raising=False)


def _grows_capped_and_jittered(naps: list[float], initial: float, cap: float) -> None:
    """Each delay lies in [initial * 2**k, initial * 2**k + initial], capped; not all on the exact doubling."""
    exact = [min(initial * 2**k, cap) for k in range(len(naps))]
    for nap, low in zip(naps, exact):
        assert low <= nap <= min(low + initial, cap) + 1e-9, (naps, exact)
    assert max(naps) <= cap
    assert naps != exact  # jitter: a fleet's restarts do not line up


# ---------------------------------------------------------------------------------------------- the policy


def test_policy_checks_its_settings() -> None:
    for bad in ({"permanent_retry": 0}, {"max_attempts": 0}, {"backoff_initial": -1}, {"max_restarts": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_policy_delays_and_when_it_gives_up() -> None:
    transient = errors.NvidiaSmiTimeoutError("hung", argv=("nvidia-smi",), timeout=1.0)
    permanent = errors.NvmlNotFoundError(("nvidia-smi",), 12, "couldn't find libnvidia-ml.so")
    policy = RetryPolicy(backoff_initial=1.0, backoff_max=5.0, jitter=False, permanent_retry=40)
    assert [policy.delay(transient, n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert policy.delay(permanent, 1) == policy.delay(permanent, 9) == 40
    fresh = StreamStats()
    assert not policy.gives_up(permanent, 50, fresh)  # a long-lived source never gives up by default
    assert RetryPolicy(fail_fast=True).gives_up(permanent, 1, fresh)
    assert not RetryPolicy(fail_fast=True).gives_up(transient, FAIL_FAST_ATTEMPTS - 1, fresh)
    assert RetryPolicy(fail_fast=True).gives_up(transient, FAIL_FAST_ATTEMPTS, fresh)
    assert not RetryPolicy(fail_fast=True).gives_up(permanent, 1, StreamStats(rows=3))  # rows flowed: retry
    assert RetryPolicy(permanent_retry=None).gives_up(permanent, 1, fresh)


# ------------------------------------------------------------------------------------------------------ pmon


def test_pmon_crashing_child_backs_off_growing_capped_and_jittered(fake_smi: MakeFake) -> None:
    naps: list[float] = []
    attempts: list[tuple[str, int, str | None, float | None]] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        s = p.stats
        ahead = None if s.next_retry_at is None else s.next_retry_at - time.time()
        attempts.append((s.state, s.attempt, s.last_error_type, ahead))

    p = pmon.stream(
        nvidia_smi=fake_smi(fault="unknown-error"),
        retry=RetryPolicy(backoff_initial=0.1, backoff_max=0.5, max_restarts=6),
        sleep=nap,
    )
    with p, pytest.raises(errors.NvidiaSmiFailedError, match="Unknown Error"):
        list(p)
    assert p.stats.starts == 7 and p.stats.restarts == 6 and p.stats.state == "failed"
    _grows_capped_and_jittered(naps, 0.1, 0.5)
    assert [a[:3] for a in attempts] == [("retrying", n, "NvidiaSmiFailedError") for n in range(1, 7)]
    for (_, _, _, ahead), nap_s in zip(attempts, naps):
        assert ahead is not None and ahead <= nap_s + 0.01  # next_retry_at is when the wait ends
    assert p.error is not None and p.stats.last_error is not None and "Unknown Error" in p.stats.last_error
    assert live_children() == []


def test_pmon_backoff_resets_after_healthy_after_not_after_one_row(fake_smi: MakeFake) -> None:
    naps: list[float] = []
    smi = fake_smi(fault="crash-after:2")
    with pmon.stream(
        nvidia_smi=smi, sleep=naps.append, retry=RetryPolicy(backoff_initial=0.01, healthy_after=3600)
    ) as p:
        for _ in zip(range(12), p):
            pass
    assert len(naps) >= 4 and naps == sorted(naps) and naps[3] >= 0.08  # rows alone do not reset it
    naps.clear()
    with pmon.stream(
        nvidia_smi=smi, sleep=naps.append, retry=RetryPolicy(backoff_initial=0.01, healthy_after=0.0)
    ) as p:
        for _ in zip(range(12), p):
            pass
    assert p.stats.restarts >= 4
    assert naps == []  # each failure came after a healthy period: restarted at once, a fresh streak
    assert live_children() == []


def test_pmon_unsupported_is_retried_slowly_and_recovers(fake_smi: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    naps: list[float] = []
    states: list[tuple[str, bool, str | None, int]] = []
    events: list[StreamEvent] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        states.append((p.stats.state, p.stats.permanent, p.stats.last_error_type, p.stats.attempt))
        if len(naps) == 2:  # the cause is fixed (a driver that supports pmon)
            monkeypatch.delenv("SMIQUERY_FAKE_PMON_UNSUPPORTED")

    p = pmon.stream(nvidia_smi=fake_smi(), retry=RetryPolicy(permanent_retry=40), sleep=nap, on_event=events.append)
    with p:
        instants = list(zip(range(2), p.samples()))
    assert len(instants) == 2 and all(len(i) == 4 for _, i in instants)
    assert len(naps) == 2 and all(36 <= n <= 44 for n in naps)  # the slow cadence, with jitter
    assert states == [("retrying", True, "NotSupportedError", 1), ("retrying", True, "NotSupportedError", 2)]
    assert p.stats.errors["NotSupportedError"] == 2
    assert any(e.kind == "recovered" for e in events)
    assert p.stats.permanent is False and p.stats.attempt == 0 and p.stats.next_retry_at is None
    assert live_children() == []


def test_pmon_fail_fast_raises_the_typed_error_at_once(fake_smi: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    naps: list[float] = []
    p = pmon.stream(nvidia_smi=fake_smi(), retry=RetryPolicy(fail_fast=True), sleep=naps.append)
    with p, pytest.raises(errors.NotSupportedError):
        list(p)
    assert p.stats.starts == 1 and naps == [] and p.stats.state == "failed"
    # a transient fault gets a few starts before the first row, then its typed error
    p = pmon.stream(nvidia_smi=fake_smi(fault="unknown-error"), retry=RetryPolicy(fail_fast=True), sleep=naps.append)
    with p, pytest.raises(errors.NvidiaSmiFailedError, match="Unknown Error"):
        list(p)
    assert p.stats.starts == FAIL_FAST_ATTEMPTS
    assert live_children() == []


def test_pmon_close_during_a_slow_retry_ends_the_stream(fake_smi: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    p = pmon.stream(nvidia_smi=fake_smi(), retry=RetryPolicy(permanent_retry=3600))
    done = threading.Event()
    rows: list[PmonRow] = []

    def consume() -> None:
        rows.extend(p)
        done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while p.stats.state != "retrying" and time.monotonic() < deadline:
        done.wait(0.05)
    assert p.stats.state == "retrying" and p.stats.next_retry_at is not None
    p.close()
    assert done.wait(60), "the stream kept waiting an hour after close()"
    assert rows == [] and p.stats.state == "closed" and p.stats.next_retry_at is None
    assert live_children() == []


# ---------------------------------------------------------------------------------------------------- asyncio


def _naps() -> tuple[list[float], object]:
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)

    return naps, nap


def test_aio_crashing_child_backs_off_growing_capped_and_jittered(fake_smi: MakeFake) -> None:
    naps, nap = _naps()

    async def main() -> aio.AsyncStream:
        s = aio.stream(
            interval=0.05,
            nvidia_smi=fake_smi(fault="unknown-error"),
            sleep=nap,  # type: ignore[arg-type]
            retry=RetryPolicy(backoff_initial=0.1, backoff_max=0.5, max_restarts=6),
        )
        async with s:
            with pytest.raises(errors.NvidiaSmiFailedError, match="Unknown Error"):
                async for _ in s:
                    pass
        return s

    s = asyncio.run(main())
    assert s.stats.starts == 7 and s.stats.restarts == 6 and s.stats.state == "failed"
    assert s.error is not None and s.stats.last_error_type == "NvidiaSmiFailedError"
    _grows_capped_and_jittered(naps, 0.1, 0.5)
    assert aio.live_children() == []


def test_aio_backoff_resets_after_healthy_after_not_after_one_row(fake_smi: MakeFake) -> None:
    smi = fake_smi(fault="crash-after:3")

    async def run(healthy_after: float) -> tuple[list[float], aio.AsyncStream]:
        naps, nap = _naps()
        async with aio.stream(
            interval=0.05,
            nvidia_smi=smi,
            sleep=nap,  # type: ignore[arg-type]
            retry=RetryPolicy(backoff_initial=0.01, healthy_after=healthy_after),
        ) as s:
            n = 0
            async for _ in s:
                n += 1
                if n == 20:
                    break
        return naps, s

    naps, _ = asyncio.run(run(3600))
    assert len(naps) >= 4 and naps == sorted(naps) and naps[3] >= 0.08  # rows alone do not reset it
    naps, s = asyncio.run(run(0.0))
    assert s.stats.restarts >= 4 and naps == []  # failures after a healthy period: restarted at once
    assert aio.live_children() == []


def test_aio_permanent_error_is_retried_slowly_and_recovers(fake_smi: MakeFake) -> None:
    smi = fake_smi(fault="version-mismatch")
    naps: list[float] = []
    states: list[tuple[str, bool, str | None, bool]] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)
        ahead = s.stats.next_retry_at is not None and s.stats.next_retry_at > time.time() + 30
        states.append((s.stats.state, s.stats.permanent, s.stats.last_error_type, ahead))
        if len(naps) == 2:  # the node rebooted into the new driver
            smi.write_text(fake_smi(fault=None).read_text())

    s = aio.stream(interval=0.05, nvidia_smi=smi, retry=RetryPolicy(permanent_retry=40), sleep=nap)

    async def main() -> list[int]:
        async with s:
            sweeps = [len(sw) async for sw in s.sweeps(count=2)]
        return sweeps

    assert asyncio.run(main()) == [8, 8]
    assert len(naps) == 2 and all(36 <= n <= 44 for n in naps)
    assert states == [("retrying", True, "DriverVersionMismatchError", True)] * 2
    assert s.stats.errors["DriverVersionMismatchError"] == 2 and s.stats.permanent is False
    assert aio.live_children() == []


def test_aio_fail_fast_raises_the_typed_error_and_one_shot_query_too(fake_smi: MakeFake, tmp_path: Path) -> None:
    smi = fake_smi(fault="version-mismatch")
    naps, nap = _naps()

    async def main() -> aio.AsyncStream:
        s = aio.stream(nvidia_smi=smi, retry=RetryPolicy(fail_fast=True), sleep=nap)  # type: ignore[arg-type]
        async with s:
            with pytest.raises(errors.DriverVersionMismatchError):
                async for _ in s:
                    pass
        with pytest.raises(errors.DriverVersionMismatchError):
            await aio.query(nvidia_smi=smi)
        return s

    s = asyncio.run(main())
    assert s.stats.starts == 1 and naps == [] and s.stats.state == "failed"
    assert aio.live_children() == []
