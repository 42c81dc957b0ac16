"""processes() and processes_df() (smiquery.sources.apps): --query-compute-apps joined to the GPUs' indices."""

from __future__ import annotations

from smiquery.sources.apps import processes, processes_df
from tests.leakcheck import no_leaks


def test_processes_joined_to_gpu_index(fake_inproc):
    with no_leaks():
        procs = processes(**fake_inproc())
    assert procs, "the bundled recording has one training process per GPU"
    assert all(p.gpu_index is not None for p in procs)
    assert [p.gpu_index for p in procs] == sorted(p.gpu_index for p in procs)
    assert all(isinstance(p.used_memory, int) for p in procs)
    df = processes_df(**fake_inproc(), gpus=[2])
    assert set(df["gpu_index"]) == {2}


def test_processes_idle_machine_is_empty_not_error(fake_inproc):
    assert processes(**fake_inproc(apps="")) == []
