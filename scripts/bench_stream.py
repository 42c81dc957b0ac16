#!/usr/bin/env python3
"""Stream engine benchmarks: monitoring cost, delivery latency, memory. Ratios from one run, one process.

1. Cost: CPU seconds (this process + children) per sweep of ``stream(interval=0.1)`` against one
   spawn-per-sample call (``subprocess.run`` of the same query + ``split``, what GPUtil does), with the fake
   nvidia-smi set to a 50 ms start-up and 8 GPUs. Target: stream <= 1/20 of spawn.
2. Latency: time from the child writing a row (its timestamp) to the consumer receiving the sample. Target p99 <= 5 ms.
3. Memory: peak RSS growth while 1,000,000 rows pass through ``stream()``. Target < 5 MB.

Exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import smiquery
from smiquery.fields import resolve_fields
from smiquery.sources.query_gpu import header_line
from smiquery.testing import fake_nvidia_smi


def cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_cost(smi: Path, sweeps: int) -> tuple[float, float]:
    fields = ",".join(f.name for f in resolve_fields("default"))
    argv = [str(smi), f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    # GPUtil-style: one process per sample, parsed by splitting.
    c0 = cpu_seconds()
    for _ in range(sweeps):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows = [line.split(", ") for line in out.splitlines() if line]
        assert len(rows) == 8
    spawn = (cpu_seconds() - c0) / sweeps
    c0 = cpu_seconds()
    with smiquery.stream("default", interval=0.1, nvidia_smi=smi) as s:
        got = sum(len(sw) for sw in s.sweeps(count=sweeps))
    assert got == 8 * sweeps
    streamed = (cpu_seconds() - c0) / sweeps
    return streamed, spawn


def bench_latency(smi: Path, rows: int) -> list[float]:
    # One GPU, so each sweep is one row stamped when the fake formats it; the stamp is cut to whole
    # milliseconds, which overstates the latency by up to 1 ms (a conservative measurement).
    lat = []
    with smiquery.stream(["timestamp", "index", "utilization.gpu"], interval=0.01, gpus=[0], nvidia_smi=smi) as s:
        for sample in s:
            now = time.time()
            ts = sample.timestamp
            assert ts is not None
            lat.append(now - ts.timestamp())
            if len(lat) >= rows:
                break
    return lat[5:]  # skip start-up


def write_wide_recording(path: Path, gpus: int) -> None:
    """A 2-sweep recording of ``gpus`` GPUs, so 1,000,000 rows take few sweeps (fast to generate)."""
    fields = resolve_fields("default")
    lines = [header_line(fields)]
    now = datetime.now().astimezone()
    for sweep in range(2):
        for i in range(gpus):
            values = [
                now,
                i,
                "NVIDIA H100 80GB HBM3",
                f"GPU-{i:08x}-0000-4000-8000-{sweep:012x}",
                60 + i % 20,
                (i * 7) % 101,
                (i * 3) % 101,
                40000 + i,
                81559,
                300.0 + (i % 400),
            ]
            lines.append(", ".join(f.format(v, units=True) for f, v in zip(fields, values)))
    path.write_text("\n".join(lines) + "\n")


MEMORY_CHILD = r"""
import resource, sys, smiquery
smi, total = sys.argv[1], int(sys.argv[2])
def rss_kb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with smiquery.stream("default", interval=0.001, nvidia_smi=smi) as s:
    it = iter(s)
    for _ in range(50_000):
        next(it)
    base = rss_kb()
    n = 50_000
    for _ in it:
        n += 1
        if n >= total:
            break
    print(base, rss_kb(), n, s.stats.dropped_rows, s.stats.restarts)
"""


def bench_memory(tmp: Path, total: int) -> tuple[float, int]:
    rec = tmp / "wide.csv"
    write_wide_recording(rec, 1000)
    smi = fake_nvidia_smi(tmp / "wide", recording=rec)
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(smi), str(total)], capture_output=True, text=True, check=True
    ).stdout.split()
    base, peak, n, dropped, restarts = map(int, out)
    assert dropped == 0 and restarts == 0, (dropped, restarts)
    return (peak - base) / 1024, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=40)
    ap.add_argument("--latency-rows", type=int, default=2000)
    ap.add_argument("--memory-rows", type=int, default=1_000_000)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        slow = fake_nvidia_smi(tmp / "slow", start_delay=0.05)
        streamed, spawn = bench_cost(slow, args.sweeps)
        results.append(
            (
                "CPU s per sweep, stream vs spawn",
                f"{streamed * 1e3:.2f} ms",
                f"{spawn * 1e3:.1f} ms",
                streamed / spawn,
                "<= 0.05",
            )
        )
        fast = fake_nvidia_smi(tmp / "fast")
        lat = sorted(bench_latency(fast, args.latency_rows))
        p99 = lat[int(len(lat) * 0.99) - 1]
        results.append(
            (
                "row delivery latency p99 (ms)",
                f"{p99 * 1e3:.2f}",
                f"median {statistics.median(lat) * 1e3:.2f}",
                p99 * 1e3,
                "<= 5",
            )
        )
        growth_mb, n = bench_memory(tmp, args.memory_rows)
        results.append((f"peak RSS growth over {n:,} rows (MB)", f"{growth_mb:.2f}", "-", growth_mb, "< 5"))
    ok = [results[0][3] <= 0.05, results[1][3] <= 5.0, results[2][3] < 5.0]
    print(f"{'measurement':40} {'smiquery':>12} {'baseline':>16} {'value':>8} {'target':>8}  verdict")
    for (name, a, b, v, t), good in zip(results, ok):
        print(f"{name:40} {a:>12} {b:>16} {v:8.3f} {t:>8}  {'PASS' if good else 'FAIL'}")
    print(f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
