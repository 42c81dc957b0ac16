"""GpuMonitor in a real model.fit (Keras 3, TensorFlow CPU backend) against a fake nvidia-smi: a hot GPU and a stall.

Most fits run against the in-process fake (`smi`: `use_runner(InProcessRunner)`, same output, log and faults, no
process); the tests about the nvidia-smi child itself (one child per fit, reaped when fit raises) use the fake
executable (`real_smi`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from smiquery.runner import SubprocessRunner
from smiquery.testing import InProcessRunner, use_runner
from tests.conftest import MakeFake
from tests.helpers import wait_for
from tests.leakcheck import no_leaks, wait_no_children

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

try:
    import keras
    import numpy as np
except ImportError:  # pragma: no cover - the keras extra is installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("keras is not installed: pip install 'smiquery[keras]'", allow_module_level=True)

from smiquery.alerts import CallbackHandler
from smiquery.training.keras import GpuMonitor
from smiquery.training.memory import MemoryView, TensorFlowMemory
from smiquery.training.monitor import TrainingAlert

pytestmark = pytest.mark.slow

UUIDS = ("GPU-00000000-1111-2222-3333-444444444444", "GPU-00000001-1111-2222-3333-444444444444")
SWEEPS = 40
STALL = range(10, 30)  # sweeps with GPU utilization at 5%
INTERVAL = 0.05
BATCHES = 10  # per epoch
BATCH_SLEEP = 0.05  # seconds per batch: an epoch spans about ten samples


def write_recording(path: Path) -> Path:
    """Two GPUs: GPU 1 at 88 C throughout (with thermal slowdown), both stalled at 5% for sweeps 10-29."""
    head = (
        "timestamp, index, uuid, temperature.gpu, utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
        "power.draw [W], clocks_event_reasons.hw_thermal_slowdown"
    )
    lines = [head]
    for t in range(SWEEPS):
        for g in range(2):
            temp = 88 if g == 1 else 60
            util = 5 if t in STALL else 95
            slow = "Active" if g == 1 else "Not Active"
            stamp = f"2026/03/14 09:30:{t:02d}.000"
            lines.append(
                f"{stamp}, {g}, {UUIDS[g]}, {temp}, {util} %, {2000 + t} MiB, 81559 MiB, {300 + g}.50 W, {slow}"
            )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: The nvidia-smi the in-process tests name; the in-process fake looks nothing up.
FAKE_PATH = "/opt/fake-driver/bin/nvidia-smi"


@pytest.fixture
def smi(inproc: InProcessRunner, tmp_path: Path) -> str:
    """The in-process fake replaying the hot-and-stall recording, logging its calls to ``calls.jsonl``."""
    inproc.recording = write_recording(tmp_path / "hot-and-stall.csv")
    inproc.log = tmp_path / "calls.jsonl"
    return FAKE_PATH


@pytest.fixture
def real_smi(fake_smi: MakeFake, tmp_path: Path) -> Path:
    """The fake executable (a real child process) replaying the same recording, logging to ``calls.jsonl``."""
    rec = write_recording(tmp_path / "hot-and-stall.csv")
    return fake_smi(recording=rec, log=tmp_path / "calls.jsonl")


@pytest.fixture(autouse=True)
def _all_gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


class Slow(keras.callbacks.Callback):  # type: ignore[misc]
    """Stretches each batch so that an epoch spans several samples (a tiny model trains too fast otherwise)."""

    def __init__(self, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.epoch = 0
        self.batch_logs: list[dict[str, Any]] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batch_logs.append(dict(logs or {}))
        time.sleep(BATCH_SLEEP)
        if self.fail_at == (self.epoch, batch):
            raise RuntimeError("boom in the middle of an epoch")


def tiny_model(lr: float = 0.01) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(lr), "mse")
    return model


def data() -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    return rng.random((BATCHES * 8, 4), dtype=np.float32), rng.random((BATCHES * 8, 1), dtype=np.float32)


def fit(model: Any, callbacks: list[Any], epochs: int = 3) -> Any:
    x, y = data()
    return model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)


KEYS = [
    f"gpu{g}_{k}" for g in (0, 1) for k in ("util_mean", "util_max", "temp_max", "mem_used_max_mib", "power_mean_w")
]


# ------------------------------------------------------------------------------------------------- model.fit


def test_epoch_logs_history_and_csvlogger_get_the_gpu_numbers(smi, inproc, tmp_path):
    inproc.env["SMIQUERY_FAKE_SWEEP"] = "5"  # the fake's loop starts 5 sweeps before the stall
    csv_path = tmp_path / "train.csv"
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
    with no_leaks():
        history = fit(tiny_model(), [monitor, Slow(), keras.callbacks.CSVLogger(str(csv_path))])
    for key in KEYS:
        assert key in history.history, key
        assert len(history.history[key]) == 3
    h = history.history
    assert h["gpu1_temp_max"] == [88.0, 88.0, 88.0]
    assert h["gpu0_temp_max"] == [60.0, 60.0, 60.0]
    assert all(5.0 <= v <= 95.0 for v in h["gpu0_util_mean"])
    assert all(v == pytest.approx(301.5) for v in h["gpu1_power_mean_w"])
    assert all(2000 <= v < 2000 + SWEEPS for v in h["gpu0_mem_used_max_mib"])
    # the stall (sweeps 10-29 at 5%) lowers the mean utilization of some epoch
    assert min(h["gpu0_util_mean"]) < 90
    header = csv_path.read_text().splitlines()[0].split(",")
    for key in KEYS:
        assert key in header
    assert len(csv_path.read_text().splitlines()) == 4  # header and three epochs
    job_keys = {"gpu0_energy_wh", "energy_wh", "steps_per_joule", "samples_per_joule"}
    assert set(KEYS) | job_keys <= monitor.epochs[0].keys()
    assert all(v > 0 for v in h["energy_wh"])
    # fit's batch_size gives the samples: 10 steps of 8 per epoch
    assert monitor.monitor.totals.steps == 3 * BATCHES and monitor.monitor.totals.samples == 3 * BATCHES * 8


def test_one_nvidia_smi_child_for_the_whole_fit_and_none_after(real_smi, tmp_path):
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(real_smi))
    with no_leaks():
        fit(tiny_model(), [monitor, Slow()])
        assert not wait_no_children(2.0)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1, calls  # never one call per batch or per epoch
    argv = calls[0]["argv"]
    assert any(a in ("-lms", "-l") for a in argv)
    assert not monitor.running


def test_alerts_fire_with_epoch_batch_and_learning_rate(smi, inproc):
    inproc.env["SMIQUERY_FAKE_SWEEP"] = "5"  # the fake's loop starts 5 sweeps before the stall
    got: list[tuple[str, dict[str, Any]]] = []
    monitor = GpuMonitor(
        interval=INTERVAL,
        nvidia_smi=str(smi),
        alerts=["temperature.gpu > 85 for 3", "utilization.gpu < 20 for 5 while memory.used > 1024"],
        handlers=[CallbackHandler(lambda e, ctx: got.append((e.message(), dict(ctx))))],
    )
    with no_leaks():
        fit(tiny_model(lr=0.025), [monitor, Slow()])
    hot = [a for a in monitor.alerts if a.event.rule.field.name == "temperature.gpu"]
    assert len(hot) == 1  # fires once, no flood, although GPU 1 stays hot
    alert = hot[0]
    assert isinstance(alert, TrainingAlert)
    assert alert.event.gpu == 1 and alert.event.state == "firing" and alert.event.value == 88
    assert alert.learning_rate == pytest.approx(0.025)
    assert alert.phase in ("setup", "train")
    if alert.phase == "setup":  # the sample came before the first epoch began
        assert alert.epoch is None
    else:
        assert alert.epoch in (0, 1, 2)
        assert alert.batch is not None and 0 <= alert.batch <= BATCHES
        assert alert.step is not None and alert.step >= alert.batch
    stalls = [a for a in monitor.alerts if a.event.rule.field.name == "utilization.gpu"]
    assert {a.event.gpu for a in stalls if a.event.state == "firing"} == {0, 1}
    for a in stalls:
        assert a.epoch is not None and a.batch is not None and a.learning_rate == pytest.approx(0.025)
    # the handlers got every event with the same context
    assert len(got) == len(monitor.alerts)
    assert got[0][1] == monitor.alerts[0].context()
    assert set(got[0][1]) == {"epoch", "batch", "step", "learning_rate", "phase"}
    assert "GPU 1" in got[0][0]
    assert monitor.alerts[0].to_dict()["rule"] == "temperature.gpu > 85 for 3"


@pytest.mark.parametrize("where", ["callback", "dataset"])
def test_a_fit_that_raises_leaves_no_nvidia_smi_behind(real_smi, where):
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(real_smi))
    model = tiny_model()
    with no_leaks():
        if where == "callback":
            with pytest.raises(RuntimeError, match="boom"):
                fit(model, [monitor, Slow(fail_at=(1, 4))])
        else:
            x, y = data()

            class Failing(keras.utils.PyDataset):  # type: ignore[misc]
                def __init__(self) -> None:
                    super().__init__()

                def __len__(self) -> int:
                    return BATCHES

                def __getitem__(self, i: int) -> tuple[Any, Any]:
                    time.sleep(BATCH_SLEEP)
                    if i == 6:
                        raise ValueError("bad record in the input pipeline")
                    return x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8]

            # TensorFlow re-raises it from its input pipeline as InvalidArgumentError
            with pytest.raises(Exception, match="bad record"):
                model.fit(Failing(), epochs=2, verbose=0, callbacks=[monitor])
        started = time.monotonic()
        left = wait_no_children(2.0)
        assert not left, f"nvidia-smi still running after fit raised: {left}"
        assert time.monotonic() - started < 2.0
    assert not monitor.running


def test_cpu_only_tensorflow_with_visible_gpus_is_said_once_and_training_goes_on(smi, caplog):
    caplog.set_level(logging.INFO, logger="smiquery.training.monitor")
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
    history = fit(tiny_model(), [monitor, Slow()], epochs=3)
    said = [r for r in caplog.records if "TensorFlow is a CPU-only build" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "nvidia-smi sees GPUs" in said[0].getMessage()
    assert len(history.history["loss"]) == 3
    assert not any("mem_gap" in k for k in history.history)
    # a second fit with the same monitor does not repeat it either
    fit(tiny_model(), [monitor], epochs=1)
    assert len([r for r in caplog.records if "CPU-only build" in r.getMessage()]) == 1


def test_cuda_visible_devices_by_index_and_uuid(smi, monkeypatch, tmp_path):
    for value in ("1", UUIDS[1], "GPU-00000001"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
        history = fit(tiny_model(), [monitor, Slow()], epochs=1)
        gpu_keys = {k for k in history.history if k.startswith("gpu")}
        assert gpu_keys == {k for k in KEYS if k.startswith("gpu1_")} | {"gpu1_energy_wh"}, value
    calls = [json.loads(line)["argv"] for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    argvs = [argv for argv in calls if "-lms" in argv]  # the streams (index 1 is also checked: one model here)
    assert argvs[0][argvs[0].index("-i") + 1] == "1"
    assert argvs[1][argvs[1].index("-i") + 1] == UUIDS[1]
    assert "-i" not in argvs[2]  # a UUID prefix: every GPU is queried, the rows are filtered


def test_no_visible_gpu_or_no_nvidia_smi_is_said_once_and_training_goes_on(smi, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi))
    history = fit(tiny_model(), [monitor], epochs=2)
    assert not any(k.startswith("gpu") for k in history.history)
    assert sum("hides every GPU" in n for n in monitor.notes) == 1
    assert not (tmp_path / "calls.jsonl").exists()

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    missing = GpuMonitor(interval=INTERVAL, nvidia_smi=str(tmp_path / "no-such-nvidia-smi"))
    with no_leaks(), use_runner(SubprocessRunner()):  # the real lookup
        history = fit(tiny_model(), [missing], epochs=2)
    assert len(history.history["loss"]) == 2
    assert len(missing.notes) == 1 and "GPU monitoring is off" in missing.notes[0]


def test_log_every_batch_adds_the_newest_sample_to_batch_logs(smi):
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=(), log_every="batch")
    recorder = Slow()
    with no_leaks():
        fit(tiny_model(), [monitor, recorder], epochs=2)
    late = recorder.batch_logs[-1]
    assert late["gpu1_temp"] == 88.0
    assert {"gpu0_util", "gpu0_temp", "gpu0_mem_used_mib", "gpu0_power_w"} <= set(late)


def test_works_with_tf_keras(smi):
    tf = pytest.importorskip("tensorflow")
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
    x, y = data()
    with no_leaks():
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor, Slow()])
    assert "gpu1_temp_max" in history.history


def test_growing_memory_gap_is_worded_by_what_tensorflow_reports():
    monitor = GpuMonitor(alerts=())
    view = MemoryView(0, 100.0 * 2**20, 900.0 * 2**20, None)  # TensorFlow: current and peak, no reserved pool
    for gap in (500.0, 520.0, 700.0, 900.0, 1100.0, 1300.0):
        monitor.monitor.watch_gap(2, gap, view, "TensorFlow")
    said = [n for n in monitor.notes if "grew" in n]
    assert len(said) == 1 and "GPU 2" in said[0]
    assert "TensorFlow's peak allocation" in said[0]
    assert "does not report its allocator's reserved pool" in said[0]  # TF's own pool may be part of it
    steady = GpuMonitor(alerts=())
    for gap in (500.0, 900.0, 880.0, 1200.0, 1190.0):
        steady.monitor.watch_gap(0, gap, view, "TensorFlow")
    assert not steady.notes


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="log_every"):
        GpuMonitor(log_every="step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid alert"):
        GpuMonitor(alerts=["temperature.gpu >"])


def test_import_smiquery_does_not_import_keras():
    code = (
        "import sys, smiquery, smiquery.alerts.notify, smiquery.analysis, smiquery.alerts.rules; "
        "bad = [m for m in ('keras', 'tensorflow', 'matplotlib') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_threads_are_gone_after_fit(smi):
    before = set(threading.enumerate())
    fit(tiny_model(), [GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi)), Slow()], epochs=1)
    wait_for(
        lambda: not [t for t in set(threading.enumerate()) - before if t.name.startswith("smiquery")],
        what="the monitor's threads to end",
    )


def test_extra_fields_are_summarised(smi):
    monitor = GpuMonitor(
        fields=["clocks_event_reasons.hw_thermal_slowdown", "memory.total"], interval=INTERVAL, nvidia_smi=str(smi)
    )
    history = fit(tiny_model(), [monitor, Slow()], epochs=1)
    h = history.history
    assert h["gpu1_clocks_event_reasons_hw_thermal_slowdown_frac"] == [1.0]
    assert h["gpu0_clocks_event_reasons_hw_thermal_slowdown_frac"] == [0.0]
    assert h["gpu0_memory_total_max"] == [81559.0]
    assert h["gpu0_memory_total_mean"] == [81559.0]


def test_tensorflow_memory_view_reads_current_and_peak(monkeypatch):
    """TensorFlow's GPU:k views (no GPU here: TensorFlow's answers are faked)."""
    import tensorflow as tf

    allocated = {"GPU:0": (1000 * 2**20, 1500 * 2**20), "GPU:1": (300 * 2**20, 0)}
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["gpu0", "gpu1"])
    monkeypatch.setattr(
        tf.config.experimental,
        "get_memory_info",
        lambda name: {"current": allocated[name][0], "peak": allocated[name][1]},
    )
    view = TensorFlowMemory()
    assert view.available() is None
    got = view.read()
    assert got == [MemoryView(0, 1000.0 * 2**20, 1500.0 * 2**20, None), MemoryView(1, 300.0 * 2**20, None, None)]


def test_callbacks_listed_before_the_monitor_are_warned_about_once(smi, tmp_path):
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
    csv = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    fit(tiny_model(), [csv, monitor], epochs=1)
    fit(tiny_model(), [csv, monitor], epochs=1)
    said = [n for n in monitor.notes if "CSVLogger" in n]
    assert len(said) == 1 and "list GpuMonitor first" in said[0]
    quiet = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=())
    fit(tiny_model(), [quiet, csv], epochs=1)
    assert not [n for n in quiet.notes if "CSVLogger" in n]


def test_a_custom_loop_whose_callbacklist_raises_reaps_nvidia_smi_without_close(real_smi):
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(real_smi), alerts=())
    model = tiny_model()

    def train() -> None:
        callbacks = keras.callbacks.CallbackList([monitor], model=model)
        callbacks.on_train_begin()
        callbacks.on_epoch_begin(0)
        assert monitor.running
        raise RuntimeError("loss is NaN")

    with no_leaks():
        with pytest.raises(RuntimeError, match="NaN"):
            train()
        left = wait_no_children(10.0)
        assert not left, "nvidia-smi still running after the custom loop raised"
    assert not monitor.running


def test_record_saves_the_runs_trace_from_the_same_nvidia_smi(smi, tmp_path):
    from smiquery.analysis import report as analyze

    record = tmp_path / "run.csv"
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=(), record=str(record))
    with no_leaks():
        fit(tiny_model(), [monitor, Slow()], epochs=1)
    calls = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert len(calls) == 1  # one nvidia-smi for the epoch logs and the recording
    report = analyze(record)
    assert report.gpus == (0, 1)


def test_a_slow_nvidia_smi_start_still_fills_the_later_epochs(smi, inproc):
    """nvidia-smi's first row comes after the first epoch has ended (cold start without persistence mode)."""
    inproc.start_delay = 3.0  # an epoch lasts about 0.5 s
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=(), first_sample_timeout=0)

    class UntilData(keras.callbacks.Callback):  # type: ignore[misc]
        """The last epoch starts once the first row is in, however slow this machine is."""

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            deadline = time.monotonic() + (60 if epoch == 7 else 0)
            while not monitor.monitor.latest() and time.monotonic() < deadline:
                time.sleep(0.02)

    with no_leaks():
        history = fit(tiny_model(), [monitor, Slow(), UntilData()], epochs=8)
    assert not any(k.startswith("gpu0_") for k in monitor.epochs[0])  # nothing yet, nothing made up
    last = monitor.epochs[-1]
    assert last["gpu1_temp_max"] == 88.0  # the data that came later landed in the epochs it arrived in
    assert history.history["gpu1_temp_max"][-1] == 88.0
    assert any("first sample came" in n for n in monitor.notes)


def test_process_share_passes_through_to_the_epoch_logs(smi, monkeypatch):
    # in-process fake: `self` is this process, the run; pid 1 on GPU 1 is someone else
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", "0:self:50:5,1:1:40:5")
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(smi), alerts=(), process_share=True)

    class UntilPmon(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            deadline = time.monotonic() + (60 if batch == 0 else 0)  # the epoch spans one pmon sample
            while len(monitor.monitor.process_shares()) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)

    h = fit(tiny_model(), [monitor, UntilPmon()], epochs=1).history
    assert h["gpu0_share"] == [1.0] and h["gpu0_other_processes"] == [0.0]
    assert h["gpu1_share"] == [0.0] and h["gpu1_other_processes"] == [1.0]
    assert any("another process uses GPU 1" in n for n in monitor.notes)
