"""What `make demo` runs: `smiquery stream` on the real GPUs when nvidia-smi works, else on a bundled recording.

The recording is an 8-GPU H100 training run (warm-up, steady load, a stall, GPU 5 running hot), replayed at
30x with two alerts, so the whole demo takes about 20 seconds. On a terminal it is a live table; piped, CSV.
It ends by writing the report and the plot of what it showed and says where they are (`make demo` installs the
plot extra; run without matplotlib, it prints the .venv/bin/... commands that draw the plot).
"""

from __future__ import annotations

import importlib.util
import shlex
import signal
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from smiquery.sources.query_gpu import get_gpu_status

ALERTS = ("temperature.gpu > 85 for 3", "utilization.gpu < 20 for 30s")


def main() -> int:
    out_dir = Path(tempfile.gettempdir()) / "smiquery-demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    status = get_gpu_status(timeout=5)
    cmd = [sys.executable, "-m", "smiquery", "stream"]
    if status.get("success"):
        gpus = len(status.get("data") or [])
        print(f"smiquery demo: nvidia-smi works; streaming this machine's {gpus} GPU(s) for 10 sweeps", flush=True)
        recording = out_dir / "live.csv"  # the demo's own scratch file: every run starts it afresh
        code = _run([*cmd, "--count", "10", "--output", str(recording), "--force"])
        return code or _afterwards(recording, out_dir)
    why = str(status.get("error") or "nvidia-smi is not available").split(";")[0].split(":")[0]
    with resources.as_file(resources.files("smiquery") / "data" / "demo-8gpu.csv") as bundled:
        print(
            f"smiquery demo: no working nvidia-smi here ({why}); "
            "replaying the bundled 8-GPU H100 training run at 30x (about 20 s)",
            flush=True,
        )
        alerts = [arg for rule in ALERTS for arg in ("--alert", rule)]
        code = _run([*cmd, "--replay", str(bundled), "--speed", "30", "--duration", "30s", *alerts])
        return code or _afterwards(bundled, out_dir)


def _afterwards(recording: Path, out_dir: Path) -> int:
    """Write the report and the plot of ``recording`` and print where they are."""
    from smiquery.analysis import report as analyze
    from smiquery.analysis import report_text

    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.txt"
    plot_path = out_dir / "plot.png"
    report = analyze(recording, rules=ALERTS)
    report_path.write_text(report_text(report), encoding="utf-8")
    print()
    print("What happened, in short:")
    for finding in report.findings[:4]:
        print(f"  [{finding.severity}] {finding.verdict.split(': ')[0]}")
    print()
    print(f"report: {report_path}")
    alerts = " ".join(f"--alert {shlex.quote(rule)}" for rule in ALERTS)
    if importlib.util.find_spec("matplotlib") is None:
        venv_bin = _here(Path(sys.executable).parent)  # .venv/bin under `make demo`
        print(
            "plot:   needs matplotlib (the plot extra); draw it with\n"
            f"        {venv_bin}/pip install -e '.[plot]' && {venv_bin}/smiquery plot {shlex.quote(str(recording))} "
            f"-o {shlex.quote(str(plot_path))} {alerts}"
        )
        return 0
    from smiquery.analysis import save_plot

    save_plot(recording, plot_path, rules=ALERTS)
    print(f"plot:   {plot_path}")
    return 0


def _here(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (``.venv/bin``), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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
