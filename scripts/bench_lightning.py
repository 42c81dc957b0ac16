#!/usr/bin/env python3
"""Cost of smiquery.training.lightning.GpuMonitor on a 200-step trainer.fit: the twin of bench_keras.py.

The same fit (a 3-layer MLP on CPU torch) with and without the callback, interleaved in one process; the same
figures from the same run: monitor cost / fit time (under 1 %), with the nvidia-smi child, start to first data,
the per-step hook cost with batch logging for 8 GPUs (under 50 us) and the longest epoch-end wait (under 50 ms).

    python scripts/bench_lightning.py [--repeats 5] [--steps 200] [--epochs 4] [--interval 1.0] [--nvidia-smi PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_training as bench

ALERTS = ["temperature.gpu > 85 for 3", "temperature.gpu > 80 for 5m"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="fits with and without the callback (each)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per fit")
    parser.add_argument("--epochs", type=int, default=4, help="epochs the steps are split into")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=1536, help="units per hidden layer (sets the step time)")
    parser.add_argument("--interval", type=float, default=1.0, help="sampling interval in seconds")
    parser.add_argument("--nvidia-smi", default=None, help="nvidia-smi to run (default: smiquery's fake)")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import lightning as L
    import psutil
    import torch

    from smiquery.training.lightning import GpuMonitor

    tmp = tempfile.TemporaryDirectory(prefix="bench-lightning-")
    smi = args.nvidia_smi or bench.fake(tmp.name)
    torch.manual_seed(0)
    features = 256
    per_epoch = args.steps // args.epochs

    class MLP(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            w = args.width
            self.net = torch.nn.Sequential(
                torch.nn.Linear(features, w),
                torch.nn.ReLU(),
                torch.nn.Linear(w, w),
                torch.nn.ReLU(),
                torch.nn.Linear(w, w),
                torch.nn.ReLU(),
                torch.nn.Linear(w, 10),
            )

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            x, y = batch  # type: ignore[misc]
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    n = per_epoch * args.batch_size
    data = torch.utils.data.TensorDataset(torch.randn(n, features), torch.randint(0, 10, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    model = MLP()

    def fit(monitor: GpuMonitor | None) -> tuple[float, float]:
        trainer = L.Trainer(
            max_epochs=args.epochs,
            accelerator="cpu",
            callbacks=[monitor] if monitor is not None else [],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        cpu0 = bench.cpu()
        start = time.perf_counter()
        trainer.fit(model, loader)
        return time.perf_counter() - start, bench.cpu() - cpu0

    def monitor() -> GpuMonitor:
        return GpuMonitor(interval=args.interval, nvidia_smi=smi, handlers=(), alerts=ALERTS)

    print(
        f"lightning {L.__version__}, torch {torch.__version__}, {args.epochs} epochs of {per_epoch} steps of "
        f"{args.batch_size}, 3x{args.width} MLP, nvidia-smi: {smi}, interval {args.interval} s, "
        f"load {os.getloadavg()[0]:.2f}"
    )

    class FakeTrainer:
        def __init__(self) -> None:
            self.global_step = 0
            self.loggers: list[object] = []

    cb = GpuMonitor(alerts=(), log_every="batch")
    cb.monitor = bench.loaded_monitor("batch")
    logged: dict[str, float] = {}

    class Logger:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            logged.update(metrics)

    trainer_stub = FakeTrainer()
    trainer_stub.loggers = [Logger()]
    batch = (torch.zeros(256, features), torch.zeros(256))
    empty = L.Callback()

    def hooks(i: int) -> None:
        cb.on_train_batch_start(trainer_stub, None, batch, i)
        cb.on_train_batch_end(trainer_stub, None, None, batch, i)

    def baseline(i: int) -> None:
        empty.on_train_batch_start(trainer_stub, None, batch, i)
        empty.on_train_batch_end(trainer_stub, None, None, batch, i)

    step_us, base_us = bench.per_call_us(hooks, baseline)
    assert len([k for k in logged if k.startswith("gpu")]) == 32, sorted(logged)

    fit(None)
    fit(monitor())
    wall_without: list[float] = []
    wall_with: list[float] = []
    cpu_without: list[float] = []
    cpu_with: list[float] = []
    costs: list[float] = []
    child: list[float] = []
    first: list[float] = []
    ends: list[float] = []
    for i in range(args.repeats):
        wall, c = fit(None)
        wall_without.append(wall)
        cpu_without.append(c)
        mon = monitor()
        child0 = bench.child_cpu()
        wall, c = fit(mon)
        child.append(bench.child_cpu() - child0)
        wall_with.append(wall)
        cpu_with.append(c)
        m = mon.monitor
        threads = m.cost["reader_cpu"] + m.cost["worker_cpu"]
        hooks_s = m.cost["start"] + m.cost["close"] + sum(m.epoch_end_seconds) + m.totals.steps * step_us / 1e6
        costs.append(threads + hooks_s)
        first.append(m.cost["first_data"])
        ends += m.epoch_end_seconds[1:]
        if psutil.Process().children(recursive=True):
            print("FAIL: children left after fit")
            return 1
        if not mon.epochs or not any(k.endswith("_util_mean") for k in mon.epochs[-1]):
            print("FAIL: the monitor logged no GPU numbers")
            return 1
        print(
            f"run {i + 1}: wall {wall_without[-1]:.3f} / {wall_with[-1]:.3f} s (without / with); monitor "
            f"{costs[-1] * 1000:.1f} ms = hooks {hooks_s * 1000:.1f} + threads {threads * 1000:.1f}; "
            f"nvidia-smi {child[-1] * 1000:.0f} ms; first data {m.cost['first_data'] * 1000:.0f} ms"
        )
    ok = bench.report(
        "lightning",
        min(wall_without),
        wall_with,
        wall_without,
        cpu_with,
        cpu_without,
        costs,
        child,
        first,
        ends,
        step_us,
        base_us,
    )
    tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
