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


def _busy(path: Path, utilization: list[int], minutes: int = 5) -> None:
    """A recording where GPU g runs at about utilization[g] % (+-1) the whole time, holding memory."""
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB]"]
    for k in range(minutes * 60 // STEP):
        at = T0 + timedelta(seconds=k * STEP)
        lines += [f"{at:%Y/%m/%d %H:%M:%S}.000, {g}, {u + k % 3 - 1} %, 30000 MiB" for g, u in enumerate(utilization)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _imbalance(path: Path, names: dict[int, GpuName] | None) -> list[tuple[tuple[int, ...], str]]:
    df = load_recording(path)
    if names is not None:
        df.attrs["gpu_names"] = names
    return [(f.gpus, f.verdict) for f in report(df, name="fleet").findings if f.kind == "imbalance"]


def test_stragglers_are_compared_within_their_node_never_across_nodes(tmp_path):
    path = tmp_path / "fleet.csv"
    # node 0 trains at 90 %, node 1 runs another job at 50 %; on node 1, GPUs 1 and 3 lag at 15 %
    _busy(path, [90, 90, 90, 90, 50, 15, 50, 15])
    got = _imbalance(path, _fleet_names(2, 4))
    assert got == [
        (
            (5, 7),
            "gpu-node-1 GPUs 1, 3 averaged 15%, 15% utilization against 50% on the other GPUs of gpu-node-1: "
            "unbalanced work or a straggler; check their share of the data and PCIe/NVLink link",
        )
    ]
    # a node whose GPUs are all at 50 % is no straggler beside a node at 90 %
    _busy(path, [90, 90, 90, 90, 50, 50, 50, 50])
    assert _imbalance(path, _fleet_names(2, 4)) == []
    # a recording's GPUs all work together: the 50 % GPUs lag the 90 % ones, one finding naming them all
    assert _imbalance(path, None) == [
        (
            (4, 5, 6, 7),
            "GPUs 4-7 averaged 50%, 50%, 50%, 50% utilization against 90% on the others: unbalanced work or a "
            "straggler; check their share of the data and PCIe/NVLink link",
        )
    ]


def test_gpus_of_one_pod_or_slurm_job_are_compared_across_their_nodes(tmp_path):
    path = tmp_path / "fleet.csv"
    _busy(path, [90, 90, 30, 60, 90, 90, 10, 10])
    names = _fleet_names(2, 4)
    # one pod holds GPUs 0-2 of both nodes; one Slurm job GPU 3 of each
    for i in (0, 1, 2, 4, 5, 6):
        names[i] = GpuName(names[i].node, names[i].instance, names[i].gpu, names[i].uuid, pod="ml/trainer-0")
    for i in (3, 7):
        names[i] = GpuName(names[i].node, names[i].instance, names[i].gpu, names[i].uuid, job="4242")
    got = _imbalance(path, names)
    # the pod's laggards named across its nodes, one finding; the job's GPU at 10 % beside its other at 60 %
    assert [gpus for gpus, _ in got] == [(2, 6), (7,)]
    assert got[0][1].startswith(
        "gpu-node-0 GPU 2 (ml/trainer-0); gpu-node-1 GPU 2 (ml/trainer-0) averaged 30%, 10% utilization against 90% "
        "on the other GPUs of pod ml/trainer-0:"
    ), got[0][1]
    assert got[1][1].startswith(
        "gpu-node-1 GPU 3 (Slurm job 4242) averaged 10% utilization against 60% on the other GPUs of Slurm job 4242:"
    ), got[1][1]
