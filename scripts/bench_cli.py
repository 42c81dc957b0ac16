"""Start-up cost of `smiquery query --format csv` against `python -c "import GPUtil; GPUtil.getGPUs()"`.

Both run as whole processes, side by side in one run (alternating, N times each), against the same fake
nvidia-smi, which is put first on PATH for both. Prints the medians and the ratio smiquery / GPUtil, and
exits 1 when the ratio of the fastest runs is above 1.0 (smiquery slower). Also checks that the CSV query did not
import pandas.

    .venv/bin/python scripts/bench_cli.py [-n 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smiquery.testing import fake_nvidia_smi

ROOT = Path(__file__).resolve().parent.parent


def _timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"bench_cli: {argv} failed with {done.returncode}: {done.stderr.decode(errors='replace')[-400:]}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=15, help="repetitions of each (default 15)")
    args = ap.parse_args()

    python = sys.executable
    console = Path(python).with_name("smiquery")
    with tempfile.TemporaryDirectory(prefix="smiquery-bench-") as tmp:
        fake = fake_nvidia_smi(tmp)
        env = dict(os.environ)
        env["PATH"] = f"{fake.parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("SMIQUERY_NVIDIA_SMI", None)
        env["PYTHONWARNINGS"] = "ignore"  # GPUtil imports the deprecated distutils
        smiquery_argv = (
            [str(console), "query", "--format", "csv"]
            if console.exists()
            else [python, "-m", "smiquery", "query", "--format", "csv"]
        )
        gputil_argv = [python, "-c", "import GPUtil; GPUtil.getGPUs()"]

        # no pandas on this path: the same command under a wrapper that reports what got imported
        probe = (
            "import sys, runpy; sys.argv = ['smiquery', 'query', '--format', 'csv']\n"
            "try:\n    runpy.run_module('smiquery', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "sys.stderr.write('PANDAS=%s\\n' % ('pandas' in sys.modules))\n"
        )
        done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, check=False)
        pandas_loaded = "PANDAS=True" in done.stderr
        if "PANDAS=" not in done.stderr:
            sys.exit(f"bench_cli: the import probe failed: {done.stderr[-400:]}")

        for argv in (smiquery_argv, gputil_argv):  # warm the page cache and .pyc files
            _timed(argv, env)
        ours: list[float] = []
        theirs: list[float] = []
        for i in range(args.n):
            pair = [(smiquery_argv, ours), (gputil_argv, theirs)]
            if i % 2:
                pair.reverse()
            for argv, into in pair:
                into.append(_timed(argv, env))

    m_ours = statistics.median(ours)
    m_theirs = statistics.median(theirs)
    # The verdict uses the fastest run of each (as timeit does): on a busy machine other processes only ever
    # add time, so the minimum is the steadiest estimate of what a command itself costs. Medians are shown too.
    ratio = min(ours) / min(theirs)
    paired = statistics.median(a / b for a, b in zip(ours, theirs))
    print(f"runs each:                         {args.n} (alternating, same fake nvidia-smi on PATH)")
    print(f"smiquery query --format csv:       min {min(ours) * 1000:7.1f} ms  median {m_ours * 1000:7.1f} ms")
    print(f"GPUtil.getGPUs():                  min {min(theirs) * 1000:7.1f} ms  median {m_theirs * 1000:7.1f} ms")
    print(f"ratio of medians:                  {m_ours / m_theirs:.2f}  (median of paired ratios {paired:.2f})")
    print(f"ratio smiquery / GPUtil (min):     {ratio:.2f}  ({'OK' if ratio <= 1.0 else 'TOO SLOW'}: must be <= 1.00)")
    print(f"pandas imported by the CSV query:  {'YES (must not be)' if pandas_loaded else 'no'}")
    return 0 if ratio <= 1.0 and not pandas_loaded else 1


if __name__ == "__main__":
    sys.exit(main())
