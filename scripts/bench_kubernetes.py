"""Pod attribution's cost: one kubelet List refresh (64 pods), and /metrics render time with attribution on vs off.

Both exporters run over the in-process fake nvidia-smi (8 GPUs) in this process; the kubelet is the tests' stand-in
(a real gRPC server on a unix socket). Run: ``PYTHONPATH=. python scripts/bench_kubernetes.py``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from smiquery.attribution import Attribution
from smiquery.attribution.kubernetes import KubernetesBackend
from smiquery.exporter import serve
from smiquery.testing import InProcessRunner, use_runner
from tests.attribution.kubelet import StandInKubelet

GPUS = [
    "GPU-70a2e60b-a656-a12f-696b-8596a11d4d6b",
    "GPU-c1b0d0c2-7b24-505e-e600-706601380be7",
    "GPU-08d66bca-5784-0341-346c-86e41bd1addc",
    "GPU-32a57ec6-2a4c-9f45-b3d1-40734f584a12",
]


def main() -> None:
    short = tempfile.mkdtemp(prefix="k25b-", dir="/tmp")
    kubelet = StandInKubelet(str(Path(short) / "kubelet.sock")).start()
    # 64 pods: 4 GPUs held whole, 4 x 15 time-sliced replicas
    kubelet.grants = [("ns", f"p{i}", "c", "nvidia.com/gpu", (GPUS[i],)) for i in range(4)]
    kubelet.grants += [("ns", f"s{i}", "c", "nvidia.com/gpu", (f"{GPUS[i % 4]}::{i}",)) for i in range(60)]
    att = Attribution(KubernetesBackend(kubelet.socket_path), interval=5.0, mig_listing=str)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        att.refresh()
        times.append(time.perf_counter() - t0)
    print(f"List refresh (64 pods): median {statistics.median(times) * 1e3:.2f} ms per interval")
    with use_runner(InProcessRunner()):
        off = serve(port=0, interval=0.2)
        on = serve(port=0, interval=0.2, attribution=Attribution(KubernetesBackend(kubelet.socket_path), interval=0.2))
        try:
            time.sleep(2.0)  # both have sweeps and the attribution its first List
            for what, call in (("/metrics (cached per sweep)", "exposition"), ("full build (collect)", "collect")):
                t_on: list[float] = []
                t_off: list[float] = []
                for i in range(400):
                    pair = ((off, t_off), (on, t_on)) if i % 2 else ((on, t_on), (off, t_off))
                    for exp, acc in pair:
                        t0 = time.perf_counter()
                        if call == "collect":
                            list(exp.collector.collect())
                        else:
                            exp.collector.exposition()
                        acc.append(time.perf_counter() - t0)
                    time.sleep(0.002)
                a, b = statistics.mean(t_on), statistics.mean(t_off)
                print(f"{what}: on {a * 1e6:.0f} us, off {b * 1e6:.0f} us, ratio on/off {a / b:.2f}")
        finally:
            on.stop()
            off.stop()
    kubelet.stop()
    shutil.rmtree(short, ignore_errors=True)


if __name__ == "__main__":
    main()
