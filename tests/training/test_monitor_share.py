"""The training monitor's process share (issue 15): the run's own part of each GPU's SM use, from one
``nvidia-smi pmon`` beside the query loop. The fake executable runs as a real child (the subject is the second
child, its pids and its reaping); ``SMIQUERY_FAKE_PMON_PROCS`` says which fake processes are the test's own
(``parent``: the process that started nvidia-smi, i.e. this test process)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable

import psutil
import pytest

from smiquery.training.epochs import own_pids
from smiquery.training.monitor import RunMonitor
from smiquery.training.outputs import JobMetrics
from smiquery.training.watch import watch
from tests.conftest import MakeFake
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

#: generous: pmon samples once a second at best, and the machine may be busy
DEADLINE = 60.0
OTHER = 1  # a pid that is never a descendant of the test process (init)


def pmon_children() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "pmon" in child.cmdline():
                out.append(child)
        except psutil.Error:
            pass
    return out


@pytest.fixture
def gpu0(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The run sees GPU 0 only (the fake has 8)."""
    monkeypatch.delenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", raising=False)
    return {"CUDA_VISIBLE_DEVICES": "0"}


def one_epoch(m: RunMonitor, *, until: Callable[[], bool]) -> dict[str, float]:
    """Epoch 0 spans at least one pmon sample for which ``until`` holds, and one step."""
    m.begin_epoch(0)
    wait_for(until, DEADLINE, f"a pmon sample (notes: {m.notes})")
    m.step()
    return m.end_epoch(0)


# ------------------------------------------------------------------------------------------------- the share


def test_a_gpu_only_the_run_uses_has_share_one_and_no_other_process(fake_smi: MakeFake, gpu0, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", f"0:parent:70:10,1:{OTHER}:90:10")  # GPU 1 is not watched
    with no_leaks(reap_timeout=5.0):
        m = RunMonitor(nvidia_smi=str(fake_smi()), interval=0.05, alerts=(), env=gpu0, process_share=True)
        with m:
            values = one_epoch(m, until=lambda: 0 in m.process_shares())
            assert 1 not in m.process_shares()
    assert values["gpu0_share"] == 1.0
    assert values["gpu0_other_processes"] == 0.0
    assert "gpu1_share" not in values
    assert not [n for n in m.notes if "another process" in n]


def test_another_process_on_my_gpu_lowers_the_share_is_noted_and_exported(fake_smi: MakeFake, gpu0, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", f"0:parent:60:10,0:{OTHER}:30:5")
    metrics = JobMetrics(metrics_port=0, metrics_addr="127.0.0.1")
    with no_leaks(reap_timeout=5.0):
        m = RunMonitor(
            nvidia_smi=str(fake_smi()),
            interval=0.05,
            alerts=(),
            env=gpu0,
            process_share=True,
            outputs=[metrics],
        )
        with m:
            values = one_epoch(m, until=lambda: 0 in m.process_shares() and bool(m.uuids()))
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10).read()
    assert values["gpu0_share"] == pytest.approx(60 / 90)
    assert values["gpu0_other_processes"] == 1.0
    said = [n for n in m.notes if "another process" in n]
    assert len(said) == 1 and "GPU 0" in said[0] and f"pid {OTHER}" in said[0] and "30% SM" in said[0]
    text = body.decode()
    uuid = m.uuids()[0]
    job = f'host="{metrics.host}",run="{metrics.run_id}"'
    assert f'smiquery_training_gpu_process_share{{{job},uuid="{uuid}"}} 0.666' in text
    assert f'smiquery_training_gpu_other_processes{{{job},uuid="{uuid}"}} 1.0' in text


def test_a_descendant_of_the_run_counts_as_the_run(fake_smi: MakeFake, gpu0, monkeypatch):
    # `self` is the pmon child itself: a child of this process, like a data-loader worker
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", f"0:self:40:5,0:parent:40:5,0:{OTHER}:20:5")
    with (
        no_leaks(reap_timeout=5.0),
        watch(nvidia_smi=str(fake_smi()), interval=0.05, alerts=(), env=gpu0, process_share=True) as w,
    ):
        w.step(epoch=0)
        assert wait_for(lambda: 0 in w.monitor.process_shares(), DEADLINE)
        values = w.end_epoch()
    assert values["gpu0_share"] == pytest.approx(80 / 100)
    assert values["gpu0_other_processes"] == 1.0


def test_without_process_share_there_is_no_pmon_and_no_share_key(fake_smi: MakeFake, gpu0, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", f"0:{OTHER}:30:5")
    with no_leaks(reap_timeout=5.0):
        m = RunMonitor(nvidia_smi=str(fake_smi()), interval=0.05, alerts=(), env=gpu0)
        with m:
            values = one_epoch(m, until=lambda: 0 in m.latest())
            assert pmon_children() == []
    assert not [k for k in values if "share" in k or "other_processes" in k]


# ----------------------------------------------------------------------------------------- failing pmon


def test_unsupported_pmon_leaves_nan_says_it_once_and_training_goes_on(fake_smi: MakeFake, gpu0, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    with no_leaks(reap_timeout=5.0):
        m = RunMonitor(nvidia_smi=str(fake_smi()), interval=0.05, alerts=(), env=gpu0, process_share=True)
        with m:
            first = one_epoch(m, until=lambda: any("not supported" in n for n in m.notes) and 0 in m.latest())
            m.begin_epoch(1)
            assert wait_for(lambda: m.running and len(m.latest()) > 0, DEADLINE)
            m.step()
            second = m.end_epoch(1)
            assert pmon_children() == []  # not restarted
    for values in (first, second):
        assert math.isnan(values["gpu0_share"]) and math.isnan(values["gpu0_other_processes"])
    assert not math.isnan(first["gpu0_util_mean"])  # the GPU numbers are not disturbed
    assert len([n for n in m.notes if "not supported" in n]) == 1
    assert m.totals.steps == 2


def test_the_pmon_child_is_gone_after_close_even_when_it_hangs(fake_smi: MakeFake, gpu0, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", "0:parent:50:5")
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_HANG_AFTER", "1")  # one sample, then silence with the child alive
    with no_leaks(reap_timeout=5.0):
        m = RunMonitor(nvidia_smi=str(fake_smi()), interval=0.05, alerts=(), env=gpu0, process_share=True)
        m.start()
        try:
            assert wait_for(lambda: len(pmon_children()) == 1, DEADLINE)
            pids = [p.pid for p in pmon_children()]
            for _ in range(100):  # steps go on while pmon says nothing
                m.step()
            assert m.totals.steps == 100
        finally:
            m.close()
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not m.running


# --------------------------------------------------------------------------------------------- own pids


def test_own_pids_are_this_process_and_its_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert own_pids([os.getpid(), child.pid, OTHER]) == {os.getpid(), child.pid}
        assert {os.getpid(), child.pid} <= own_pids()
    finally:
        child.kill()
        child.wait()


def test_without_procfs_only_this_process_is_the_run(tmp_path):
    missing = str(tmp_path / "no-proc")
    assert own_pids([os.getpid(), os.getppid()], root=missing) == {os.getpid()}
