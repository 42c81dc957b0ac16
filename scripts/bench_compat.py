#!/usr/bin/env python3
"""``smiquery.compat.GPUtil.getGPUs()`` wall time against the real ``GPUtil.getGPUs()``, on the same fake.

Both run in this process against one fake nvidia-smi put first on PATH, in rounds that run each side once,
alternating which goes first, so that a busy moment on a shared machine lands on both sides of a round. The
verdict is the median of the per-round ratios shim / GPUtil, with a 95% bootstrap interval around it; best and
median times and this process's CPU per call are printed too. Target: ratio <= 1.0.

Two children: ``python`` (default), the bundled 8-GPU demo fake, a Python program that takes ~150 ms to start,
as a slow nvidia-smi does; and ``sh``, a shell script that prints the same 8 rows in ~2 ms, so that what the two
libraries do around the child (spawning, waiting, reaping, parsing) is a visible share of the time.

Usage: ``python scripts/bench_compat.py [--rounds N] [--child python|sh]``. Exit status 1 when the shim is
slower beyond doubt (the whole interval above the target); a median above the target with the interval
reaching below it is reported as within noise.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import subprocess
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


def _shell_fake(folder: Path, python_fake: Path) -> Path:
    """A /bin/sh nvidia-smi that prints what the Python fake printed for GPUtil's query, without its start-up."""
    query = [str(python_fake), "--query-gpu=" + ",".join(shim._FIELDS), "--format=csv,noheader,nounits"]
    folder.mkdir(exist_ok=True)
    rows = folder / "rows.csv"
    rows.write_text(subprocess.run(query, capture_output=True, text=True, check=True).stdout)
    path = folder / "nvidia-smi"
    path.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(rows))}\n")
    path.chmod(0o755)
    return path


def _interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios`` (fixed seed: the same data give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--child", choices=("python", "sh"), default="python")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fake = fake_nvidia_smi(Path(tmp) / "bin")
        if args.child == "sh":
            fake = _shell_fake(Path(tmp) / "sh", fake)
        os.environ["PATH"] = f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        os.environ.pop("SMIQUERY_NVIDIA_SMI", None)
        sides: dict[str, Callable[[], object]] = {"GPUtil": real.getGPUs, "shim": shim.getGPUs}
        assert len(real.getGPUs()) == len(shim.getGPUs()) == 8  # warm-up, and the two agree
        rounds = args.rounds * (20 if args.child == "sh" else 1)  # a cheap child: more rounds, same wall time
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, float] = dict.fromkeys(sides, 0.0)
        order = list(sides)
        for _ in range(rounds):
            order.reverse()  # who goes first alternates: no side always runs on a warmer cache
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                sides[name]()
                times[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - start_cpu
    print(f"child: {args.child} fake nvidia-smi, {rounds} rounds")
    for name, ts in times.items():
        print(
            f"{name + '.getGPUs():':22} best {min(ts) * 1000:7.2f} ms  median {statistics.median(ts) * 1000:7.2f} ms"
            f"  (this process's CPU {cpu[name] / len(ts) * 1000:5.3f} ms per call)"
        )
    ratios = [s / g for s, g in zip(times["shim"], times["GPUtil"])]
    ratio = statistics.median(ratios)
    low, high = _interval(ratios)
    best = min(times["shim"]) / min(times["GPUtil"])
    if ratio <= TARGET:
        verdict, status = "OK", 0
    elif low <= TARGET:
        verdict, status = "within noise: the interval reaches the target", 0
    else:
        verdict, status = "TOO SLOW", 1
    print(
        f"ratio shim / GPUtil: median of rounds {ratio:.3f} (95% interval {low:.3f}..{high:.3f}), of bests {best:.3f}"
        f"  -> {verdict} (target <= {TARGET:.2f})"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
