#!/usr/bin/env python3
"""Load test of `smiquery export` over loopback: latency, throughput, nvidia-smi starts per scrape, memory.

The exporter runs as its own process (`python -m smiquery.cli_export export`) on the fake nvidia-smi (8 GPUs,
`health` preset, interval 1 s), pinned to one CPU core; this script scrapes /metrics in a loop over one
persistent HTTP/1.1 connection from another core. Targets: p99 < 10 ms, >= 300 scrapes/s, no nvidia-smi start
during the loop (counted in the fake's invocation log), RSS growth < 2 MB between 1,000 scrapes and the end.

    python scripts/bench_exporter.py                # 100,000 scrapes (a few minutes)
    python scripts/bench_exporter.py --scrapes 5000

Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.testing import fake_nvidia_smi  # noqa: E402

P99_MAX_MS = 10.0
RATE_MIN = 300.0
RSS_GROWTH_MAX_MB = 2.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def starts(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.strip()) if log.exists() else 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=int, default=100_000, help="number of scrapes (default 100000)")
    ap.add_argument("--fields", default="health")
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args()
    if args.scrapes < 1000:
        ap.error("--scrapes must be at least 1000 (memory is compared from scrape 1,000 on)")

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    with tempfile.TemporaryDirectory(prefix="smiquery-bench-") as tmp:
        log = Path(tmp) / "invocations.jsonl"
        fake = fake_nvidia_smi(Path(tmp) / "bin", log=log)
        argv = [
            sys.executable, "-m", "smiquery.cli_export", "export", "--port", "0", "--interval", str(args.interval),
            "--fields", args.fields, "--nvidia-smi", str(fake),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            os.sched_setaffinity(proc.pid, {server_cpu})
            os.sched_setaffinity(0, {client_cpu})
            assert proc.stderr is not None
            line = proc.stderr.readline()
            m = re.search(r"http://([\d.]+):(\d+)/metrics", line)
            if not m:
                print(f"exporter did not start: {line}{proc.stderr.read()}", file=sys.stderr)
                return 1
            host, port = m.group(1), int(m.group(2))
            conn = http.client.HTTPConnection(host, port, timeout=10)
            deadline = time.monotonic() + 20
            while True:
                conn.request("GET", "/healthz")
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    break
                if time.monotonic() > deadline:
                    print("exporter never became healthy", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            starts_before = starts(log)
            lat: list[float] = []
            rss_at: dict[int, float] = {}
            size = 0
            t_start = time.perf_counter()
            for i in range(1, args.scrapes + 1):
                t0 = time.perf_counter()
                conn.request("GET", "/metrics")
                r = conn.getresponse()
                body = r.read()
                lat.append(time.perf_counter() - t0)
                if r.status != 200:
                    print(f"scrape {i}: HTTP {r.status}", file=sys.stderr)
                    return 1
                if i == 1:
                    size = len(body)
                    if b"smiquery_temperature_gpu_celsius{" not in body:
                        print("scrape 1 has no GPU metrics", file=sys.stderr)
                        return 1
                if i in (1000, 10_000) or i % 25_000 == 0 or i == args.scrapes:
                    rss_at[i] = rss_mb(proc.pid)
            elapsed = time.perf_counter() - t_start
            starts_after = starts(log)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        exit_code = proc.returncode

    rate = args.scrapes / elapsed
    p50, p99, worst = (percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3, max(lat) * 1e3)
    growth = rss_at[args.scrapes] - rss_at[1000]
    rows = [
        ("p99 latency", f"{p99:.2f} ms (p50 {p50:.2f}, max {worst:.1f})", f"< {P99_MAX_MS:g} ms", p99 < P99_MAX_MS),
        ("throughput", f"{rate:.0f} scrapes/s", f">= {RATE_MIN:g}/s", rate >= RATE_MIN),
        (
            "nvidia-smi starts during loop",
            f"{starts_after - starts_before} (before: {starts_before})",
            "0",
            starts_after == starts_before,
        ),
        (
            "RSS growth 1,000 -> end",
            f"{growth:+.2f} MB ({rss_at[1000]:.1f} -> {rss_at[args.scrapes]:.1f} MB)",
            f"< {RSS_GROWTH_MAX_MB:g} MB",
            growth < RSS_GROWTH_MAX_MB,
        ),
        ("exporter exit on SIGTERM", str(exit_code), "0", exit_code == 0),
    ]
    print(
        f"smiquery export bench: {args.scrapes} scrapes, fields {args.fields}, interval {args.interval:g} s, "
        f"{size} bytes per scrape, exporter on CPU {server_cpu}, client on CPU {client_cpu}"
    )
    print("RSS samples: " + ", ".join(f"{k}: {v:.1f} MB" for k, v in sorted(rss_at.items())))
    width = max(len(r[0]) for r in rows)
    for name, got, target, ok in rows:
        print(f"  {name:<{width}}  {got:<40} target {target:<10} {'PASS' if ok else 'FAIL'}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
