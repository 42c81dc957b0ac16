"""Recordings as a sample source: CSV, JSONL and Parquet round trips, pacing, selection, sweeps."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from importlib import resources
from itertools import islice, pairwise
from pathlib import Path

import pytest

from smiquery.errors import InvalidFieldError, InvalidTimeZoneError, ReplayError
from smiquery.fields import get_field
from smiquery.recordings import (
    CsvWriter,
    JsonlWriter,
    Replay,
    detect_format,
    missing_reasons,
    replay,
    sample_from_json,
    to_dataframe,
)
from smiquery.recordings.parquet import write_frame
from smiquery.sample import GpuSample, Schema
from smiquery.source import SweepGrouper
from smiquery.sources.query_gpu import CsvParser
from smiquery.streams.sync import stream
from tests.corpus import require_corpus
from tests.helpers import wait_for

DEMO = Path(str(resources.files("smiquery") / "data" / "demo-8gpu.csv"))
LOOP_LOG = "csv-loop/flame__timestamp-power.draw__lms100-torch-ex.csv"


def head(n: int, fields: str | None = None) -> list[GpuSample]:
    return list(islice(replay(DEMO, speed=0, fields=fields), n))


def test_bundled_recording_plays_whole():
    r = replay(DEMO, speed=0)
    sweeps = list(r.sweeps())
    assert len(sweeps) == 600
    assert all([s.index for s in sw] == list(range(8)) for sw in sweeps)
    assert r.stats.rows == 4800 and r.stats.sweeps == 600 and r.stats.dropped_rows == 0
    assert r.gpu_count == 8
    first = sweeps[0][0]
    # nvidia-smi's CSV names no zone: the sample says none either (not UTC, not this host's zone)
    assert first.timestamp == datetime(2026, 3, 14, 9, 30, 0, 117000) and first.timestamp.tzinfo is None
    assert first["fan.speed"] is None and first.missing["fan.speed"] == "not_available"
    hot = max((s for sw in sweeps for s in sw), key=lambda s: s.get("temperature.gpu") or 0)
    assert hot.index == 5 and hot.temperature_gpu > 85  # type: ignore[operator]


def test_sweeps_count_and_latest():
    r = replay(DEMO, speed=0)
    assert r.latest() == (None, None)
    got = list(r.sweeps(count=3))
    assert len(got) == 3
    sweep, age = r.latest()
    assert sweep == got[-1] and age is not None and age >= 0


def test_fields_are_projected_and_index_kept():
    rows = head(8, "temperature.gpu,fan.speed")
    assert rows[0].fields == ("index", "temperature.gpu", "fan.speed")
    assert rows[0].missing == {"fan.speed": "not_available"}
    assert [s.index for s in rows] == list(range(8))
    assert replay(DEMO, speed=0, fields="memory.used").fields[0].name == "index"


def test_gpu_selection_by_index_and_uuid():
    uuid = head(8)[3].uuid
    assert {s.index for s in islice(replay(DEMO, speed=0, gpus="5"), 20)} == {5}
    assert {s.index for s in islice(replay(DEMO, speed=0, gpus=[1, 2]), 20)} == {1, 2}
    r = replay(DEMO, speed=0, gpus=uuid)
    assert r.gpu_count == 1 and {s.index for s in islice(r, 5)} == {3}


def test_errors_say_what_to_do(tmp_path):
    with pytest.raises(ReplayError, match="not found; record one with `smiquery stream --output FILE`"):
        replay(tmp_path / "nope.csv")
    with pytest.raises(ReplayError, match=r"has no power\.limit; it holds index, temperature\.gpu"):
        replay(_write_rows(tmp_path / "few.csv", head(8, "temperature.gpu")), fields="power.limit")
    headerless = tmp_path / "noheader.csv"
    headerless.write_text("0, 33\n1, 34\n")
    with pytest.raises(ReplayError, match="no nvidia-smi CSV header line"):
        replay(headerless)
    with pytest.raises(InvalidFieldError):
        replay(DEMO, fields="temp")
    with pytest.raises(ValueError, match="speed"):
        replay(DEMO, speed=-1)


def _write_rows(path: Path, samples: list[GpuSample]) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        w = CsvWriter(fh, [get_field(n) for n in samples[0].fields])
        for s in samples:
            w.write(s)
    return path


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.naps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


def test_pacing_follows_the_timestamps_divided_by_speed():
    t = FakeTime()
    r = Replay(DEMO, speed=4, sleep=t.sleep, clock=t.clock)
    samples = list(islice(r, 8 * 5))
    first, last = samples[0].timestamp, samples[-1].timestamp
    assert first is not None and last is not None
    span = (last - first).total_seconds()
    assert 3.9 < span < 4.1
    assert sum(t.naps) == pytest.approx(span / 4, abs=1e-6)
    t0 = FakeTime()
    list(islice(Replay(DEMO, speed=0, sleep=t0.sleep, clock=t0.clock), 80))
    assert t0.naps == []


def test_real_pacing_is_interruptible_by_close():
    r = replay(DEMO, speed=0.001)  # one recorded millisecond (between GPUs) takes a second
    got: list[GpuSample] = []
    th = threading.Thread(target=lambda: got.extend(r))
    th.start()
    wait_for(lambda: got, what="the first replayed sample")
    t0 = time.monotonic()
    r.close()
    th.join(5)
    assert not th.is_alive() and time.monotonic() - t0 < 2
    assert 1 <= len(got) < 8


def test_long_gaps_are_skipped(tmp_path):
    rows = head(16)
    late = rows[8:]
    shifted = [_shift(s, hours=5) for s in late]
    path = _write_rows(tmp_path / "gap.csv", rows[:8] + shifted)
    t = FakeTime()
    assert len(list(Replay(path, speed=1, sleep=t.sleep, clock=t.clock))) == 16
    assert sum(t.naps) < 1


def _shift(s: GpuSample, hours: float) -> GpuSample:
    from datetime import timedelta

    from smiquery.recordings.base import with_timestamp

    assert s.timestamp is not None
    return with_timestamp(s, s.timestamp + timedelta(hours=hours))


def test_loop_keeps_time_moving_forward(tmp_path):
    path = _write_rows(tmp_path / "two.csv", head(16))
    r = replay(path, speed=0, loop=True)
    sweeps = list(r.sweeps(count=6))
    stamps = [sw.timestamp for sw in sweeps]
    assert all(a is not None and b is not None and a < b for a, b in pairwise(stamps)), stamps
    assert [s.index for s in sweeps[5]] == list(range(8))


def test_truncated_last_line_is_dropped_and_counted(tmp_path):
    text = "".join(DEMO.read_text().splitlines(keepends=True)[:17])
    path = tmp_path / "cut.csv"
    path.write_text(text + text.splitlines()[16][:40])  # a crash mid-row
    r = replay(path, speed=0)
    assert len(list(r)) == 16
    assert r.stats.dropped_rows == 1


def test_csv_round_trip_in_nvidia_smi_format(tmp_path):
    rows = head(16)
    path = _write_rows(tmp_path / "rec.csv", rows)
    text = path.read_text()
    assert text.splitlines()[0].startswith("timestamp, index, name, uuid, temperature.gpu, utilization.gpu [%]")
    assert ", [N/A], " in text and " MiB, " in text
    again = list(replay(path, speed=0))
    assert [s.values() for s in again] == [s.values() for s in rows]
    assert [dict(s.missing) for s in again] == [dict(s.missing) for s in rows]
    assert len(list(CsvParser().parse(text.splitlines()))) == 16

    from smiquery.recordings import read_csv

    df = read_csv(path)
    assert len(df) == 16 and df["fan_speed"].isna().all()


def test_jsonl_round_trip(tmp_path):
    rows = head(16)
    path = tmp_path / "rec.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        w = JsonlWriter(fh)
        for s in rows:
            w.write(s)
    assert '"fan.speed": null' in path.read_text()
    assert '"_missing": {"fan.speed": "not_available"' in path.read_text()
    r = replay(path, speed=0)
    again = list(r)
    assert r.format == "jsonl"
    assert [s.values() for s in again] == [s.values() for s in rows]
    assert [dict(s.missing) for s in again] == [dict(s.missing) for s in rows]
    assert again[0].timestamp == rows[0].timestamp


def test_parquet_file_round_trip(tmp_path):
    import pandas as pd

    rows = head(16)
    path = tmp_path / "rec.parquet"
    write_frame(to_dataframe(rows), path)  # one Parquet file, as each part of a dataset is written
    df = pd.read_parquet(path)
    assert len(df) == 16
    assert df.attrs["fields"][:3] == ["timestamp", "index", "name"]
    assert df.attrs["units"]["memory_used"] == "MiB"
    assert len(missing_reasons(df)["fan_speed"]) == 16
    again = list(replay(path, speed=0))
    assert [s.values() for s in again] == [s.values() for s in rows]
    assert [dict(s.missing) for s in again] == [dict(s.missing) for s in rows]


def test_sample_from_json_types_values():
    s = sample_from_json(
        {
            "timestamp": "2026-03-14T09:30:00.117",
            "index": 2,
            "pci.domain": "0x0",
            "persistence_mode": "Enabled",
            "power.draw": 70,
            "fan.speed": None,
            "_missing": {"fan.speed": "not_supported"},
        }
    )
    assert s.timestamp == datetime(2026, 3, 14, 9, 30, 0, 117000)  # no offset written: naive, as recorded
    assert s["pci.domain"] == 0 and s["persistence_mode"] is True
    assert s["power.draw"] == 70.0 and isinstance(s["power.draw"], float)
    assert s.missing == {"fan.speed": "not_supported"}
    assert s.raw["fan.speed"] == "[Not Supported]"


def test_bad_jsonl_lines_are_dropped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"index": 0, "temperature.gpu": 40}\n[1]\n{"index": "x"}\n{"index": 1, "temperature.gpu": 4')
    r = replay(path, speed=0)
    assert [s.index for s in r] == [0]
    assert r.stats.dropped_rows == 3


def test_detect_format(tmp_path):
    assert detect_format("a.CSV") == "csv"
    assert detect_format("a.ndjson") == "jsonl"
    assert detect_format("a.pq") == "parquet"
    odd = tmp_path / "rec.dat"
    odd.write_text('{"index": 0}\n')
    assert detect_format(odd) == "jsonl"
    odd.write_text("timestamp, index\n")
    assert detect_format(odd) == "csv"


# --------------------------------------------------------------------------------------------------- sweeps


def _s(index: int) -> GpuSample:
    return GpuSample(Schema(("index",)), (index,), (str(index),))


def test_sweep_grouper_matches_stream_rules():
    g = SweepGrouper()
    done = [[s.index for s in sw] for i in [0, 1, 2, 0, 2, 0, 1, 2, 0] for sw in g.feed(_s(i))]
    # first sweep ends when an index repeats; then 3 GPUs make a sweep, or a repeat cuts one short
    assert done == [[0, 1, 2], [0, 2], [0, 1, 2]]
    last = g.flush()
    assert last is not None
    assert [s.index for s in last] == [0]
    assert g.flush() is None
    one = SweepGrouper(expected=1)
    assert [len(one.feed(_s(0))) for _ in range(3)] == [1, 1, 1]


def test_replay_sweeps_equal_stream_sweeps(fake_smi):
    with stream("index,temperature.gpu", interval=0.05, nvidia_smi=fake_smi()) as s:
        live = [[x.index for x in sw] for sw in s.sweeps(count=3)]
    played = [[x.index for x in sw] for sw in replay(DEMO, speed=0).sweeps(count=3)]
    assert live == played


def test_csv_writer_writes_whole_lines_in_one_call():
    calls: list[str] = []

    class Spy(io.StringIO):
        def write(self, text: str) -> int:
            calls.append(text)
            return super().write(text)

    rows = head(3)
    w = CsvWriter(Spy(), [get_field(n) for n in rows[0].fields])
    for s in rows:
        w.write(s)
    assert len(calls) == 3
    assert calls[0].count("\n") == 2 and all(c.endswith("\n") for c in calls)


@pytest.mark.parametrize("content", [b"", b"\n\n", bytes(range(256)) * 16, b"timestamp, index\ngarbage\n"])
def test_empty_or_random_recordings_are_errors(tmp_path, content):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(ReplayError) as info:
        replay(path, speed=0)
    assert str(info.value).startswith(("recording", str(path)))
    assert "\n" not in str(info.value)


def test_torn_last_line_and_garbage_are_skipped_and_counted(tmp_path):
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    lines.insert(100, "\x00\x01garbage")
    path = tmp_path / "killed.csv"
    path.write_text("\n".join(lines) + "\n" + lines[-1][:30], encoding="utf-8")
    r = replay(path, speed=0)
    assert len(list(r)) == 4800
    assert r.stats.dropped_rows == 2
    assert r.first_error is not None and r.first_error.lineno == 101


def test_a_log_without_index_replays_as_gpu_0():
    log = require_corpus() / LOOP_LOG
    r = replay(log, speed=0)
    samples = list(r)
    assert {s.index for s in samples} == {0}
    assert r.gpu_count == 1
    assert all(len(sweep) == 1 for sweep in replay(log, speed=0).sweeps(5))


def test_headerless_log_with_columns(tmp_path):
    path = tmp_path / "noheader.csv"
    path.write_text("0, 33\n1, 34\n0, 35\n1, 36\n", encoding="utf-8")
    r = replay(path, speed=0, columns="index,temperature.gpu")
    assert [(s.index, s.temperature_gpu) for s in r] == [(0, 33), (1, 34), (0, 35), (1, 36)]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_every_writer_fails_at_once_where_it_cannot_write(tmp_path, suffix):
    from smiquery.fields import resolve_fields
    from smiquery.recordings import open_recorder

    fields = resolve_fields("default")
    with pytest.raises(FileNotFoundError):
        open_recorder(tmp_path / "no-such-dir" / f"run{suffix}", fields)
    taken = tmp_path / f"taken{suffix}"
    taken.mkdir()
    with pytest.raises(IsADirectoryError):
        open_recorder(taken, fields)
    fine = open_recorder(tmp_path / f"run{suffix}", fields)
    fine.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no probe file left behind


# ------------------------------------------------------------------------------------------ time zones (tz=)

BERLIN_OFFSET = "+01:00"  # 2026-03-14 is winter time in Berlin


def _cli(*args: object, **env: str) -> subprocess.CompletedProcess[str]:
    """``smiquery ...`` as a user runs it (this checkout's code: the child inherits PYTHONPATH)."""
    return subprocess.run(
        [sys.executable, "-m", "smiquery", *map(str, args)],
        env={**os.environ, "NO_COLOR": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _noheader(tmp_path: Path, lines: int = 40) -> tuple[Path, Path, str]:
    """The demo's first rows as a plain log with its header and the same rows without (noheader)."""
    text = DEMO.read_text(encoding="utf-8").splitlines()
    header, rows = text[0], text[1 : lines + 1]
    with_header = tmp_path / "with" / "log.csv"
    without = tmp_path / "without" / "log.csv"
    with_header.parent.mkdir()
    without.parent.mkdir()
    with_header.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    without.write_text("\n".join(rows) + "\n", encoding="utf-8")
    names = ",".join(cell.split(" [")[0].strip() for cell in header.split(","))
    return with_header, without, names


def test_replay_keeps_naive_times_naive_and_tz_names_the_zone():
    plain = next(iter(replay(DEMO, speed=0)))
    assert plain.timestamp == datetime(2026, 3, 14, 9, 30, 0, 117000) and plain.timestamp.tzinfo is None
    berlin = next(iter(replay(DEMO, speed=0, tz="Europe/Berlin")))
    assert berlin.timestamp is not None and str(berlin.timestamp.tzinfo) == "Europe/Berlin"
    assert berlin.timestamp.replace(tzinfo=None) == plain.timestamp  # the recorded wall-clock time, now zoned
    assert berlin.timestamp.isoformat().endswith(BERLIN_OFFSET)
    assert berlin.raw["timestamp"] == "2026/03/14 09:30:00.117"  # the text as recorded


def test_replay_of_an_aware_recording_keeps_or_converts_its_zone(tmp_path):
    path = tmp_path / "zoned.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        w = JsonlWriter(fh)
        for s in replay(DEMO, speed=0, tz="Europe/Berlin", fields="default"):
            w.write(s)
    assert '"timestamp": "2026-03-14T09:30:00.117+01:00"' in path.read_text(encoding="utf-8")
    kept = next(iter(replay(path, speed=0)))
    assert kept.timestamp is not None and kept.timestamp.utcoffset() == timedelta(hours=1)
    utc = next(iter(replay(path, speed=0, tz="UTC")))
    assert utc.timestamp is not None and utc.timestamp.hour == 8 and utc.timestamp.utcoffset() == timedelta(0)
    assert utc.timestamp == kept.timestamp  # the same instant


def test_replay_rejects_an_unknown_zone_with_a_typed_error():
    with pytest.raises(InvalidTimeZoneError, match="unknown time zone 'Mars/Olympus'") as info:
        replay(DEMO, speed=0, tz="Mars/Olympus")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    with pytest.raises(InvalidTimeZoneError):
        sample_from_json({"timestamp": "2026-03-14T09:30:00"}, tz="")


def test_headerless_replay_with_columns_equals_the_header_one(tmp_path):
    with_header, without, names = _noheader(tmp_path)
    with pytest.raises(ReplayError, match="no nvidia-smi CSV header"):
        replay(without, speed=0)
    a = list(replay(with_header, speed=0))
    b = list(replay(without, speed=0, columns=names))
    assert len(a) == 40 and [s.values() for s in a] == [s.values() for s in b]
    with pytest.raises(ReplayError, match="header does not match"):
        replay(with_header, speed=0, columns="timestamp,index,power.draw")


def test_cli_stream_replay_tz_shows_the_zone_and_never_claims_utc(tmp_path):
    # TZ=UTC: a naive recording replayed on a UTC machine must still not be labelled UTC
    plain = _cli("stream", "--replay", DEMO, "--speed", "0", "-n", "1", "-F", "jsonl", "-f", "timestamp", TZ="UTC")
    assert plain.returncode == 0, plain.stderr
    first = json.loads(plain.stdout.splitlines()[0])
    assert first["timestamp"] == "2026-03-14T09:30:00.117"  # no offset: none was recorded
    zoned = _cli("stream", "--replay", DEMO, "--speed", "0", "-n", "1", "-F", "jsonl", "--tz", "Europe/Berlin")
    assert zoned.returncode == 0, zoned.stderr
    assert json.loads(zoned.stdout.splitlines()[0])["timestamp"] == "2026-03-14T09:30:00.117+01:00"
    csv = _cli("stream", "--replay", DEMO, "--speed", "0", "-n", "1", "-F", "csv", "--tz", "Asia/Tokyo")
    assert csv.returncode == 0, csv.stderr
    assert csv.stdout.splitlines()[1].startswith("2026/03/14 09:30:00.117, 0,")  # recorded wall clock, localized
    for args, code in (
        (["stream", "--replay", DEMO, "--tz", "Mars/Olympus"], 2),
        (["stream", "--tz", "UTC", "-n", "1"], 2),
    ):
        bad = _cli(*args)
        assert bad.returncode == code, bad.stderr
        assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        assert "--tz" in bad.stderr


def test_cli_stream_replay_headerless_log_needs_and_takes_fields(tmp_path):
    with_header, without, names = _noheader(tmp_path, lines=16)
    refused = _cli("stream", "--replay", without, "--speed", "0", "-F", "csv")
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "pass its columns in order with --fields" in refused.stderr
    a = _cli("stream", "--replay", with_header, "--speed", "0", "-F", "csv", "--fields", names)
    b = _cli("stream", "--replay", without, "--speed", "0", "-F", "csv", "--fields", names)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout and len(a.stdout.splitlines()) == 17
    wrong = _cli("stream", "--replay", without, "--speed", "0", "--fields", "timestamp,index,power.draw")
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1
    assert "no row fits the columns timestamp,index,power.draw" in wrong.stderr
    unknown = _cli("stream", "--replay", without, "--speed", "0", "--fields", "timestamp,index,temprature.gpu")
    assert unknown.returncode == 2 and "temprature.gpu" in unknown.stderr
    disagree = _cli("stream", "--replay", with_header, "--speed", "0", "--fields", "timestamp,clocks.max.sm")
    assert disagree.returncode == 1 and "has no clocks.max.sm" in disagree.stderr
