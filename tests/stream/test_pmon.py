"""The supervised ``nvidia-smi pmon`` stream on the fake: instants, restarts, backoff, hangs, close, a real capture."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from smiquery import errors
from smiquery.retry import RetryPolicy
from smiquery.runner import live_children
from smiquery.sources.pmon import PmonRow
from smiquery.streams.pmon import stream
from tests.conftest import MakeFake
from tests.sources.test_pmon import _corpus_sections


@pytest.fixture(autouse=True)
def _no_fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SMIQUERY_FAKE_PMON", "SMIQUERY_FAKE_FAULT", "SMIQUERY_NVIDIA_SMI"):
        monkeypatch.delenv(var, raising=False)


def test_stream_with_count_yields_typed_instants_and_ends(fake_smi: MakeFake) -> None:
    with stream(nvidia_smi=fake_smi(), count=2) as p:
        instants = list(p.samples())
    assert len(instants) == 2
    assert [len(i) for i in instants] == [4, 4]  # pmon watches at most four GPUs
    row = instants[0][0]
    assert isinstance(row.pid, int) and isinstance(row.sm, int) and row.fb is not None and row.command == "python3.11"
    assert row.timestamp is not None
    assert p.stats.starts == 1 and p.stats.restarts == 0 and p.stats.state == "ended"
    assert live_children() == []


def test_idle_gpus_print_one_line_each(fake_smi: MakeFake) -> None:
    with stream(nvidia_smi=fake_smi(apps=""), count=1, gpus=[0, 1]) as p:
        rows = list(p)
    assert [(r.gpu, r.idle) for r in rows] == [(0, True), (1, True)]


def test_stream_restarts_after_a_crash_and_keeps_one_child(fake_smi: MakeFake) -> None:
    naps: list[float] = []
    seen_children: set[int] = set()
    with stream(
        nvidia_smi=fake_smi(fault="crash-after:3"), sleep=naps.append, retry=RetryPolicy(backoff_initial=0.01)
    ) as p:
        rows = []
        for row in p:
            seen_children.update(live_children())
            assert len(live_children()) <= 1
            rows.append(row)
            if len(rows) == 10:
                break
    assert p.stats.restarts >= 3 and p.stats.starts == p.stats.restarts + 1
    # a few rows do not make a child healthy (healthy_after): the backoff keeps growing, with jitter
    assert 0.01 <= naps[0] <= 0.02 and 0.02 <= naps[1] <= 0.03 and 0.04 <= naps[2] <= 0.05
    assert p.stats.last_error_type is not None
    assert live_children() == []


def test_failing_starts_back_off_exponentially_then_give_up(fake_smi: MakeFake) -> None:
    naps: list[float] = []
    p = stream(
        nvidia_smi=fake_smi(fault="unknown-error"),
        sleep=naps.append,
        retry=RetryPolicy(backoff_initial=0.01, max_restarts=3),
    )
    with p, pytest.raises(errors.NvidiaSmiFailedError, match="Unknown Error"):
        list(p)
    assert len(naps) == 3 and all(low <= n <= low + 0.01 for n, low in zip(naps, [0.01, 0.02, 0.04]))
    assert p.stats.starts == 4 and p.stats.state == "failed"
    assert live_children() == []


def test_hung_pmon_is_killed_and_restarted(fake_smi: MakeFake) -> None:
    with stream(nvidia_smi=fake_smi(fault="hang-after:2"), stall_timeout=1.0, sleep=lambda s: None) as p:
        rows = []
        for row in p:
            rows.append(row)
            if len(rows) == 3:
                break
    assert p.stats.errors["NvidiaSmiTimeoutError"] >= 1 and p.stats.restarts >= 1
    assert live_children() == []


def test_permanent_error_raises_at_once_with_fail_fast(fake_smi: MakeFake) -> None:
    with (
        stream(
            nvidia_smi=fake_smi(fault="nvml-not-found"), sleep=lambda s: None, retry=RetryPolicy(fail_fast=True)
        ) as p,
        pytest.raises(errors.NvmlNotFoundError),
    ):
        list(p)
    assert p.stats.starts == 1 and p.stats.state == "failed"
    assert live_children() == []


def test_close_from_another_thread_stops_a_blocked_reader(fake_smi: MakeFake) -> None:
    p = stream(nvidia_smi=fake_smi(), interval=10)
    got = threading.Event()
    done = threading.Event()
    rows: list[PmonRow] = []

    def read() -> None:
        for row in p:
            rows.append(row)
            got.set()
        done.set()

    t = threading.Thread(target=read)
    t.start()
    assert got.wait(30)
    p.close()
    assert done.wait(30)
    t.join(30)
    assert live_children() == []


def test_replays_a_real_capture_through_the_stream(
    fake_smi: MakeFake, corpus_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    body = next(b for n, p, b in _corpus_sections(corpus_dir) if "h100-80gb" in n and p == "load")
    capture = tmp_path / "pmon.txt"
    capture.write_text("\n".join(body) + "\n", encoding="utf-8")
    monkeypatch.setenv("SMIQUERY_FAKE_PMON", str(capture))
    with stream(nvidia_smi=fake_smi(), count=5) as p:
        instants = list(p.samples())
    assert len(instants) == 5
    assert all(len(i) == 3 for i in instants)
