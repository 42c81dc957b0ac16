#!/usr/bin/env python3
"""Benchmark the fleet view against a real Prometheus with backfilled history, in one run.

1. ``smiquery top --once``: one screen of a fleet of 64 nodes x 8 GPUs (an hour at 15 s, the three namings
   taking turns by node), as a user runs it (a child process, start-up included), and :func:`snapshot` alone.
2. ``smiquery report --prometheus`` of a week of 8 nodes x 8 GPUs (one sample a minute by default:
   10,080 points per series) vs the same report of the same samples read from an nvidia-smi CSV recording:
   :func:`fleet_frame` + :func:`report` against :func:`load_recording` + :func:`report`, in this process,
   best of ``--rounds`` each, alternating, with the CPU seconds each took (this process's, and for Prometheus the
   server's: on a loaded machine the wall times vary, the CPU far less); then both commands as child processes
   (median of ``--rounds``). Both reports are checked
   to be the same analysis (the fleet's names its GPUs by node, the recording's by number). The goal (issue 34)
   is a ratio of at most 1.0.

Usage: ``python scripts/bench_fleet.py [--top-nodes 64] [--report-nodes 8] [--days 7] [--interval 60] [--rounds 3]
[--skip-top] [--skip-report]``. Needs promtool and prometheus (scripts/install-prometheus). A few minutes on two
cores, most of it promtool.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.analysis import load_recording, report  # noqa: E402
from smiquery.fleet import PrometheusClient, fleet_frame, snapshot  # noqa: E402
from tests.fleet.fleetdata import (  # noqa: E402
    backfill,
    fleet_spec,
    sorted_keys,
    started,
    tool,
    unnamed,
    write_openmetrics,
    write_recording,
)

ROUNDS = 3  # --rounds


def _server_cpu(pid: int) -> float:  # CPU seconds a process has used (Linux /proc)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build(tmp: Path, nodes: int, gpus: int, samples: int, step: int, with_recording: bool) -> tuple[int, int]:
    spec = fleet_spec(nodes, gpus)
    end = int(time.time()) // step * step - 120
    start = end - (samples - 1) * step
    om = tmp / "fleet.om"
    t = time.perf_counter()
    with om.open("w", encoding="utf-8") as fh:
        write_openmetrics(fh, spec, start, samples, step)
    if with_recording:
        write_recording(tmp / "fleet.csv", spec, start, samples, step)
    print(f"  wrote {om.stat().st_size / 1e6:.0f} MB of OpenMetrics in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    backfill(str(tool("promtool")), om, tmp / "data", "24h")
    om.unlink()
    print(f"  promtool backfill {time.perf_counter() - t:.1f} s", flush=True)
    return start, end


def bench_top(nodes: int, gpus: int) -> None:
    print(f"top --once: {nodes} nodes x {gpus} GPUs, an hour at 15 s", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _, end = build(tmp, nodes, gpus, 240, 15, False)
        with started(str(tool("prometheus")), tmp / "data", tmp / "prom.log") as server:
            client = PrometheusClient(server.url)
            listed = len(snapshot(client, at=end))  # warm-up: the server reads its blocks
            assert listed == nodes * gpus, listed
            inproc = []
            for _ in range(ROUNDS):
                t = time.perf_counter()
                snapshot(client, at=end)
                inproc.append(time.perf_counter() - t)
            cli = []
            argv = [sys.executable, "-m", "smiquery", "top", "-p", server.url, "--once", "--at", str(end)]
            for _ in range(ROUNDS):
                t = time.perf_counter()
                done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
                cli.append(time.perf_counter() - t)
                assert done.returncode == 0, done.stderr
            print(f"  snapshot() of {listed} GPUs: {min(inproc):.3f} s (best of {ROUNDS})")
            print(f"  smiquery top --once (child process, start-up included): {statistics.median(cli):.3f} s (median)")


def bench_report(nodes: int, gpus: int, days: float, step: int) -> int:
    samples = int(days * 86400 / step)
    print(f"report: {nodes} nodes x {gpus} GPUs, {days:g} days at {step} s ({samples} points per series)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        start, end = build(tmp, nodes, gpus, samples, step, True)
        with started(str(tool("prometheus")), tmp / "data", tmp / "prom.log") as server:
            client = PrometheusClient(server.url, timeout=300)
            warm = fleet_frame(client, start, end)  # warm-up: blocks into the page cache
            load_recording(tmp / "fleet.csv", tz="UTC")
            prom_t: list[tuple[float, float, float]] = []  # wall, CPU here, CPU of the server
            rec_t: list[tuple[float, float, float]] = []
            for _ in range(ROUNDS):
                t, c, s = time.perf_counter(), time.process_time(), _server_cpu(server.popen.pid)
                from_prom = report(fleet_frame(client, start, end), name="fleet")
                prom_t.append((time.perf_counter() - t, time.process_time() - c, _server_cpu(server.popen.pid) - s))
                t, c = time.perf_counter(), time.process_time()
                from_rec = report(load_recording(tmp / "fleet.csv", tz="UTC"), name="fleet")
                rec_t.append((time.perf_counter() - t, time.process_time() - c, 0.0))
            p, r = min(w for w, _, _ in prom_t), min(w for w, _, _ in rec_t)
            # the fleet's report names GPUs by node (and judges stragglers per node: the recording is told the nodes
            # too); all else must be the recording's report
            named = load_recording(tmp / "fleet.csv", tz="UTC")
            named.attrs["gpu_names"] = warm.attrs["gpu_names"]
            a, b = unnamed(from_prom.to_dict()), unnamed(report(named, name="fleet").to_dict())
            plain = sorted_keys(from_rec.to_dict())
            if any(a[k] != plain[k] for k in a if k != "findings"):
                print(
                    f"  DIFFERENT FROM THE UNNAMED RECORDING: {[k for k in a if k != 'findings' and a[k] != plain[k]]}"
                )
                return 1
            if a != b:
                print(f"  DIFFERENT REPORTS: {[k for k in a if a[k] != b[k]]} (times {p:.2f} s vs {r:.2f} s)")
                return 1
            with (tmp / "fleet.csv").open() as fh:
                rows = sum(1 for _ in fh) - 1
            print(f"  from Prometheus: {p:.2f} s; from the recording ({rows} rows): {r:.2f} s; ratio {p / r:.2f}x")
            cp, sp, cr = (min(x[k] for x in got) for got, k in ((prom_t, 1), (prom_t, 2), (rec_t, 1)))
            print(f"  CPU: {cp:.2f} s here + {sp:.2f} s in Prometheus, against {cr:.2f} s (least of {ROUNDS} each)")
            # as a user runs them: child processes, start-up included, median of 3 each, alternating
            by_prom = [sys.executable, "-m", "smiquery", "report", "-p", server.url, "--start", str(start)]
            by_prom += ["--end", str(end), "--format", "json"]
            by_rec = [sys.executable, "-m", "smiquery", "report", str(tmp / "fleet.csv"), "--tz", "UTC"]
            by_rec += ["--format", "json"]
            cli: dict[str, list[float]] = {"prom": [], "rec": []}
            for _ in range(ROUNDS):
                for key, argv in (("prom", by_prom), ("rec", by_rec)):
                    t = time.perf_counter()
                    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
                    cli[key].append(time.perf_counter() - t)
                    assert done.returncode == 0, done.stderr
            cp, cr = statistics.median(cli["prom"]), statistics.median(cli["rec"])
            print(
                f"  smiquery report --prometheus: {cp:.2f} s; smiquery report fleet.csv: {cr:.2f} s; "
                f"ratio {cp / cr:.2f}x (child processes, median of {ROUNDS})"
            )
            print(
                f"  same findings: {len(a['stalls'])} stalls, {len(a['alerts'])} alerts, "
                f"energy of {len(a['energy_wh'])} GPUs"
            )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-nodes", type=int, default=64)
    ap.add_argument("--report-nodes", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--interval", type=int, default=60, help="seconds between samples of the report's week")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each timing (best or median of them)")
    ap.add_argument("--skip-top", action="store_true")
    ap.add_argument("--skip-report", action="store_true")
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    if tool("promtool") is None or tool("prometheus") is None:
        print("bench_fleet: promtool/prometheus missing; run scripts/install-prometheus", file=sys.stderr)
        return 1
    if not args.skip_top:
        bench_top(args.top_nodes, args.gpus)
    if not args.skip_report:
        return bench_report(args.report_nodes, args.gpus, args.days, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
