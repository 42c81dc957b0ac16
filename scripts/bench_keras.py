#!/usr/bin/env python3
"""Overhead of smiquery.keras.GpuMonitor on a 200-step model.fit: the same fit with and without the callback.

Runs are interleaved in one process (without, with, without, with, ...) after warm-up fits, and three ratios
are printed:

  wall   (best fit time with - best without) / best without: what a user feels; needs a quiet machine
  cpu    (median process+children CPU seconds with - without) / median without: the extra work, robust to
         other load on the machine
  cost   what monitoring itself consumed (time in its hooks on the training thread, CPU of its two threads and
         of the nvidia-smi child) / best fit time without

The exit status checks --criterion (default cost) against --max-ratio (default 2%). "cost" is the default
because it does not depend on what else the machine runs: on a machine whose cores the fit keeps busy it bounds
the wall-clock overhead from above (monitoring can only slow training by taking CPU from it); "wall" is the
number to read on a quiet machine, "cpu" on a busy one.

    python scripts/bench_keras.py [--repeats 5] [--steps 200] [--interval 1.0] [--nvidia-smi PATH]

Without --nvidia-smi it uses the fake nvidia-smi from smiquery.testing (a real child process replaying the
bundled 8-GPU recording), so the numbers include starting, reading and reaping a real child. The fake is a
Python program: starting it costs about 90 ms of CPU, more than a real nvidia-smi's start. The model is a
3x1536 MLP at batch 256, about 50 ms a step on two CPU cores (a small real model; on a GPU a step of a real
model takes as long or longer). The monitor's cost is mostly fixed per fit (about 0.1 s), so the ratio shrinks
for longer fits and grows for shorter ones: pass --width 512 for a 2 s fit and see it near 5%.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ALERTS = ["temperature.gpu > 85 for 3", "temperature.gpu > 80 for 5m"]


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _child_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="fits with and without the callback (each)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per fit")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=1536, help="units per hidden layer (sets the step time)")
    parser.add_argument("--interval", type=float, default=1.0, help="GpuMonitor sampling interval in seconds")
    parser.add_argument("--nvidia-smi", default=None, help="nvidia-smi to run (default: smiquery's fake)")
    parser.add_argument("--criterion", choices=("wall", "cpu", "cost"), default="cost", help="ratio the exit checks")
    parser.add_argument("--max-ratio", type=float, default=0.02, help="fail above this overhead ratio")
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import psutil

    from smiquery.keras import GpuMonitor
    from smiquery.testing import fake_nvidia_smi

    tmp = tempfile.TemporaryDirectory(prefix="bench-keras-")
    smi = args.nvidia_smi or str(fake_nvidia_smi(Path(tmp.name) / "bin"))

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
    n = args.steps * args.batch_size
    x = rng.standard_normal((n, features), dtype=np.float32)
    y = rng.integers(0, 10, size=(n,))

    def fit(monitor: GpuMonitor | None) -> tuple[float, float]:
        callbacks = [monitor] if monitor is not None else []
        cpu0 = _cpu()
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start, _cpu() - cpu0

    def monitor() -> GpuMonitor:
        return GpuMonitor(interval=args.interval, nvidia_smi=smi, handlers=(), alerts=ALERTS)

    print(
        f"keras {keras.__version__} ({keras.backend.backend()}), {args.steps} steps of {args.batch_size}, "
        f"3x{args.width} MLP, nvidia-smi: {smi}, interval {args.interval} s, load {os.getloadavg()[0]:.2f}"
    )
    fit(None)  # warm-up: tracing and the first allocations
    fit(monitor())
    wall_without: list[float] = []
    wall_with: list[float] = []
    cpu_without: list[float] = []
    cpu_with: list[float] = []
    costs: list[float] = []
    for i in range(args.repeats):
        wall, cpu = fit(None)
        wall_without.append(wall)
        cpu_without.append(cpu)
        mon = monitor()
        child0 = _child_cpu()
        wall, cpu = fit(mon)
        child = _child_cpu() - child0
        wall_with.append(wall)
        cpu_with.append(cpu)
        costs.append(sum(mon.cost.values()) + child)
        left = psutil.Process().children(recursive=True)
        if left:
            print(f"FAIL: children left after fit: {left}")
            return 1
        if not mon.epochs or not any(k.endswith("_util_mean") for k in mon.epochs[0]):
            print("FAIL: the monitor added no GPU numbers to the logs")
            return 1
        threads = mon.cost["reader_cpu"] + mon.cost["watchdog_cpu"]
        print(
            f"run {i + 1}: wall {wall_without[-1]:.3f} / {wall_with[-1]:.3f} s, "
            f"cpu {cpu_without[-1]:.3f} / {cpu_with[-1]:.3f} s (without / with); monitor cost "
            f"{costs[-1] * 1000:.1f} ms = hooks {mon.cost['hooks'] * 1000:.1f} + threads {threads * 1000:.1f} "
            f"+ nvidia-smi {child * 1000:.1f}"
        )
    best = min(wall_without)
    ratios = {
        "wall": (min(wall_with) - best) / best,
        "cpu": (statistics.median(cpu_with) - statistics.median(cpu_without)) / statistics.median(cpu_without),
        "cost": statistics.median(costs) / best,
    }
    spread = (max(wall_without) - best) / best
    print(f"fit time without the callback: best {best:.3f} s, spread {spread:.1%} (noise of this machine)")
    for name, value in ratios.items():
        mark = " <- criterion" if name == args.criterion else ""
        print(f"overhead ratio {name:<4} {value:+.4f} ({value:+.2%} of fit time){mark}")
    ok = ratios[args.criterion] < args.max_ratio
    print(f"{'PASS' if ok else 'FAIL'}: {args.criterion} ratio {'<' if ok else '>='} {args.max_ratio:.0%}")
    tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
