"""Shared parts of the training benchmarks (bench_keras.py, bench_lightning.py): CPU clocks, the per-step cost of
the monitor's hooks for 8 GPUs, and the report of the four figures."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the figures the training issue sets
MAX_COST_RATIO = 0.01  # monitor CPU cost under 1 % of a 200-step fit
MAX_STEP_US = 50.0  # per-step cost with batch logging, 8 GPUs
MAX_EPOCH_END_S = 0.050  # no wait on the training thread at an epoch's end beyond 50 ms


def cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def eight_gpu_sweep() -> Any:
    """One sweep of the bundled 8-GPU demo recording."""
    from smiquery.recordings import replay

    with replay(str(Path(__file__).resolve().parent.parent / "smiquery" / "data" / "demo-8gpu.csv")) as r:
        for sweep in r.sweeps():
            if len(sweep) == 8:
                return sweep
    raise SystemExit("the demo recording has no 8-GPU sweep")


def loaded_monitor(log_every: str = "batch") -> Any:
    """A RunMonitor holding one 8-GPU sweep, as during a fit, without a child (for the per-step figure)."""
    from smiquery.training.monitor import RunMonitor

    monitor = RunMonitor(alerts=(), log_every=log_every, env={})  # type: ignore[arg-type]
    monitor._take(eight_gpu_sweep(), select=False)
    monitor.begin_epoch(0)
    return monitor


def per_call_us(
    call: Callable[[int], object], baseline: Callable[[int], object], n: int = 20000
) -> tuple[float, float]:
    """Median microseconds per call of ``call`` and of ``baseline`` (an empty hook), interleaved in blocks."""
    ours: list[float] = []
    base: list[float] = []
    block = max(n // 20, 1)
    for _ in range(20):
        t = time.perf_counter()
        for i in range(block):
            baseline(i)
        base.append((time.perf_counter() - t) / block * 1e6)
        t = time.perf_counter()
        for i in range(block):
            call(i)
        ours.append((time.perf_counter() - t) / block * 1e6)
    return statistics.median(ours), statistics.median(base)


def report(
    name: str,
    fit_best: float,
    wall_with: list[float],
    wall_without: list[float],
    cpu_with: list[float],
    cpu_without: list[float],
    costs: list[float],
    child: list[float],
    first_data: list[float],
    epoch_end: list[float],
    step_us: float,
    step_base_us: float,
) -> bool:
    """Print the figures and the verdict; True when every target holds."""
    median = statistics.median
    best = fit_best
    ratios = {
        "wall": (min(wall_with) - best) / best,
        "cpu": (median(cpu_with) - median(cpu_without)) / median(cpu_without),
        "cost": median(costs) / best,
        "cost+child": (median(costs) + median(child)) / best,
    }
    spread = (max(wall_without) - best) / best
    print(f"{name}: fit time without the monitor: best {best:.3f} s, spread {spread:.1%} (noise of this machine)")
    for key, value in ratios.items():
        mark = " <- criterion" if key == "cost" else ""
        print(f"  overhead ratio {key:<10} {value:+.4f} ({value:+.2%} of fit time){mark}")
    print(f"  fixed cost per fit, start to first data: median {median(first_data) * 1000:.0f} ms (wall, not CPU)")
    print(f"  nvidia-smi child CPU per fit: median {median(child) * 1000:.0f} ms (the fake is Python; a real one is C)")
    print(f"  per-step hook cost, batch logging, 8 GPUs: {step_us:.1f} us (an empty hook: {step_base_us:.2f} us)")
    worst = max(epoch_end) if epoch_end else 0.0
    print(f"  longest wait at an epoch end after the first: {worst * 1000:.2f} ms")
    checks = {
        f"cost ratio < {MAX_COST_RATIO:.0%}": ratios["cost"] < MAX_COST_RATIO,
        f"per-step cost < {MAX_STEP_US:.0f} us": step_us < MAX_STEP_US,
        f"epoch-end wait < {MAX_EPOCH_END_S * 1000:.0f} ms": worst < MAX_EPOCH_END_S,
    }
    for what, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}: {what}")
    return all(checks.values())


def fake(tmp: str) -> str:
    from smiquery.testing import fake_nvidia_smi

    return str(fake_nvidia_smi(Path(tmp) / "bin"))
