"""Snapshots when an alert fires: the folder's files, one per firing, bounded size, never blocking the caller."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from smiquery.alerts import Notifier, SnapshotHandler, take_snapshot
from smiquery.analysis import load_recording
from smiquery.sources.query_gpu import CsvParser
from tests.conftest import MakeFake
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

T0 = datetime(2026, 3, 14, 9, 30, tzinfo=timezone.utc)


def _samples(temps: list[int]) -> list[Any]:
    parser = CsvParser(["timestamp", "index", "uuid", "temperature.gpu", "memory.used"])
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    return list(
        parser.parse(
            f"{(T0 + timedelta(seconds=i)).strftime('%Y/%m/%d %H:%M:%S.000')}, 0, {uuid}, {t}, 2000"
            for i, t in enumerate(temps)
        )
    )


def test_one_snapshot_per_firing_with_the_evidence(fake_smi: MakeFake, tmp_path: Path):
    smi = fake_smi()
    snap = SnapshotHandler(tmp_path / "snaps", nvidia_smi=str(smi))
    notifier = Notifier(["temperature.gpu > 85 for 2"], [snap])
    with no_leaks(reap_timeout=10.0):
        for s in _samples([60, 60, 90, 90, 91, 92, 93]):  # fires once, keeps firing: one snapshot
            notifier.update(s, {"epoch": 3, "batch": 17})
        assert snap.wait(30.0)
        wait_for(lambda: len(snap.taken) == 1, 30.0, "the first snapshot")
        for s in _samples([60, 90, 90]):  # cleared, then fires again: a second snapshot
            notifier.update(s)
        assert snap.wait(30.0)
        wait_for(lambda: len(snap.taken) == 2, 30.0, "the second snapshot")
        notifier.close()
    folder = Path(snap.taken[0])
    assert folder.parent == tmp_path / "snaps"
    alert = json.loads((folder / "alert.json").read_text())
    assert alert["event"]["state"] == "firing" and alert["event"]["gpu"] == 0
    assert alert["context"] == {"epoch": 3, "batch": 17}
    df = load_recording(folder / "samples.csv")  # `smiquery report` reads the recent samples
    assert len(df) == 4 and df["temperature_gpu"].max() == 90  # the history up to the firing sample
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["alert.json", "details.json", "nvidia-smi-q.xml", "processes.csv", "samples.csv"]
    assert (folder / "nvidia-smi-q.xml").read_text().lstrip().startswith("<?xml")
    details = json.loads((folder / "details.json").read_text())["gpus"]  # the XML parsed, for a program to read
    assert details and all(g["uuid"].startswith("GPU-") and isinstance(g["memory_total"], int) for g in details)
    assert (folder / "processes.csv").read_text().splitlines()[0].startswith("gpu_uuid, pid, process_name")


def test_files_are_cut_at_max_bytes_keeping_the_newest_rows(tmp_path: Path):
    samples = _samples(list(range(2000)))
    event = Notifier(["temperature.gpu > 85"]).evaluate(samples[90])[0]
    folder = Path(take_snapshot(tmp_path, event, {}, samples, nvidia_smi=str(tmp_path / "none"), max_bytes=4096))
    text = (folder / "samples.csv").read_text()
    assert len(text.encode()) <= 4096
    header, *rows = text.splitlines()
    assert header == "timestamp, index, uuid, temperature.gpu, memory.used [MiB]"
    temps = [int(row.split(", ")[3]) for row in rows]
    assert temps[0] > 0 and temps == list(range(temps[0], 2000))  # the newest rows, none skipped, the oldest cut
    assert (folder / "nvidia-smi-q.xml.error.txt").exists()  # no nvidia-smi: said in the folder, nothing raised


def test_a_snapshot_never_blocks_the_caller(tmp_path: Path):
    slow = tmp_path / "slow-nvidia-smi"
    slow.write_text("#!/bin/sh\nsleep 20\n")
    slow.chmod(0o755)
    snap = SnapshotHandler(tmp_path / "snaps", nvidia_smi=str(slow), timeout=1.0)
    notifier = Notifier(["temperature.gpu > 85"], [snap])
    started = time.monotonic()
    for s in _samples([90]):
        notifier.update(s)
    assert time.monotonic() - started < 5.0  # the 20 s nvidia-smi runs on the snapshot's thread
    assert snap.wait(30.0)
    folder = Path(snap.taken[0])
    assert "did not answer" in (folder / "nvidia-smi-q.xml.error.txt").read_text()


def test_the_details_of_a_mig_gpu_are_parsed_into_details_json(tmp_path: Path) -> None:
    from smiquery.alerts.rules import AlertEvaluator
    from smiquery.testing import InProcessRunner

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "details-2gpu-mig.xml"
    ev = AlertEvaluator(["temperature.gpu > 85 for 1"])
    event = next(e for s in _samples([90]) for e in ev.update(s))
    runner = InProcessRunner(env={"SMIQUERY_FAKE_XML": str(fixture)})
    folder = Path(take_snapshot(tmp_path, event, nvidia_smi="/opt/nvidia-smi", runner=runner))
    gpus = json.loads((folder / "details.json").read_text())["gpus"]
    assert gpus[0]["uuid"] == "GPU-11111111-2222-3333-4444-555555555555"
    assert [m["gpu_instance_id"] for m in gpus[0]["mig_devices"]] == [2, 9]
    assert gpus[0]["remapped_rows"]["pending"] is True and "hw_thermal_slowdown" in gpus[0]["clock_event_reasons"]
    assert gpus[1]["memory_used"] is None and gpus[1]["missing"]["memory_used"] == "not_available"  # N/A, not 0


def test_a_cut_xml_leaves_a_reason_instead_of_details_json(tmp_path: Path) -> None:
    from smiquery.alerts.rules import AlertEvaluator
    from smiquery.testing import InProcessRunner

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "details-2gpu-mig.xml"
    ev = AlertEvaluator(["temperature.gpu > 85 for 1"])
    event = next(e for s in _samples([90]) for e in ev.update(s))
    runner = InProcessRunner(env={"SMIQUERY_FAKE_XML": str(fixture)})
    folder = Path(take_snapshot(tmp_path, event, nvidia_smi="/opt/nvidia-smi", runner=runner, max_bytes=2000))
    assert not (folder / "details.json").exists()
    assert "parsing nvidia-smi-q.xml failed" in (folder / "details.json.error.txt").read_text()


def _disk_full(monkeypatch: Any) -> None:
    """Every file write fails as on a full disk, after creating the file (as a real ENOSPC leaves it: 0 bytes)."""
    import errno

    def full(self: Path, data: bytes) -> int:
        self.open("wb").close()
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full)


def test_a_full_disk_leaves_nothing_behind_and_warns_once_per_firing(tmp_path: Path, monkeypatch: Any, caplog: Any):
    snaps = tmp_path / "snaps"
    snap = SnapshotHandler(snaps, nvidia_smi=str(tmp_path / "none"), max_snapshots=2)
    notifier = Notifier(["temperature.gpu > 85"], [snap])
    _disk_full(monkeypatch)
    with caplog.at_level("WARNING", logger="smiquery"):
        for temps in ([90, 91], [60, 90], [60, 90]):  # three firings, each kept firing for a while
            for s in _samples(temps):
                notifier.update(s)
            assert snap.wait(30.0)
    notifier.close()
    assert list(snaps.iterdir()) == []  # no empty folder, no 0-byte alert.json
    assert snap.taken == [] and snap.failed == 2  # failed snapshots count toward max_snapshots
    assert snap.skipped == 1  # the third firing: the limit of 2 is reached
    lines = [r for r in caplog.records if "snapshot" in r.getMessage()]
    assert [r.exc_info for r in lines] == [None, None, None]  # no traceback
    assert sum("No space left on device" in r.getMessage() for r in lines) == 2
    assert sum("the limit of 2 is reached" in r.getMessage() for r in lines) == 1


def test_a_snapshot_skipped_while_another_is_written_is_logged(tmp_path: Path, caplog: Any):
    slow = tmp_path / "slow-nvidia-smi"
    slow.write_text("#!/bin/sh\nsleep 3\n")
    slow.chmod(0o755)
    snap = SnapshotHandler(tmp_path / "snaps", nvidia_smi=str(slow), timeout=5.0)
    notifier = Notifier(["temperature.gpu > 85"], [snap])
    parser = CsvParser(["index", "uuid", "temperature.gpu"])
    two = list(parser.parse([f"{g}, GPU-0000000{g}-1111-2222-3333-444444444444, 90" for g in (0, 1)]))
    with caplog.at_level("WARNING", logger="smiquery"):
        for s in two:  # both GPUs fire at once: the second snapshot is skipped, and says so
            notifier.update(s)
        assert snap.wait(60.0)
    notifier.close()
    assert snap.skipped == 1 and len(snap.taken) == 1
    said = [r.getMessage() for r in caplog.records if "no snapshot for" in r.getMessage()]
    assert len(said) == 1 and "GPU 1" in said[0] and "another snapshot is being written" in said[0]
