"""A real terminal for the tests of the live views: a tmux session of a fixed size, read as a person sees it.

tmux interprets every escape sequence the program writes; ``capture-pane`` gives back the screen's text. Each
:class:`Screen` has its own tmux server (``-L``), killed at the end, so tests never share one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import pytest

IN_CI = os.environ.get("CI") == "true"


def need_tmux() -> str:
    """tmux's path; skips without it (fails under CI=true: scripts/install-container-tools installs it)."""
    path = shutil.which("tmux")
    if path is None:
        if IN_CI:
            pytest.fail("tmux is missing; CI must run the terminal tests (scripts/install-container-tools)")
        pytest.skip("tmux is not installed (apt-get install tmux)")
    return path


class Screen:
    """A command running in a detached tmux window of ``columns`` x ``rows``."""

    def __init__(
        self, argv: Sequence[str], *, columns: int, rows: int, env: Mapping[str, str], cwd: str | None = None
    ) -> None:
        self.tmux = need_tmux()
        self.socket = f"smiquery-test-{uuid.uuid4().hex[:12]}"
        self.columns = columns
        self.rows = rows
        # the window stays open after the program ends (remain-on-exit, set before it starts), so that its last
        # screen and exit status can be read
        with tempfile.NamedTemporaryFile("w", suffix=".conf", prefix="smiquery-tmux-", delete=False) as conf:
            conf.write("set -g remain-on-exit on\n")
        self._conf = conf
        exports = [f"{k}={v}" for k, v in env.items() if "\n" not in v]
        self._status = self._conf.name + ".status"
        # sh writes the program's exit status where the test reads it (tmux's own record of it is racy); its
        # no-op trap keeps Ctrl-C for the program, which gets SIGINT's default action back at exec
        keep = 'trap : INT; "$@"; echo $? > "$0.tmp"; mv "$0.tmp" "$0"'
        command = ["env", "-i", *exports, "sh", "-c", keep, self._status, *argv]
        self._tmux(
            "-f", self._conf.name, "new-session", "-d", "-x", str(columns), "-y", str(rows), "-s", "t",
            *(["-c", cwd] if cwd else []), "--", *command,
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            [self.tmux, "-L", self.socket, *args], capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args[:3])} failed: {done.stderr.strip()}")
        return done.stdout

    def text(self) -> str:
        """The screen as text, one line per terminal row (trailing blanks removed)."""
        return self._tmux("capture-pane", "-p", "-t", "t")

    def final_text(self) -> str:
        """Everything a program that has ended printed (scrolled-off lines too), without tmux's own notice."""
        lines = self._tmux("capture-pane", "-p", "-S", "-", "-t", "t").splitlines()
        return "\n".join(x for x in lines if not x.startswith("Pane is dead")).strip("\n") + "\n"

    def scrollback(self) -> int:
        """How many lines have scrolled off the top of the window into its history."""
        return int(self._tmux("display-message", "-p", "-t", "t", "#{history_size}").strip())

    def styled(self) -> str:
        """The screen with its colours as escape sequences (``capture-pane -e``)."""
        return self._tmux("capture-pane", "-p", "-e", "-t", "t")

    def wait_for(self, ready: Callable[[str], bool], timeout: float = 60.0) -> str:
        """The screen once ``ready(text)`` holds; fails with the last screen after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        text = self.text()
        while not ready(text):
            if time.monotonic() > end:
                raise AssertionError(f"the screen never got there; it shows:\n{text}")
            time.sleep(0.2)
            text = self.text()
        return text

    def keys(self, *keys: str) -> None:
        """Type ``keys`` (tmux key names: ``C-c``, ``q``)."""
        self._tmux("send-keys", "-t", "t", *keys)

    def exit_status(self, timeout: float = 30.0) -> int:
        """The program's exit status, once it has ended."""
        end = time.monotonic() + timeout
        while not os.path.exists(self._status):
            if time.monotonic() > end:
                raise AssertionError(f"the program did not end; the screen:\n{self.text()}")
            time.sleep(0.2)
        with open(self._status, encoding="ascii") as f:
            return int(f.read())

    def close(self) -> None:
        """Kill this test's tmux server (and the program in it)."""
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=30, check=False)
        for path in (self._conf.name, self._status):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> Screen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
