"""Start-up cost: `import smiquery`, one fake nvidia-smi call, and `smiquery query` (with `--help`) as processes.

Each command runs as a whole process, N times, interleaved with a bare `python -c pass` baseline measured in the
same run. Prints the median wall time of each in ms and its ratio to the baseline median (1.0 would be free start-up:
nothing beyond the interpreter's own). The fake is the script written by smiquery.testing.fake_nvidia_smi, and
`smiquery query` runs against it (put first on PATH). The commands run in an empty folder, so `-c` and `-m` import
smiquery from where this interpreter finds it (PYTHONPATH first), never from the current directory.

    .venv/bin/python scripts/bench_start.py [-n 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    """Wall time of one run in ms; exits when the command fails (a broken command must not look fast)."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, check=False)
    elapsed = (time.perf_counter() - t0) * 1000.0
    if done.returncode != 0:
        sys.exit(f"bench_start: {argv} failed with {done.returncode}: {done.stderr.decode(errors='replace')[-400:]}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-n", type=int, default=21, help="runs of each command (default 21)")
    args = ap.parse_args()

    from smiquery.testing import fake_nvidia_smi

    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="smiquery-bench-") as tmp:
        fake = fake_nvidia_smi(tmp)
        env = dict(os.environ)
        env["PATH"] = f"{fake.parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("SMIQUERY_NVIDIA_SMI", None)
        commands: dict[str, list[str]] = {
            "python -c pass (baseline)": [python, "-c", "pass"],
            "import smiquery": [python, "-c", "import smiquery"],
            "fake nvidia-smi --query-gpu": [
                str(fake),
                "--query-gpu=timestamp,index,uuid,name,utilization.gpu,memory.used,power.draw",
                "--format=csv,nounits",
            ],
            "smiquery query --help": [python, "-m", "smiquery", "query", "--help"],
            "smiquery query": [python, "-m", "smiquery", "query"],
        }
        for argv in commands.values():  # warm the page cache and the .pyc files
            _timed(argv, env, tmp)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.n):
            for name, argv in commands.items():
                times[name].append(_timed(argv, env, tmp))

    base = statistics.median(times["python -c pass (baseline)"])
    print(f"{'command':<32}{'median ms':>10}{'x baseline':>12}   (n={args.n}, {python})")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<32}{med:>10.1f}{med / base:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
