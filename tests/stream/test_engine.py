"""The stream engine on its own: lines and the time in; samples, sweeps, events and deadlines out.

No process, no thread, no clock: each test builds an :class:`~smiquery.streams.engine.Engine` and hands it lines
and ``now`` values, as h11's tests hand its ``Connection`` bytes. The process boundary (pipes, exit codes,
signals, a paused parent) is tested with the fake nvidia-smi in the other files of this folder.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from smiquery import errors
from smiquery.fields import resolve_fields
from smiquery.retry import FAIL_FAST_ATTEMPTS, RetryPolicy, one_line
from smiquery.sample import GpuSample
from smiquery.source import StreamEvent, StreamStats, Sweep
from smiquery.streams.engine import Engine
from smiquery.streams.sweeps import CsvRows

FIELDS = resolve_fields("timestamp,index,uuid,memory.used,utilization.gpu")
T0 = datetime(2026, 3, 1, 12, 0, 0)
CRASH = errors.NvidiaSmiFailedError(("nvidia-smi",), 255, "Unknown Error")
MISMATCH = errors.DriverVersionMismatchError(("nvidia-smi",), 18, "Driver/library version mismatch")
Item = GpuSample | Sweep


def make(
    policy: RetryPolicy | None = None, *, interval: float = 1.0, tz: ZoneInfo | None = None, **kw: float
) -> Engine[Item]:
    stats = StreamStats()
    events: list[StreamEvent] = []
    rows = CsvRows(FIELDS, stats, events.append, interval=interval, tz=tz)
    kw.setdefault("startup_timeout", 45.0)
    kw.setdefault("stall_timeout", 10.0)
    return Engine(
        rows,
        ("nvidia-smi",),
        policy if policy is not None else RetryPolicy(jitter=False),
        stats=stats,
        events=events,
        **kw,  # type: ignore[arg-type]
    )


def row(index: int, at: datetime) -> str:
    return f"{at:%Y/%m/%d %H:%M:%S}.{at.microsecond // 1000:03d}, {index}, GPU-{index:08d}, 100 MiB, 5 %"


def sweep_lines(gpus: Iterable[int], at: datetime) -> list[str]:
    return [row(i, at) for i in gpus]


def sweeps(items: Sequence[Item]) -> list[Sweep]:
    return [x for x in items if isinstance(x, Sweep)]


def kinds(events: Sequence[StreamEvent]) -> list[str]:
    return [e.kind for e in events]


def running(engine: Engine[Item], now: float = 0.0) -> Engine[Item]:
    engine.begin(now)
    assert engine.starting(now)
    engine.started(now)
    return engine


# ------------------------------------------------------------------------------------------ sweeps, one instant


def test_lines_in_samples_and_sweeps_out():
    engine = running(make())
    out = [x for n in range(3) for x in engine.feed(sweep_lines(range(4), T0 + timedelta(seconds=n)), n + 1.0)]
    assert [len(s) for s in sweeps(out)] == [4, 4, 4]
    assert all(s.complete for s in sweeps(out))
    # the `now` of the read that closed each: the first once the next began (the GPU set was still being learnt)
    assert [s.arrived for s in sweeps(out)] == [2.0, 2.0, 3.0]
    assert engine.stats.rows == 12 and engine.stats.sweeps == 3 and engine.stats.state == "running"
    assert engine.take_events() == []


@pytest.mark.parametrize("step", [-3600.0, -2.0, 3600.0])
def test_a_clock_step_inside_a_sweep_neither_splits_it_nor_loses_a_gpu(step: float):
    # the wall clock behind the timestamps jumps between GPU 3 and GPU 4 of the second sweep
    engine = running(make(interval=0.5))
    out: list[Item] = []
    for n in range(6):
        at = T0 + timedelta(seconds=0.5 * n)
        for i in range(8):
            shifted = at + timedelta(seconds=step) if (n, i) >= (1, 4) else at
            out += engine.feed([row(i, shifted)], n + 0.01 * i, idle=0.5 if i == 0 else 0.0)
    got = sweeps(out)
    assert [len(s) for s in got] == [8] * 6 and all(s.complete for s in got)
    assert [e for e in engine.take_events() if e.kind in ("gpu_lost", "short_sweep")] == []


@pytest.mark.parametrize("one_line_a_read", [True, False], ids=["thread", "asyncio"])
def test_a_slow_row_is_still_the_same_instant(one_line_a_read: bool):
    # GPU 3 and the rest come 70 % of an interval late: the thread driver feeds each line with its own wait, the
    # asyncio driver the lines of one read with the wait of that read
    engine = running(make(interval=1.0))
    out: list[Item] = []
    for n in range(5):
        at = T0 + timedelta(seconds=n)
        late = at + timedelta(seconds=0.7)
        reads = [(sweep_lines(range(3), at), 0.3), ([row(3, at), *sweep_lines(range(4, 8), late)], 0.7)]
        for lines, idle in reads:
            if one_line_a_read:
                for k, line in enumerate(lines):
                    out += engine.feed([line], n + idle, idle if k == 0 else 0.0)
            else:
                out += engine.feed(lines, n + idle, idle)
    assert [len(s) for s in sweeps(out)] == [8] * 5
    assert [e for e in engine.take_events() if e.kind in ("gpu_lost", "short_sweep")] == []


def test_rows_an_interval_apart_are_two_instants():
    engine = running(make(interval=1.0))
    out = engine.feed(sweep_lines([0, 1], T0), 1.0, idle=1.0)
    out += engine.feed(sweep_lines([2, 3], T0 + timedelta(seconds=1)), 2.0, idle=1.0)
    out += engine.feed(sweep_lines(range(4), T0 + timedelta(seconds=2)), 3.0, idle=1.0)
    assert [[s.index for s in sw] for sw in sweeps(out)] == [[0, 1], [2, 3], [0, 1, 2, 3]]
    assert not sweeps(out)[1].complete  # GPUs 0 and 1 are known by then: the short sweep says so


def test_dst_fall_back_is_resolved_by_row_order():
    engine = running(make(interval=0.5, tz=ZoneInfo("Europe/Berlin")))
    start = datetime(2026, 10, 25, 2, 59, 58)
    stamps = [start + timedelta(seconds=0.5 * n) for n in range(4)]
    stamps += [datetime(2026, 10, 25, 2, 0, 0) + timedelta(seconds=0.5 * n) for n in range(4)]  # CET now
    out = [x for n, at in enumerate(stamps) for x in engine.feed(sweep_lines(range(4), at), n, idle=0.5)]
    instants = [s.timestamp.timestamp() for sw in sweeps(out) for s in sw if s.timestamp is not None]
    assert len(instants) == 8 * 4 and instants == sorted(instants)  # the second 02:00 after the first 02:59
    assert all(sw.complete for sw in sweeps(out))


def test_a_failure_cuts_the_unfinished_sweep_short():
    engine = running(make())
    engine.feed(sweep_lines(range(4), T0), 1.0)
    engine.feed(sweep_lines([0, 1], T0 + timedelta(seconds=1)), 2.0)
    got = engine.failed(CRASH, 2.5, 1000.0)
    assert got is not None
    (cut,) = got[0]
    assert isinstance(cut, Sweep) and [s.index for s in cut] == [0, 1] and cut.damaged
    assert kinds(engine.take_events()) == ["short_sweep", "error", "restart"]


def test_notices_are_not_rows_and_garbage_is_a_dropped_row():
    engine = running(make())
    out = engine.feed(["WARNING: infoROM is corrupted at gpu 0000:0B:00.0", "\x00garbage", row(0, T0)], 1.0)
    assert [type(x) for x in out] == [GpuSample] and engine.stats.rows == 1
    assert engine.stats.dropped_rows == 1 and kinds(engine.take_events()) == ["dropped_row"]


# --------------------------------------------------------------------------------------------- lost GPUs


def test_a_gpu_whose_rows_stop_is_lost_once_then_back():
    engine = running(make())
    out: list[Item] = []
    plan = [range(4)] * 3 + [[0, 1, 3]] * 3 + [range(4)] * 2
    for n, gpus in enumerate(plan):
        out += engine.feed(sweep_lines(gpus, T0 + timedelta(seconds=n)), n + 1.0, idle=1.0)
    events = [e for e in engine.take_events() if e.kind in ("gpu_lost", "gpu_back", "short_sweep")]
    assert [(e.kind, e.gpu, e.uuid) for e in events] == [
        ("gpu_lost", 2, "GPU-00000002"),
        ("gpu_back", 2, "GPU-00000002"),
    ]
    assert engine.stats.gpu_lost_events == 1 and engine.stats.lost_gpus == set()
    assert all(sw.missing == {2} for sw in sweeps(out)[3:6])


def test_nvidia_smis_gpu_is_lost_message_names_the_gpu():
    engine = running(make())
    fields = resolve_fields("index,pci.bus_id")
    engine.rows = rows = CsvRows(fields, engine.stats, engine.events.append, interval=1.0)
    rows.child_started()
    buses = ["00000000:01:00.0", "00000000:02:00.0", "00000000:03:00.0"]
    for n in range(2):
        engine.feed([f"{i}, {b}" for i, b in enumerate(buses)], n + 1.0, idle=1.0)
    said = f"Unable to determine the device handle for GPU {buses[1]}: GPU is lost. Reboot the system"
    engine.feed(["0, " + buses[0], said, "2, " + buses[2]], 3.0, idle=1.0)
    engine.feed(["0, " + buses[0]], 4.0, idle=1.0)
    lost = [e for e in engine.take_events() if e.kind == "gpu_lost"]
    assert [(e.gpu, e.detail) for e in lost] == [(1, "GPU 1 is lost (nvidia-smi says it is lost)")]


# ----------------------------------------------------------------------------------------------- deadlines


def test_start_up_then_stall_deadlines_and_their_messages():
    engine = make(startup_timeout=45.0, stall_timeout=10.0)
    engine.begin(100.0)
    assert engine.starting(100.0)
    engine.started(101.0)
    assert engine.deadline() == 146.0  # the start-up deadline counts from the child's start
    hung = engine.expired(146.0)
    assert isinstance(hung, errors.NvidiaSmiTimeoutError)
    assert str(hung).startswith("nvidia-smi printed no row within 45 s of starting")
    engine.feed([row(0, T0)], 110.0)
    assert engine.deadline() == 120.0  # a row: the stall deadline
    engine.feed(["Unable to determine the device handle for GPU 0000:02:00.0: Unknown Error"], 115.0)
    assert engine.deadline() == 120.0  # a notice is no sign of life
    hung = engine.expired(120.0)
    assert hung is not None and str(hung).startswith("nvidia-smi printed no data row for 10 s (it printed: Unable")


def test_duration_is_a_deadline_and_ends_the_stream_without_an_error():
    engine = make(duration=5.0, stall_timeout=30.0)
    engine.begin(0.0)
    assert engine.starting(0.0)
    engine.started(0.0)
    engine.feed([row(0, T0)], 1.0)
    assert engine.deadline() == 5.0  # the end of the stream comes before the stall deadline
    assert engine.expired(5.0) is None and engine.stopped(5.0)
    assert not engine.starting(5.0)  # no new child after the end
    engine.finish()
    assert engine.stats.state == "ended" and engine.stats.starts == 1


def test_max_rows_and_close():
    engine = running(make(max_rows=5))
    engine.feed(sweep_lines(range(3), T0), 1.0)
    assert not engine.done
    engine.feed(sweep_lines(range(3), T0 + timedelta(seconds=1)), 2.0)
    assert engine.done
    engine = running(make())
    engine.close()
    assert engine.stopped(0.0) and not engine.starting(1.0)
    assert engine.failed(CRASH, 1.0, 1000.0) is None  # the failure was the close: nothing counted
    engine.finish()
    assert engine.stats.state == "closed" and engine.stats.errors == {}


# ------------------------------------------------------------------------------------------ retry decisions


def fail(engine: Engine[Item], exc: errors.SmiqueryError, now: float, wall: float = 1000.0) -> float:
    assert engine.starting(now)
    engine.started(now)
    got = engine.failed(exc, now + 1, wall)
    assert got is not None
    return got[1]


def test_transient_failures_back_off_exponentially_capped_then_give_up():
    engine = make(RetryPolicy(backoff_initial=1.0, backoff_max=5.0, jitter=False, max_attempts=5))
    engine.begin(0.0)
    seen = []
    for n in range(4):
        delay = fail(engine, CRASH, 10.0 * n, wall=1000.0 + n)
        s = engine.stats
        seen.append((delay, s.state, s.attempt, s.next_retry_at))
    # the wait doubles from 1 s and is capped at 5 s; next_retry_at is the wall time passed in plus the wait
    assert [d for d, *_ in seen] == [1.0, 2.0, 4.0, 5.0]
    assert [tuple(x) for _, *x in seen] == [("retrying", n + 1, 1000.0 + n + d) for n, d in enumerate([1, 2, 4, 5])]
    events = engine.take_events()
    assert kinds(events) == ["error", "restart"] * 4
    assert events[1].detail == f"restarting nvidia-smi in 1.0 s after: {one_line(CRASH)}"
    assert engine.starting(50.0)
    with pytest.raises(errors.NvidiaSmiFailedError) as caught:
        engine.failed(CRASH, 51.0, 2000.0)
    assert caught.value is CRASH and engine.stats.state == "failed"
    assert (engine.stats.starts, engine.stats.restarts) == (5, 4)
    assert engine.stats.errors == {"NvidiaSmiFailedError": 5}


def test_jitter_spreads_restarts_within_one_initial_delay():
    delays = [make(RetryPolicy(backoff_initial=1.0, backoff_max=60.0)) for _ in range(20)]
    for engine in delays:
        engine.begin(0.0)
    firsts = [fail(engine, CRASH, 0.0) for engine in delays]
    assert all(1.0 <= d <= 2.0 for d in firsts) and len(set(firsts)) > 1


def test_one_row_does_not_reset_the_backoff_but_a_healthy_period_does():
    engine = make(RetryPolicy(backoff_initial=1.0, jitter=False, healthy_after=30.0))
    engine.begin(0.0)
    assert [fail(engine, CRASH, t) for t in (0.0, 10.0)] == [1.0, 2.0]
    assert engine.starting(20.0)
    engine.started(20.0)
    engine.feed([row(0, T0)], 21.0)
    assert engine.stats.attempt == 0 and engine.stats.state == "running"
    assert engine.failed(CRASH, 40.0, 1000.0)[1] == 4.0  # type: ignore[index]  # 19 s of data: the streak goes on
    assert engine.starting(50.0)
    engine.started(50.0)
    engine.feed([row(0, T0)], 51.0)
    engine.take_events()
    assert engine.failed(CRASH, 81.0, 1000.0)[1] == 0.0  # type: ignore[index]  # 30 s of data: a fresh streak, at once
    said = f"restarting nvidia-smi now after: {one_line(CRASH)} (it had run well for a while)"
    assert engine.take_events()[-1].detail == said
    assert fail(engine, CRASH, 90.0) == 1.0  # the backoff starts over


def test_a_fault_that_needs_a_person_is_retried_slowly_and_its_recovery_said():
    engine = make(RetryPolicy(permanent_retry=40.0, jitter=False))
    engine.begin(0.0)
    assert [fail(engine, MISMATCH, t) for t in (0.0, 100.0)] == [40.0, 40.0]
    assert engine.stats.permanent and engine.stats.last_error_type == "DriverVersionMismatchError"
    assert engine.take_events()[-1].detail.endswith("(this needs a person: retrying slowly)")
    assert engine.starting(200.0)
    engine.started(200.0)
    engine.feed([row(0, T0)], 201.0)
    assert kinds(engine.take_events()) == ["recovered"]
    assert not engine.stats.permanent and engine.stats.next_retry_at is None


def test_fail_fast_gives_up_before_the_first_row_only():
    engine = make(RetryPolicy(fail_fast=True, jitter=False))
    engine.begin(0.0)
    assert engine.starting(0.0)
    with pytest.raises(errors.DriverVersionMismatchError):
        engine.failed(MISMATCH, 1.0, 1000.0)
    engine = make(RetryPolicy(fail_fast=True, jitter=False))
    engine.begin(0.0)
    for n in range(FAIL_FAST_ATTEMPTS - 1):
        fail(engine, CRASH, 10.0 * n)
    assert engine.starting(100.0)
    with pytest.raises(errors.NvidiaSmiFailedError):
        engine.failed(CRASH, 101.0, 1000.0)
    engine = running(make(RetryPolicy(fail_fast=True, jitter=False)))
    engine.feed([row(0, T0)], 1.0)
    assert engine.failed(MISMATCH, 2.0, 1000.0) is not None  # rows flowed: a driver upgrade mid-run is retried


def test_max_restarts_counts_every_restart():
    engine = make(RetryPolicy(max_restarts=2, jitter=False))
    engine.begin(0.0)
    for t in (0.0, 10.0):
        assert engine.starting(t)
        engine.started(t)
        engine.feed([row(0, T0)], t + 1)  # rows between the failures: still restarts
        assert engine.failed(CRASH, t + 2, 1000.0) is not None
    assert engine.starting(20.0)
    with pytest.raises(errors.NvidiaSmiFailedError):
        engine.failed(CRASH, 21.0, 1000.0)
    assert (engine.stats.starts, engine.stats.restarts, engine.stats.state) == (3, 2, "failed")


def test_the_policy_asks_its_tenacity_strategies():
    policy = RetryPolicy(backoff_initial=1.0, backoff_max=5.0, jitter=False, permanent_retry=40)
    assert [policy.delay(CRASH, n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    retrying = policy.retrying(StreamStats())
    assert retrying.wait is not None and retrying.stop is not None
    assert policy.delay(MISMATCH, 3) == 40.0
