#!/usr/bin/env python3
"""Cost of the training monitor's process share (``RunMonitor(process_share=True)``), against the fake nvidia-smi.

1. Per-step cost on the training thread: a loop of small CPU-bound "steps" (about 0.2 ms of Python each) calls
   :meth:`RunMonitor.step` after each, with an epoch end every 500 steps; the wall time of the ``step()`` and
   ``end_epoch()`` calls is summed. Rounds with the share on and off alternate in this one process; the ratio
   on/off of the median per-step cost is printed. Target <= 1.5 (the step never touches pmon: the difference is
   the pmon thread competing for the GIL).
2. The pmon reading thread's CPU time (parsing, /proc ancestry walks, per-epoch sums) per second of run, in ms.
   Target <= 5 ms/s.

The fake watches 8 GPUs; pmon covers 4, each with this process and two others (``SMIQUERY_FAKE_PMON_PROCS``).
The fake nvidia-smi's own CPU is not counted: it is a Python child, not the real binary.

Usage: ``python scripts/bench_monitor_share.py [--seconds S] [--rounds N]``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.testing import fake_nvidia_smi  # noqa: E402
from smiquery.training.monitor import RunMonitor  # noqa: E402

STEP_RATIO_TARGET = 1.5
PMON_MS_PER_S_TARGET = 5.0
EPOCH_STEPS = 500


def _work(n: int = 400) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def _round(smi: Path, share: bool, seconds: float) -> tuple[float, float, int]:
    """One run: (mean seconds per monitor call, pmon thread CPU ms per second, epochs with a pmon sample)."""
    m = RunMonitor(nvidia_smi=str(smi), interval=1.0, alerts=(), process_share=share, first_sample_timeout=30)
    m.start()
    try:
        deadline = time.monotonic() + 30
        while not m.latest() and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = 0.0
        calls = 0
        epoch = 0
        m.begin_epoch(epoch)
        began = time.monotonic()
        end = began + seconds
        while time.monotonic() < end:
            _work()
            t0 = time.perf_counter()
            m.step()
            calls += 1
            if calls % EPOCH_STEPS == 0:
                m.end_epoch(epoch)
                epoch += 1
                m.begin_epoch(epoch)
            spent += time.perf_counter() - t0
        m.end_epoch(epoch)
        wall = time.monotonic() - began
        sampled = sum(1 for e in m.epochs if not math.isnan(e.get("gpu0_other_processes", math.nan)))
    finally:
        m.close()
    return spent / max(calls, 1), m.cost["pmon_cpu"] * 1000.0 / wall, sampled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting (on and off alternate)")
    args = ap.parse_args()
    me = os.getpid()
    procs = ",".join(f"{g}:{me}:40:10,{g}:1:20:5,{g}:2:10:5" for g in range(4))
    os.environ["SMIQUERY_FAKE_PMON_PROCS"] = procs
    with tempfile.TemporaryDirectory() as tmp:
        smi = fake_nvidia_smi(tmp)
        off: list[float] = []
        on: list[float] = []
        pmon_ms: list[float] = []
        seen = 0
        for _ in range(args.rounds):
            off.append(_round(smi, False, args.seconds)[0])
            cost, ms, epochs_with_share = _round(smi, True, args.seconds)
            on.append(cost)
            pmon_ms.append(ms)
            seen += epochs_with_share
    ratio = statistics.median(on) / statistics.median(off)
    print(
        f"per monitor call (step/epoch end), median of {args.rounds}: off {statistics.median(off) * 1e6:.2f} us, "
        f"share on {statistics.median(on) * 1e6:.2f} us; ratio {ratio:.2f} (target <= {STEP_RATIO_TARGET})"
    )
    print(
        f"pmon thread CPU: {statistics.median(pmon_ms):.2f} ms per second (max {max(pmon_ms):.2f}; "
        f"target <= {PMON_MS_PER_S_TARGET}); epochs with a pmon sample: {seen}"
    )
    ok = ratio <= STEP_RATIO_TARGET and statistics.median(pmon_ms) <= PMON_MS_PER_S_TARGET and seen > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
