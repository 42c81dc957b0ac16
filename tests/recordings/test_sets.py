"""A rotated set read as one recording: a member just started (header only) or pruned since it was listed is skipped
with a note; only a set without a single row is an error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from smiquery.errors import RecordingError
from smiquery.recordings import read_recording
from smiquery.recordings.base import read_members

HEADER = "timestamp, index, utilization.gpu [%], memory.used [MiB]"


def _rows(path: Path, count: int) -> Path:
    """nvidia-smi's CSV: a header and ``count`` rows of GPU 0, a second apart (count 0: the header alone)."""
    rows = [f"2026/05/04 12:00:{s:02d}.000, 0, 90, 2048" for s in range(count)]
    path.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    return path


def _report(*args: object) -> subprocess.CompletedProcess[str]:
    """``smiquery report`` as a user runs it (this checkout's code: the child inherits PYTHONPATH)."""
    return subprocess.run(
        [sys.executable, "-m", "smiquery", "report", *map(str, args)],
        env={**os.environ, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_report_of_a_set_just_rotated_skips_the_header_only_file_and_says_so(tmp_path):
    _rows(tmp_path / "run.20260504T120000.csv", 20)  # the rotated file, as the recorder names it
    live = _rows(tmp_path / "run.csv", 0)  # the new file: its header, no row yet
    done = _report(tmp_path / "run*.csv", "-F", "json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"smiquery: warning: skipped {live}: it holds no rows\n"
    report = json.loads(done.stdout)
    assert report["samples_per_gpu"] == 20
    assert report["skipped_files"] == [f"skipped {live}: it holds no rows"]
    # an empty file (created, not even a header yet) is the same moment
    live.write_bytes(b"")
    again = _report(tmp_path / "run*.csv")
    assert again.returncode == 0, again.stderr
    assert f"skipped {live}: it holds no rows" in again.stderr


def test_a_member_pruned_between_the_glob_and_the_read_is_skipped_with_a_note(tmp_path):
    kept = _rows(tmp_path / "run.20260504T120000.csv", 20)
    gone = tmp_path / "run.20260504T115900.csv"  # listed by the glob, then removed by --keep
    df = read_members([str(gone), str(kept)], read_recording)
    assert len(df) == 20
    assert df.attrs["skipped_files"] == [f"skipped {gone}: it is gone (rotation pruned it after it was listed?)"]


def test_a_set_without_a_single_row_is_still_an_error(tmp_path):
    first = _rows(tmp_path / "run.20260504T120000.csv", 0)
    _rows(tmp_path / "run.csv", 0)
    with pytest.raises(RecordingError, match=re.escape(f"recording {first} holds no readable rows")):
        read_recording(tmp_path / "run*.csv")
    done = _report(tmp_path / "run*.csv")
    assert done.returncode == 1
    assert done.stderr == f"smiquery: error: recording {first} holds no readable rows\n"


def test_a_member_that_is_not_a_recording_is_still_an_error(tmp_path):
    _rows(tmp_path / "run.20260504T120000.csv", 20)
    (tmp_path / "run.csv").write_text("2026/05/04 12:01:00.000, 0, 90, 2048\n", encoding="utf-8")  # no header
    with pytest.raises(RecordingError, match=re.escape(str(tmp_path / "run.csv"))):
        read_recording(tmp_path / "run*.csv")
