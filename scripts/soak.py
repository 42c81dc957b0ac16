"""Soak the stream supervisor: hours of a multi-GPU stream compressed into minutes, with faults injected at random.

A scripted nvidia-smi (a real process on real pipes, `-lms 10`) runs a random plan, one segment per start: some
sweeps, maybe a fault in the middle (a garbage line, a GPU whose cells read [GPU is lost], a GPU whose rows stop),
maybe a step of the wall clock (back or forward, seconds to an hour, between GPU 3's and GPU 4's rows of one
sweep; later children keep the shifted clock), then a fault that ends the child (a crash cutting a sweep short, a
hang, a hang ignoring SIGTERM, or a driver reload: the sweep is cut, exit 255, and the next child sees GPUs 0 and 1
swapped, GPU 1 removed and the rest renumbered down, or a GPU added), sometimes after a slow start. Every row
carries its loop iteration (unique across children) in `memory.used`, and its GPU's UUID.

Checks (each printed as `ok` or `FAIL` with the count behind it; exit status 1 when one fails):
  - 0 mixed instants: no sweep holds two rows of one GPU (UUID or index) or rows of two loop iterations;
  - 0 lost events naming a GPU that is delivering: a `gpu_lost` event's UUID has no row with values in the sweep
    delivered next after the event nor the one after it (on_event fires before the sweep that caused it is
    delivered, or right after; an engine that queued events behind several sweeps would need another check);
  - every injected fault counted once (errors by type, dropped rows, short sweeps, lost GPUs, restarts), at most
    one live child at any moment, restarts no more than the plan asks for; RSS, open fds and threads flat.

    python scripts/soak.py [--minutes 3] [--seed 1]

Output: a summary (wall time, sweeps, children started, faults injected by kind, the supervisor's stats and
events, RSS/fds/threads at the first and last sample), then one line per check: `  ok   <check> (<figures>)` or
`  FAIL <check> (<figures>)`. `--minutes 1` is a quick run.
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
from smiquery.streams.sync import stream

GPUS = 8
FIELDS = ["timestamp", "index", "uuid", "memory.used"]
FAKE = r"""
import json, os, signal, sys, time
from datetime import datetime
argv = sys.argv[1:]
ms = int(argv[argv.index("-lms") + 1]) if "-lms" in argv else 1000
DT = ms / 1000
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts"), "a+") as f:
    f.seek(0)
    n = len(f.read())
    f.write(".")
plan = json.load(open(os.path.join(here, "plan.json")))
seg = plan[n] if n < len(plan) else dict(plan[-1], sweeps=10**9, mid=None, end=None, slow=0, step=None)
out = sys.stdout
N = n * 100000  # loop iterations never repeat across children
offset = seg["clock"]  # the wall clock's shift: a step stays for later children

def row(g, lost=False):
    stamp = datetime.fromtimestamp(time.time() + offset)
    ts = stamp.strftime("%Y/%m/%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d}"
    tag = "[GPU is lost]" if lost else str(N)
    out.write(f"{ts}, {g}, {seg['layout'][g]}, {tag}\n")

if seg["slow"]:
    time.sleep(seg["slow"])
gpus = len(seg["layout"])
mid_at = seg["sweeps"] // 2
step_at = seg["sweeps"] // 3
lost_gpu = dropped_gpu = None
for i in range(seg["sweeps"]):
    if i == mid_at and seg["mid"] == "garbage":
        out.write("0, 4\x00\xff2, garbage\n")
    if i == mid_at and seg["mid"] == "gpu-lost":
        lost_gpu = 3
    if i == mid_at and seg["mid"] == "dropout":
        dropped_gpu = 5
    for g in range(gpus):
        if i == step_at and g == 4 and seg["step"]:
            offset += seg["step"]  # mid-sweep: GPUs 0-3 before the step, 4.. after it
        if g != dropped_gpu:
            row(g, lost=g == lost_gpu)
    out.flush()
    N += 1
    time.sleep(DT)
end = seg["end"]
if end in ("crash", "reenumerate"):
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

# wall-clock steps in seconds: NTP slews below 0.128 s, so a step is larger; an hour is a badly set clock
STEPS = [-3600.0, -30.0, -1.5, 1.5, 30.0, 3600.0]


def uuid_of(k: int) -> str:
    return f"GPU-5eed0000-0000-4000-8000-{k:012x}"


def make_plan(rng: random.Random, segments: int) -> list[dict[str, object]]:
    plan: list[dict[str, object]] = []
    layout = [uuid_of(k) for k in range(GPUS)]
    made = GPUS  # physical GPUs made so far: an added one gets a UUID never seen before
    clock = 0.0
    for _ in range(segments):
        end = rng.choice(["crash", "crash", "hang", "hang-ignore-term", "reenumerate"])
        mode = None
        if end == "reenumerate":
            mode = rng.choice(["swap", "remove", "add"])
            if mode == "remove" and len(layout) <= 6:  # GPU 5 must stay for `dropout`
                mode = "add"
            if mode == "add" and len(layout) >= 12:
                mode = "remove"
        step = rng.choice([None, None, *STEPS])
        if step is not None and abs(clock + step) > 7200:  # keep the clock within two hours of the truth
            step = -step
        plan.append(
            {
                "sweeps": rng.randint(60, 300),
                "mid": rng.choice([None, None, "garbage", "gpu-lost", "dropout"]),
                "end": end,
                "mode": mode,
                "slow": rng.choice([0, 0, 0, 1.5]),
                "layout": list(layout),
                "clock": clock,
                "step": step,
            }
        )
        clock += step or 0.0
        if mode == "swap":
            layout[0], layout[1] = layout[1], layout[0]
        elif mode == "remove":
            del layout[1]
        elif mode == "add":
            layout.append(uuid_of(made))
            made += 1
    return plan


def mixed(sweep: Sweep) -> bool:
    """Two rows of one GPU, or rows of two loop iterations (the tag in `memory.used`) in one sweep."""
    idx = [x.index for x in sweep]
    uuids = [x.uuid for x in sweep]
    tags = {x.memory_used for x in sweep if x.memory_used is not None}
    return len(set(idx)) != len(idx) or len(set(uuids)) != len(uuids) or len(tags) > 1


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
            return bool(p.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    def watch_children() -> None:
        nonlocal max_children
        while not stop.is_set():
            n = sum(1 for p in me.children(recursive=True) if live(p))
            max_children = max(max_children, n)
            time.sleep(0.005)

    delivering: list[frozenset[str]] = []  # per delivered sweep: the UUIDs with a row of values
    lost_at: list[tuple[str | None, int]] = []  # per gpu_lost event: its UUID, sweeps delivered before it
    lost_said: list[str] = []  # what each gpu_lost event said
    short_said: Counter[str] = Counter()  # short_sweep events by what they said

    def on_event(e: StreamEvent) -> None:
        events[e.kind] += 1
        if e.kind == "gpu_lost":
            lost_at.append((e.uuid, len(delivering)))
            lost_said.append(f"GPU {e.gpu} {e.uuid}: {e.detail}")
        if e.kind == "short_sweep":
            short_said[e.detail] += 1

    watcher = threading.Thread(target=watch_children, daemon=True)
    watcher.start()
    s = stream(
        FIELDS,
        interval=0.01,
        nvidia_smi=smi,
        stall_timeout=0.5,
        startup_timeout=5.0,
        retry=RetryPolicy(backoff_initial=0.01, backoff_max=0.2, healthy_after=0.3),
        on_event=on_event,
    )
    mixed_instants = sweeps = 0
    samples: list[tuple[float, int, int, int]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_sample = t0 + 10  # after warm-up
    with s:
        for sw in s.sweeps():
            sweeps += 1
            delivering.append(frozenset(str(x.uuid) for x in sw if not x.gpu_lost and x.uuid))
            if mixed(sw):
                mixed_instants += 1
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
    injected: Counter[str] = Counter()
    for seg in plan[: children - 1]:  # the last child was stopped by us, its end fault never came
        injected[str(seg["end"])] += 1
        if seg["mode"]:
            injected[f"reenumerate-{seg['mode']}"] += 1
        if seg["mid"]:
            injected[str(seg["mid"])] += 1
        if seg["step"]:
            injected["clock-step-" + ("back" if float(seg["step"]) < 0 else "forward")] += 1  # type: ignore[arg-type]
    last = plan[children - 1]
    # the running child's mid-segment fault may or may not have struck yet
    pending_mid = str(last["mid"]) if last["mid"] else None
    # a gpu_lost event is false when its GPU has a row of values in the next sweep delivered or the one after
    false_said = [
        said
        for (uuid, at), said in zip(lost_at, lost_said)
        if uuid is not None and any(uuid in d for d in delivering[at : at + 2])
    ]
    false_lost = len(false_said)
    unnamed_lost = sum(1 for uuid, _ in lost_at if uuid is None)

    def within(got: int, want: int, kind: str) -> bool:
        return got == want or (pending_mid == kind and got == want + 1)

    def floor(col: int, first: bool = False) -> int:
        third = max(len(samples) // 3, 1)
        part = samples[:third] if first else samples[-third:]
        return int(min((row[col] for row in part), default=0))

    timeouts = injected["hang"] + injected["hang-ignore-term"]
    cut = injected["crash"] + injected["reenumerate"]  # both end the child mid-sweep with exit 255
    # a GPU truly gone: [GPU is lost] cells, rows that stop, or a GPU removed by a driver reload
    lost_want = injected["gpu-lost"] + injected["dropout"] + injected["reenumerate-remove"]
    lost_pending = 1 if pending_mid in ("gpu-lost", "dropout") else 0
    fd_floor, th_floor = (floor(2, first=True), floor(2)), (floor(3, first=True), floor(3))
    checks = {
        f"0 mixed instants (got {mixed_instants} of {sweeps} sweeps)": mixed_instants == 0,
        f"0 lost events naming a GPU that is delivering (got {false_lost} of {len(lost_at)} gpu_lost events; "
        f"{unnamed_lost} named no UUID)": false_lost == 0,
        f"crashes and reloads counted once (UnknownError exits: {st.errors['NvidiaSmiFailedError']}, want {cut})": (
            st.errors["NvidiaSmiFailedError"] == cut
        ),
        f"hangs counted once (timeouts: {st.errors['NvidiaSmiTimeoutError']}, want {timeouts})": (
            st.errors["NvidiaSmiTimeoutError"] == timeouts
        ),
        f"garbage lines counted once (dropped rows: {st.dropped_rows}, want {injected['garbage']})": within(
            st.dropped_rows, injected["garbage"], "garbage"
        ),
        f"lost GPUs counted once (cells + dropouts + removals: {st.gpu_lost_events}, want {lost_want}"
        f"{'+1' if lost_pending else ''})": st.gpu_lost_events in {lost_want, lost_want + lost_pending},
        f"short sweeps = cut sweeps + garbage ({st.short_sweeps}, want {cut + injected['garbage']})": within(
            st.short_sweeps, cut + injected["garbage"], "garbage"
        ),
        f"restarts = injected ending faults ({st.restarts}, want {children - 1})": st.restarts
        == children - 1
        == sum(st.errors.values()),
        f"at most one live child (max {max_children})": max_children <= 1,
        "RSS flat (< 8 MiB growth after warm-up)": not samples or samples[-1][1] - samples[0][1] < 8 << 20,
        # a child's pipes come and go with restarts: a leak shows as a floor that rises, so compare the lowest
        # count in the last third of the run with the lowest in the first third
        f"fds flat (floor {fd_floor[0]} -> {fd_floor[1]})": fd_floor[1] <= fd_floor[0],
        f"threads flat (floor {th_floor[0]} -> {th_floor[1]})": th_floor[1] <= th_floor[0],
    }
    gpus = sorted({len(seg["layout"]) for seg in plan[:children]})  # type: ignore[arg-type]
    print(
        f"soak: {elapsed:.0f} s wall, {sweeps} sweeps at -lms 10 (= {sweeps / 3600:.1f} h at 1 Hz), "
        f"{gpus[0]}-{gpus[-1]} GPUs"
    )
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
    for said in false_said[:3]:
        print(f"       a gpu_lost event naming a GPU that is delivering: {said}")
    print(f"short sweeps by what they said: {dict(short_said.most_common())}")
    if failed:
        print(f"soak: {len(failed)} of {len(checks)} checks FAILED")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
