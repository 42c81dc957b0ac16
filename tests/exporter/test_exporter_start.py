"""A normal start of the exporter logs no "not collecting" warning; a first sample that is overdue does, once."""

from __future__ import annotations

from tests.exporter.test_exporter import UUIDS, _sample, _scripted


def test_a_first_sample_overdue_is_said_once():
    changes: list[tuple[bool, str]] = []
    src, col, _ = _scripted(on_state=lambda up, why: changes.append((up, why)), stale_after=30.0)
    src.stats.state = "running"  # nvidia-smi started; its first row has not come yet
    col.refresh()
    col.refresh()
    assert changes == []  # within stale_after of the start: nvidia-smi is still starting
    col._born -= 31  # ...and now it is late
    col.refresh()
    col.refresh()
    assert changes == [(False, "no sample yet (waiting for nvidia-smi)")]
    src.publish(_sample(0, UUIDS[0]))
    col.refresh()
    assert changes[-1] == (True, "ok")
