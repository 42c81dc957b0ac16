"""The time rules: nvidia-smi stamps local wall-clock time with no zone, and that clock repeats, skips and steps.

A DST fall-back read in its zone resolves by row order; read without one, no duration goes negative and the step
is reported once; live alert holds run on the monotonic arrival clock; energy integrates over nvidia-smi's own
timestamps, not over when sweeps were delivered.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from itertools import islice, pairwise
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest

from smiquery.alerts import AlertEvaluator
from smiquery.analysis import report as analyze
from smiquery.analysis import report_text
from smiquery.clock import Localizer
from smiquery.recordings import Replay, read_csv, read_recording
from smiquery.source import Sweep
from smiquery.sources.query_gpu import parse_lines
from tests.training.test_monitor import deliver, hand_monitor

BERLIN = ZoneInfo("Europe/Berlin")
HEADER = "timestamp, index, power.draw [W], utilization.gpu [%], memory.used [MiB]"
# 2026-10-25: Berlin's clocks go back from 03:00 CEST to 02:00 CET, so 02:00-03:00 happens twice
FIRST = datetime(2026, 10, 24, 23, 30, tzinfo=timezone.utc)  # 01:30 CEST
STEP = 10  # seconds between sweeps
SWEEPS = 2 * 3600 // STEP  # two hours: 01:30 CEST .. 02:30 CET, through both passes of the repeated hour


def _stamp(wall: datetime) -> str:
    return wall.strftime("%Y/%m/%d %H:%M:%S.") + f"{wall.microsecond // 1000:03d}"


def _fallback_csv(path: Path) -> Path:
    """Two GPUs at 100 W and 150 W, a sweep every 10 s for two hours across the fall-back, as nvidia-smi logs it."""
    lines = [HEADER]
    for k in range(SWEEPS):
        wall = (FIRST + timedelta(seconds=k * STEP)).astimezone(BERLIN).replace(tzinfo=None)
        lines.append(f"{_stamp(wall)}, 0, 100.00, 90, 2048")
        lines.append(f"{_stamp(wall + timedelta(milliseconds=3))}, 1, 150.00, 90, 2048")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def fallback(tmp_path: Path) -> Path:
    return _fallback_csv(tmp_path / "fallback.csv")


def _strictly_increasing(stamps: list[datetime]) -> bool:
    return all(b > a for a, b in pairwise(stamps))


# ------------------------------------------------------------------------------------ zone resolution by order


def test_read_csv_in_its_zone_puts_the_repeated_hour_after_the_first(fallback):
    df = read_csv(fallback, tz="Europe/Berlin")
    gpu0 = df[df["index"] == 0]["timestamp"]
    assert gpu0.is_monotonic_increasing and gpu0.is_unique
    assert (gpu0.iloc[-1] - gpu0.iloc[0]).total_seconds() == (SWEEPS - 1) * STEP
    # the second pass of 02:00-03:00 is CET (+01:00)
    assert gpu0.iloc[-1].utcoffset() == timedelta(hours=1)
    assert gpu0.iloc[0].utcoffset() == timedelta(hours=2)


def test_the_python_reader_and_the_parser_resolve_the_same_way(fallback):
    text = fallback.read_text()
    samples = parse_lines(text, tz=BERLIN)
    stamps = [s.timestamp for s in samples if s.index == 0]
    assert _strictly_increasing([t.astimezone(timezone.utc) for t in stamps if t is not None])
    fast = read_csv(fallback, tz="Europe/Berlin")["timestamp"].tolist()
    utc = timezone.utc
    assert [t.to_pydatetime().astimezone(utc) for t in fast] == [s.timestamp.astimezone(utc) for s in samples]


def test_replay_and_jsonl_in_their_zone_resolve_by_order(fallback, tmp_path):
    with Replay(fallback, speed=0, tz="Europe/Berlin") as rec:
        stamps = [s.timestamp.astimezone(timezone.utc) for s in rec if s.index == 0 and s.timestamp is not None]
    assert len(stamps) == SWEEPS and _strictly_increasing(stamps)
    jsonl = tmp_path / "fallback.jsonl"
    jsonl.write_text(
        "".join(
            f'{{"timestamp": "{(FIRST + timedelta(seconds=k * STEP)).astimezone(BERLIN):%Y-%m-%dT%H:%M:%S}", '
            f'"index": 0, "power.draw": 100.0}}\n'
            for k in range(SWEEPS)
        )
    )
    got = read_recording(jsonl, tz="Europe/Berlin")["timestamp"]
    assert got.is_monotonic_increasing and got.is_unique


def test_localizer_keeps_a_small_step_back_in_the_first_pass_and_shifts_a_skipped_time_forward():
    loc = Localizer(BERLIN)
    first = loc(datetime(2026, 10, 25, 2, 30, 5))
    again = loc(datetime(2026, 10, 25, 2, 30, 2))  # NTP stepped 3 s back inside the first pass
    assert first.utcoffset() == again.utcoffset() == timedelta(hours=2)
    assert loc(datetime(2026, 3, 29, 2, 30)).isoformat() == "2026-03-29T03:30:00+02:00"


# ---------------------------------------------------------------------------------------------- the report


def test_report_in_its_zone_has_true_span_and_energy_and_names_the_change_once(fallback):
    report = analyze(fallback, tz="Europe/Berlin")
    hours = SWEEPS * STEP / 3600  # each sample stands for one interval
    assert report.duration == pytest.approx((SWEEPS - 1) * STEP)
    assert report.energy_wh[0] == pytest.approx(100 * hours)
    assert report.energy_wh[1] == pytest.approx(150 * hours)
    clock = [f for f in report.findings if f.kind == "clock"]
    assert len(clock) == 1
    assert "from UTC+02:00 to UTC+01:00" in clock[0].verdict
    assert "UTC+02:00 to UTC+01:00" in report_text(report)


def test_report_without_a_zone_never_goes_negative_and_reports_the_step_back_once(fallback):
    report = analyze(fallback)
    hours = SWEEPS * STEP / 3600
    # the step back counts 0: one interval of the two hours is lost, none is negative
    assert report.duration == pytest.approx((SWEEPS - 2) * STEP)
    assert report.energy_wh[0] == pytest.approx(100 * (hours - STEP / 3600))
    assert report.energy_wh[1] == pytest.approx(150 * (hours - STEP / 3600))
    clock = [f for f in report.findings if f.kind == "clock"]
    assert len(clock) == 1
    assert "went back 59 min 50 s at 02:59:50" in clock[0].verdict
    assert all(s.seconds >= 0 for s in report.stalls)
    assert all(a.seconds >= 0 for a in report.alerts)


def test_report_of_an_ntp_step_back_finds_one_clock_step(tmp_path):
    lines = [HEADER]
    t = datetime(2026, 5, 4, 12, 0, 0)
    for k in range(120):
        wall = t + timedelta(seconds=k) - (timedelta(seconds=30) if k >= 60 else timedelta(0))
        lines += [f"{_stamp(wall)}, 0, 100.00, 5, 4096", f"{_stamp(wall)}, 1, 100.00, 5, 4096"]
    path = tmp_path / "ntp.csv"
    path.write_text("\n".join(lines) + "\n")
    report = analyze(path, min_stall=60)
    assert report.duration == pytest.approx(118.0)
    assert [f.kind for f in report.findings].count("clock") == 1
    assert "went back 29 s" in next(f.verdict for f in report.findings if f.kind == "clock")
    # a stall across the step is one stretch of 119 samples' time, not 30 s shorter
    stalls = [s for s in report.stalls if s.gpu == 0]
    assert len(stalls) == 1 and stalls[0].seconds == pytest.approx(119.0)


def test_plot_never_draws_a_line_backwards_across_a_step():
    from smiquery.analysis.series import line_points

    x = np.array(
        ["2026-10-25T02:59:50", "2026-10-25T03:00:00", "2026-10-25T02:00:10", "2026-10-25T02:00:20"],
        dtype="datetime64[ns]",
    )
    xs, ys = line_points(x, np.array([1.0, 2.0, 3.0, 4.0]), gap_limit=30.0, max_points=1000)
    drawn = [(a, b) for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:], strict=False) if not (np.isnan(ya) or np.isnan(yb))]
    assert drawn and all(b > a for a, b in drawn)


# -------------------------------------------------------------------------------------------------- alerts


def _sample(ts: datetime, util: float):
    (s,) = parse_lines([HEADER, f"{_stamp(ts)}, 0, 100.00, {util:g}, 2048"])
    return s


def test_live_hold_across_a_fall_back_fires_on_time():
    ev = AlertEvaluator(["utilization.gpu > 50 for 30s"])
    wall = datetime(2026, 10, 25, 2, 59, 45)
    fired_at = None
    for k in range(60):
        # the wall clock goes back an hour 15 s in; the monotonic arrival clock just runs on
        stamp = wall + timedelta(seconds=k) - (timedelta(hours=1) if k >= 15 else timedelta(0))
        events = ev.update(_sample(stamp, 90), now=1000.0 + k)
        if events:
            fired_at = k
            assert events[0].duration == pytest.approx(30.0)
            break
    assert fired_at == 30


def test_live_ntp_step_forward_does_not_fire_an_hour_hold_early():
    ev = AlertEvaluator(["utilization.gpu > 50 for 1h"])
    wall = datetime(2026, 5, 4, 12, 0, 0)
    for k in range(120):
        stamp = wall + timedelta(seconds=k) + (timedelta(hours=1) if k >= 10 else timedelta(0))
        assert ev.update(_sample(stamp, 90), now=500.0 + k) == []
    assert ev.state(0, 0) == "pending"
    fired = ev.update(_sample(wall + timedelta(hours=2), 90), now=500.0 + 3600)
    assert [e.state for e in fired] == ["firing"]


def test_replayed_hold_counts_a_step_back_as_zero_not_negative():
    ev = AlertEvaluator(["utilization.gpu > 50 for 30s"])
    wall = datetime(2026, 10, 25, 2, 59, 45)
    fired_at = None
    for k in range(60):
        stamp = wall + timedelta(seconds=k) - (timedelta(hours=1) if k >= 15 else timedelta(0))
        events = ev.update(_sample(stamp, 90))  # a recording: only its timestamps
        if events:
            fired_at = k
            assert events[0].duration >= 0
            break
    assert fired_at == 31  # the step itself counts 0 s


# -------------------------------------------------------------------------------------------------- energy


def test_monitor_energy_of_two_sweeps_delivered_together_is_one_interval():
    monitor, src = hand_monitor(interval=1.0)
    try:
        monitor.begin_epoch(0)
        t = datetime(2026, 5, 4, 12, 0, 0)
        for k in range(2):
            (s,) = parse_lines([HEADER, f"{_stamp(t + timedelta(seconds=k))}, 0, 100.00, 90, 2048"])
            sweep = Sweep([s])
            sweep.arrived = 50.0  # type: ignore[attr-defined]  # both read in one go
            deliver(monitor, src, sweep)
        values = monitor.end_epoch(0)
    finally:
        monitor.close()
    assert values["gpu0_energy_wh"] == pytest.approx(100.0 / 3600.0)
    assert not math.isnan(values["gpu0_energy_wh"])


# ------------------------------------------------------------------- replayed holds in a zone (true elapsed time)

TEMP_HEADER = "timestamp, index, temperature.gpu"


def _walls_csv(path: Path, first: datetime, rows: int = 40) -> Path:
    """GPU 0 at 90 C, one row a second of true time from ``first`` (UTC), stamped in Berlin's wall time."""
    lines = [TEMP_HEADER]
    for k in range(rows):
        wall = (first + timedelta(seconds=k)).astimezone(BERLIN).replace(tzinfo=None)
        lines.append(f"{_stamp(wall)}, 0, 90")
    path.write_text("\n".join(lines) + "\n")
    return path


# 2026-03-29: Berlin goes from 01:59:59 CET to 03:00:00 CEST; 20 rows before the skip, 20 after
SPRING = datetime(2026, 3, 29, 0, 59, 40, tzinfo=timezone.utc)  # 01:59:40 CET
# 2026-10-25: Berlin goes from 02:59:59 CEST back to 02:00:00 CET; 20 rows before, 20 after
FALL = datetime(2026, 10, 25, 0, 59, 40, tzinfo=timezone.utc)  # 02:59:40 CEST


def _replay_alert(path: Path, rule: str) -> subprocess.CompletedProcess[str]:
    """``smiquery stream --replay`` as a user runs it, as fast as it goes."""
    args = ["stream", "--replay", path, "--tz", "Europe/Berlin", "--alert", rule, "--speed", 0, "--format", "csv"]
    return subprocess.run(
        [sys.executable, "-m", "smiquery", *map(str, args)],
        env={**os.environ, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_replayed_hold_across_a_spring_forward_counts_true_time(tmp_path):
    path = _walls_csv(tmp_path / "spring.csv", SPRING)
    assert "2026/03/29 01:59:59.000, 0, 90\n2026/03/29 03:00:00.000, 0, 90" in path.read_text()
    # 39 s really passed: the skipped hour is no time at all
    long = _replay_alert(path, "temperature.gpu > 85 for 5m")
    assert long.returncode == 0, long.stderr
    assert "ALERT" not in long.stderr and "held 36" not in long.stderr
    short = _replay_alert(path, "temperature.gpu > 85 for 20s")
    assert short.returncode == 0, short.stderr
    alerts = [line for line in short.stderr.splitlines() if "ALERT firing" in line]
    assert len(alerts) == 1, short.stderr
    assert "held 20.0 s at 2026-03-29 03:00:00" in alerts[0]


def test_replayed_hold_across_a_fall_back_is_not_shortened_or_delayed(tmp_path):
    path = _walls_csv(tmp_path / "fall.csv", FALL)
    assert "2026/10/25 02:59:59.000, 0, 90\n2026/10/25 02:00:00.000, 0, 90" in path.read_text()
    long = _replay_alert(path, "temperature.gpu > 85 for 5m")
    assert long.returncode == 0, long.stderr
    assert "ALERT" not in long.stderr
    short = _replay_alert(path, "temperature.gpu > 85 for 20s")
    alerts = [line for line in short.stderr.splitlines() if "ALERT firing" in line]
    assert len(alerts) == 1, short.stderr
    # the 21st row, 20 s after the first: the second 02:00:00 (CET), not a second later
    assert "held 20.0 s at 2026-10-25 02:00:00" in alerts[0]


def test_replay_paces_and_loops_across_a_spring_forward_by_true_time(tmp_path):
    path = _walls_csv(tmp_path / "spring.csv", SPRING)
    now = [0.0]
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        now[0] += seconds

    with Replay(path, speed=1, tz="Europe/Berlin", sleep=nap, clock=lambda: now[0]) as rec:
        assert len(list(rec)) == 40
    assert sum(naps) == pytest.approx(39.0)  # every second waited, the skipped hour not taken for a gap
    with Replay(path, speed=0, tz="Europe/Berlin", loop=True) as rec:
        stamps = [s.timestamp for s in islice(rec, 80) if s.timestamp is not None]
    utc = [t.astimezone(timezone.utc) for t in stamps]
    # the second lap follows the first a second later, as a recording one second a row would
    assert [(b - a).total_seconds() for a, b in pairwise(utc)] == [1.0] * 79


def test_report_of_a_stall_across_a_spring_forward_has_its_true_length(tmp_path):
    lines = [HEADER]
    for k in range(240):  # 01:50 CET on, every 5 s; both GPUs stalled from 01:58:20 CET to 03:03:20 CEST
        wall = (datetime(2026, 3, 29, 0, 50, tzinfo=timezone.utc) + timedelta(seconds=5 * k)).astimezone(BERLIN)
        util = 0 if 100 <= k < 160 else 90
        lines += [f"{_stamp(wall.replace(tzinfo=None))}, {g}, 100.00, {util}, 4096" for g in (0, 1)]
    path = tmp_path / "stall.csv"
    path.write_text("\n".join(lines) + "\n")
    report = analyze(path, tz="Europe/Berlin")
    together = [f for f in report.findings if f.kind == "stall_together"]
    assert len(together) == 1
    assert "from 01:58:20 for 5 min" in together[0].verdict
    assert together[0].seconds == pytest.approx(300.0)
    assert [s.end.astimezone(timezone.utc) - s.start.astimezone(timezone.utc) for s in report.stalls] == [
        timedelta(minutes=5)
    ] * 2


def test_stream_help_and_docs_name_the_clock_that_holds_an_alert():
    from tests.cli.test_cli import run

    said = "timed live by when the rows arrive (a monotonic clock"
    flat = " ".join(run("stream", "--help").stdout.split())
    assert said in flat and "in --replay by the samples' timestamps" in flat
    assert "own timestamps" not in flat  # live, the wall-clock timestamps never time a hold
    docs = " ".join((Path(__file__).parents[1] / "docs" / "cli.md").read_text(encoding="utf-8").split())
    assert said in docs and "in a `--replay` by the samples' timestamps" in docs
