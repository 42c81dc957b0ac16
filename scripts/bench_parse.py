#!/usr/bin/env python3
"""Benchmark smiquery's parsers against plain baselines, in one run, and fail when a target is missed.

Measurements (each prints smiquery's number, the baseline's, their ratio and the target):

1. ``smiquery.recordings.read_csv`` of a 1,000,000-row recording (the ``default`` preset, 8 GPUs, header with
   units, ``nounits`` values, some status tokens) vs ``pyarrow.csv.read_csv`` of the same file with default
   options (untyped). Best of 3 each. Target: <= 3.0x. The same for nvidia-smi's default ``--format=csv``
   (units in the values too, one GPU's power ``[N/A]`` throughout).
2. Peak memory of ``read_csv``: the peak RSS (``VmHWM``; ``ru_maxrss`` where there is no /proc) of a child
   process that imports the modules and reads the file, minus that of a child that only imports the same
   modules, vs the final DataFrame's ``memory_usage(deep=True)``. Target: <= 3.0x.
3. Streaming: per-row cost of ``CsvParser(PRESETS["default"]).feed(line)`` vs a bare ``line.split(", ")``
   of the same 100,000 lines (without status tokens), in thread CPU time. Best of 10. Target: <= 10x.

Timed rounds alternate between the two sides of a ratio, so that a busy moment on a shared machine does not
count against one side only.

Usage: ``python scripts/bench_parse.py [--rows N]``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.fields import PRESETS, resolve_fields  # noqa: E402
from smiquery.sources.query_gpu import CsvParser, header_line  # noqa: E402

GPUS = 8
TARGET_READ = 3.0
TARGET_MEMORY = 3.0
TARGET_STREAM = 8.0  # issue 20: CsvParser.feed within 8x a bare split
READ_ROUNDS = 3
STREAM_ROUNDS = 10

_GPU_NAME = "NVIDIA H100 80GB HBM3"


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-1a2b-3c4d-5e6f-{0xABCDEF000000 + i:012x}"


def generate_lines(rows: int, seed: int = 7, *, tokens: bool = True, units: bool = False) -> list[str]:
    """``rows`` data lines as ``nvidia-smi --query-gpu=<default> --format=csv,nounits -lms 100`` prints them.

    With ``tokens``, GPU 7 reports ``[N/A]`` utilization every tenth sweep (as a MIG-enabled GPU does) and
    every 997th row has ``[Unknown Error]`` for power.draw. With ``units``, the values carry their units as in
    nvidia-smi's default ``--format=csv`` (``38 %``, ``214 MiB``, ``69.85 W``) and GPU 3 reports ``[N/A]`` power
    throughout (a GPU without power readings), instead of the tokens above.
    """
    rnd = random.Random(seed)
    start = datetime(2026, 3, 14, 9, 26, 53)
    uuids = [_uuid(i) for i in range(GPUS)]
    temps = [rnd.randint(30, 80) for _ in range(GPUS)]
    out: list[str] = []
    for n in range(rows):
        sweep, gpu = divmod(n, GPUS)
        t = start + timedelta(milliseconds=100 * sweep + gpu)
        stamp = t.strftime("%Y/%m/%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"
        temp = temps[gpu] + rnd.randint(-2, 2)
        util_gpu: str = str(rnd.randint(0, 100))
        util_mem: str = str(rnd.randint(0, 100))
        power = f"{rnd.uniform(60.0, 700.0):.2f}"
        if tokens and gpu == 7 and sweep % 10 == 0:
            # a MIG-enabled GPU reports no utilization
            util_gpu = util_mem = "[N/A]"
        if tokens and n % 997 == 0:
            power = "[Unknown Error]"
        used = rnd.randint(0, 81559)
        if units:
            power = "[N/A]" if gpu == 3 else f"{power} W"
            out.append(
                f"{stamp}, {gpu}, {_GPU_NAME}, {uuids[gpu]}, {temp}, {util_gpu} %, {util_mem} %, {used} MiB, "
                f"81559 MiB, {power}"
            )
            continue
        out.append(f"{stamp}, {gpu}, {_GPU_NAME}, {uuids[gpu]}, {temp}, {util_gpu}, {util_mem}, {used}, 81559, {power}")
    return out


def write_recording(path: Path, rows: int, *, units: bool = False) -> None:
    """A ``rows``-row recording of the default preset: ``nounits`` values, or with ``units`` nvidia-smi's default."""
    fields = resolve_fields("default")
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(header_line(fields) + "\n")
        chunk = 100_000
        for first in range(0, rows, chunk):
            lines = generate_lines(min(chunk, rows - first), seed=first, tokens=not units, units=units)
            f.write("\n".join(lines) + "\n")


def best_of(n: int, *fns: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Best time of each function over ``n`` rounds (wall time unless another ``clock`` is given).

    Each round runs every function once, in alternating order, so that a busy spell on a shared machine slows
    both sides of a ratio rather than one.
    """
    best = [float("inf")] * len(fns)
    for round_ in range(n):
        order = list(enumerate(fns))
        for i, fn in order if round_ % 2 == 0 else reversed(order):
            gc.collect()
            t0 = clock()
            result = fn()
            best[i] = min(best[i], clock() - t0)
            del result
    return best


_CHILD = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import pandas, pyarrow, pyarrow.csv, pyarrow.compute, numpy
import smiquery.recordings
pandas.DataFrame({"a": pandas.array([1], dtype="Int64")})  # load pandas' lazy parts in both children
size = 0
if sys.argv[2] != "-":
    df = smiquery.recordings.read_csv(sys.argv[2])
    size = int(df.memory_usage(deep=True).sum())
peak = None
try:
    # VmHWM is this program's own peak; ru_maxrss also counts the parent's memory at fork time on Linux.
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
print(json.dumps({"maxrss": peak, "df": size}))
"""


def child_peak(path: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), path], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def stream_costs(lines: list[str]) -> tuple[float, float]:
    fields = PRESETS["default"]

    def parse() -> object:
        feed = CsvParser(fields).feed
        for line in lines:
            feed(line)
        return None

    # Both loops run in this one thread, so its CPU time is their cost, and other programs on a shared host
    # do not count. Splitting the lines several times per round keeps both rounds about as long.
    repeat = 8

    def split() -> object:
        for _ in range(repeat):
            for line in lines:
                line.split(", ")
        return None

    t_parse, t_split = best_of(STREAM_ROUNDS, parse, split, clock=time.thread_time)
    return t_parse / len(lines), t_split / (repeat * len(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the recording (default 1,000,000)")
    ap.add_argument("--stream-rows", type=int, default=100_000, help="lines for the streaming measurement")
    args = ap.parse_args()

    import pyarrow.csv as pacsv

    from smiquery.recordings import read_csv

    results: list[tuple[str, str, str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="smiquery-bench-") as tmp:
        path = Path(tmp) / "recording.csv"
        t0 = time.perf_counter()
        write_recording(path, args.rows)
        size_mb = path.stat().st_size / 1e6
        print(
            f"recording: {args.rows:,} rows x 10 fields, {GPUS} GPUs, {size_mb:.1f} MB "
            f"(written in {time.perf_counter() - t0:.1f} s)"
        )

        # memory first, in fresh children, while this process is still small
        base = child_peak("-")
        run = child_peak(str(path))
        peak = run["maxrss"] - base["maxrss"]

        read_csv(path)  # warm up: imports, page cache
        pacsv.read_csv(str(path))
        t_ours, t_arrow = best_of(READ_ROUNDS, lambda: read_csv(path), lambda: pacsv.read_csv(str(path)))
        results.append(
            (
                f"read_csv nounits (best of {READ_ROUNDS})",
                f"{t_ours:.3f} s",
                f"{t_arrow:.3f} s",
                t_ours / t_arrow,
                TARGET_READ,
            )
        )
        units = Path(tmp) / "units.csv"
        write_recording(units, args.rows, units=True)
        read_csv(units)
        t_ours, t_arrow = best_of(READ_ROUNDS, lambda: read_csv(units), lambda: pacsv.read_csv(str(units)))
        results.append(
            (
                f"read_csv with units (best of {READ_ROUNDS})",
                f"{t_ours:.3f} s",
                f"{t_arrow:.3f} s",
                t_ours / t_arrow,
                TARGET_READ,
            )
        )
        units.unlink()
        results.append(
            (
                "read_csv peak RSS vs DataFrame size",
                f"{peak / 2**20:.0f} MiB",
                f"{run['df'] / 2**20:.0f} MiB",
                peak / run["df"],
                TARGET_MEMORY,
            )
        )

    lines = generate_lines(args.stream_rows, seed=99, tokens=False)
    per_parse, per_split = stream_costs(lines)
    results.append(
        (
            f"CsvParser.feed per row (best of {STREAM_ROUNDS})",
            f"{per_parse * 1e6:.2f} us",
            f"{per_split * 1e6:.2f} us",
            per_parse / per_split,
            TARGET_STREAM,
        )
    )

    print()
    print("baselines: pyarrow.csv.read_csv(path) with default options; DataFrame.memory_usage(deep=True).sum();")
    print('           line.split(", ") of the same lines.')
    print("peak RSS: VmHWM (ru_maxrss off Linux) of a child that imports pandas/pyarrow/smiquery.recordings and runs")
    print("          read_csv, minus that of a child that only imports the same modules.")
    print("streaming: CPU time of this thread; rows without status tokens (a token row takes the slower path).")
    print()
    header = f"{'measurement':<38} {'smiquery':>11} {'baseline':>11} {'ratio':>7} {'target':>7}  result"
    print(header)
    print("-" * len(header))
    failed = False
    for name, ours, baseline, ratio, target in results:
        ok = ratio <= target
        failed = failed or not ok
        print(f"{name:<38} {ours:>11} {baseline:>11} {ratio:>6.2f}x {target:>6.1f}x  {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
