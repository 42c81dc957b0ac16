"""Tiny scripted nvidia-smi executables for supervisor and runner tests: real processes, real pipes, real signals.

Each script prints rows for the fields ``index, temperature.gpu`` (the temperature is 40 + the GPU index plus
the sweep number, so rows of different instants differ) at the interval nvidia-smi was given (``-l``/``-lms``),
following a plan written in a few lines of Python with these helpers:

* ``sweep(gpus)``: one row per GPU in ``gpus``, then sleep the interval;
* ``out(text)``: print a line (a message, garbage...);
* ``DT``: the interval in seconds; ``N``: the sweep counter; ``STATE``: a file for state across starts.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

FIELDS = ["index", "temperature.gpu"]

_PRELUDE = '''
import os, signal, subprocess, sys, time
argv = sys.argv[1:]
ms = 1000
for i, a in enumerate(argv):
    if a == "-lms":
        ms = int(argv[i + 1])
    elif a == "-l":
        ms = int(argv[i + 1]) * 1000
DT = ms / 1000
N = 0
STATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state")

def out(text):
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()

def sweep(gpus, pause=True):
    global N
    for g in gpus:
        out(f"{g}, {40 + g + N % 10}")
    N += 1
    if pause:
        time.sleep(DT)

def starts():
    """How many times this script was started before (counted in STATE)."""
    n = int(open(STATE).read()) if os.path.exists(STATE) else 0
    with open(STATE, "w") as f:
        f.write(str(n + 1))
    return n
'''


def scripted_smi(folder: Path, plan: str, name: str = "nvidia-smi") -> Path:
    """Write an executable nvidia-smi that runs ``plan`` (Python, using the helpers above) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\n" + _PRELUDE + "\n" + textwrap.dedent(plan).strip() + "\n")
    path.chmod(0o755)
    return path
