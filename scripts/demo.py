"""What `make demo` runs: `smiquery stream` on the real GPUs when nvidia-smi works, else on a bundled recording.

The recording is an 8-GPU H100 training run (warm-up, steady load, a stall, GPU 5 running hot), replayed at
30x with two alerts, so the whole demo takes about 20 seconds. On a terminal it is a live table; piped, CSV.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from importlib import resources

from smiquery.oneshot import get_gpu_status


def main() -> int:
    status = get_gpu_status(timeout=5)
    cmd = [sys.executable, "-m", "smiquery", "stream"]
    if status.get("success"):
        gpus = len(status.get("data") or [])
        print(f"smiquery demo: nvidia-smi works; streaming this machine's {gpus} GPU(s) for 10 sweeps", flush=True)
        cmd += ["--count", "10"]
        return _run(cmd)
    why = str(status.get("error") or "nvidia-smi is not available").split(";")[0].split(":")[0]
    with resources.as_file(resources.files("smiquery") / "data" / "demo-8gpu.csv") as recording:
        print(
            f"smiquery demo: no working nvidia-smi here ({why}); "
            "replaying the bundled 8-GPU H100 training run at 30x (about 20 s)",
            flush=True,
        )
        cmd += [
            "--replay",
            str(recording),
            "--speed",
            "30",
            "--duration",
            "30s",
            "--alert",
            "temperature.gpu > 85 for 3",
            "--alert",
            "utilization.gpu < 20 for 30s",
        ]
        return _run(cmd)


def _run(cmd: list[str]) -> int:
    proc = subprocess.Popen(cmd)
    # Ctrl-C reaches the child too (same process group); wait for it to finish cleanly and pass on its code.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
