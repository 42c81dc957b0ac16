"""Core v3: the engine is right about time (clock steps, DST, slow rows) and identity (GPUs renumbered, removed,
added), survives a paused parent, a close from its own callback and a flood, for every driver."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from smiquery import aio, errors
from smiquery.retry import RetryPolicy
from smiquery.source import StreamEvent, Sweep
from smiquery.sources.query_gpu import query
from smiquery.streams.sync import stream
from smiquery.testing import InProcessRunner
from tests.conftest import MakeFake
from tests.helpers import wait_for

FIELDS = "timestamp,index,uuid,memory.used,utilization.gpu"
GPUS = 8  # the fake's default recording


def sync_sweeps(smi: Path, fault_free_count: int, **kw: Any) -> tuple[list[Sweep], list[StreamEvent]]:
    events: list[StreamEvent] = []
    with stream(FIELDS, nvidia_smi=smi, on_event=events.append, **kw) as s:
        sweeps = list(s.sweeps(count=fault_free_count))
    return sweeps, events


def aio_sweeps(smi: Path, count: int, **kw: Any) -> tuple[list[Sweep], list[StreamEvent]]:
    events: list[StreamEvent] = []

    async def main() -> list[Sweep]:
        async with aio.stream(FIELDS, nvidia_smi=smi, on_event=events.append, **kw) as s:
            return [sw async for sw in s.sweeps(count=count)]

    return asyncio.run(main()), events


DRIVERS: dict[str, Callable[..., tuple[list[Sweep], list[StreamEvent]]]] = {"sync": sync_sweeps, "aio": aio_sweeps}


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest) -> Callable[..., tuple[list[Sweep], list[StreamEvent]]]:
    return DRIVERS[request.param]


def one_instant_each(sweeps: list[Sweep]) -> None:
    for sw in sweeps:
        indices = [s.index for s in sw]
        assert indices == sorted(set(indices)), f"a sweep mixes instants: {indices}"


# ------------------------------------------------------------------------------------------------- time


# Clock steps and DST inside a sweep, and slow rows, are the engine's logic: tests/stream/test_engine.py.


def test_sweeps_carry_their_monotonic_arrival_time(fake_smi: MakeFake, driver: Any):
    before = time.monotonic()
    sweeps, _ = driver(fake_smi(fault="clock-step:3:-3600"), 3, interval=0.2)
    arrived = [sw.arrived for sw in sweeps]
    assert all(a is not None and a >= before for a in arrived)
    assert arrived == sorted(arrived)  # a step of the wall clock does not touch the arrival clock


# --------------------------------------------------------------------------------------------- identity


def reload_stream(smi: Path, mode: str, count: int, driver: Any) -> tuple[list[Sweep], list[StreamEvent]]:
    return driver(smi, count, interval=0.1, retry=RetryPolicy(backoff_initial=0.01, backoff_max=0.05))


@pytest.mark.parametrize("mode", ["swap", "remove", "add"])
def test_after_a_driver_reload_lost_events_name_only_the_gpu_that_is_gone(fake_smi: MakeFake, driver: Any, mode: str):
    smi = fake_smi(fault=f"reenumerate:20:{mode}")  # after 2.5 sweeps the driver reloads with another GPU set
    sweeps, events = reload_stream(smi, mode, 8, driver)
    one_instant_each(sweeps)
    before = {s.uuid for s in sweeps[0]}
    after = {s.uuid for s in sweeps[-1]}
    lost = [e for e in events if e.kind == "gpu_lost"]
    assert {e.uuid for e in lost} == before - after  # exactly the removed GPU, named by its UUID
    delivering = {s.uuid for sw in sweeps[-3:] for s in sw}
    assert not {e.uuid for e in lost} & delivering
    assert sweeps[-1].complete
    if mode == "swap":
        moved = [e for e in events if e.kind == "gpu_renumbered"]
        assert sorted(e.gpu for e in moved) == [0, 1]  # both GPUs deliver, under each other's index
    if mode == "remove":
        assert len(lost) == 1 and len(after) == GPUS - 1
    if mode == "add":
        assert len(after) == GPUS + 1


def test_stats_follow_the_latest_sweep_by_uuid_after_a_reload(fake_smi: MakeFake):
    smi = fake_smi(fault="reenumerate:20:remove")
    with stream(FIELDS, nvidia_smi=smi, interval=0.1, retry=RetryPolicy(backoff_initial=0.01)) as s:
        sweeps = list(s.sweeps(count=8))
        stats = s.stats
    gone = ({x.uuid for x in sweeps[0]} - {x.uuid for x in sweeps[-1]}).pop()
    assert set(stats.lost_uuids) == {gone}
    assert stats.lost_gpus == set()  # its old index 1 is delivered by another GPU now
    assert stats.known_gpus == {x.index: x.uuid for x in sweeps[-1]}


# ------------------------------------------------------------------------------------------- process life

PAUSED = {
    "sync": """
import sys
from smiquery.streams.sync import stream
from smiquery.retry import RetryPolicy
s = stream("index,uuid", nvidia_smi=sys.argv[1], interval=0.1, stall_timeout=1.0,
           retry=RetryPolicy(max_restarts=0))
n = 0
for sweep in s.sweeps():
    n += 1
    print(n, s.stats.restarts, flush=True)
""",
    "aio": """
import asyncio, sys
from smiquery import aio
from smiquery.retry import RetryPolicy
async def main():
    s = aio.stream("index,uuid", nvidia_smi=sys.argv[1], interval=0.1, stall_timeout=1.0,
                   retry=RetryPolicy(max_restarts=0))
    n = 0
    async for sweep in s.sweeps():
        n += 1
        print(n, s.stats.restarts, flush=True)
asyncio.run(main())
""",
}


@pytest.mark.parametrize("kind", sorted(PAUSED))
def test_a_paused_parent_does_not_kill_a_healthy_child(fake_smi: MakeFake, tmp_path: Path, kind: str):
    # A stopped process's wait returns empty-handed past its deadline without looking again (PEP 475): the
    # rows printed meanwhile must still be read before the child is called hung.
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PAUSED[kind]))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen(
        [sys.executable, str(script), str(fake_smi())], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout is not None
        assert wait_for(lambda: parent.stdout.readline().startswith("3 "), 60, "three sweeps")
        parent.send_signal(signal.SIGSTOP)  # Ctrl-Z: the child goes on printing into the pipe
        time.sleep(3.0)  # three stall timeouts, the subject of the test
        parent.send_signal(signal.SIGCONT)
        lines = [parent.stdout.readline() for _ in range(40)]
        assert parent.poll() is None, "the stream gave up: it called its healthy child hung"
        assert all(line.split()[1] == "0" for line in lines), lines  # no restart
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


def test_close_from_the_streams_own_callback_returns_at_once(fake_smi: MakeFake):
    closed_in: list[float] = []
    holder: list[Any] = []

    def on_event(event: StreamEvent) -> None:
        if event.kind == "gpu_lost" and not closed_in:
            t0 = time.monotonic()
            holder[0].close()
            closed_in.append(time.monotonic() - t0)

    smi = fake_smi(fault="drop-gpu-after:12:3")  # a GPU drops out soon: its event calls close()
    s = stream(FIELDS, nvidia_smi=smi, interval=0.05, on_event=on_event)
    holder.append(s)
    s.start()
    assert wait_for(lambda: not s.running, 30, "the stream to end after close()")
    assert closed_in and closed_in[0] < 1.0  # it used to wait out its 5 s timeout on itself
    assert s.stats.state == "closed"
    assert s.child_pid is None


def test_a_one_shot_flood_fails_typed_with_bounded_memory(fake_smi: MakeFake):
    proc = psutil.Process()
    before = proc.memory_info().rss
    with pytest.raises(errors.OutputTooLargeError, match="more than 8 MiB"):
        query("index", nvidia_smi=fake_smi(fault="flood"), timeout=60)
    assert proc.memory_info().rss - before < 64 * 1024 * 1024


def test_a_one_shot_flood_in_process_fails_the_same_way():
    with pytest.raises(errors.OutputTooLargeError):
        query("index", runner=InProcessRunner(fault="flood"), timeout=60)


def test_a_flooding_loop_child_keeps_memory_flat(fake_smi: MakeFake):
    smi = fake_smi(fault="flood:41943040")  # 40 MiB of 1 MiB lines without a row, then exit 0
    events: list[StreamEvent] = []
    s = stream(FIELDS, nvidia_smi=smi, interval=0.1, on_event=events.append, retry=RetryPolicy(max_restarts=0))
    proc = psutil.Process()
    before = proc.memory_info().rss
    with pytest.raises(errors.SmiqueryError), s:
        list(s)
    dropped = [e for e in events if e.kind == "dropped_row"]
    assert len(dropped) >= 30  # every over-long line is one dropped row, cut to its head
    assert proc.memory_info().rss - before < 32 * 1024 * 1024


# ------------------------------------------------------------------------------------------- conformance


def iter_pmon(smi: Path, **kw: Any) -> Iterator[Any]:
    from smiquery.streams import pmon

    with pmon.stream(nvidia_smi=smi, **kw) as p:
        yield from p


@pytest.mark.parametrize("kind", ["sync", "aio", "pmon"])
def test_every_driver_has_one_retry_policy_and_one_stats_shape(fake_smi: MakeFake, kind: str):
    from smiquery.streams import pmon

    policy = RetryPolicy(backoff_initial=0.01, backoff_max=0.02, max_restarts=2)
    smi = fake_smi(fault="crash-after:10")
    if kind == "sync":
        src: Any = stream(FIELDS, nvidia_smi=smi, interval=0.05, retry=policy)
        with pytest.raises(errors.NvidiaSmiFailedError), src:
            list(src)
    elif kind == "pmon":
        src = pmon.stream(nvidia_smi=smi, retry=policy)
        with pytest.raises(errors.NvidiaSmiFailedError), src:
            list(src)
    else:
        src = aio.stream(FIELDS, nvidia_smi=smi, interval=0.05, retry=policy)

        async def main() -> None:
            async with src:
                async for _ in src:
                    pass

        with pytest.raises(errors.NvidiaSmiFailedError):
            asyncio.run(main())
    assert src.retry_policy is policy
    stats = src.stats
    assert (stats.starts, stats.restarts, stats.state) == (3, 2, "failed")
    assert dict(stats.errors) == {"NvidiaSmiFailedError": 3}
    assert stats.rows > 0 and stats.last_error_type == "NvidiaSmiFailedError"


def test_defaults_are_one_policy():
    from smiquery.streams import pmon

    defaults = {
        stream(nvidia_smi=sys.executable).retry_policy,
        aio.stream(nvidia_smi=sys.executable).retry_policy,
        pmon.stream(nvidia_smi=sys.executable).retry_policy,
    }
    assert defaults == {RetryPolicy()}


def test_sync_aio_and_replay_group_one_recording_alike(fake_smi: MakeFake, tmp_path: Path):
    from smiquery.recordings import replay

    sync, _ = sync_sweeps(fake_smi(), 5, interval=0.05)
    asy, _ = aio_sweeps(fake_smi(), 5, interval=0.05)
    rec = tmp_path / "rec.csv"
    rec.write_text(
        "timestamp, index, uuid, memory.used [MiB], utilization.gpu [%]\n"
        + "".join(
            f"2026/10/25 02:00:0{i}.000, {s.index}, {s.uuid}, {s.memory_used} MiB, {s.utilization_gpu} %\n"
            for i, sw in enumerate(sync)
            for s in sw
        )
    )
    with replay(rec, speed=0) as r:
        replayed = list(r.sweeps())
    assert [[s.uuid for s in sw] for sw in sync] == [[s.uuid for s in sw] for sw in asy]
    assert [[s.uuid for s in sw] for sw in sync] == [[s.uuid for s in sw] for sw in replayed]
    assert all(sw.complete for sw in (*sync, *asy, *replayed))


def test_threads_end_with_the_stream(fake_smi: MakeFake):
    before = threading.active_count()
    with stream(FIELDS, nvidia_smi=fake_smi(), interval=0.05) as s:
        s.start()
        assert wait_for(lambda: s.latest()[0] is not None, 30, "a first sweep")
    assert wait_for(lambda: threading.active_count() <= before + 1, 10, "the stream's thread to end")
