#!/usr/bin/env python3
"""``smiquery.compat.GPUtil.getGPUs()`` wall time against the real ``GPUtil.getGPUs()``, on the same fake.

Both run in this process against one fake nvidia-smi (the bundled 8-GPU demo) put first on PATH, in rounds that
alternate which side goes first, so that a busy moment on a shared machine does not count against one side only.
Prints the best and median times of each, this process's CPU per call, and the ratio shim / GPUtil of the best
times. Target: <= 1.0. Starting nvidia-smi dominates both, so on a busy machine the ratio wanders by a few %.

Usage: ``python scripts/bench_compat.py [--rounds N]``. Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.compat import GPUtil as shim  # noqa: E402
from smiquery.testing import fake_nvidia_smi  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import GPUtil as real

TARGET = 1.0


def main() -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fake = fake_nvidia_smi(Path(tmp) / "bin")
        os.environ["PATH"] = f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        os.environ.pop("SMIQUERY_NVIDIA_SMI", None)
        sides: dict[str, Callable[[], object]] = {"GPUtil": real.getGPUs, "shim": shim.getGPUs}
        assert len(real.getGPUs()) == len(shim.getGPUs()) == 8  # warm-up, and the two agree
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, float] = dict.fromkeys(sides, 0.0)
        order = list(sides)
        for _ in range(args.rounds):
            order.reverse()  # who goes first alternates: no side always runs on a warmer cache
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                sides[name]()
                times[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - start_cpu
    for name, ts in times.items():
        print(
            f"{name + '.getGPUs():':22} best {min(ts) * 1000:7.1f} ms  median {statistics.median(ts) * 1000:7.1f} ms"
            f"  (this process's CPU {cpu[name] / len(ts) * 1000:5.2f} ms per call)"
        )
    ratio = min(times["shim"]) / min(times["GPUtil"])
    ok = ratio <= TARGET
    print(f"ratio shim / GPUtil (best): {ratio:.2f}  ({'OK' if ok else 'TOO SLOW'}: must be <= {TARGET:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
