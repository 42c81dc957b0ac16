"""Energy per epoch: integrated over nvidia-smi's timestamps and pro-rated at epoch boundaries.

The live tests compare each epoch's ``gpuN_energy_wh`` with a hand integral (trapezoids, linear interpolation at the
epoch's ends) of the power the same run recorded, epoch 0 included, at 1 s and 0.2 s sampling.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from smiquery.recordings import read_recording
from smiquery.training.epochs import BETWEEN, EnergySplitter
from smiquery.training.monitor import RunMonitor
from smiquery.training.outputs import Recording
from smiquery.training.watch import watch
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

# ------------------------------------------------------------------------------------------- the splitter


def test_an_interval_that_spans_an_epoch_boundary_is_shared_by_time():
    e = EnergySplitter(1.0)
    e.mark(100.0, 0)
    assert e.sample(0, 100.5, 200.0, None) == []  # the first sample measures nothing yet
    assert e.sample(0, 101.5, 200.0, None) == [(0, pytest.approx(200.0))]
    e.mark(101.75, BETWEEN)
    e.mark(101.9, 1)
    parts = e.sample(0, 102.5, 100.0, 0)
    # 0.25 s to epoch 0, 0.15 s between epochs (the run's total only), 0.6 s to epoch 1
    assert parts == [(0, pytest.approx(25.0)), (BETWEEN, pytest.approx(15.0)), (1, pytest.approx(60.0))]


def test_the_end_of_an_epoch_takes_its_tail_and_the_next_sample_only_the_rest():
    e = EnergySplitter(1.0)
    e.mark(0.0, 0)
    e.sample(0, 0.2, 100.0, 0)
    e.sample(0, 1.2, 100.0, 0)
    # the epoch ends at 1.6 s: the sample covering 1.2-1.6 s has not come yet, the newest power stands for it
    assert e.tail(0, 1.6, 0) == [(0, pytest.approx(40.0))]
    e.mark(1.6, BETWEEN)
    e.mark(1.7, 1)
    assert e.sample(0, 2.2, 100.0, 1) == [(BETWEEN, pytest.approx(10.0)), (1, pytest.approx(50.0))]


def test_a_sample_taken_before_the_end_and_delivered_after_it_is_not_counted_twice():
    e = EnergySplitter(1.0)
    e.mark(0.0, 0)
    e.sample(0, 0.0, 100.0, 0)
    assert e.tail(0, 1.5, 0) == [(0, pytest.approx(150.0))]
    e.mark(1.5, 1)
    assert e.sample(0, 1.0, 100.0, 1) == []  # stamped 1.0 s, already credited up to 1.5 s
    assert e.sample(0, 2.0, 100.0, 1) == [(1, pytest.approx(50.0))]


def test_two_sweeps_delivered_together_are_still_an_interval_apart():
    # energy goes by nvidia-smi's timestamps, not by when the sweeps arrived (the first epoch lost its first
    # interval when two sweeps came in one read)
    e = EnergySplitter(1.0)
    e.mark(0.0, 0)
    got = e.sample(0, 0.0, 300.0, 0) + e.sample(0, 1.0, 300.0, 0)
    assert got == [(0, pytest.approx(300.0))]


def test_an_epoch_end_credit_does_not_swallow_samples_after_nvidia_smis_clock_stepped_back():
    e = EnergySplitter(1.0)
    e.sample(0, 3600.0, 100.0, 0)
    e.tail(0, 3600.5, 0)
    e.sample(0, 0.0, 100.0, 0)  # an hour back (a DST fall-back in nvidia-smi's local time)
    assert e.sample(0, 1.0, 100.0, 0) == [(0, pytest.approx(100.0))]


def test_a_clock_step_back_counts_nothing_and_a_jump_one_interval():
    e = EnergySplitter(1.0)
    e.sample(0, 10.0, 100.0, 0)
    assert e.sample(0, 9.0, 100.0, 0) == []
    assert e.sample(0, 3600.0, 100.0, 0) == [(0, pytest.approx(100.0))]


# ------------------------------------------------------------------------------------------ a live run


def _hand_integral_wh(path: Path, gpu: int, start: float, end: float) -> float:
    """Trapezoids of the recorded power of ``gpu`` between ``start`` and ``end`` (wall seconds), in Wh."""
    df = read_recording(path)
    rows = df[df["index"] == gpu]
    ts = [t.to_pydatetime().timestamp() for t in rows["timestamp"]]
    watts = [float(w) for w in rows["power_draw"]]

    def at(t: float) -> float:
        for (t0, w0), (t1, w1) in itertools.pairwise(zip(ts, watts, strict=True)):
            if t0 <= t <= t1:
                return w0 + (w1 - w0) * (t - t0) / (t1 - t0) if t1 > t0 else w1
        raise AssertionError(f"no recorded power around {t}")

    points = [(start, at(start))] + [(t, w) for t, w in zip(ts, watts, strict=True) if start < t < end]
    points.append((end, at(end)))
    joules = sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(points))
    return joules / 3600.0


@pytest.mark.parametrize(("interval", "epoch_s"), [(1.0, 5.0), (0.2, 1.5)])
def test_each_epochs_energy_is_within_5_percent_of_the_hand_integral(inproc, tmp_path, interval, epoch_s):
    path = tmp_path / "run.csv"
    spans: list[tuple[float, float]] = []
    logs: list[dict[str, float]] = []
    with no_leaks(reap_timeout=5.0):
        monitor = RunMonitor(interval=interval, alerts=(), gpus=[0, 1], outputs=[Recording(path)]).start()
        try:
            assert wait_for(lambda: len(monitor.latest()) == 2)
            for epoch in range(3):
                began = time.time()
                monitor.begin_epoch(epoch)
                time.sleep(epoch_s)
                ended = time.time()
                logs.append(monitor.end_epoch(epoch))
                spans.append((began, ended))
                time.sleep(interval * 0.3)  # some time between epochs (validation), in no epoch's figure
            # the recording must cover the last epoch's end for the hand integral
            assert wait_for(lambda: all(s.timestamp.timestamp() > spans[-1][1] for s in monitor.latest().values()))
        finally:
            monitor.close()
    df = read_recording(path)
    first = {g: min(t.to_pydatetime().timestamp() for t in df[df["index"] == g]["timestamp"]) for g in (0, 1)}
    for epoch, ((began, ended), values) in enumerate(zip(spans, logs, strict=True)):
        for gpu in (0, 1):
            # epoch 0 runs from the GPU's first sample (nothing is measured before it; the setup before the first
            # epoch began counts in epoch 0); the others from their beginning
            hand = _hand_integral_wh(path, gpu, first[gpu] if epoch == 0 else began, ended)
            got = values[f"gpu{gpu}_energy_wh"]
            assert got == pytest.approx(hand, rel=0.05), (epoch, gpu, got, hand)
        assert values["energy_wh"] == pytest.approx(values["gpu0_energy_wh"] + values["gpu1_energy_wh"])


# ------------------------------------------------------------------------------ the time before the first sample


def test_the_first_sample_holds_its_power_back_to_the_runs_start():
    e = EnergySplitter(1.0, 100.0)
    e.mark(100.1, 0)
    # nvidia-smi's first sample comes 0.5 s after the run began: its power stands for the time before it
    assert e.sample(0, 100.5, 200.0, 0) == [(None, pytest.approx(20.0)), (0, pytest.approx(80.0))]
    assert e.held == {None: pytest.approx(0.1), 0: pytest.approx(0.4)}
    assert e.sample(0, 101.5, 200.0, 0) == [(0, pytest.approx(200.0))]
    assert e.held == {None: pytest.approx(0.1), 0: pytest.approx(0.4)}  # only the first sample is held back


def _constant_power(path: Path, watts: float) -> Path:
    head = "timestamp, index, uuid, name, temperature.gpu, utilization.gpu [%], memory.used [MiB], power.draw [W]"
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    row = f"2026/03/14 09:30:00.000, 0, {uuid}, NVIDIA H100, 60, 95 %, 2000 MiB, {watts} W"
    path.write_text(f"{head}\n{row}\n", encoding="utf-8")
    return path


def test_every_epoch_of_a_plain_loop_counts_its_whole_time_epoch_0_included(inproc, tmp_path):
    # nvidia-smi's first sample comes half a second after watch() returned (a real one takes that long to start):
    # epoch 0 lost that half second (-12.7 % at 3 s epochs) while epochs 1 and 2 were within 1 %
    watts = 312.45
    inproc.recording = _constant_power(tmp_path / "constant.csv", watts)
    inproc.start_delay = 0.5
    spans: list[tuple[float, float]] = []
    with no_leaks(reap_timeout=5.0):
        began = time.time()
        with watch(interval=1.0, alerts=(), gpus=[0], nvidia_smi="/opt/fake-driver/bin/nvidia-smi") as w:
            for epoch in range(3):
                for batch in range(10):
                    time.sleep(0.25)  # the batch's work
                    if batch == 0 and epoch > 0:
                        began = time.time()  # the epoch begins at its first step (the batch before is the last one's)
                    w.step(epoch=epoch, batch=batch)
                ended = time.time()
                w.end_epoch()
                spans.append((began, ended))
    assert len(w.epochs) == 3
    for epoch, ((start, end), values) in enumerate(zip(spans, w.epochs, strict=True)):
        expected = watts * (end - start) / 3600.0
        assert values["gpu0_energy_wh"] == pytest.approx(expected, rel=0.05), (epoch, values, expected)
    # the estimate is said: epoch 0's record tells how long the first sample's power stood for
    assert w.epochs[0]["energy_held_back_s"] == pytest.approx(0.5, abs=0.4)
    assert "energy_held_back_s" not in w.epochs[1]
