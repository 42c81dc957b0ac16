"""Fleet-wide findings say what was measured: how long the GPUs stalled at once, named by node and index."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from smiquery.analysis import load_recording, report
from smiquery.analysis.model import GpuName

T0 = datetime(2026, 12, 5, 13, 50, 0)
STEP = 2


def _write(path: Path, stalls: dict[int, tuple[int, int]], n_gpus: int, minutes: int = 15) -> None:
    """A recording of ``n_gpus`` busy GPUs holding memory; GPU g under 20 % from minute a to minute b of stalls[g]."""
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB]"]
    for k in range(minutes * 60 // STEP):
        at = T0 + timedelta(seconds=k * STEP)
        for g in range(n_gpus):
            a, b = stalls.get(g, (0, 0))
            util = 2 if a * 60 <= k * STEP < b * 60 else 90
            lines.append(f"{at:%Y/%m/%d %H:%M:%S}.000, {g}, {util} %, 30000 MiB")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _fleet_names(nodes: int, per_node: int) -> dict[int, GpuName]:
    return {
        n * per_node + g: GpuName(f"gpu-node-{n}", f"10.0.0.{n}:9849", str(g), f"GPU-{n}-{g}")
        for n in range(nodes)
        for g in range(per_node)
    }


def test_two_nodes_stalls_overlapping_by_2_min_are_said_to_overlap_by_2_min(tmp_path):
    # node 0's 36 GPUs stall 7:14 to 10:14, node 1's 8:14 to 11:14: 3-minute stalls that overlap by 2 minutes
    path = tmp_path / "fleet.csv"
    stalls = {g: (7, 10) if g < 36 else (8, 11) for g in range(72)}
    _write(path, stalls, 72)
    df = load_recording(path)
    df.attrs["gpu_names"] = _fleet_names(2, 36)
    got = report(df, name="fleet")
    (together,) = [f for f in got.findings if f.kind == "stall_together"]
    assert together.verdict.startswith(
        "All 72 GPUs stalled together from 13:58:00 for 2 min, all at once (their stalls spanned 4 min from 13:57:00)"
    ), together.verdict
    # the same recording without names: the same finding, its GPUs by number
    plain = report(load_recording(path), name="fleet")
    assert [(f.kind, f.gpus, f.seconds, f.start) for f in plain.findings] == [
        (f.kind, f.gpus, f.seconds, f.start) for f in got.findings
    ]


def test_gpus_of_several_nodes_are_named_per_node_by_their_index_there(tmp_path):
    path = tmp_path / "fleet.csv"
    _write(path, {1: (3, 8), 2: (3, 8), 3: (3, 8), 4: (3, 8), 6: (5, 6)}, 8, minutes=10)
    df = load_recording(path)
    df.attrs["gpu_names"] = _fleet_names(2, 4)
    got = report(df, name="fleet")
    (together,) = [f for f in got.findings if f.kind == "stall_together"]
    assert together.verdict.startswith(
        "gpu-node-0 GPUs 1-3; gpu-node-1 GPUs 0, 2 stalled together from 13:55:00 for 1 min, all at once (their "
        "stalls spanned 5 min from 13:53:00)"
    ), together.verdict
    doc = got.to_dict()
    assert doc["findings"][0]["gpus"][0] == {
        "index": 1,
        "instance": "10.0.0.0:9849",
        "gpu": "1",
        "uuid": "GPU-0-1",
        "node": "gpu-node-0",
    }


def test_stalls_that_overlap_only_in_a_chain_are_never_said_to_be_all_at_once(tmp_path):
    path = tmp_path / "chain.csv"
    _write(path, {0: (2, 5), 1: (4, 7), 2: (6, 9)}, 3, minutes=12)
    got = report(load_recording(path), name="chain")
    (together,) = [f for f in got.findings if f.kind == "stall_together"]
    assert together.verdict.startswith(
        "All 3 GPUs stalled in overlapping stretches from 13:52:00 over 7 min, never all at once (at most 2 at a time)"
    ), together.verdict
