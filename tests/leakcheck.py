"""Checks that a test left no nvidia-smi child, no open pipe and no stray thread behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil


def open_pipes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out.add(int(fd))
    return out


def children() -> list[psutil.Process]:
    # An unreaped zombie counts as a leak too, so every child that still exists is reported.
    return list(psutil.Process().children(recursive=True))


def wait_no_children(timeout: float = 2.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    left = children()
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = children()
    return left


@contextmanager
def no_leaks(reap_timeout: float = 2.0) -> Iterator[None]:
    """Fail if the block leaves children, pipes or threads behind (children get ``reap_timeout`` to go)."""
    pipes = open_pipes()
    threads = set(threading.enumerate())
    yield
    left = wait_no_children(reap_timeout)
    assert not left, f"child processes left behind: {[(c.pid, c.cmdline()) for c in left]}"
    deadline = time.monotonic() + reap_timeout
    while time.monotonic() < deadline and (open_pipes() - pipes or _new_threads(threads)):
        time.sleep(0.02)
    assert not (open_pipes() - pipes), f"pipes left open: {open_pipes() - pipes}"
    # smiquery-spawner lives as long as the process, by design: it forks every loop child (parent-death signal).
    stray = [t.name for t in set(threading.enumerate()) - threads if t.is_alive() and t.name != "smiquery-spawner"]
    assert not stray, f"threads left running: {stray}"


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name != "smiquery-spawner"]
