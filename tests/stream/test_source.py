"""One source type: a live stream and a replayed recording both implement SampleSource the same way."""

from __future__ import annotations

import time

import pytest

from smiquery.recordings import replay
from smiquery.source import SampleSource, StreamEvent, Sweep, SweepGrouper
from smiquery.streams.sync import stream
from smiquery.testing import fake_nvidia_smi
from tests.conftest import FIXTURES

RECORDING = FIXTURES / "h100x8-590-sweep.csv"


@pytest.fixture(params=["stream", "replay"])
def source(request, tmp_path) -> SampleSource:
    if request.param == "stream":
        return stream(interval=0.05, nvidia_smi=fake_nvidia_smi(tmp_path, recording=RECORDING))
    return replay(RECORDING, speed=0, loop=True)


def test_both_are_sample_sources(source):
    with source:
        assert isinstance(source, SampleSource)
        assert source.fields and source.fields[0].name in ("index", "timestamp")


def test_sweeps_latest_stats_and_events_work_alike(source):
    heard: list[StreamEvent] = []
    source.subscribe(heard.append)
    with source:
        sweeps = list(source.sweeps(count=3))
        latest, age = source.latest()
    assert len(sweeps) == 3 and all(isinstance(sw, Sweep) and sw.complete and len(sw) == 8 for sw in sweeps)
    assert latest is sweeps[-1] and age is not None and age >= 0
    assert source.stats.sweeps >= 3 and source.stats.short_sweeps == 0


def test_background_start_and_close(source):
    source.start()
    try:
        deadline = time.monotonic() + 30
        while source.latest()[0] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.latest()[0] is not None and source.running
    finally:
        source.close(timeout=5)
    assert not source.running and source.error is None


def test_grouper_never_learns_a_count_once():
    from smiquery.fields import resolve_fields
    from smiquery.sources.query_gpu import CsvParser

    parser = CsvParser(resolve_fields(["index", "temperature.gpu"]))
    rows = [parser.feed(f"{i}, 40") for i in (0, 1, 0, 1, 2, 3, 0, 1, 2, 3)]
    grouper = SweepGrouper()
    sweeps = [sw for r in rows if r is not None for sw in grouper.feed(r)]
    # Two GPUs looked like the whole machine until GPUs 2 and 3 showed up: their late rows are flagged, not
    # passed off as an instant of their own, and from then on every sweep holds all four.
    assert [[s.index for s in sw] for sw in sweeps] == [[0, 1], [0, 1], [2, 3], [0, 1, 2, 3]]
    assert sweeps[2].damaged and not sweeps[2].complete
    assert sweeps[3].complete


def test_a_damaged_first_sweep_does_not_fix_the_gpu_count():
    from smiquery.fields import resolve_fields
    from smiquery.sources.query_gpu import CsvParser

    parser = CsvParser(resolve_fields(["index", "temperature.gpu"]))
    grouper = SweepGrouper()
    sweeps: list[Sweep] = []
    for i in (0, 1, None, None, 0, 1, 2, 3, 0, 1, 2, 3):  # None: a garbled row of GPU 2 or 3
        if i is None:
            grouper.damage()
            continue
        sample = parser.feed(f"{i}, 40")
        assert sample is not None
        sweeps += grouper.feed(sample)
    assert [[s.index for s in sw] for sw in sweeps] == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert sweeps[0].damaged and sweeps[1].complete and sweeps[2].complete
