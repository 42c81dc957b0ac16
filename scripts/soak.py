"""Soak the stream supervisor: hours of an 8-GPU stream compressed into minutes, with faults injected at random.

A scripted nvidia-smi (a real process on real pipes, `-lms 10`) runs a random plan, one segment per start: some
sweeps, maybe a fault in the middle (a garbage line, a GPU whose cells read [GPU is lost], a GPU whose rows stop),
then a fault that ends the child (a crash cutting a sweep short, a hang, a hang ignoring SIGTERM), sometimes after
a slow start. Every row carries its sweep number in `temperature.gpu`, so a sweep mixing two instants shows.

It checks, and prints: no sweep mixes instants; every injected fault is counted once (errors by type, dropped
rows, short sweeps, lost GPUs, restarts); at most one live child at any moment; restarts no more than the plan
asks for; RSS, open fds and threads flat. Exit status 1 when a check fails.

    python scripts/soak.py [--minutes 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from smiquery.retry import RetryPolicy
from smiquery.source import StreamEvent, Sweep
from smiquery.supervisor import stream

GPUS = 8
FAKE = r"""
import json, os, signal, sys, time
argv = sys.argv[1:]
ms = int(argv[argv.index("-lms") + 1]) if "-lms" in argv else 1000
DT = ms / 1000
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts"), "a+") as f:
    f.seek(0)
    n = len(f.read())
    f.write(".")
plan = json.load(open(os.path.join(here, "plan.json")))
seg = plan[n] if n < len(plan) else {"sweeps": 10**9, "mid": None, "end": None, "slow": 0}
out = sys.stdout
N = n * 1000  # sweep numbers never repeat across children

def row(g, lost=False):
    t = "[GPU is lost]" if lost else str(40 + (N % 50))
    out.write(f"{g}, {t}\n")

if seg["slow"]:
    time.sleep(seg["slow"])
mid_at = seg["sweeps"] // 2
lost_gpu = dropped_gpu = None
for i in range(seg["sweeps"]):
    if i == mid_at and seg["mid"] == "garbage":
        out.write("0, 4\x00\xff2, garbage\n")
    if i == mid_at and seg["mid"] == "gpu-lost":
        lost_gpu = 3
    if i == mid_at and seg["mid"] == "dropout":
        dropped_gpu = 5
    for g in range(8):
        if g != dropped_gpu:
            row(g, lost=g == lost_gpu)
    out.flush()
    N += 1
    time.sleep(DT)
end = seg["end"]
if end == "crash":
    for g in range(3):  # a sweep cut short
        row(g)
    out.write("Unable to determine the device handle for GPU 0000:02:00.0: Unknown Error\n")
    out.flush()
    sys.exit(255)
if end == "hang-ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if end in ("hang", "hang-ignore-term"):
    while True:
        time.sleep(3600)
"""


def make_plan(rng: random.Random, segments: int) -> list[dict[str, object]]:
    plan = []
    for _ in range(segments):
        plan.append(
            {
                "sweeps": rng.randint(60, 300),
                "mid": rng.choice([None, None, "garbage", "gpu-lost", "dropout"]),
                "end": rng.choice(["crash", "crash", "hang", "hang-ignore-term"]),
                "slow": rng.choice([0, 0, 0, 1.5]),
            }
        )
    return plan


def one_instant(sweep: Sweep) -> bool:
    idx = [s.index for s in sweep]
    phases = {s.temperature_gpu for s in sweep if s.temperature_gpu is not None}
    return idx == sorted(set(idx)) and len(phases) <= 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="wall time of the soak (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the supervisor warns about every injected fault; the totals say it
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="smiquery-soak-"))
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n{FAKE}")
    smi.chmod(0o755)
    plan = make_plan(rng, 10_000)
    (folder / "plan.json").write_text(json.dumps(plan))

    me = psutil.Process()
    events: Counter[str] = Counter()
    max_children = 0
    stop = threading.Event()

    def live(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch_children() -> None:
        nonlocal max_children
        while not stop.is_set():
            n = sum(1 for p in me.children(recursive=True) if live(p))
            max_children = max(max_children, n)
            time.sleep(0.005)

    def on_event(e: StreamEvent) -> None:
        events[e.kind] += 1

    watcher = threading.Thread(target=watch_children, daemon=True)
    watcher.start()
    s = stream(
        ["index", "temperature.gpu"],
        interval=0.01,
        nvidia_smi=smi,
        stall_timeout=0.5,
        startup_timeout=5.0,
        retry=RetryPolicy(backoff_initial=0.01, backoff_max=0.2, healthy_after=0.3),
        on_event=on_event,
    )
    mixed = sweeps = 0
    samples: list[tuple[float, int, int, int]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_sample = t0 + 10  # after warm-up
    with s:
        for sw in s.sweeps():
            sweeps += 1
            if not one_instant(sw):
                mixed += 1
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, me.memory_info().rss, me.num_fds(), threading.active_count()))
                next_sample = now + 2
            if now >= end:
                break
    stop.set()
    watcher.join()
    elapsed = time.monotonic() - t0
    st = s.stats
    children = len((folder / "starts").read_text())
    injected = Counter()
    for seg in plan[: children - 1]:  # the last child was stopped by us, its end fault never came
        injected[str(seg["end"])] += 1
        if seg["mid"]:
            injected[str(seg["mid"])] += 1
    last = plan[children - 1]
    # the running child's mid-segment fault may or may not have struck yet
    pending_mid = str(last["mid"]) if last["mid"] else None

    def within(got: int, want: int, kind: str) -> bool:
        return got == want or (pending_mid == kind and got == want + 1)

    def floor(col: int, first: bool = False) -> int:
        third = max(len(samples) // 3, 1)
        part = samples[:third] if first else samples[-third:]
        return min((row[col] for row in part), default=0)

    timeouts = injected["hang"] + injected["hang-ignore-term"]
    checks = {
        "no sweep mixes instants": mixed == 0,
        "crashes counted once (UnknownError exits)": st.errors["NvidiaSmiFailedError"] == injected["crash"],
        "hangs counted once (timeouts)": st.errors["NvidiaSmiTimeoutError"] == timeouts,
        "garbage lines counted once (dropped rows)": within(st.dropped_rows, injected["garbage"], "garbage"),
        "lost GPUs counted once (cells + dropouts)": st.gpu_lost_events
        in {
            injected["gpu-lost"] + injected["dropout"],
            injected["gpu-lost"] + injected["dropout"] + (1 if pending_mid in ("gpu-lost", "dropout") else 0),
        },
        "short sweeps = cut sweeps + garbage": within(
            st.short_sweeps, injected["crash"] + injected["garbage"], "garbage"
        ),
        "restarts = injected ending faults": st.restarts == children - 1 == sum(st.errors.values()),
        "at most one live child": max_children <= 1,
        "RSS flat (< 8 MiB growth after warm-up)": not samples or samples[-1][1] - samples[0][1] < 8 << 20,
        # a child's pipes come and go with restarts: a leak shows as a floor that rises, so compare the lowest
        # count in the last third of the run with the lowest in the first third
        "fds flat": floor(2) <= floor(2, first=True),
        "threads flat": floor(3) <= floor(3, first=True),
    }
    print(f"soak: {elapsed:.0f} s wall, {sweeps} sweeps at -lms 10 (= {sweeps / 3600:.1f} h at 1 Hz), 8 GPUs")
    print(f"children started: {children}; injected: {dict(sorted(injected.items()))}")
    print(
        f"stats: rows {st.rows}, sweeps {st.sweeps}, short {st.short_sweeps}, dropped rows {st.dropped_rows}, "
        f"restarts {st.restarts}, GPU losses {st.gpu_lost_events}, errors {dict(st.errors)}"
    )
    print(f"events: {dict(sorted(events.items()))}; max live children {max_children}")
    if samples:
        (t_a, rss_a, fd_a, th_a), (t_b, rss_b, fd_b, th_b) = samples[0], samples[-1]
        print(
            f"RSS {rss_a / 2**20:.1f} -> {rss_b / 2**20:.1f} MiB, fds {fd_a} -> {fd_b} (floor {floor(2, True)} -> "
            f"{floor(2)}), threads {th_a} -> {th_b} (t = {t_a:.0f} s -> {t_b:.0f} s, {len(samples)} samples)"
        )
    failed = [name for name, ok in checks.items() if not ok]
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
