"""What the tests of the fake share: paths, constants, and a fake started as a child with deadlines."""

from __future__ import annotations

import os
import select
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser

if TYPE_CHECKING:
    pass

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "smiquery" / "data" / "demo-8gpu.csv"
DEMO_APPS = ROOT / "smiquery" / "data" / "demo-8gpu-apps.csv"
SOME = "index,uuid,name,memory.used,power.draw,temperature.gpu,fan.speed,clocks_event_reasons.active,driver_version"
HELP = "Please run 'nvidia-smi -h' for help."
GPU_LOST = "GPU is lost. Reboot the system to recover this GPU"
LOOP_ARGS = ("--format=csv,noheader", "-lms", "10")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMIQUERY_FAKE_")}
    env.update(extra)
    return env


def run(exe: Path, *args: str, timeout: float = 20.0, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(exe), *args], capture_output=True, env=child_env(**env), timeout=timeout, check=False)


def lines_of(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines()


@cache
def demo_rows() -> tuple[GpuSample, ...]:
    return tuple(CsvParser().parse(DEMO.read_text(encoding="utf-8").splitlines()))


class Child:
    """A fake started with pipes; reads lines with deadlines; always killed and reaped on exit."""

    def __init__(self, exe: Path, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(**env)
        )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.buf = b""

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        finally:
            self.proc.wait(timeout=10)
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()

    def _fill(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.fd], [], [], left)[0]:
            return False
        chunk = os.read(self.fd, 65536)
        if not chunk:
            raise EOFError
        self.buf += chunk
        return True

    def readline(self, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if not self._fill(deadline):
                raise TimeoutError(f"no line within {timeout} s")
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8")

    def readlines(self, n: int, timeout: float = 5.0) -> list[str]:
        return [self.readline(timeout) for _ in range(n)]

    def silent_for(self, seconds: float) -> bool:
        """True when nothing at all arrives within ``seconds``."""
        before = len(self.buf)
        try:
            self._fill(time.monotonic() + seconds)
        except EOFError:
            return True
        return len(self.buf) == before

    def stopped_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stderr(self) -> bytes:
        assert self.proc.stderr is not None and self.proc.poll() is not None
        return self.proc.stderr.read()
