"""Reports that are right: across a DST fall-back, and saying what a recording cannot tell (issue 22, items 5-6)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from typer.testing import CliRunner

from smiquery.analysis import report, report_json, report_markdown, report_text
from tests.analysis.test_report import _app

BERLIN = ZoneInfo("Europe/Berlin")
# 02:55 CEST to 02:05 CET on 2026-10-25: ten minutes across the fall-back, the reproduction
FIRST = datetime(2026, 10, 25, 0, 55, tzinfo=timezone.utc)
STEP = 5
SWEEPS = 600 // STEP + 1  # 00:55:00 .. 01:05:00 UTC


def _fallback(path: Path) -> Path:
    lines = ["timestamp, index, power.draw [W], utilization.gpu [%], memory.used [MiB]"]
    for k in range(SWEEPS):
        wall = (FIRST + timedelta(seconds=k * STEP)).astimezone(BERLIN).replace(tzinfo=None)
        for g in range(2):
            lines.append(f"{wall:%Y/%m/%d %H:%M:%S}.000, {g}, 300.00 W, 90 %, 2048 MiB")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _cli(*args: str) -> str:
    got = CliRunner().invoke(_app(), ["report", *args])
    assert got.exit_code == 0, got.output
    return got.stdout


# ------------------------------------------------------------------------------------------ item 5: DST


@pytest.mark.parametrize("tz", [None, "Europe/Berlin"])
def test_a_fall_back_recording_reports_positive_span_and_energy_with_or_without_a_zone(tmp_path, tz):
    path = _fallback(tmp_path / "fallback.csv")
    zone = ["--tz", tz] if tz else []
    doc = json.loads(_cli(str(path), "-F", "json", *zone))
    hours = SWEEPS * STEP / 3600
    if tz:  # the repeated hour placed by row order: the true ten minutes, every sample's energy
        assert doc["duration_seconds"] == pytest.approx(600)
        assert doc["energy_wh"] == {
            "0": pytest.approx(300 * hours, abs=1e-3),
            "1": pytest.approx(300 * hours, abs=1e-3),
        }
    else:  # the step back counts 0: one interval lost, nothing negative
        assert doc["duration_seconds"] == pytest.approx(600 - STEP)
        assert doc["energy_wh"]["0"] == pytest.approx(300 * (hours - STEP / 3600), abs=1e-3)
    clock = [f for f in doc["findings"] if f["kind"] == "clock"]
    assert len(clock) == 1
    text = _cli(str(path), *zone)
    head = text.splitlines()[0]
    assert f"2026-10-25 02:55:00 to 02:05:00 ({'10 min' if tz else '9 min 55 s'}," in head
    if tz:
        assert "from UTC+02:00 to UTC+01:00" in text and "went back" not in text
    else:
        assert "The recorded clock went back 59 min 55 s at 02:59:55" in text
        assert "name the zone (--tz)" in text


def test_a_fall_back_plot_runs_forward_in_a_zone_and_never_draws_backwards_without(tmp_path):
    pytest.importorskip("matplotlib")
    import numpy as np

    from smiquery.analysis import plot_recording

    path = _fallback(tmp_path / "fallback.csv")
    zoned = plot_recording(path, "power.draw", rules=[], tz="Europe/Berlin")
    for line in zoned.get_axes()[0].get_lines():
        x = np.asarray(line.get_xdata(), dtype="datetime64[ns]")
        assert (np.diff(x) > np.timedelta64(0)).all()  # the second 02:00-02:05 is drawn after 02:55-03:00
    assert zoned.get_axes()[0].get_xlim()[1] - zoned.get_axes()[0].get_xlim()[0] == pytest.approx(600 / 86400)
    naive = plot_recording(path, "power.draw", rules=[])
    for line in naive.get_axes()[0].get_lines():
        if not (line.get_gid() or "").startswith("gpu-"):
            continue
        x = np.asarray(line.get_xdata(), dtype="datetime64[ns]")
        y = np.asarray(line.get_ydata(), dtype=float)
        joined = ~np.isnan(y[:-1]) & ~np.isnan(y[1:])
        assert (np.diff(x)[joined] > np.timedelta64(0)).all()


# ------------------------------------------------------------------------------ item 6: what is not known


def _csv(path: Path, header: str, rows: list[str]) -> Path:
    path.write_text(header + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def test_a_log_without_utilization_does_not_claim_no_stall(tmp_path):
    path = _csv(
        tmp_path / "temps.csv",
        "timestamp, index, temperature.gpu",
        [f"2026/01/01 12:00:{s:02d}.000, 0, 60" for s in range(60)],
    )
    r = report(path)
    assert "utilization.gpu" in r.not_recorded
    text = report_text(r)
    assert "no stall" not in text
    assert "not known: utilization.gpu was not recorded" in text
    assert "Not recorded: utilization.gpu" in text
    # the temperature rules were checked, the throttle rules were not (their fields are missing)
    assert "no GPU past a threshold" in text
    (unchecked,) = [line for line in text.splitlines() if "not checked (field not recorded): " in line]
    assert "clocks_event_reasons.hw_thermal_slowdown == Active for 1m" in unchecked
    assert "temperature.gpu > 85" not in unchecked
    assert json.loads(report_json(r))["not_recorded"][0] == "utilization.gpu"
    md = report_markdown(r)
    assert "Not known: utilization.gpu was not recorded." in md and "no stall" not in md


def test_utilization_that_is_na_throughout_is_not_recorded_either(tmp_path):
    path = _csv(
        tmp_path / "na.csv",
        "timestamp, index, utilization.gpu [%], memory.used [MiB]",
        [f"2026/01/01 12:00:{s:02d}.000, 0, [N/A], 4096 MiB" for s in range(60)],
    )
    assert "no stall" not in report_text(report(path))


def test_a_single_snapshot_has_no_interval_or_energy(tmp_path):
    path = _csv(
        tmp_path / "one.csv",
        "timestamp, index, power.draw [W], utilization.gpu [%], memory.used [MiB]",
        ["2026/01/01 12:00:00.000, 0, 350.00 W, 5 %, 4096 MiB", "2026/01/01 12:00:00.000, 1, 350.00 W, 5 %, 4096 MiB"],
    )
    r = report(path)
    assert r.energy_wh == {}
    text = report_text(r)
    assert text.splitlines()[0] == (
        "one.csv: 2 GPUs, one sample each at 2026-01-01 12:00:00 (recorder's local time): "
        "a single snapshot, so no durations, stalls or energy"
    )
    assert "every 1 s" not in text and "Wh" not in text and "no stall" not in text


def test_a_span_over_midnight_shows_both_dates(tmp_path):
    start = datetime(2026, 1, 1, 23, 58, 0)
    rows = [
        f"{start + timedelta(seconds=s):%Y/%m/%d %H:%M:%S}.000, 0, {5 if 60 <= s < 200 else 90} %, 4096 MiB"
        for s in range(300)
    ]
    r = report(_csv(tmp_path / "night.csv", "timestamp, index, utilization.gpu [%], memory.used [MiB]", rows))
    head = report_text(r).splitlines()[0]
    assert "2026-01-01 23:58:00 to 2026-01-02 00:02:59" in head
    (stall,) = [f for f in r.findings if f.kind == "stall"]
    assert "from 2026-01-01 23:59:00" in stall.verdict


def test_the_same_finding_on_many_gpus_is_one_line_naming_them(tmp_path):
    rows = []
    for s in range(120):
        for g in range(4):
            hot = 90 if g in (0, 1, 2) and s >= 20 else 60
            used = 81000 if g in (1, 3) else 40000
            rows.append(f"2026/01/01 12:{s // 60:02d}:{s % 60:02d}.000, {g}, {hot}, {used} MiB, 81559 MiB")
    path = _csv(tmp_path / "four.csv", "timestamp, index, temperature.gpu, memory.used [MiB], memory.total [MiB]", rows)
    r = report(path, rules=["temperature.gpu > 85 for 3"])
    hot = [f for f in r.findings if f.kind == "hot"]
    assert len(hot) == 1 and hot[0].gpus == (0, 1, 2)
    assert hot[0].verdict.startswith("GPUs 0-2 were over 85 C (temperature.gpu) for 1 min 40 s each in 3 stretches")
    full = [f for f in r.findings if f.kind == "memory_full"]
    assert len(full) == 1 and full[0].gpus == (1, 3)
    assert full[0].verdict.startswith("GPUs 1, 3 peaked at 99% of their memory")
    assert sum(1 for line in report_text(r).splitlines() if "peaked at" in line) == 1
