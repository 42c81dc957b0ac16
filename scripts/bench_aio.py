#!/usr/bin/env python3
"""CPU per sweep of ``smiquery.aio.stream`` against the sync ``smiquery.stream``, on the same fake.

Both read the bundled 8-GPU demo from one fake nvidia-smi in loop mode (``-lms 20``, the ``default`` preset) for
``--sweeps`` sweeps; this process's CPU time (``time.process_time``: every thread, not the child) is divided by
the sweep count. Rounds alternate between the two; the best round of each counts. Target: aio <= 1.1x sync (issue 20).

Usage: ``python scripts/bench_aio.py [--sweeps N] [--rounds N]``. Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import smiquery  # noqa: E402
from smiquery import aio  # noqa: E402
from smiquery.testing import fake_nvidia_smi  # noqa: E402

TARGET = 1.1
INTERVAL = 0.02


def _sync(fake: Path, sweeps: int) -> float:
    with smiquery.stream("default", interval=INTERVAL, nvidia_smi=fake) as s:
        it = s.sweeps()
        next(it)  # the child's start-up is not what is measured
        start = time.process_time()
        for _ in range(sweeps):
            next(it)
        spent = time.process_time() - start
        it.close()  # type: ignore[attr-defined]
    return spent / sweeps


def _async(fake: Path, sweeps: int) -> float:
    async def run() -> float:
        async with aio.stream("default", interval=INTERVAL, nvidia_smi=fake) as s:
            it = s.sweeps()
            await it.__anext__()
            start = time.process_time()
            for _ in range(sweeps):
                await it.__anext__()
            spent = time.process_time() - start
            await it.aclose()  # type: ignore[attr-defined]
        return spent / sweeps

    return asyncio.run(run())


def main() -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best = {"sync": float("inf"), "aio": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        fake = fake_nvidia_smi(Path(tmp) / "bin")
        for _ in range(args.rounds):
            best["sync"] = min(best["sync"], _sync(fake, args.sweeps))
            best["aio"] = min(best["aio"], _async(fake, args.sweeps))
    for name, t in best.items():
        print(f"{name + ' stream:':13} {t * 1e6:8.0f} us CPU per 8-GPU sweep")
    ratio = best["aio"] / best["sync"]
    ok = ratio <= TARGET
    print(f"ratio aio / sync: {ratio:.2f}  ({'OK' if ok else 'TOO SLOW'}: must be <= {TARGET:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
