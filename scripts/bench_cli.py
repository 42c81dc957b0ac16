"""Start-up cost of `smiquery query --format csv` against `python -c "import GPUtil; GPUtil.getGPUs()"`.

Both run as whole processes, side by side in one run (alternating, N times each), against the same fake
nvidia-smi, which is put first on PATH for both. Prints the medians and the ratio smiquery / GPUtil, and
exits 1 when the ratio of the fastest runs is above 1.0 (smiquery slower). Also checks that the CSV query did not
import pandas, and times the same query through typer's parser (`-Fcsv`, a spelling the fast path leaves to
typer) to show what the fast path saves.

    .venv/bin/python scripts/bench_cli.py [-n 15]
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
from pathlib import Path

from smiquery.testing import fake_nvidia_smi

ROOT = Path(__file__).resolve().parent.parent


_CPU: dict[int, list[float]] = {}


def _timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall time of one run; its CPU time (the command and its children, nvidia-smi included) goes to _CPU."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    _CPU.setdefault(id(argv), []).append(cpu)
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
        typer_argv = [*smiquery_argv[:-2], "-Fcsv"]  # the same query, parsed by typer

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

        for argv in (smiquery_argv, gputil_argv, typer_argv):  # warm the page cache and .pyc files
            _timed(argv, env)
        ours: list[float] = []
        theirs: list[float] = []
        typer_path: list[float] = []
        for i in range(args.n):
            trio = [(smiquery_argv, ours), (gputil_argv, theirs), (typer_argv, typer_path)]
            if i % 2:
                trio.reverse()
            for argv, into in trio:
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
    m_typer = statistics.median(typer_path)
    print(f"same query through typer (-Fcsv):  min {min(typer_path) * 1000:7.1f} ms  median {m_typer * 1000:7.1f} ms")
    print(f"fast path / typer path (min):      {min(ours) / min(typer_path):.2f}  (median {m_ours / m_typer:.2f})")
    # CPU time is steadier than wall time on a shared machine: waiting for a core is not counted
    cpu = {name: min(_CPU[id(argv)]) * 1000 for name, argv in (("fast", smiquery_argv), ("typer", typer_argv))}
    cpu["GPUtil"] = min(_CPU[id(gputil_argv)]) * 1000
    print(
        f"CPU time (min, with nvidia-smi):   fast path {cpu['fast']:.0f} ms, typer path {cpu['typer']:.0f} ms, "
        f"GPUtil {cpu['GPUtil']:.0f} ms"
    )
    return 0 if ratio <= 1.0 and not pandas_loaded else 1


if __name__ == "__main__":
    sys.exit(main())
