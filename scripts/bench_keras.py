#!/usr/bin/env python3
"""Cost of smiquery.training.keras.GpuMonitor on a 200-step model.fit: the same fit with and without the callback.

Runs are interleaved in one process (without, with, without, with, ...) after warm-up fits. Figures, all from
the same run:

  cost        what the monitor itself consumed in this process (its hooks on the training thread: start, every
              step, every epoch end, close; plus the CPU of its reading, handler and watchdog threads) / best fit
              time without: the criterion, under 1 %
  cost+child  the same plus the nvidia-smi child's CPU (here the fake, a Python program: ~90 ms to start, far
              more than the real C binary)
  wall, cpu   the wall-clock and process CPU differences (noisy on a shared machine; read them on a quiet one)
  first data  fixed cost per fit: wall time from on_train_begin to the first sample
  per step    the two batch hooks with log_every="batch" and 8 GPUs, against an empty hook (under 50 us)
  epoch end   the longest on_epoch_end after the first (the first may wait for nvidia-smi's first sample)

    python scripts/bench_keras.py [--repeats 5] [--steps 200] [--epochs 4] [--interval 1.0] [--nvidia-smi PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _bench_training as bench

ALERTS = ["temperature.gpu > 85 for 3", "temperature.gpu > 80 for 5m"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="fits with and without the callback (each)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per fit")
    parser.add_argument("--epochs", type=int, default=4, help="epochs the steps are split into")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=1536, help="units per hidden layer (sets the step time)")
    parser.add_argument("--interval", type=float, default=1.0, help="GpuMonitor sampling interval in seconds")
    parser.add_argument("--nvidia-smi", default=None, help="nvidia-smi to run (default: smiquery's fake)")
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import psutil

    from smiquery.training.keras import GpuMonitor

    tmp = tempfile.TemporaryDirectory(prefix="bench-keras-")
    smi = args.nvidia_smi or bench.fake(tmp.name)

    keras.utils.set_random_seed(0)
    features = 256
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    per_epoch = args.steps // args.epochs
    n = per_epoch * args.batch_size
    x = rng.standard_normal((n, features), dtype=np.float32)
    y = rng.integers(0, 10, size=(n,))

    def fit(monitor: GpuMonitor | None) -> tuple[float, float]:
        callbacks = [monitor] if monitor is not None else []
        cpu0 = bench.cpu()
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start, bench.cpu() - cpu0

    def monitor() -> GpuMonitor:
        return GpuMonitor(interval=args.interval, nvidia_smi=smi, handlers=(), alerts=ALERTS)

    print(
        f"keras {keras.__version__} ({keras.backend.backend()}), {args.epochs} epochs of {per_epoch} steps of "
        f"{args.batch_size}, 3x{args.width} MLP, nvidia-smi: {smi}, interval {args.interval} s, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    # per-step figure: the two batch hooks of a batch-logging monitor holding an 8-GPU sweep
    cb = GpuMonitor(alerts=(), log_every="batch")
    cb.monitor = bench.loaded_monitor("batch")
    logs: dict[str, float] = {}
    empty = keras.callbacks.Callback()

    def hooks(i: int) -> None:
        cb.on_train_batch_begin(i)
        cb.on_train_batch_end(i, logs)

    def baseline(i: int) -> None:
        empty.on_train_batch_begin(i)
        empty.on_train_batch_end(i, logs)

    step_us, base_us = bench.per_call_us(hooks, baseline)
    assert len([k for k in logs if k.startswith("gpu")]) == 32, sorted(logs)

    fit(None)  # warm-up: tracing and the first allocations
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
        steps = m.totals.steps
        threads = m.cost["reader_cpu"] + m.cost["worker_cpu"] + m.cost.get("watchdog_cpu", 0.0)
        hooks_s = m.cost["start"] + m.cost["close"] + sum(m.epoch_end_seconds) + steps * step_us / 1e6
        costs.append(threads + hooks_s)
        first.append(m.cost["first_data"])
        ends += m.epoch_end_seconds[1:]
        if psutil.Process().children(recursive=True):
            print("FAIL: children left after fit")
            return 1
        if not mon.epochs or not any(k.endswith("_util_mean") for k in mon.epochs[-1]):
            print("FAIL: the monitor added no GPU numbers to the logs")
            return 1
        print(
            f"run {i + 1}: wall {wall_without[-1]:.3f} / {wall_with[-1]:.3f} s (without / with); monitor "
            f"{costs[-1] * 1000:.1f} ms = hooks {hooks_s * 1000:.1f} + threads {threads * 1000:.1f}; "
            f"nvidia-smi {child[-1] * 1000:.0f} ms; first data {m.cost['first_data'] * 1000:.0f} ms"
        )
    ok = bench.report(
        "keras",
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
