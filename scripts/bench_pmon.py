#!/usr/bin/env python3
"""Cost of parsing ``nvidia-smi pmon`` output, and memory over a long stream.

1. Per-line cost of ``PmonParser.feed(line)`` against a bare ``line.split()`` of the same 100,000 pmon lines
   (``-s um`` columns, 4 GPUs, busy and idle lines), in thread CPU time, best of 7 alternating rounds. Prints the
   ratio; target <= 12x (measured 9-11x on a busy 2-core box).
2. RSS over 1,000,000 lines fed through the parser and the per-instant grouping (``samples()``'s), with
   ``top_processes`` on every instant, as a day-long stream would: VmRSS after 100,000 lines and after
   1,000,000. Target: growth <= 2 MiB (flat: nothing is kept per line).

Usage: ``python scripts/bench_pmon.py``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.sources.pmon import InstantGrouper, PmonParser, top_processes  # noqa: E402

SPLIT_TARGET = 12.0
RSS_TARGET_MIB = 2.0
HEADER = (ROOT / "tests" / "fixtures" / "pmon-h100x4-590-um.txt").read_text(encoding="utf-8").splitlines()[:2]


def _lines(n: int) -> Iterator[str]:
    """``n`` pmon data lines in the -s um layout: 4 GPUs, 3 processes on three of them, GPU 3 idle."""
    i = 0
    while i < n:
        for gpu in range(4):
            procs = [(7000 + gpu * 10 + k, k) for k in range(3)] if gpu != 3 else [(None, 0)]
            for pid, k in procs:
                if i >= n:
                    return
                if pid is None:
                    yield f"{gpu:>5}{'-':>11}{'-':>6}" + f"{'-':>7}" * 7 + "    -              "
                else:
                    sm = (i + k * 7) % 100
                    cells = f"{sm:>7}{sm // 4:>7}{'-':>7}{'-':>7}{'-':>7}{'-':>7}{20000 + k:>7}"
                    yield f"{gpu:>5}{pid:>11}{'C':>6}{cells}    python3        "
                i += 1


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> int:
    """Run both measurements; returns the exit status."""
    lines = list(_lines(100_000))
    parser = PmonParser()
    for h in HEADER:
        parser.feed(h)
    feed = parser.feed

    def ours() -> None:
        for line in lines:
            feed(line)

    def split() -> None:
        for line in lines:
            line.split()

    gc.disable()
    best = {"PmonParser.feed": float("inf"), "str.split": float("inf")}
    for _ in range(7):
        best["PmonParser.feed"] = min(best["PmonParser.feed"], _cpu(ours))
        best["str.split"] = min(best["str.split"], _cpu(split))
    gc.enable()
    n = len(lines)
    for name, t in best.items():
        print(f"{name + ':':18} {t / n * 1e9:7.0f} ns/line")
    ratio = best["PmonParser.feed"] / best["str.split"]
    ok_split = ratio <= SPLIT_TARGET
    print(f"ratio parser / str.split: {ratio:.1f}x  ({'OK' if ok_split else 'TOO SLOW'}: must be <= {SPLIT_TARGET:g}x)")
    lines.clear()

    stream_parser = PmonParser(strict=False)
    for h in HEADER:
        stream_parser.feed(h)
    grouper = InstantGrouper()
    rss_at: dict[int, float] = {}
    instants = 0
    for i, line in enumerate(_lines(1_000_000), 1):
        row = stream_parser.feed(line)
        if row is not None:
            done = grouper.feed(row)
            if done is not None:
                top_processes(done, 2)
                instants += 1
        if i in (100_000, 1_000_000):
            gc.collect()
            rss_at[i] = _rss_mib()
    growth = rss_at[1_000_000] - rss_at[100_000]
    ok_rss = growth <= RSS_TARGET_MIB
    print(
        f"RSS after 100,000 lines {rss_at[100_000]:.1f} MiB, after 1,000,000 {rss_at[1_000_000]:.1f} MiB "
        f"({instants} instants): growth {growth:+.2f} MiB ({'OK' if ok_rss else 'GROWS'}: must be <= "
        f"{RSS_TARGET_MIB:g} MiB)"
    )
    return 0 if ok_split and ok_rss else 1


if __name__ == "__main__":
    sys.exit(main())
