"""The one background poller: newest value, its age, its error; never blocks a reader."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from smiquery.errors import NvidiaSmiFailedError
from smiquery.sources.latest import Latest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_before_the_first_poll_nothing_is_known():
    latest = Latest(lambda: 1, 5.0, name="counting")
    snap = latest.get()
    assert (snap.value, snap.age, snap.at, snap.error, snap.polls) == (None, None, None, None, 0)


def test_a_poll_keeps_its_value_and_the_age_grows_with_the_clock():
    clock = Clock()
    latest = Latest(lambda: [1, 2], 5.0, name="counting", clock=clock, wall=lambda: 1_700_000_000.0)
    assert latest.poll() == [1, 2]
    clock.now += 7.5
    snap = latest.get()
    assert snap.value == [1, 2] and snap.age == pytest.approx(7.5) and snap.at == 1_700_000_000.0


def test_a_failed_poll_keeps_the_old_value_and_says_why(caplog: pytest.LogCaptureFixture):
    results: list[object] = [
        "first",
        NvidiaSmiFailedError(["nvidia-smi"], 9, "Unable to determine the device handle\nmore"),
        "third",
    ]

    def fetch() -> str:
        got = results.pop(0)
        if isinstance(got, Exception):
            raise got
        return str(got)

    latest = Latest(fetch, 5.0, name="listing processes", errors=(NvidiaSmiFailedError,))
    latest.poll()
    assert latest.poll() is None
    snap = latest.get()
    assert snap.value == "first" and snap.error.startswith("nvidia-smi exited with code 9: Unable to determine")
    assert snap.failures == {"NvidiaSmiFailedError": 1}
    assert "listing processes failed: nvidia-smi exited with code 9" in caplog.text
    latest.poll()
    assert latest.get().value == "third" and latest.get().error is None


def test_a_bug_is_not_a_poll_failure():
    def fetch() -> int:
        raise KeyError("bug")

    latest = Latest(fetch, 5.0, name="x", errors=(NvidiaSmiFailedError,))
    with pytest.raises(KeyError):
        latest.poll()


def test_the_thread_polls_until_closed_and_delivers_values():
    seen: list[int] = []
    two = threading.Event()
    counter = iter(range(1000))

    def deliver(value: int) -> None:
        seen.append(value)
        if len(seen) >= 2:
            two.set()

    latest = Latest(lambda: next(counter), 0.01, name="counting", on_value=deliver)
    with latest:
        assert latest.wait_first(30)
        assert two.wait(30)
        assert latest.running
    assert not latest.running
    after = len(seen)
    assert seen[:2] == [0, 1] and latest.get().value == seen[-1] and after >= 2


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be positive"):
        Latest(lambda: 1, 0, name="details")


def test_a_snapshot_is_fresh_up_to_its_max_age():
    clock = Clock()
    latest = Latest(lambda: "v", 5.0, name="x", clock=clock)
    assert latest.get().fresh(10.0) is None  # nothing yet
    latest.poll()
    clock.now += 10.0
    assert latest.get().fresh(10.0) == "v" and latest.get().fresh(9.9) is None


def test_following_keeps_the_newest_value_and_opens_the_stream_again_after_a_failure(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level("INFO", logger="smiquery.poll")
    opened: list[int] = []
    three = threading.Event()
    closed = threading.Event()

    def values() -> Iterator[int]:
        opened.append(len(opened))
        if len(opened) == 1:
            yield 1
            raise NvidiaSmiFailedError(["nvidia-smi", "pmon"], 3, "Not supported on the device(s)")
        yield 2
        three.set()
        closed.wait(30)  # blocked, as a stream between instants, until close() ends it
        yield 3

    latest = Latest.following(values, 0.01, name="nvidia-smi pmon", errors=(NvidiaSmiFailedError,), on_close=closed.set)
    with latest:
        assert three.wait(30)
        snap = latest.get()
        assert snap.value == 2 and snap.error is None and snap.polls == 2
        assert snap.failures == {"NvidiaSmiFailedError": 1}
    assert not latest.running and opened == [0, 1]
    assert "nvidia-smi pmon failed: nvidia-smi exited with code 3" in caplog.text
    assert "nvidia-smi pmon works again" in caplog.text
