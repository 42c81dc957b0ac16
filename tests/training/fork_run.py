"""A recorded, pushed run that forks a child while it goes on (as a DataLoader forks its workers), run as a script.

argv: HOW (``exit``: the child exits normally, running the exit hooks; ``close``: it also closes its copy of the
monitor, as leaving a ``with`` block would; ``os._exit``; ``pool``: a fork-context multiprocessing pool), the
recording path, the Pushgateway URL, the nvidia-smi, the JSON file the parent writes what it saw to.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable

from smiquery.training.outputs import run_monitor


def _square(x: int) -> int:
    return x * x


def _wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60.0
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def main(how: str, out: str, gateway: str, nvidia_smi: str, result: str) -> None:
    monitor = run_monitor(
        interval=0.05, alerts=(), record=out, pushgateway=gateway, push_interval=0.1, run_id="fork",
        nvidia_smi=nvidia_smi, gpus=[0],
    ).start()  # fmt: skip
    me = os.getpid()

    def newest() -> float:
        got = monitor.latest().get(0)
        return got.timestamp.timestamp() if got is not None and got.timestamp is not None else 0.0

    _wait(lambda: newest() > 0, "the first sample")
    monitor.step(epoch=0, batch=0)
    forked = time.time()
    if how == "pool":
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(_square, range(8)) == [x * x for x in range(8)]
    else:
        pid = os.fork()
        if pid == 0:
            if how == "os._exit":
                os._exit(0)
            if how == "close":
                monitor.close()
            sys.exit(0)  # a normal exit: the exit hooks run
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
    journal_kept = os.path.exists(os.path.join(out, "_open.jsonl"))
    _wait(lambda: newest() > time.time() - 0.2 and newest() > forked + 0.5, "samples after the fork")
    monitor.step(epoch=0, batch=1)
    assert os.getpid() == me
    doc = {"forked": forked, "journal_kept": journal_kept, "running": monitor.running, "notes": monitor.notes}
    monitor.close()
    with open(result, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)


if __name__ == "__main__":
    main(*sys.argv[1:6])
