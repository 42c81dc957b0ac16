"""Recordings a platform team can leave running: real `smiquery stream -o` processes against the fake nvidia-smi.

A real SIGKILL of the recorder, a real full disk (a small tmpfs mounted by the test when it runs as root: the
kernel's own ENOSPC, the error a full /var gives), and a per-file size limit set on the running recorder with
prlimit (EFBIG, no root needed; Python ignores SIGXFSZ, so the write fails the way a full disk's does). Both are
lifted while the recorder runs, and it must go on recording by itself. Existing files are refused unless --force or
--append, --rotate/--keep rotate, SIGHUP reopens, copytruncate is noticed, and a rotated set reads as one.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import tracemalloc
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import psutil
import pytest

from smiquery.cli import main
from smiquery.errors import UsageError
from smiquery.fields import resolve_fields
from smiquery.recordings import ParquetDataset, TextRecorder, open_recording, read_recording, replay
from smiquery.sources.query_gpu import parse_lines
from tests.helpers import wait_for

SAFE = ("NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_VISIBLE_DEVICES", "SMIQUERY_NVIDIA_SMI", "SMIQUERY_FAKE_")
FIELDS = resolve_fields("timestamp,index,utilization.gpu,power.draw")


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SAFE)}
    env.update(NO_COLOR="1")
    return env


def argv(*args: object, smi: Path) -> list[str]:
    return [sys.executable, "-m", "smiquery", "--nvidia-smi", str(smi), *(str(a) for a in args)]


def start(smi: Path, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv("stream", "-F", "csv", *args, smi=smi),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then the stderr it wrote."""
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    return err


class StderrLines:
    """The recorder's stderr, read on a thread so a test can wait for a line without blocking."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def has(self, text: str) -> bool:
        return any(text in x for x in self.lines)

    def stop(self) -> list[str]:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._thread.join(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        assert self.proc.returncode == 143, self.lines
        return self.lines


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)


def rows_in(path: Path) -> int:
    """Whole data lines in a CSV (header excluded) or JSONL file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    lines = [x for x in data.split(b"\n")[:-1] if x and not x.startswith(b"timestamp")]
    return len(lines)


def journal_or_parts(path: Path) -> int:
    return rows_in(path / "_open.jsonl") + 1000 * len(list(path.glob("part-*.parquet")))


def samples(n: int, gpus: int = 2, start_minute: int = 0) -> list:
    lines = [
        f"2026/01/01 {(start_minute + i // 3600) % 24:02d}:{(i // 60) % 60:02d}:{i % 60:02d}.000, {g}, {i % 100} %, "
        f"{100 + i % 50}.50 W"
        for i in range(n)
        for g in range(gpus)
    ]
    return list(parse_lines(lines, FIELDS))


# ------------------------------------------------------------------------------------------------ SIGKILL


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_sigkill_loses_nothing_written_and_the_rest_reads(fake_smi, tmp_path, suffix):
    rec = tmp_path / f"run.{suffix}"
    proc = start(fake_smi(), "-l", "100ms", "-o", rec)
    counter = journal_or_parts if suffix == "parquet" else rows_in
    try:
        wait_for(lambda: counter(rec) >= 40, timeout=60, what="40 rows recorded")
        seen = counter(rec)
    finally:
        proc.kill()  # SIGKILL: no handler, no close, no last flush
        proc.communicate(timeout=30)
    killed_at = datetime.now()
    assert proc.returncode == -signal.SIGKILL
    df = read_recording(rec)
    assert "skipped" not in df.attrs  # whole lines only: every row written is read
    assert len(df) >= seen
    last = df["timestamp"].max().to_pydatetime()
    gap = ((killed_at if last.tzinfo is None else killed_at.astimezone()) - last).total_seconds()
    assert gap < 10.0  # within --flush-every's default: what the issue allows; in fact one interval or two


def test_a_killed_parquet_dataset_is_closed_on_append_and_pandas_reads_the_parts(fake_smi, tmp_path):
    rec = tmp_path / "run.parquet"
    proc = start(fake_smi(), "-l", "100ms", "-o", rec)
    try:
        wait_for(lambda: rows_in(rec / "_open.jsonl") >= 20, timeout=60, what="20 rows in the journal")
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    before = len(read_recording(rec))
    proc = start(fake_smi(), "-l", "100ms", "-o", rec, "--append")
    wait_for(
        lambda: (rec / "part-000001.parquet").exists() and rows_in(rec / "_open.jsonl") >= 10,
        timeout=60,
        what="the killed run's journal closed, the appended run recording",
    )
    stop(proc)
    import pandas as pd

    parts = sorted(p.name for p in rec.glob("part-*.parquet"))
    assert parts == ["part-000001.parquet", "part-000002.parquet"]  # the killed run's journal became a part
    assert not (rec / "_open.jsonl").exists()
    outside = pd.read_parquet(rec)  # what other tools see: the closed parts
    ours = read_recording(rec)
    assert len(outside) == len(ours) >= before + 10


# ------------------------------------------------------------------------------------------------ full disk


def _tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_a_full_disk_drops_rows_says_so_and_recording_resumes(fake_smi, tmp_path, suffix):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "256k"):
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test covers a write that fails for want of room")
    try:
        filler = disk / "filler"
        with open(filler, "wb") as fh:  # leave ~24 KiB free: a few hundred rows
            fh.write(b"\0" * (256 - 24) * 1024)
        rec = disk / f"run.{suffix}"
        err = StderrLines(start(fake_smi(), "-l", "20ms", "-o", rec))
        wait_for(lambda: err.has("the disk is full"), timeout=120, what="the full-disk notice")
        before = len(read_recording(rec))
        filler.unlink()  # space again
        wait_for(lambda: err.has("again;"), timeout=60, what="recording resumes")
        lines = err.stop()
        df = read_recording(rec)
        assert "skipped" not in df.attrs  # cut back to whole lines: nothing torn
        assert len(df) > before
        written = rec / "_open.jsonl" if suffix == "parquet" else rec
        full = [x for x in lines if "the disk is full" in x]
        assert (
            full[0]
            == f"smiquery: cannot write {written}: the disk is full; rows are dropped until there is space again"
        )
        assert any(x.startswith(f"smiquery: recording to {written} again; ") for x in lines)
        assert not any("Errno" in x for x in lines)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_file_size_limit_drops_rows_and_lifting_it_resumes(fake_smi, tmp_path):
    rec = tmp_path / "run.csv"
    err = StderrLines(start(fake_smi(), "-l", "20ms", "-o", rec))
    try:
        wait_for(lambda: rows_in(rec) >= 5, timeout=60, what="rows")
        me = psutil.Process(err.proc.pid)
        me.rlimit(psutil.RLIMIT_FSIZE, (rec.stat().st_size + 2048, resource.RLIM_INFINITY))
        wait_for(lambda: err.lines, timeout=60, what="the notice")
        assert err.lines[0] == (
            f"smiquery: cannot write {rec}: the file is as large as this system lets it grow; "
            "rows are dropped until there is space again"
        )
        size = rec.stat().st_size
        assert rec.read_bytes().endswith(b"\n")
        me.rlimit(psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_for(lambda: len(err.lines) >= 2, timeout=60, what="the recovery notice")
        assert err.lines[1].startswith(f"smiquery: recording to {rec} again; ") and "row(s) were lost" in err.lines[1]
        wait_for(lambda: rec.stat().st_size > size + 500, timeout=60, what="more rows")
    finally:
        err.stop()
    df = read_recording(rec)
    assert "skipped" not in df.attrs


# ------------------------------------------------------------------------------------------------ refuse, force, append


def test_an_existing_recording_is_refused_unless_force_or_append(tmp_path, capsys):
    rec = tmp_path / "run.csv"
    rec.write_text("keep me\n")
    assert cli(*["stream", "--replay", _demo(tmp_path), "--speed", "0", "-F", "csv", "-o", str(rec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"smiquery: usage error: {rec} already exists; "
        "pass --append to go on writing it, --force to replace it, or another --output"
    ]
    assert rec.read_text() == "keep me\n"
    assert cli(*["stream", "--replay", _demo(tmp_path), "--speed", "0", "-F", "csv", "-o", str(rec), "--force"]) == 0
    rows = len(read_recording(rec))
    assert rows == 8
    assert cli(*["stream", "--replay", _demo(tmp_path), "--speed", "0", "-F", "csv", "-o", str(rec), "--append"]) == 0
    text = rec.read_text()
    assert text.count("timestamp") == 1  # one header: the rows went on below it
    assert len(read_recording(rec)) == 2 * rows
    capsys.readouterr()
    other = ["-f", "timestamp,index", "--append"]
    assert cli(*["stream", "--replay", _demo(tmp_path), "--speed", "0", "-F", "csv", "-o", str(rec), *other]) == 2
    msg = capsys.readouterr().err.strip()
    assert msg.startswith(f"smiquery: usage error: --append: {rec} records timestamp,index,") and msg.endswith(
        "another --output"
    )


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("x.bmp", "usage error: --output {p}: cannot tell the format from the name; name it .csv, .jsonl or .parquet"),
        ("nowhere/run.csv", "error: cannot write {p}: no such file or directory; choose another --output"),
    ],
)
def test_output_errors_are_one_line_naming_the_file(tmp_path, capsys, target, says):
    path = tmp_path / target
    code = cli(*["stream", "--replay", _demo(tmp_path), "--speed", "0", "-F", "csv", "-o", str(path)])
    err = capsys.readouterr().err.strip()
    assert err == "smiquery: " + says.format(p=path)
    assert code == (2 if target.endswith("bmp") else 1)


def _demo(tmp_path: Path) -> str:
    """A small recording (4 sweeps of 2 GPUs) to replay into --output."""
    path = tmp_path / "demo-in.csv"
    if not path.exists():
        w = open_recording(path, FIELDS)
        for s in samples(4):
            w.write(s)
        w.close()
    return str(path)


# ------------------------------------------------------------------------------------------------ rotation


def test_rotate_by_size_keeps_n_and_the_set_reads_as_one_in_time_order(fake_smi, tmp_path):
    rec = tmp_path / "run.csv"
    proc = start(fake_smi(), "-l", "20ms", "-o", rec, "--rotate", "4KB", "--keep", "2")
    try:
        seen: set[str] = set()

        def rotations() -> int:
            seen.update(p.name for p in tmp_path.glob("run.*T*.csv"))
            return len(seen)

        wait_for(lambda: rotations() >= 3 and rows_in(rec) > 5, timeout=90, what="three rotations")
    finally:
        stop(proc)
    rotated = sorted(tmp_path.glob("run.*T*.csv"))
    assert len(rotated) == 2  # --keep 2: the oldest went
    metas = sorted(p.name.removesuffix(".meta.json") for p in tmp_path.glob("run.*T*.csv.meta.json"))
    assert metas == [p.name for p in rotated]  # each rotated file keeps its zone; pruned ones lose theirs too
    for p in rotated:
        assert p.stat().st_size >= 4000 and p.read_text().startswith("timestamp")
    df = read_recording(str(tmp_path / "run*.csv"))
    stamps = df["timestamp"]
    assert stamps.is_monotonic_increasing  # the live run.csv (newest) read last, whatever the names say
    assert len(df) == sum(rows_in(p) for p in [*rotated, rec])


def test_sighup_reopens_after_logrotate_moved_the_file(fake_smi, tmp_path):
    rec = tmp_path / "run.jsonl"
    moved = tmp_path / "run.jsonl.1"
    proc = start(fake_smi(), "-l", "50ms", "-o", rec)
    try:
        wait_for(lambda: rows_in(rec) >= 5, timeout=60, what="rows")
        os.rename(rec, moved)  # logrotate, create mode
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: rows_in(rec) >= 5, timeout=60, what="rows in the new file")
        assert proc.poll() is None  # SIGHUP did not end it
    finally:
        stop(proc)
    old = moved.read_text().splitlines()
    assert all(json.loads(x) for x in old)
    both = read_recording([str(moved), str(rec)])
    assert both["timestamp"].is_monotonic_increasing
    assert len(both) == len(old) + rows_in(rec)


def test_copytruncate_is_noticed_and_the_file_stays_a_csv(fake_smi, tmp_path):
    rec = tmp_path / "run.csv"
    err = StderrLines(start(fake_smi(), "-l", "50ms", "-o", rec))
    try:
        wait_for(lambda: rows_in(rec) >= 10, timeout=60, what="rows")
        shutil.copy(rec, tmp_path / "run.csv.1")
        os.truncate(rec, 0)  # logrotate copytruncate
        wait_for(lambda: err.lines and rows_in(rec) >= 3, timeout=60, what="rows after the truncation")
    finally:
        err.stop()
    assert err.lines == [f"smiquery: {rec} shrank under the recorder (copytruncate?); writing on at its new end"]
    text = rec.read_text()
    assert text.startswith("timestamp, index")  # a header again: the new file is a CSV on its own
    assert "\0" not in text  # written at the new end, not at the old offset (no hole)
    assert len(read_recording(rec)) == rows_in(rec)


# ------------------------------------------------------------------------------------------------ in process


def test_parquet_memory_stays_flat_the_writer_holds_no_rows(tmp_path):
    few, many = samples(500), samples(5_000)

    def peak(rows: list, name: str) -> int:
        w = ParquetDataset(tmp_path / name, FIELDS, part_rows=250)
        tracemalloc.start()
        for s in rows:
            w.write(s)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        w.close()
        return top

    small, big = peak(few, "a.parquet"), peak(many, "b.parquet")
    assert big < 2 * small  # ten times the rows, about the same memory: one part's close at most
    assert len(list((tmp_path / "b.parquet").glob("part-*.parquet"))) == 40  # 10,000 rows in 250-row parts
    assert len(read_recording(tmp_path / "b.parquet")) == 10_000


def test_every_part_of_a_parquet_dataset_keeps_the_nullable_dtypes(tmp_path):
    from smiquery.recordings.parquet import read_parquet

    w = ParquetDataset(tmp_path / "run.parquet", FIELDS, part_rows=4)
    for s in samples(6):  # 12 rows
        w.write(s)
    w.close()
    parts = sorted((tmp_path / "run.parquet").glob("part-*.parquet"))
    assert len(parts) == 3
    for part in parts:
        assert {str(t) for t in read_parquet(str(part)).dtypes[1:]} <= {"Int64", "Float64"}, part


def test_a_single_gpu_dataset_is_gpu_0_in_its_parts_and_its_open_journal(tmp_path):
    fields = resolve_fields("timestamp,power.draw")
    w = ParquetDataset(tmp_path / "run.parquet", fields, part_rows=4)
    for s in parse_lines([f"2026/01/01 00:00:{i:02d}.000, {100 + i}.50 W" for i in range(10)], fields):
        w.write(s)
    df = read_recording(tmp_path / "run.parquet")  # two parts and the open journal
    assert df["index"].tolist() == [0] * 10
    w.close()


def test_a_parquet_dataset_records_its_zone(tmp_path):
    w = open_recording(tmp_path / "run.parquet", FIELDS)
    for s in parse_lines(["2026/01/01 00:00:00.000, 0, 5 %, 1.00 W"], FIELDS, tz=ZoneInfo("Europe/Berlin")):
        w.write(s)
    w.close()
    assert json.loads((tmp_path / "run.parquet" / "_smiquery.json").read_text())["tz"] == "Europe/Berlin"
    assert str(read_recording(tmp_path / "run.parquet")["timestamp"].dt.tz) == "Europe/Berlin"


def test_replay_plays_a_glob_and_a_dataset(tmp_path):
    for name, minute in (("b.csv", 0), ("a.csv", 1)):  # names in the other order than time
        w = open_recording(tmp_path / name, FIELDS)
        for s in samples(3, start_minute=minute * 60):
            w.write(s)
        w.close()
    played = [s.timestamp for s in replay(str(tmp_path / "*.csv"), speed=0)]
    assert len(played) == 12 and played == sorted(played)
    w = open_recording(tmp_path / "run.parquet", FIELDS)
    for s in samples(3):
        w.write(s)
    w.close()
    assert len(list(replay(tmp_path / "run.parquet", speed=0))) == 6


def test_a_glob_that_matches_nothing_says_so(tmp_path):
    from smiquery.errors import RecordingError

    with pytest.raises(RecordingError, match=r"no recording matches .*nothing\*\.csv"):
        read_recording(str(tmp_path / "nothing*.csv"))
    (tmp_path / "x.csv").write_text("")
    with pytest.raises(UsageError, match="already exists"):
        open_recording(tmp_path / "x.csv", FIELDS)


def test_a_csv_recording_knows_its_zone_across_a_dst_fall_back(tmp_path, monkeypatch):
    walls = ["01:40", "02:00", "02:20", "02:40", "02:00", "02:20", "02:40", "03:00"]  # 2026-10-25: 02:xx twice
    lines = [f"2026/10/25 {w}:00.000, 0, 50 %, 100.00 W" for w in walls]
    rec = tmp_path / "run.csv"
    w = open_recording(rec, FIELDS)
    for s in parse_lines(lines, FIELDS, tz=ZoneInfo("Europe/Berlin")):  # as a live stream in Berlin gives them
        w.write(s)
    w.close()
    import pandas as pd

    plain = pd.read_csv(rec, skipinitialspace=True)  # still plain nvidia-smi CSV to other tools
    assert list(plain.columns[:2]) == ["timestamp", "index"] and len(plain) == 8
    assert json.loads((tmp_path / "run.csv.meta.json").read_text())["tz"] == "Europe/Berlin"
    monkeypatch.setenv("TZ", "UTC")  # read elsewhere: the recording's own zone counts, not the reader's
    stamps = read_recording(rec)["timestamp"]
    assert str(stamps.dt.tz) == "Europe/Berlin"
    assert stamps.is_monotonic_increasing  # the repeated hour resolved by row order
    assert (stamps.iloc[-1] - stamps.iloc[0]).total_seconds() == 2 * 3600 + 20 * 60
    played = [s.timestamp for s in replay(rec, speed=0)]
    assert played == sorted(played) and played[0].tzinfo is not None


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("100MB", (100_000_000, None)),
        ("64MiB", (64 * 2**20, None)),
        ("500k", (500_000, None)),
        ("1h", (None, 3600.0)),
        ("30m", (None, 1800.0)),
    ],
)
def test_rotate_takes_a_size_or_a_duration(text, want):
    from smiquery.cli.stream import parse_rotate

    assert parse_rotate(text) == want


def test_rotate_rejects_what_is_neither(tmp_path, capsys):
    code = cli(
        "stream",
        "--replay",
        _demo(tmp_path),
        "--speed",
        "0",
        "-F",
        "csv",
        "-o",
        str(tmp_path / "r.csv"),
        "--rotate",
        "lots",
    )
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "smiquery: usage error: --rotate 'lots': give a size such as 100MB or 1GB, or a duration such as 1h or 30m"
    )
    assert not (tmp_path / "r.csv").exists()


def test_rotation_by_duration_and_sighup_on_a_dataset_close_parts(tmp_path):
    now = [0.0]
    rec = TextRecorder(tmp_path / "run.jsonl", FIELDS, kind="jsonl", rotate_seconds=60, clock=lambda: now[0])
    rows = samples(6)
    for s in rows[:4]:
        rec.write(s)
    now[0] = 61.0
    for s in rows[4:]:
        rec.write(s)
    rec.close()
    rotated = list(tmp_path.glob("run.*T*.jsonl"))
    assert len(rotated) == 1 and rows_in(rotated[0]) == 4 and rows_in(tmp_path / "run.jsonl") == 8
    ds = ParquetDataset(tmp_path / "run.parquet", FIELDS)
    for s in rows[:4]:
        ds.write(s)
    ds.reopen()  # what SIGHUP calls
    for s in rows[4:]:
        ds.write(s)
    ds.close()
    parts = sorted(p.name for p in (tmp_path / "run.parquet").glob("part-*.parquet"))
    assert parts == ["part-000001.parquet", "part-000002.parquet"]
    assert len(read_recording(tmp_path / "run.parquet")) == 12


def test_replaying_a_plain_log_records_no_zone_it_does_not_know(tmp_path):
    plain = tmp_path / "log.csv"
    plain.write_text(
        "timestamp, index, utilization.gpu [%]\n2026/01/01 00:00:00.000, 0, 5 %\n2026/01/01 00:00:01.000, 0, 7 %\n"
    )
    out = tmp_path / "copy.csv"
    assert cli("stream", "--replay", str(plain), "--speed", "0", "-F", "csv", "-o", str(out)) == 0
    assert json.loads((tmp_path / "copy.csv.meta.json").read_text())["tz"] is None  # naive times: no guess
    assert read_recording(out)["timestamp"].dt.tz is None
    berlin = tmp_path / "berlin.csv"
    assert (
        cli("stream", "--replay", str(plain), "--tz", "Europe/Berlin", "--speed", "0", "-F", "csv", "-o", str(berlin))
        == 0
    )
    assert str(read_recording(berlin)["timestamp"].dt.tz) == "Europe/Berlin"  # the zone --tz named is kept


def test_keep_prunes_the_oldest_parquet_parts(tmp_path):
    ds = ParquetDataset(tmp_path / "run.parquet", FIELDS, part_rows=4, keep=2)
    for s in samples(10):  # 20 rows: parts of 4, the last 4 closed by close()
        ds.write(s)
    ds.close()
    parts = sorted(p.name for p in (tmp_path / "run.parquet").glob("part-*.parquet"))
    assert parts == ["part-000004.parquet", "part-000005.parquet"]
    df = read_recording(tmp_path / "run.parquet")
    assert len(df) == 8 and df["timestamp"].is_monotonic_increasing  # the newest 8 rows
