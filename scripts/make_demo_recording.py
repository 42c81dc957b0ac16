#!/usr/bin/env python3
"""Write smiquery/data/demo-8gpu.csv and demo-8gpu-apps.csv: a synthetic, deterministic 8-GPU training run.

Ten minutes of `nvidia-smi --query-gpu=... --format=csv -l 1` on 8x H100 SXM (driver 590.48.01), one sweep per
second: warm-up, steady load, a data-pipeline stall, steady load again, and GPU 5 running hot for a few minutes.
Run it again after changing it; the output only depends on the seed.

    python scripts/make_demo_recording.py [--out-dir smiquery/data]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from smiquery.fields import PRESETS, get_field

SEED = 590_48_01
GPUS = 8
SWEEPS = 600
START = datetime(2026, 3, 14, 9, 30, 0, 117_000)
NAME = "NVIDIA H100 80GB HBM3"
DRIVER = "590.48.01"
BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
MEMORY_TOTAL = 81559  # MiB, what H100 80GB HBM3 reports
MEMORY_RESERVED = 527  # MiB the driver keeps; total = reserved + used + free on 590
POWER_LIMIT = 700.0
SM_MAX = 1980
MEM_CLOCK = 2619

# Story, in seconds from the start.
WARMUP_END = 60
STALL = (300, 390)
HOT_GPU = 5
HOT = (392, 600)  # GPU 5 heats up, stays past 85 C for a few minutes, then cools down

EXTRA = (
    "memory.free",
    "power.draw.instant",
    "temperature.memory",
    "clocks.current.memory",
    "clocks_event_reasons.sw_power_cap",
    "ecc.errors.uncorrected.aggregate.total",
    "pcie.link.gen.gpucurrent",
    "pci.bus_id",
    "driver_version",
)

# clocks_event_reasons.active bits (NVML nvmlClocksEventReason*)
GPU_IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
HW_THERMAL = 0x40


def field_names() -> list[str]:
    names: list[str] = []
    for name in (*PRESETS["default"], *PRESETS["health"], *EXTRA):
        if name not in names:
            names.append(name)
    return names


def make_uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def nvsmi_time(when: datetime) -> str:
    return when.strftime("%Y/%m/%d %H:%M:%S.") + f"{when.microsecond // 1000:03d}"


def smooth(t: float, a: float, b: float) -> float:
    """0 before a, 1 after b, a smooth ramp between."""
    if t <= a:
        return 0.0
    if t >= b:
        return 1.0
    x = (t - a) / (b - a)
    return x * x * (3 - 2 * x)


class Gpu:
    def __init__(self, index: int, rng: random.Random) -> None:
        self.index = index
        self.uuid = make_uuid(rng)
        self.bus_id = f"00000000:{BUS_IDS[index]}:00.0"
        self.temp_offset = rng.uniform(-2.5, 2.5)
        self.power_offset = rng.uniform(-15.0, 15.0)
        self.memory_peak = 70_100 + rng.randint(-900, 900)
        self.temp = 33.0 + rng.uniform(-1.5, 1.5)
        self.corrected = 0
        self.aggregate_uncorrected = 1 if index == 6 else 0  # one old double-bit error on GPU 6, before this run


def load_at(t: int, gpu: Gpu, rng: random.Random) -> float:
    """Target utilization (0..100) at second t."""
    if t < WARMUP_END:
        base = 95.0 * smooth(t, 8, WARMUP_END)
    elif STALL[0] <= t < STALL[1]:
        base = rng.uniform(2, 17)
    else:
        base = 95.0
    if base > 50:
        base += rng.uniform(-4, 4)
        if rng.random() < 0.03:
            base -= rng.uniform(10, 30)  # an all-reduce hiccup
    return max(0.0, min(100.0, base))


def sweep_rows(t: int, gpus: Sequence[Gpu], rng: random.Random, stamp: datetime) -> list[dict[str, str]]:
    rows = []
    for i, gpu in enumerate(gpus):
        util = load_at(t, gpu, rng)
        util_i = round(util)
        stalled = STALL[0] <= t < STALL[1]
        mem_util = round(util * 0.62 + rng.uniform(-3, 3)) if util_i else 0
        mem_util = max(0, min(100, mem_util))
        if t < WARMUP_END:
            used = round(1 + (gpu.memory_peak - 1) * smooth(t, 3, 45))
        else:
            used = gpu.memory_peak + rng.randint(-40, 40)
        free = MEMORY_TOTAL - MEMORY_RESERVED - used

        # temperature follows load with a lag; GPU 5 gets a failing cold plate in the HOT window
        target = 36 + 0.40 * util + gpu.temp_offset
        if gpu.index == HOT_GPU:
            target += 17.0 * smooth(t, HOT[0], HOT[0] + 40) * (1 - smooth(t, HOT[1] - 20, HOT[1]))
        gpu.temp += (target - gpu.temp) * 0.08 + rng.uniform(-0.4, 0.4)
        temp = round(gpu.temp)
        hot = gpu.index == HOT_GPU and temp > 85

        power = 68.0 + 6.2 * util + gpu.power_offset + rng.uniform(-12, 12)
        if hot:
            power -= 90.0
        if power > POWER_LIMIT:
            power = POWER_LIMIT - rng.uniform(0.1, 3.0)  # the power cap holds it under the limit
        instant = min(POWER_LIMIT + 25, power + rng.uniform(-40, 40))
        capped = power > 690.0

        sm = 345 if util_i == 0 else SM_MAX - (rng.choice((0, 0, 15, 30)) if not capped else rng.randint(60, 180))
        if hot:
            sm = 1410 + rng.randint(-60, 60)
        mem_clock = MEM_CLOCK

        reasons = 0
        if util_i == 0:
            reasons |= GPU_IDLE
        if capped:
            reasons |= SW_POWER_CAP
        if hot:
            reasons |= HW_SLOWDOWN | HW_THERMAL

        if gpu.index == 3 and t in (233, 471):
            gpu.corrected += 1

        row = {
            "timestamp": nvsmi_time(stamp + timedelta(milliseconds=i + i // 5)),  # rows of a sweep ~1 ms apart
            "index": str(gpu.index),
            "name": NAME,
            "uuid": gpu.uuid,
            "temperature.gpu": str(temp),
            "utilization.gpu": f"{util_i} %",
            "utilization.memory": f"{mem_util} %",
            "memory.used": f"{used} MiB",
            "memory.total": f"{MEMORY_TOTAL} MiB",
            "power.draw": f"{power:.2f} W",
            "pci.bus_id": gpu.bus_id,
            "power.limit": f"{POWER_LIMIT:.2f} W",
            "fan.speed": "[N/A]",  # H100 SXM has no fan
            "pstate": "P0",
            "clocks.current.sm": f"{sm} MHz",
            "clocks_event_reasons.active": f"0x{reasons:016X}",
            "clocks_event_reasons.hw_thermal_slowdown": "Active" if hot else "Not Active",
            "clocks_event_reasons.sw_thermal_slowdown": "Not Active",
            "clocks_event_reasons.hw_power_brake_slowdown": "Not Active",
            "ecc.errors.corrected.volatile.total": str(gpu.corrected),
            "ecc.errors.uncorrected.volatile.total": "0",
            "retired_pages.pending": "No",
            "memory.free": f"{free} MiB",
            "power.draw.instant": f"{instant:.2f} W",
            "temperature.memory": str(temp + 6 + rng.choice((0, 1, 1, 2))),
            "clocks.current.memory": f"{mem_clock} MHz",
            "clocks_event_reasons.sw_power_cap": "Active" if capped else "Not Active",
            "ecc.errors.uncorrected.aggregate.total": str(gpu.aggregate_uncorrected),
            "pcie.link.gen.gpucurrent": "5" if util_i or stalled else "1",
            "driver_version": DRIVER,
        }
        # NVML hiccups seen in real captures: an occasional status token in a measured column
        if t in (127, 128) and gpu.index == 2:
            row["power.draw.instant"] = "[N/A]"
        if t == 444 and gpu.index == 7:
            row["temperature.memory"] = "[Unknown Error]"
        rows.append(row)
    return rows


def header_cell(name: str) -> str:
    return get_field(name).header


def write_recording(path: Path, rng: random.Random, gpus: Sequence[Gpu]) -> None:
    names = field_names()
    lines = [", ".join(header_cell(n) for n in names)]
    stamp = START
    for t in range(SWEEPS):
        for row in sweep_rows(t, gpus, rng, stamp):
            lines.append(", ".join(row[n] for n in names))
        # `-l 1` sleeps one second after each query, so sweeps drift by the query time
        stamp += timedelta(milliseconds=1000 + rng.randint(1, 4))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", newline="\n")


def write_apps(path: Path, rng: random.Random, gpus: Sequence[Gpu]) -> None:
    lines = ["pid, process_name, gpu_uuid, used_gpu_memory [MiB]"]
    first_pid = 48_213
    for gpu in gpus:
        used = gpu.memory_peak - 516 - rng.randint(0, 40)
        lines.append(f"{first_pid + gpu.index}, /opt/conda/bin/python3.11, {gpu.uuid}, {used} MiB")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", newline="\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "smiquery" / "data")
    args = parser.parse_args(argv)
    rng = random.Random(SEED)
    gpus = [Gpu(i, rng) for i in range(GPUS)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_recording(args.out_dir / "demo-8gpu.csv", rng, gpus)
    write_apps(args.out_dir / "demo-8gpu-apps.csv", rng, gpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
