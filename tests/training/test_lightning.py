"""The Lightning callback in a real ``trainer.fit`` on CPU torch against a fake nvidia-smi.

The fits run against the in-process fake (``inproc``: same output, log and faults, no process); the test that the
nvidia-smi child is reaped when fit raises uses the fake executable.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

from smiquery.testing import InProcessRunner
from tests.conftest import MakeFake
from tests.leakcheck import no_leaks, wait_no_children

try:
    import lightning as L
    import torch
except ImportError:  # pragma: no cover - installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("lightning is not installed: pip install 'smiquery[lightning]' torch", allow_module_level=True)

from smiquery.training.lightning import GpuMonitor, _batch_size

pytestmark = [
    pytest.mark.slow,
    # Lightning and torch warn about their own internals (pytree, data loader workers); not this callback's
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
]

INTERVAL = 0.05
STEP_SLEEP = 0.03


class Tiny(L.LightningModule):  # type: ignore[misc]
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        time.sleep(STEP_SLEEP)  # an epoch spans several samples
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("loss is NaN")
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.02)


def loader(n: int = 80, batch: int = 8) -> Any:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.rand(n, 4, generator=g), torch.rand(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def trainer(tmp_path: Path, monitor: GpuMonitor, epochs: int = 2) -> Any:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[monitor],
        logger=L.pytorch.loggers.CSVLogger(str(tmp_path), name="run", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )


@pytest.fixture(autouse=True)
def _all_gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_fit_logs_gpu_numbers_energy_and_throughput_through_the_logger(inproc: InProcessRunner, tmp_path: Path):
    inproc.log = tmp_path / "calls.jsonl"
    record = tmp_path / "run.csv"
    monitor = GpuMonitor(interval=INTERVAL, alerts=(), record=str(record), prefix="gpu/")
    with no_leaks(reap_timeout=5.0):
        trainer(tmp_path, monitor).fit(Tiny(), loader())
        assert not wait_no_children(5.0)
    assert len(monitor.epochs) == 2
    e = monitor.epochs[-1]
    assert not math.isnan(e["gpu0_util_mean"])
    assert e["energy_wh"] > 0 and e["samples_per_joule"] > 0
    assert 0 <= e["data_wait_frac"] <= 1
    assert monitor.monitor.totals.steps == 20 and monitor.monitor.totals.samples == 160
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()))
    logged = [r for r in rows if r.get("gpu/gpu0_util_mean")]
    assert len(logged) == 2  # one row per epoch, through Lightning's logger
    assert float(logged[-1]["gpu/samples_per_joule"]) > 0
    calls = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert len(calls) == 1 and any(a in ("-lms", "-l") for a in json.loads(calls[0])["argv"])
    from smiquery.analysis import report as analyze

    assert analyze(record).gpus  # the run's trace, from the same nvidia-smi


def test_cpu_torch_with_visible_gpus_is_said(inproc: InProcessRunner, tmp_path: Path):
    monitor = GpuMonitor(interval=INTERVAL, alerts=())
    trainer(tmp_path, monitor, epochs=1).fit(Tiny(), loader())
    assert any("PyTorch is a CPU-only build while nvidia-smi sees GPUs" in n for n in monitor.notes)


def test_a_fit_that_raises_leaves_no_nvidia_smi_behind(fake_smi: MakeFake, tmp_path: Path):
    # a real child: the subject is that fit's error path reaps it
    monitor = GpuMonitor(interval=INTERVAL, nvidia_smi=str(fake_smi()), alerts=())
    with no_leaks(reap_timeout=5.0):
        with pytest.raises(RuntimeError, match="NaN"):
            trainer(tmp_path, monitor).fit(Tiny(fail_at=13), loader())
        assert not wait_no_children(5.0)
    assert not monitor.monitor.running


def test_alerts_carry_epoch_step_and_learning_rate(inproc: InProcessRunner, tmp_path: Path):
    monitor = GpuMonitor(interval=INTERVAL, alerts=["temperature.gpu > 0"])
    trainer(tmp_path, monitor, epochs=1).fit(Tiny(), loader())
    assert monitor.alerts
    a = monitor.alerts[0]
    assert a.event.state == "firing"
    if a.phase == "setup":  # the sample came before the first epoch began: no optimizer step yet
        assert a.epoch is None
    else:
        assert a.learning_rate == pytest.approx(0.02)


def test_batch_size_of_common_batch_shapes():
    x = torch.zeros(16, 3)
    assert _batch_size(x) == 16
    assert _batch_size((x, torch.zeros(16))) == 16
    assert _batch_size({"input": x}) == 16
    assert _batch_size([[x]]) == 16
    assert _batch_size("text") is None


def test_process_share_passes_through(inproc: InProcessRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # in-process fake: `self` is this process, the run; pid 1 on GPU 0 is someone else
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_PROCS", "0:self:60:5,0:1:20:5")
    monitor = GpuMonitor(interval=INTERVAL, alerts=(), process_share=True)

    class UntilPmon(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any) -> None:
            deadline = time.monotonic() + (60 if args[-1] == 0 else 0)  # the epoch spans one pmon sample
            while 0 not in monitor.monitor.process_shares() and time.monotonic() < deadline:
                time.sleep(0.02)

    t = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[monitor, UntilPmon()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with no_leaks(reap_timeout=5.0):
        t.fit(Tiny(), loader())
    e = monitor.epochs[-1]
    assert e["gpu0_share"] == pytest.approx(0.75) and e["gpu0_other_processes"] == 1.0


def test_ddp_with_two_ranks_counts_the_samples_of_both(tmp_path: Path):
    """A real 2-rank DDP fit (gloo on CPU, Lightning's own launcher): samples per joule counts both ranks' samples,
    as the energy is every watched GPU's."""
    import subprocess
    import sys

    from smiquery.testing import fake_nvidia_smi

    fake = fake_nvidia_smi(tmp_path / "bin")
    out = tmp_path / "ddp.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    script = Path(__file__).with_name("ddp_fit.py")
    done = subprocess.run(
        [sys.executable, str(script), str(out), str(fake)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["world"] == 2
    # each rank: 40 of the 80 samples per epoch, in 5 steps of 8; the job: 80 samples per epoch
    assert doc["steps"] == 10 and doc["samples"] == 160
    for values in doc["epochs"]:
        joules = values["energy_wh"] * 3600
        assert joules == pytest.approx((values["gpu0_energy_wh"] + values["gpu1_energy_wh"]) * 3600)
        assert values["samples_per_joule"] == pytest.approx(80 / joules)
        assert values["steps_per_joule"] == pytest.approx(5 / joules)
