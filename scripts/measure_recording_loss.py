"""Measure what `smiquery stream --output` loses, per format, on SIGKILL and on a full disk.

Real processes against the fake nvidia-smi (10 sweeps a second):

* SIGKILL: record for a few seconds, ``kill -9``, read the recording back. Loss is the time between the kill and
  the last row read (a sample interval or two is the floor: rows not sampled yet), plus any unreadable line.
* Full disk: record onto a small tmpfs (root) or under a file-size limit set with prlimit (not root), let it fill,
  free space, go on, stop with SIGTERM. Reported: rows the recorder says it dropped while full, rows lost *besides*
  those (rows readable before the disk filled that are gone after), unreadable lines, and whether it resumed.

    .venv/bin/python scripts/measure_recording_loss.py [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil

from smiquery.recordings import read_recording
from smiquery.testing import fake_nvidia_smi

FORMATS = ("csv", "jsonl", "parquet")


def recorder(smi: Path, out: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "smiquery", "--nvidia-smi", str(smi), "stream", "-F", "csv", "-l", "100ms", "-o"]
    return subprocess.Popen(
        [*cmd, str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ}
    )


def rows_on_disk(path: Path) -> int:
    target = path / "_open.jsonl" if path.suffix == ".parquet" else path
    try:
        return target.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait(pred, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit("timed out")
        time.sleep(0.05)


def sigkill_trial(smi: Path, folder: Path, fmt: str, seconds: float) -> tuple[float, int, int]:
    out = folder / f"kill-{time.monotonic_ns()}.{fmt}"
    proc = recorder(smi, out)
    wait(lambda: rows_on_disk(out) >= 5)
    time.sleep(seconds)
    proc.kill()
    killed = datetime.now()
    proc.communicate(timeout=30)
    df = read_recording(out)
    last = df["timestamp"].max().to_pydatetime()
    gap = ((killed if last.tzinfo is None else killed.astimezone()) - last).total_seconds()
    skipped = df.attrs.get("skipped")
    return gap, len(df), skipped.count if skipped is not None else 0


def _mount(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir()
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=False).returncode == 0
    )


def full_disk_trial(smi: Path, folder: Path, fmt: str) -> dict[str, object]:
    disk = folder / f"disk-{fmt}"
    tmpfs = _mount(disk, "512k")
    if not tmpfs:
        disk.mkdir(exist_ok=True)
    try:
        filler = disk / "filler"
        if tmpfs:
            filler.write_bytes(b"\0" * (512 - 40) * 1024)
        out = disk / f"run.{fmt}"
        proc = recorder(smi, out)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
        reader.start()
        wait(lambda: rows_on_disk(out) >= 5)
        if not tmpfs:
            psutil.Process(proc.pid).rlimit(psutil.RLIMIT_FSIZE, (out.stat().st_size + 20_000, resource.RLIM_INFINITY))
        wait(lambda: any("is full" in x or "as large as" in x for x in lines))
        before = len(read_recording(out))
        time.sleep(2.0)  # two seconds of a full disk
        if tmpfs:
            filler.unlink()
        else:
            psutil.Process(proc.pid).rlimit(psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait(lambda: any(" again; " in x for x in lines))
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=30)
        df = read_recording(out)
        said = next((x for x in lines if " again; " in x), "")
        m = re.search(r"again; (\d+) row", said)
        skipped = df.attrs.get("skipped")
        return {
            "how": "tmpfs (ENOSPC)" if tmpfs else "RLIMIT_FSIZE (EFBIG)",
            "rows before full": before,
            "dropped while full": int(m.group(1)) if m else -1,
            "rows read at the end": len(df),
            "earlier rows lost": max(0, before - len(df)),
            "unreadable lines": skipped.count if skipped is not None else 0,
            "exit": proc.returncode,
        }
    finally:
        if tmpfs:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        smi = fake_nvidia_smi(folder / "bin")
        print("SIGKILL (sampling every 100 ms; loss = kill time - last row read):")
        for fmt in FORMATS:
            gaps, torn = [], 0
            for i in range(args.trials):
                gap, _rows, skipped = sigkill_trial(smi, folder, fmt, 1.0 + i)
                gaps.append(gap)
                torn += skipped
            print(f"  {fmt:8} worst {max(gaps):.2f} s, mean {sum(gaps) / len(gaps):.2f} s, unreadable lines {torn}")
        print("Full disk (2 s full, then space again; stopped with SIGTERM):")
        for fmt in FORMATS:
            res = full_disk_trial(smi, folder, fmt)
            print(f"  {fmt:8} " + ", ".join(f"{k}: {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
