"""stream(): one long-lived nvidia-smi, its fault matrix, restarts, and reaping on every path."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest

from smiquery import errors
from smiquery.retry import RetryPolicy
from smiquery.source import StreamEvent
from smiquery.sources.query_gpu import query_df
from smiquery.streams.sync import DEFAULT_HISTORY_SWEEPS, Stream, stream
from tests.helpers import wait_for
from tests.leakcheck import no_leaks, wait_no_children


def starts(log: Path) -> int:
    return len([ln for ln in log.read_text().splitlines() if ln.strip()]) if log.exists() else 0


def test_one_process_for_many_sweeps(fake_smi, tmp_path):
    log = tmp_path / "calls.jsonl"
    with no_leaks(), stream(interval=0.05, nvidia_smi=fake_smi(log=log)) as s:
        sweeps = list(s.sweeps(count=5))
    assert starts(log) == 1
    argv = json.loads(log.read_text().splitlines()[0])["argv"]
    assert "-lms" in argv and "50" in argv
    assert [len(sw) for sw in sweeps] == [8] * 5
    assert all([x.index for x in sw] == list(range(8)) for sw in sweeps)
    assert s.stats.rows == 40


def test_whole_seconds_use_dash_l(fake_smi):
    s = stream(interval=2, nvidia_smi=fake_smi())
    assert s.argv[-2:] == ("-l", "2")
    s.close()


def test_max_samples_and_duration(fake_smi):
    with no_leaks():
        got = list(stream(interval=0.05, nvidia_smi=fake_smi(), max_samples=11))
        assert len(got) == 11
        t0 = time.monotonic()
        list(stream(interval=0.05, nvidia_smi=fake_smi(), duration=0.5))
        assert 0.4 < time.monotonic() - t0 < 3


def test_hang_before_first_row_retries_then_fails(fake_smi):
    naps: list[float] = []
    with no_leaks():
        s = stream(
            interval=0.05,
            nvidia_smi=fake_smi(fault="hang"),
            startup_timeout=0.3,
            retry=RetryPolicy(max_attempts=3, backoff_initial=0.1),
            sleep=naps.append,
        )
        with pytest.raises(errors.NvidiaSmiTimeoutError, match="no row within"):
            next(iter(s))
    assert s.stats.starts == 3
    assert s.stats.errors["NvidiaSmiTimeoutError"] == 3
    assert len(naps) == 2 and all(n < 1.0 for n in naps), naps  # backoff starts well under a second


@pytest.mark.parametrize("fault", ["hang-after:16", "hang-after:16,ignore-term", "crash-after:16"])
def test_mid_stream_failure_restarts_and_samples_resume(fake_smi, fault, tmp_path):
    log = tmp_path / "calls.jsonl"
    events: list[StreamEvent] = []
    with (
        no_leaks(reap_timeout=3),
        stream(
            interval=0.05,
            nvidia_smi=fake_smi(fault=fault, log=log),
            stall_timeout=0.5,
            retry=RetryPolicy(backoff_initial=0.05),
            on_event=events.append,
        ) as s,
    ):
        got = [x for _, x in zip(range(40), s)]
    assert len(got) == 40
    assert starts(log) >= 3
    assert s.stats.restarts >= 2
    assert sum(s.stats.errors.values()) >= 2
    assert any(e.kind == "restart" for e in events)


def test_gpu_lost_mid_stream_is_visible(fake_smi):
    events: list[StreamEvent] = []
    with stream(interval=0.05, nvidia_smi=fake_smi(fault="gpu-lost-after:8:2"), on_event=events.append) as s:
        sweeps = list(s.sweeps(count=3))
    lost = sweeps[-1].by_index()[2]
    assert lost.gpu_lost
    assert lost.temperature_gpu is None and lost.missing["temperature.gpu"] == "gpu_lost"
    assert not sweeps[-1].by_index()[1].gpu_lost
    assert s.stats.lost_gpus == {2}
    assert [e.gpu for e in events if e.kind == "gpu_lost"] == [2]


@pytest.mark.parametrize("fault", ["garbage-after:8", "wrong-columns-after:5"])
def test_bad_rows_are_dropped_and_counted(fake_smi, fault):
    with stream(interval=0.05, nvidia_smi=fake_smi(fault=fault)) as s:
        got = [x for _, x in zip(range(24), s)]
    assert len(got) == 24
    assert s.stats.dropped_rows >= 1
    assert all(len(x.values()) == len(s.fields) for x in got)


def test_truncated_last_row_then_exit_is_restarted(fake_smi):
    with stream(interval=0.05, nvidia_smi=fake_smi(fault="truncated"), retry=RetryPolicy(backoff_initial=0.05)) as s:
        got = [x for _, x in zip(range(20), s)]
    assert len(got) == 20
    assert s.stats.dropped_rows >= 1


@pytest.mark.parametrize(
    ("fault", "error"),
    [("permission", errors.InsufficientPermissionsError), ("nvml-not-found", errors.NvmlNotFoundError)],
)
def test_permanent_errors_give_up_only_when_told(fake_smi, fault, error):
    naps: list[float] = []
    with no_leaks():
        s = stream(nvidia_smi=fake_smi(fault=fault), retry=RetryPolicy(max_attempts=2), sleep=naps.append)
        with pytest.raises(error):
            list(s)
    assert s.stats.starts == 2
    assert len(naps) == 1 and naps[0] >= 27  # the slow cadence for faults that need a person
    assert s.stats.state == "failed" and s.error is not None


def test_retryable_error_gives_up_after_attempts(fake_smi):
    naps: list[float] = []
    s = stream(nvidia_smi=fake_smi(fault="driver-not-loaded"), retry=RetryPolicy(max_attempts=4), sleep=naps.append)
    with pytest.raises(errors.DriverNotLoadedError):
        list(s)
    assert s.stats.starts == 4
    assert len(naps) == 3 and naps == sorted(naps)


def test_abandoned_by_break_reaps_within_2s(fake_smi):
    with no_leaks(reap_timeout=2):
        for _ in stream(interval=0.05, nvidia_smi=fake_smi()):
            break


def consume(smi: Path, exc: BaseException) -> None:
    for _ in stream(interval=0.05, nvidia_smi=smi):
        raise exc


def test_abandoned_by_exception_in_consumer(fake_smi):
    with no_leaks(reap_timeout=2), pytest.raises(ZeroDivisionError):
        consume(fake_smi(), ZeroDivisionError())


def test_abandoned_by_del(fake_smi):
    gc.disable()  # no reference cycle: dropping the last reference must reap at once, without the collector
    try:
        with no_leaks(reap_timeout=2):
            s = stream(interval=0.05, nvidia_smi=fake_smi())
            it = iter(s)
            next(it)
            del it, s
    finally:
        gc.enable()


def test_keyboard_interrupt_in_consumer_reaps(fake_smi):
    with no_leaks(reap_timeout=2), pytest.raises(KeyboardInterrupt):
        consume(fake_smi(), KeyboardInterrupt())


def test_background_latest_is_non_blocking_and_fresh(fake_smi):
    with no_leaks(reap_timeout=3):
        s = Stream(interval=0.05, nvidia_smi=fake_smi()).start()
        try:
            first, first_age = s.latest()  # at once, whether or not a sweep is there yet
            assert (first is None) == (first_age is None)
            wait_for(lambda: s.latest()[0] is not None, 5, "a first sweep")
            sweep, age = s.latest()
            assert sweep is not None and len(sweep) == 8
            assert age is not None and age < 1.0
            assert s.running
        finally:
            s.close()
        assert not s.running
        other = Stream(interval=0.05, nvidia_smi=fake_smi()).start()
        try:
            with pytest.raises(RuntimeError, match="background"):
                iter(other)
        finally:
            other.close()


def test_history_is_the_newest_sweeps_as_the_dataframe_query_df_gives(fake_inproc):
    with stream(interval=0.05, history_sweeps=5, **fake_inproc()) as s:
        before = s.history()
        seen = list(s.sweeps(count=12))
        df, newest = s.history(), s.history(n=2)
    snapshot = query_df(**fake_inproc())
    assert before.empty and list(before.columns) == list(snapshot.columns)
    assert len(df) == 5 * 8  # the bound: the seven older sweeps are gone
    assert list(df.columns) == list(snapshot.columns)
    assert df.dtypes.to_dict() == snapshot.dtypes.to_dict()
    assert df.attrs["units"]["memory_used"] == "MiB"
    kept = [x for sweep in seen[-5:] for x in sweep]
    assert df["timestamp"].tolist() == [x.timestamp for x in kept]
    assert df["memory_used"].tolist() == [x.memory_used for x in kept]
    assert newest["timestamp"].tolist() == df["timestamp"].tolist()[-16:]
    assert s.history(n=0).empty
    with pytest.raises(ValueError, match="0 or more"):
        s.history(n=-1)
    assert DEFAULT_HISTORY_SWEEPS == stream.__init__.__kwdefaults__["history_sweeps"] == 3600


def test_a_background_stream_fills_its_history(fake_inproc):
    s = stream(interval=0.05, **fake_inproc()).start()
    try:
        wait_for(lambda: len(s.history()) >= 3 * 8, 30, "three sweeps in the history")
        df = s.history()
        assert df["timestamp"].is_monotonic_increasing
        assert set(df["index"]) == set(range(8))
    finally:
        s.close()


def test_stream_validates_before_running(fake_smi, tmp_path):
    log = tmp_path / "calls.jsonl"
    with pytest.raises(errors.InvalidFieldError):
        stream(["bogus.field"], nvidia_smi=fake_smi(log=log))
    with pytest.raises(errors.InvalidGpuIdError):
        stream(gpus="nine", nvidia_smi=fake_smi(log=log))
    with pytest.raises(ValueError, match="interval"):
        stream(interval=0, nvidia_smi=fake_smi(log=log))
    assert starts(log) == 0


def test_selected_gpus_form_sweeps(fake_smi):
    with stream(interval=0.05, gpus=[1, 5], nvidia_smi=fake_smi()) as s:
        sweeps = list(s.sweeps(count=3))
    assert [[x.index for x in sw] for sw in sweeps] == [[1, 5]] * 3


def test_no_children_after_everything():
    assert wait_no_children(2) == []


def test_crash_after_gpu_lost_is_not_reported_as_gpu_lost(fake_smi):
    # the [GPU is lost] cells are data; the exit reason is the message line printed at the crash
    events: list[StreamEvent] = []
    s = stream(
        interval=0.05,
        nvidia_smi=fake_smi(fault="gpu-lost-after:4:1,crash-after:12"),
        on_event=events.append,
        retry=RetryPolicy(backoff_initial=0.05),
    )
    with s:
        for _ in zip(range(30), s):
            pass
    errs = [e.error for e in events if e.kind == "error"]
    assert errs
    assert not any(isinstance(e, errors.GpuLostError) for e in errs)
    assert all("[GPU is lost]" not in str(e) for e in errs)
