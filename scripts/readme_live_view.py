"""Capture `smiquery stream`'s live view from a real terminal (tmux) against the fake nvidia-smi, for the README.

Runs ``smiquery --nvidia-smi FAKE stream`` in a detached tmux window of 110 x 26, waits until the processes under
each GPU are shown, captures the screen with ``tmux capture-pane`` and puts it between the README's
``<!-- live-view -->`` markers (``--check``: only say whether the README's block is a capture of this layout).

Usage: python scripts/readme_live_view.py [--check]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- live-view:begin -->", "<!-- live-view:end -->"
COLUMNS, ROWS = 110, 26


def capture() -> str:
    """The screen of the live view once it shows the processes (trailing blank lines removed)."""
    from smiquery.testing import fake_nvidia_smi

    tmux = shutil.which("tmux")
    if tmux is None:
        sys.exit("readme_live_view: tmux is not installed (apt-get install tmux)")
    folder = Path(tempfile.gettempdir()) / "smiquery-fake"
    smi = fake_nvidia_smi(folder)
    socket = f"smiquery-readme-{int(time.time())}"
    cmd = [sys.executable, "-m", "smiquery", "--nvidia-smi", str(smi), "stream", "--interval", "500ms"]
    base = [tmux, "-L", socket]
    subprocess.run(
        [*base, "-f", "/dev/null", "new-session", "-d", "-x", str(COLUMNS), "-y", str(ROWS), "--", *cmd],
        check=True,
        timeout=30,
    )
    try:
        end = time.monotonic() + 60
        while True:
            screen = subprocess.run(
                [*base, "capture-pane", "-p"], capture_output=True, text=True, check=True, timeout=30
            ).stdout
            sweeps = re.search(r"sweeps (\d+)", screen)
            if "└" in screen and sweeps is not None and int(sweeps.group(1)) >= 6:
                break
            if time.monotonic() > end:
                sys.exit(f"readme_live_view: the live view never showed processes; it shows:\n{screen}")
            time.sleep(0.2)
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30, check=False)
    return "\n".join(line.rstrip() for line in screen.rstrip().splitlines())


def main() -> int:
    text = README.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"readme_live_view: README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    if "--check" in sys.argv[1:]:
        lines = old.strip().strip("`").strip().splitlines()
        ok = bool(lines) and lines[0].startswith("smiquery stream") and all(len(x) <= COLUMNS for x in lines)
        print("README live view: " + ("a capture" if ok else "missing or not a capture"))
        return 0 if ok else 1
    screen = capture()
    README.write_text(f"{head}{BEGIN}\n```\n{screen}\n```\n{END}{tail}", encoding="utf-8")
    print(screen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
